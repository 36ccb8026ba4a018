"""Each trainer phase's measured memory peak next to the memory planner's, on one GPU (or CPU).

    python benchmarks/phase_memory.py --config configs/gsm8k_qwen2.5-0.5b_1gpu.yaml \
        --model-shape configs/model_shapes/Qwen2.5-0.5B.json [--samples N] [key=value ...]

One process, the config's layout at TP = PP = 1. The model is `--model` (an HF directory)
or, with `--model-shape`, a randomly initialised HF checkpoint of that shape written to a
temporary directory (no hub needed). The PPO models are built as the trainer builds them
(offload switches included) and one trainer step's learning runs (`learn_from_batch`) on a
synthetic batch of `--samples` full-length samples (default: one mini-batch; the config's
prompt and response lengths, rewards that differ within each group). The build and every
stage of the step (old log-probs, reference, values, critic update, actor update) are
measured (the build against the planner's build phase):

- CUDA: the allocator's peak during the stage (`max_memory_allocated`, everything alive:
  resident models included), next to the planner's phase less its CUDA-runtime allowance
  (what the allocator cannot see);
- CPU: the most bytes allocated during the stage above its start (torch.profiler's
  allocation events), next to the planner's activations of the stage's model (the models
  live in host memory before and after).

The forward-only stages of trained models (old log-probs, values) are the planner's phases
of their own (the parameters alone, a forward's activations). Prints one JSON object;
tools/run_gpu_checks.sh runs it for the 0.5B config. Here (CPU, the tiny model, 512-token
micro-batches): planned / measured 0.98 for the actor's update, 0.88 for the critic's,
0.94 for the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# the stage names of `learn_from_batch` -> (the planner's phase, the role whose activations
# the stage holds on the CPU, whether it is a forward-only pass)
STAGES = {
    "build": ("build", None, False),
    "old_log_prob": ("old_log_prob", "actor", True),
    "ref": ("reference", "reference", False),
    "values": ("values", "critic", True),
    "update_critic": ("critic", "critic", False),
    "update_actor": ("actor", "actor", False),
}
MIB = 1024**2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", help="an HF model directory")
    parser.add_argument("--model-shape", help="an HF config.json: random weights of that shape")
    parser.add_argument(
        "--samples", type=int, help="default: one mini-batch (ppo_mini_batch_size x rollout.n)"
    )
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def random_model(shape: Path, out: Path) -> Path:
    """A randomly initialised bf16 HF checkpoint of `shape` in `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(shape.read_text()))
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def synthetic_batch(cfg, vocab_size: int, samples: int):
    from rlhf.rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    n = cfg.actor_rollout_ref.rollout.n
    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length

    def tokens(length: int) -> list[int]:
        return torch.randint(3, vocab_size, (length,), generator=gen).tolist()

    prompts = [tokens(prompt) for _ in range(-(-samples // n))]
    return RolloutBatch(
        prompt_ids=[prompts[i // n] for i in range(samples)],
        response_ids=[tokens(response) for _ in range(samples)],
        scores_b=torch.arange(samples, dtype=torch.float32) % 2,
        data_sources=["synthetic"] * samples,
        uids=[f"p{i // n}" for i in range(samples)],
    )


class StageMemory:
    """`learn_from_batch`'s timer, measuring each stage's memory peak instead of its time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.peaks[name] = torch.cuda.max_memory_allocated()
            return
        from rlhf.memory.measure import allocation_peak, profiling_memory

        with profiling_memory() as prof:
            yield
        self.peaks[name] = allocation_peak(prof)


def single_rank_models(config: str, model: str, overrides: list[str], port: int):
    """`config` with `model` on one process (its process group started, seeded) and the PPO
    models built as the trainer builds them: (cfg, ctx, arch, models, the stage meter with
    the build's peak). Call `teardown` after."""
    from rlhf.config import load_config
    from rlhf.distributed.bootstrap import init_parallel, seed_everything
    from rlhf.engine.build import build_engine
    from rlhf.trainer.preflight import load_policy_arch

    one = [f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1"]
    cfg = load_config(config, [*one, *overrides])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("WORLD_SIZE", "1")
    ctx = init_parallel(cfg.trainer.device)
    seed_everything(0)
    arch = load_policy_arch(cfg)
    meter = StageMemory(ctx.device)
    with meter.stage("build"):  # the models one after the other, offloaded as configured
        models = build_engine(cfg, arch, ctx, total_steps=1)
    return cfg, ctx, arch, models, meter


def measure(args) -> dict:
    from rlhf.algo import build_kl_controller
    from rlhf.distributed.bootstrap import teardown
    from rlhf.memory.planner import GPU_RUNTIME_BYTES, PlanInputs, plan_memory
    from rlhf.trainer.step import Learning, learn_from_batch

    cfg, ctx, arch, models, meter = single_rank_models(
        args.config, args.model, args.overrides, 29531
    )
    try:
        aro = cfg.actor_rollout_ref
        samples = args.samples or aro.actor.ppo_mini_batch_size * aro.rollout.n
        batch = synthetic_batch(cfg, arch.vocab_size, samples)
        learn_from_batch(
            models,
            batch,
            Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer),
            build_kl_controller(cfg.algorithm.kl_ctrl),
            meter,
        )
    finally:
        teardown()
    cuda = ctx.device.type == "cuda"
    gpu = torch.cuda.get_device_properties(0).total_memory if cuda else None
    plan = plan_memory(PlanInputs.from_config(cfg, arch, 1, ctx.device.type), gpu)
    stages = {}
    for name, peak in meter.peaks.items():
        if name not in STAGES:  # advantages: no model runs
            continue
        phase, role, forward = STAGES[name]
        if cuda:
            planned = plan.phases[phase] - GPU_RUNTIME_BYTES
        elif role is None:  # the build: on the CPU the models' bytes are measured
            planned = plan.phases[phase]
        else:
            row = plan.row(role)
            planned = row.forward_activations if forward else row.activations
        stages[name] = {
            "measured_mib": round(peak / MIB, 1),
            "planned_mib": round(planned / MIB, 1),
            "planned_over_measured": round(planned / peak, 3) if peak else None,
        }
    return {"device": ctx.device.type, "samples": batch.size, "stages": stages}


def main(argv=None) -> None:
    args = parse_args(argv)
    if (args.model is None) == (args.model_shape is None):
        raise SystemExit("give one of --model and --model-shape")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_shape:
            args.model = str(random_model(Path(args.model_shape), Path(tmp) / "model"))
        print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
