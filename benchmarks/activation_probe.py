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
from rlhf.engine.build import build_engine
from rlhf.engine.heads import token_logprobs
from rlhf.memory.measure import peak_bytes_during
from rlhf.memory.planner import PlanInputs, plan_stage
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.preflight import load_policy_arch

SAMPLES, PROMPT = 4, 8


@dataclass(frozen=True)
class ActivationMeasurement:
    grads: dict[str, torch.Tensor]  # the model's main_grad per parameter, on the CPU
    peak: int  # bytes measured above the level before the call
    estimate: int  # the planner's activation bytes for the same micro-batch


def packed_batch(tokens: int, vocab_size: int, micro_batches: int = 1) -> RolloutBatch:
    """SAMPLES sequences per micro-batch that fill `micro_batches` micro-batches of `tokens`
    tokens exactly."""
    gen = torch.Generator().manual_seed(5)
    rows = [
        torch.randint(3, vocab_size, (tokens // SAMPLES,), generator=gen).tolist()
        for _ in range(SAMPLES * micro_batches)
    ]
    return RolloutBatch(
        prompt_ids=[row[:PROMPT] for row in rows],
        response_ids=[row[PROMPT:] for row in rows],
        scores_b=torch.zeros(len(rows)),
        data_sources=["synthetic"] * len(rows),
        uids=[str(i) for i in range(len(rows))],
    )


def measure_activations(
    model_dir: str | Path,
    ctx: ParallelContext,
    tokens: int,
    *,
    role: str = "actor",
    recompute: str = "none",
    sequence_parallel: bool | None = None,
    micro_batches: int = 1,
    dtype: str = "float32",
    planned_attention: str = "cpu",
    vp: int = 1,
) -> ActivationMeasurement:
    """`role`: "actor" or "critic"; `sequence_parallel`: Megatron's (None: the default, on
    when TP > 1; must match `ctx`); `micro_batches` of `tokens` each go through one
    forward-backward (under PP, 1F1B keeps several in flight); `planned_attention`: "cpu"
    plans the local spec's attention, "cuda" the fused one; `vp`: virtual-pipeline chunks
    per stage. The estimate is the planner's for this rank's pipeline stage."""
    section = "actor_rollout_ref.actor" if role == "actor" else "critic"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"trainer.n_gpus_per_node={ctx.world_size}",
        f"algorithm.adv_estimator={'grpo' if role == 'actor' else 'gae'}",
        "algorithm.use_kl_in_reward=false",
        f"{section}.megatron.tensor_model_parallel_size={ctx.tp_size}",
        f"{section}.megatron.pipeline_model_parallel_size={ctx.pp_size}",
        f"{section}.megatron.virtual_pipeline_model_parallel_size={vp}",
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
    models = build_engine(cfg, arch, ctx, total_steps=1)
    batch = packed_batch(tokens, arch.vocab_size, micro_batches)
    (planned,) = models.planner.plan(batch, tokens)
    if len(planned) != micro_batches or any(mb.num_tokens != tokens for mb in planned):
        raise ValueError(f"the batch did not pack into {micro_batches} x {tokens} tokens")
    vocab = models.logprob_head.vocab

    def head(output, mb):
        if role == "critic":
            return mb.gather(output[..., 0].float()).sum() / mb.num_tokens, {}
        logp, _ = token_logprobs(output, mb, vocab, 1.0)
        return -logp.sum() / mb.num_tokens, {}

    model = models.actor if role == "actor" else models.critic
    assert model is not None, "the critic exists with GAE"

    def update():
        return model.compute_gradients(planned, head)

    update()  # warm-up: lazily built buffers
    _, peak = peak_bytes_during(update, ctx.device)
    params = model.module.global_names().items()
    grads = {name: p.main_grad.detach().cpu().clone() for p, name in params}
    inputs = PlanInputs.from_config(cfg, arch, ctx.world_size, planned_attention)
    plan = plan_stage(inputs, ctx.pp_rank, None)  # this rank's stage
    return ActivationMeasurement(grads, peak, plan.row(role).activations)
