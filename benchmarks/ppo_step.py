"""Time one PPO step's trainer stages, its MFU and the framework overhead.

    python benchmarks/ppo_step.py [--hidden 256 --layers 4 --samples 32 --prompt 64 --response 64]

A synthetic step (random prompts and responses of varied length, scores in [0, 1]) runs the
trainer's own stages on a tiny HF-initialised Qwen2 model in one process: old log-probs,
reference, values, advantages, critic update, actor update (one mini-batch, one epoch).
Generation and weight sync need SGLang servers and are measured by benchmarks/rollout.py
and benchmarks/weight_sync.py; a real run logs all of them as `timing_s/*`.

Prints one JSON object:
- stage_s: mean seconds per stage over the timed steps (after one warm-up step);
- mfu: model FLOPs of the stages / their time / a matmul rate measured in the same run, in
  the training dtype (`--dtype`; bfloat16 is Megatron's mixed precision);
- overhead: update_actor time / the time of a plain loop (forward, log-prob loss, backward,
  Adam step) over the same packed micro-batches on the same model — what the schedule,
  loss bookkeeping and metric reductions cost;
- packed_attention: that plain loop with attention per sample (what the trainer does,
  `rlhf.models.packed_attention`) and with each packed row masked as a whole (T x T
  scores), and the speedup of the former.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed import bootstrap
from rlhf.utils import torch_dtype


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64, help="longest prompt")
    parser.add_argument("--response", type=int, default=64, help="longest response")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser.parse_args()


def random_ids(gen: torch.Generator, min_len: int, max_len: int, vocab: int) -> list[int]:
    length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def synthetic_batch(args, vocab: int):
    from rlhf.rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    prompts = [random_ids(gen, args.prompt // 2, args.prompt, vocab) for _ in range(args.samples)]
    responses = [random_ids(gen, 1, args.response, vocab) for _ in range(args.samples)]
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        scores_b=torch.rand(args.samples, generator=gen),
        data_sources=["synthetic"] * args.samples,
        uids=[str(i // 2) for i in range(args.samples)],
    )


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def run_stages(models, batch, algorithm, budget: int, kl_coef: float) -> dict[str, float]:
    """The trainer's stages of one step on `batch`, every model at token budget `budget`."""
    import dataclasses

    from rlhf.engine import engine
    from rlhf.trainer import step as experience

    seconds: dict[str, float] = {}

    def stage(name, fn):
        synchronize()
        start = time.perf_counter()
        out = fn()
        synchronize()
        seconds[name] = time.perf_counter() - start
        return out

    m, planner = models, models.planner
    old = stage(
        "old_log_prob",
        lambda: engine.compute_logprobs(m.actor, batch, planner, budget, m.logprob_head),
    )
    ref, _ = stage(
        "ref", lambda: engine.compute_logprobs(m.ref, batch, planner, budget, m.logprob_head)
    )
    values = stage("values", lambda: engine.compute_values(m.critic, batch, planner, budget))
    exp, _ = stage(
        "adv", lambda: experience.build_experience(batch, old, ref, values, algorithm, kl_coef)
    )
    for role, spec in (("critic", m.critic_update), ("actor", m.actor_update)):
        spec = dataclasses.replace(spec, token_budget=budget)
        stage(f"update_{role}", lambda spec=spec: engine.run_updates(spec, batch, exp, planner))
    seconds["step"] = sum(seconds.values())
    return seconds


def plain_update_seconds(
    module, micro_batches, vocab, temperature: float, masked_rows: bool = False
) -> float:
    """Forward, log-prob loss, backward, Adam step over `micro_batches`: nothing else.

    `masked_rows`: attend over each whole packed row with a block-diagonal T x T mask (the
    local spec before per-sample attention) instead of per sample."""
    from rlhf.engine.heads import token_logprobs
    from rlhf.engine.micro_batch import block_causal_mask

    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-6)

    def inputs(mb):
        if not masked_rows or mb.packed_seq_params is None:
            return mb.attention_mask, mb.packed_seq_params
        bounds = mb.packed_seq_params.cu_seqlens_q.tolist()
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        return block_causal_mask(lengths).to(mb.tokens.device), None

    def one_step():
        optimizer.zero_grad()
        for mb in micro_batches:
            mask, packed = inputs(mb)
            logits = module(mb.tokens, mb.position_ids, mask, packed_seq_params=packed)
            logp, _ = token_logprobs(logits, mb, vocab, temperature)
            (-logp.sum() / max(1, int(mb.mask.sum()))).backward()
        optimizer.step()

    one_step()  # warm-up
    return min(timed(one_step) for _ in range(3))


def measure(args, model_dir: Path) -> dict:
    from rlhf.engine.build import build_engine
    from rlhf.engine.micro_batch import MicroBatchPlanner
    from rlhf.trainer.metrics import measure_matmul_flops, ppo_step_flops
    from rlhf.trainer.preflight import load_policy_arch

    n_samples = args.samples
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_batch_size={n_samples // 2}",
            "actor_rollout_ref.rollout.n=2",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={n_samples // 2}",
            f"critic.ppo_mini_batch_size={n_samples // 2}",
            f"data.max_prompt_length={args.prompt}",
            f"data.max_response_length={args.response}",
            f"actor_rollout_ref.actor.megatron.dtype={args.dtype}",
            f"critic.megatron.dtype={args.dtype}",
        ],
    )
    env = bootstrap.init_parallel("cpu" if not torch.cuda.is_available() else "auto")
    bootstrap.seed_everything(0)
    arch = load_policy_arch(cfg)
    models = build_engine(cfg, arch, env, total_steps=args.steps + 1)
    models = dataclasses.replace(models, planner=MicroBatchPlanner(env, thd=False))
    batch = synthetic_batch(args, arch.vocab_size)
    run_stages(models, batch, cfg.algorithm, args.budget, 0.001)  # warm-up
    runs = [run_stages(models, batch, cfg.algorithm, args.budget, 0.001) for _ in range(args.steps)]
    stage_s = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    tokens = sum(batch.sequence_lengths)
    flops = ppo_step_flops(arch, tokens, tokens / batch.size, forward_passes=3, train_epochs=2)
    peak = measure_matmul_flops(env.device, torch_dtype(args.dtype))
    (micro_batches,) = models.planner.plan(batch, args.budget)
    head = models.logprob_head
    (module,) = models.actor.module.chunks  # PP = 1: one chunk
    plain_s = plain_update_seconds(module, micro_batches, head.vocab, head.temperature)
    masked_s = plain_update_seconds(
        module, micro_batches, head.vocab, head.temperature, masked_rows=True
    )
    num_params = sum(p.numel() for p in models.actor.module.parameters())
    bootstrap.teardown()
    return {
        "model": {"hidden": args.hidden, "layers": args.layers, "params": num_params},
        "samples": n_samples,
        "tokens_per_step": tokens,
        "micro_batches": len(micro_batches),
        "stage_s": {k: round(v, 4) for k, v in stage_s.items()},
        "matmul_flops_per_s": peak,
        "mfu": flops / stage_s["step"] / peak,
        "plain_update_s": round(plain_s, 4),
        "overhead": stage_s["update_actor"] / plain_s,
        "packed_attention": {
            "per_sample_update_s": round(plain_s, 4),
            "masked_row_update_s": round(masked_s, 4),
            "speedup": masked_s / plain_s,
        },
        "device": env.device.type,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec.scaled(args.hidden, args.layers)
        model_dir = save_tiny_model(Path(tmp) / "model", spec)
        print(json.dumps(measure(args, model_dir), indent=2))


if __name__ == "__main__":
    main()
