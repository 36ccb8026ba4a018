"""Measure the activation memory of a training micro-batch, next to the planner's.

The actor (or the critic) is built as the trainer builds it, from `model_dir`, with the
given recompute setting; one packed micro-batch of exactly `tokens` tokens (SAMPLES
sequences) goes through `compute_gradients` with a log-prob loss (the critic: a loss on its
values), once to warm up and once measured with `rlhf.memory.measure.peak_bytes_during`.
Used by benchmarks/memory.py and the activation tests; `docs/memory.md` has the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed.bootstrap import seed_everything
from rlhf.distributed.context import ParallelContext
from rlhf.memory.measure import peak_bytes_during
from rlhf.memory.planner import plan_memory
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.heads import token_logprobs
from rlhf.trainer.setup import build_ppo_models, load_policy_arch

SAMPLES, PROMPT = 4, 8


@dataclass(frozen=True)
class ActivationMeasurement:
    grads: dict[str, torch.Tensor]  # the model's main_grad per parameter, on the CPU
    peak: int  # bytes measured above the level before the call
    estimate: int  # the planner's activation bytes for the same micro-batch


def packed_batch(tokens: int, vocab_size: int) -> RolloutBatch:
    """SAMPLES sequences that fill one micro-batch of `tokens` tokens exactly."""
    gen = torch.Generator().manual_seed(5)
    rows = [
        torch.randint(3, vocab_size, (tokens // SAMPLES,), generator=gen).tolist()
        for _ in range(SAMPLES)
    ]
    return RolloutBatch(
        prompt_ids=[row[:PROMPT] for row in rows],
        response_ids=[row[PROMPT:] for row in rows],
        scores_b=torch.zeros(SAMPLES),
        data_sources=["synthetic"] * SAMPLES,
        uids=[str(i) for i in range(SAMPLES)],
    )


def measure_activations(
    model_dir: str | Path,
    ctx: ParallelContext,
    tokens: int,
    *,
    role: str = "actor",
    recompute: str = "none",
    sequence_parallel: bool | None = None,
    dtype: str = "float32",
    planned_attention: str = "cpu",
) -> ActivationMeasurement:
    """`role`: "actor" or "critic"; `sequence_parallel`: Megatron's (None: the default, on
    when TP > 1; must match `ctx`); `planned_attention`: "cpu" plans the local spec's
    attention, "cuda" the fused one."""
    section = "actor_rollout_ref.actor" if role == "actor" else "critic"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"trainer.n_gpus_per_node={ctx.world_size}",
        f"algorithm.adv_estimator={'grpo' if role == 'actor' else 'gae'}",
        "algorithm.use_kl_in_reward=false",
        f"{section}.megatron.tensor_model_parallel_size={ctx.tp_size}",
        f"{section}.megatron.dtype={dtype}",
        f"{section}.ppo_max_token_len_per_gpu={tokens}",
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={tokens // SAMPLES - PROMPT}",
    ]
    if recompute != "none":
        overrides.append(f"{section}.megatron.recompute_granularity={recompute}")
    if sequence_parallel is not None:
        overrides.append(f"{section}.megatron.sequence_parallel={str(sequence_parallel).lower()}")
    cfg = load_config(None, overrides)
    arch = load_policy_arch(cfg)
    seed_everything(0)
    models = build_ppo_models(cfg, arch, ctx, total_steps=1)
    (micro_batches,) = models.planner.plan(packed_batch(tokens, arch.vocab_size), tokens)
    if len(micro_batches) != 1 or micro_batches[0].num_tokens != tokens:
        raise ValueError(f"{tokens} tokens did not pack into one micro-batch of that size")
    vocab = models.logprob_head.vocab

    def head(output, mb):
        if role == "critic":
            return mb.gather(output[..., 0].float()).sum() / mb.num_tokens, {}
        logp, _ = token_logprobs(output, mb, vocab, 1.0)
        return -logp.sum() / mb.num_tokens, {}

    model = models.actor if role == "actor" else models.critic
    assert model is not None, "the critic exists with GAE"

    def update():
        return model.compute_gradients(micro_batches, head)

    update()  # warm-up: lazily built buffers
    _, peak = peak_bytes_during(update, ctx.device)
    params = model.module.named_parameters()
    grads = {name: p.main_grad.detach().cpu().clone() for name, p in params}
    plan = plan_memory(cfg, arch, ctx.world_size, device=planned_attention)
    return ActivationMeasurement(grads, peak, plan.row(role).activations)
