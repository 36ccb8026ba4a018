#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine: PyTorch preinstalled, no
# network, at most 15 minutes of one GPU in all (each part has its own time limit, so a part
# that hangs costs its limit, not the session):
#
#   tools/run_gpu_checks.sh [OUT_DIR]     # default: $OUT, else runs/gpu_checks
#
# Small wheels placed in .whl/ (megatron-core for that python, torch-memory-saver, ...) are
# installed into a private directory first; nothing is downloaded. What it writes to OUT_DIR:
#   gpu.txt               device, driver, versions
#   pytest_gpu.log        tests/gpu: the device ledger against the CUDA allocator, NCCL
#                         buffers on the rank's GPU, offload round trip and release, the
#                         trainer's stages on CUDA, reward-model training, SGLang sleep/wake
#                         (torch_memory_saver pause/resume; skipped where SGLang is absent)
#   offload.json          offload and reload bandwidth through pinned host memory
#   phase_memory.json     the build's and each step stage's peak for a 0.5B model against
#                         the planner's phases
#   ppo_step.json         a ~130M-parameter PPO step in bf16 (MFU, phase times)
#   plan_*.txt            the planner's per-phase table of the shipped GPU configs on this GPU
# Exits non-zero when any part failed or ran out of its time.
set -uo pipefail

out=${1:-${OUT:-runs/gpu_checks}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rlhf_gpu_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/rlhf_gpu_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1

status=0
part() {  # part SECONDS OUTPUT COMMAND...: run it with a time limit, output to the file
    local limit=$1 file=$2 start=$SECONDS
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$file" 2>&1 || {
        echo "FAILED ($?): $*" >>"$file"
        status=1
    }
    echo "$(basename "$file"): $((SECONDS - start)) s" | tee -a "$out/times.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import sys, torch, megatron.core as m, transformers as t
print("python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__,
      "transformers", t.__version__)' | tee -a "$out/gpu.txt"

part 420 "$out/pytest_gpu.log" python3 -m pytest tests/gpu -v -p no:cacheprovider
part 90 "$out/offload.json" python3 benchmarks/offload_bandwidth.py --gib 8
part 180 "$out/phase_memory.json" python3 benchmarks/phase_memory.py \
    --config configs/gsm8k_qwen2.5-0.5b_1gpu.yaml --model-shape configs/model_shapes/Qwen2.5-0.5B.json
part 120 "$out/ppo_step.json" python3 benchmarks/ppo_step.py --hidden 1024 --layers 8 \
    --samples 64 --prompt 256 --response 512 --budget 4096 --dtype bfloat16
for pair in gsm8k_qwen2.5-0.5b_1gpu:Qwen2.5-0.5B gsm8k_8gpu:Qwen2.5-7B \
    qwen3_30b_a3b_grpo_8gpu:Qwen3-30B-A3B gsm8k_2node:Qwen2.5-14B; do
    # the doctor also checks paths this machine lacks: its table is what is kept, not its status
    timeout 60 python3 -m rlhf.cli.doctor --config "configs/${pair%%:*}.yaml" \
        --model-config "configs/model_shapes/${pair##*:}.json" --gpus-per-node 8 \
        >"$out/plan_${pair%%:*}.txt" 2>&1
done
tail -n 3 "$out/pytest_gpu.log"
cat "$out"/offload.json "$out"/phase_memory.json "$out"/ppo_step.json "$out/times.txt"
exit $status
