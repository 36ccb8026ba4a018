#!/usr/bin/env bash
# `make quickstart-async`: the GRPO quickstart with asynchronous rollout on a disaggregated
# CPU server. Starts one SGLang server on the quickstart model (launch/sglang_servers.sh,
# port 30000, pinned to core 0), waits until it announces itself, runs rlhf-train with
# configs/quickstart_async_cpu.yaml (pinned to core 1; extra arguments are overrides), and
# stops the server when the run ends, fails or is interrupted. On one core nothing is pinned.
#
#   PYTHON=.venv/bin/python launch/quickstart_async.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RUN_DIR=runs/quickstart_async

server_core=() trainer_core=()  # taskset prefixes, when there are two cores to split
if [[ $(nproc) -ge 2 ]] && command -v taskset >/dev/null 2>&1; then
    server_core=(taskset -c 0) trainer_core=(taskset -c 1)
fi

mkdir -p "$RUN_DIR"
announced="$RUN_DIR/servers.out"
: >"$announced"
# a simple command in the background: $! is the launcher itself (taskset and the script exec
# it), which stops its server on SIGTERM
MODEL=runs/quickstart/model DEVICE=cpu LOG_DIR="$RUN_DIR/sglang_logs" PYTHON="$PYTHON" \
    "${server_core[@]}" launch/sglang_servers.sh >"$announced" &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
until grep -q '^actor_rollout_ref.rollout.server_urls=' "$announced"; do
    if ! kill -0 "$server" 2>/dev/null; then
        echo "the SGLang server did not start; see $RUN_DIR/sglang_logs" >&2
        exit 1
    fi
    sleep 1
done
"${trainer_core[@]}" "$PYTHON" -m rlhf.cli.train --config configs/quickstart_async_cpu.yaml "$@"
