"""Worker: the actor's gradients and peak activation memory per recompute setting.

For each `--variants` entry (none, selective, full) the actor is built from the HF checkpoint
with that `megatron.recompute_granularity`, and one packed micro-batch of exactly `--tokens`
tokens (4 samples) goes through `TrainableMegatronModel.compute_gradients` with a loss head
(the mean negative log-prob of the response tokens, vocab-parallel). The call is made once to
warm up, then measured with `rlhf.memory.measure.peak_bytes_during`. Rank 0 writes, per
variant, the gradients (`main_grad`), the peak bytes above the level before the call and the
memory planner's activation estimate for the same micro-batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown

SAMPLES = 4
PROMPT = 8


def packed_batch(tokens: int, vocab_size: int):
    """SAMPLES sequences that fill one micro-batch of `tokens` tokens exactly."""
    from rlhf.rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(5)
    response = tokens // SAMPLES - PROMPT
    ids = [torch.randint(3, vocab_size, (PROMPT + response,), generator=gen).tolist()
           for _ in range(SAMPLES)]  # fmt: skip
    return RolloutBatch(
        prompt_ids=[row[:PROMPT] for row in ids],
        response_ids=[row[PROMPT:] for row in ids],
        scores_b=torch.zeros(SAMPLES),
        data_sources=["synthetic"] * SAMPLES,
        uids=[str(i) for i in range(SAMPLES)],
    )


class NegativeLogprobHead:
    def __init__(self, vocab) -> None:
        self.vocab = vocab

    def __call__(self, logits, mb):
        from rlhf.trainer.heads import token_logprobs

        logp, _ = token_logprobs(logits, mb, self.vocab, 1.0)
        return -logp.sum() / mb.num_tokens, {}


def run(args, ctx, recompute: str) -> dict:
    from rlhf.config import validate_config
    from rlhf.memory.measure import peak_bytes_during
    from rlhf.memory.planner import plan_memory
    from rlhf.trainer.setup import build_ppo_models, load_policy_arch

    settings = [
        f"actor_rollout_ref.model.path={args.model}",
        f"trainer.n_gpus_per_node={ctx.world_size}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={args.tp}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.tokens}",
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={args.tokens // SAMPLES - PROMPT}",
    ]
    if recompute != "none":
        settings.append(f"actor_rollout_ref.actor.megatron.recompute_granularity={recompute}")
    cfg = load_config(None, settings)
    arch = load_policy_arch(cfg)
    validate_config(cfg, ctx.world_size, arch)
    seed_everything(0)
    models = build_ppo_models(cfg, arch, ctx, total_steps=1)
    (micro_batches,) = models.planner.plan(packed_batch(args.tokens, arch.vocab_size), args.tokens)
    assert len(micro_batches) == 1 and micro_batches[0].num_tokens == args.tokens
    head = NegativeLogprobHead(models.logprob_head.vocab)
    actor = models.actor
    actor.compute_gradients(micro_batches, head)  # warm-up: lazily built buffers
    _, peak = peak_bytes_during(lambda: actor.compute_gradients(micro_batches, head), ctx.device)
    grads = {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()}
    plan = plan_memory(cfg, arch, ctx.world_size, device="cpu")
    return {"grads": grads, "peak": peak, "estimate": plan.row("actor").activations}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--variants", default="none,selective,full")
    args = parser.parse_args()
    ctx = init_parallel("cpu", tp_size=args.tp)
    try:
        results = {name: run(args, ctx, name) for name in args.variants.split(",")}
        if ctx.rank == 0:
            torch.save(results, Path(args.out))
            print({name: (r["peak"], r["estimate"]) for name, r in results.items()})
    finally:
        teardown()


if __name__ == "__main__":
    main()
