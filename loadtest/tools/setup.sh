#!/usr/bin/env bash
# Installs two load-testing tools that others use to measure inference servers, each into a
# virtualenv of its own, never into Spillgate's .venv (neither is a dependency):
#
#   loadtest/tools/setup.sh          # idempotent; prints "ready: TOOL VERSION VENV" for each
#
#   guidellm 0.8.1         -> $GUIDELLM_VENV        (default $TOOLS_VENVS/guidellm)
#   inference-perf 0.7.0   -> $INFERENCE_PERF_VENV  (default $TOOLS_VENVS/inference-perf)
#   TOOLS_VENVS defaults to /tmp/spillgate-tools.
#
# guidellm depends on torch; the CPU build is installed first (torch==2.13.0, the release
# loadtest/real_vllm uses) so that pip does not pull the CUDA build and its gigabytes of
# NVIDIA libraries. inference-perf needs Python 3.12 or newer: TOOLS_PYTHON312 names the
# interpreter, else the first of python3.13, python3.12 (or pyenv's 3.12/3.13) that runs.
# Neither tool downloads anything at run time here: both are given a local tokenizer
# (loadtest/real_vllm/tiny_model.py) and synthetic prompts.
set -euo pipefail

GUIDELLM_VERSION=0.8.1
INFERENCE_PERF_VERSION=0.7.0
TORCH_VERSION=2.13.0
ROOT=${TOOLS_VENVS:-/tmp/spillgate-tools}
GUIDELLM_VENV=${GUIDELLM_VENV:-$ROOT/guidellm}
INFERENCE_PERF_VENV=${INFERENCE_PERF_VENV:-$ROOT/inference-perf}
PYTHON311=${TOOLS_PYTHON311:-python3.11}

log() { echo "[tools] $*" >&2; }

installed() {  # venv, distribution, version
  [[ -x $1/bin/python ]] &&
    [[ $("$1/bin/python" -c "import importlib.metadata as m; print(m.version('$2'))" 2>/dev/null) == "$3" ]]
}

python312() {
  local c
  if [[ -n ${TOOLS_PYTHON312:-} ]]; then echo "$TOOLS_PYTHON312"; return; fi
  for c in python3.13 python3.12; do
    if "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  # pyenv's shims refuse a version that is not selected; its installed ones still run
  if command -v pyenv >/dev/null; then
    for c in "$(pyenv root)"/versions/3.1[23]*/bin/python3; do
      if [[ -x $c ]] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
        echo "$c"; return
      fi
    done
  fi
  return 1
}

if ! installed "$GUIDELLM_VENV" guidellm "$GUIDELLM_VERSION"; then
  log "installing guidellm $GUIDELLM_VERSION into $GUIDELLM_VENV (minutes)"
  "$PYTHON311" -m venv "$GUIDELLM_VENV"
  "$GUIDELLM_VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  "$GUIDELLM_VENV/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
fi
echo "ready: guidellm $GUIDELLM_VERSION $GUIDELLM_VENV"

if ! installed "$INFERENCE_PERF_VENV" inference-perf "$INFERENCE_PERF_VERSION"; then
  PY312=$(python312) || {
    log "inference-perf needs Python >= 3.12: set TOOLS_PYTHON312 to one"; exit 1;
  }
  log "installing inference-perf $INFERENCE_PERF_VERSION into $INFERENCE_PERF_VENV with $PY312"
  "$PY312" -m venv "$INFERENCE_PERF_VENV"
  "$INFERENCE_PERF_VENV/bin/pip" install -q "inference-perf==$INFERENCE_PERF_VERSION"
fi
echo "ready: inference-perf $INFERENCE_PERF_VERSION $INFERENCE_PERF_VENV"
