#!/usr/bin/env bash
# Start SGLang servers for disaggregated rollouts and keep them up until SIGTERM / Ctrl-C.
#
# Usage:
#   RLHF_SGLANG_API_KEY=<secret> MODEL=/shared/models/Qwen2.5-7B-Instruct NUM_SERVERS=2 TP=4 \
#     HOST=0.0.0.0 launch/sglang_servers.sh [extra flags of python -m rlhf.cli.launch_servers]
#   MODEL=runs/quickstart/model DEVICE=cpu launch/sglang_servers.sh      # one CPU server
#
# Environment (defaults in brackets):
#   MODEL         HF model directory (required)
#   NUM_SERVERS   servers to start [1]; on cuda server i uses GPUs i*TP .. i*TP+TP-1
#   TP            tensor-parallel GPUs per server [1]
#   BASE_PORT     server i listens on BASE_PORT+i [30000]
#   HOST          address to bind [127.0.0.1]; 0.0.0.0 to serve other nodes (URLs then use
#                 this host's name; needs RLHF_SGLANG_API_KEY)
#   RLHF_SGLANG_API_KEY  key the servers and the router require (Authorization: Bearer);
#                 export the same value for the trainer. Required unless HOST is loopback.
#                 They read it from the environment, never from their command line.
#   DEVICE        cuda | cpu [cuda if nvidia-smi lists a GPU, else cpu]
#   DTYPE         float32 | bfloat16 | float16 [bfloat16 on cuda, float32 on cpu]
#   MEM_FRACTION  share of GPU memory SGLang may take [0.85]
#   MAX_TOTAL_TOKENS  KV-cache tokens [SGLang's choice on cuda, 4096 on cpu]
#   ROUTER=1      also start an sglang-router on ROUTER_PORT [30100]
#   LOG_DIR       one log file per server [logs/sglang]
#   STARTUP_TIMEOUT  seconds for all servers to answer /health [600]
#   PYTHON        interpreter [the active environment's python]
#   CONFIG        a run config whose actor_rollout_ref.rollout.engine_kwargs.sglang (extra
#                 SGLang server arguments) the servers get too; more with
#                 --engine-kwarg NAME=VALUE
#
# Once every server answers GET /health, stdout gets one URL per line, then the override to
# paste into the training command (actor_rollout_ref.rollout.server_urls=[...]). The servers
# are started with the trainer's own argument builder (rlhf/rollout/sglang_server.py).
set -euo pipefail

: "${MODEL:?set MODEL to the HF model directory to serve}"
if [[ -z "${DEVICE:-}" ]]; then
    DEVICE=cpu
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --list-gpus 2>/dev/null | grep -q .; then
        DEVICE=cuda
    fi
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; else PYTHON=python3; fi
fi

args=(
    --model "$MODEL"
    --num-servers "${NUM_SERVERS:-1}"
    --tp "${TP:-1}"
    --base-port "${BASE_PORT:-30000}"
    --host "${HOST:-127.0.0.1}"
    --device "$DEVICE"
    --mem-fraction "${MEM_FRACTION:-0.85}"
    --log-dir "${LOG_DIR:-logs/sglang}"
    --startup-timeout "${STARTUP_TIMEOUT:-600}"
)
if [[ -n "${DTYPE:-}" ]]; then args+=(--dtype "$DTYPE"); fi
if [[ -n "${MAX_TOTAL_TOKENS:-}" ]]; then args+=(--max-total-tokens "$MAX_TOTAL_TOKENS"); fi
if [[ "${ROUTER:-0}" == 1 ]]; then args+=(--router --router-port "${ROUTER_PORT:-30100}"); fi
if [[ -n "${CONFIG:-}" ]]; then args+=(--config "$CONFIG"); fi

# exec: SIGTERM / SIGINT reach the launcher itself, which stops every server it started.
exec "$PYTHON" -m rlhf.cli.launch_servers "${args[@]}" "$@"
