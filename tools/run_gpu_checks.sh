#!/usr/bin/env bash
# The GPU tests (tests/gpu) and the PPO-step benchmark on CUDA, with the machine's own python3
# (a GPU box with PyTorch already installed; no .venv, no network):
#
#   tools/run_gpu_checks.sh [OUT_DIR]     # default: $OUT, else runs/gpu_checks
#
# Wheels placed in .whl/ (e.g. megatron-core built for that python) are installed into a
# private directory first. Writes gpu.txt (device and versions), pytest_gpu.log,
# ppo_step_*.json (MFU, and `packed_attention`: per-sample against masked-row attention on the
# local spec, the issue-17 comparison when Transformer Engine is absent), memory_bf16.json
# (measured vs planned activations), logprob_head.json (bytes per logit and seconds of the
# chunked log-prob head at a 152k vocabulary, by the CUDA allocator), phase_memory.json (each
# trainer phase's peak for a 0.5B model against the planner), checkpoint_save.json (how long
# a save of the 0.5B actor and critic holds the step, synchronous vs trainer.async_save, and
# the plan's estimate) and plan_*.txt (the memory planner's per-phase table on this GPU) to
# OUT_DIR; exits non-zero when any part failed.
set -uo pipefail

out=${1:-${OUT:-runs/gpu_checks}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rlhf_gpu_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/rlhf_gpu_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import sys, torch, megatron.core as m, transformers as t
print("python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__,
      "transformers", t.__version__)' | tee -a "$out/gpu.txt"

status=0
python3 -m pytest tests/gpu -v -p no:cacheprovider 2>&1 | tee "$out/pytest_gpu.log" || status=1
# a ~130M-parameter model with long responses in bf16 and fp32, then the CPU benchmark's size
large=(--hidden 1024 --layers 8 --samples 64 --prompt 256 --response 512 --budget 4096)
for dtype in bfloat16 float32; do
    python3 benchmarks/ppo_step.py "${large[@]}" --dtype "$dtype" >"$out/ppo_step_large_$dtype.json" ||
        status=1
done
python3 benchmarks/ppo_step.py >"$out/ppo_step_small.json" || status=1
# activation memory measured by the CUDA allocator vs the planner's estimate, and the plans
# of the shipped GPU configs for this GPU
python3 benchmarks/memory.py --hidden 1024 --layers 8 --tokens 4096 --dtype bfloat16 \
    >"$out/memory_bf16.json" || status=1
python3 benchmarks/logprob_head.py --tokens 16384 >"$out/logprob_head.json" || status=1
# each trainer phase's peak for a 0.5B model (random weights of its shape) against the planner
python3 benchmarks/phase_memory.py --config configs/gsm8k_qwen2.5-0.5b_1gpu.yaml \
    --model-shape configs/model_shapes/Qwen2.5-0.5B.json >"$out/phase_memory.json" || status=1
# how long a checkpoint save holds the step: synchronous vs in the background
python3 benchmarks/checkpoint_save.py --config configs/gsm8k_qwen2.5-0.5b_1gpu.yaml \
    --model-shape configs/model_shapes/Qwen2.5-0.5B.json >"$out/checkpoint_save.json" || status=1
for pair in gsm8k_qwen2.5-0.5b_1gpu:Qwen2.5-0.5B gsm8k_8gpu:Qwen2.5-7B gsm8k_grpo_8gpu:Qwen2.5-7B \
    gsm8k_72b_grpo_4node:Qwen2.5-72B; do
    python3 -m rlhf.cli.doctor --config "configs/${pair%%:*}.yaml" \
        --model-config "configs/model_shapes/${pair##*:}.json" >"$out/plan_${pair%%:*}.txt" 2>&1
done
cat "$out"/ppo_step_*.json "$out"/memory_bf16.json "$out"/logprob_head.json \
    "$out"/phase_memory.json "$out"/checkpoint_save.json
exit $status
