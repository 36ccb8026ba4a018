"""Worker: the trainer's old-log-prob stage and actor updates at any TP/PP/DP layout.

On a fixed synthetic batch (varied prompt and response lengths, a small token budget so
several packed micro-batches are needed), rank 0 writes to OUT:
`logprobs_before` [B, R], the update's `metrics` (pg_loss, grad_norm, ...) and
`logprobs_after` [B, R] (the old-log-prob stage re-run after the optimizer step) and, when
every rank holds whole weights (no TP/PP), the `gradient` of that update's loss before the
step and the updated `weights`. Then a second update from the new policy with 2
mini-batches x 2 epochs (clipping active): its `clipped_metrics` and `logprobs_final`.
Also the dtypes of the model's parameters and of the optimizer's master parameters, and
`checkpoint_round_trip`:
whether the actor (weights, master weights, Adam moments) saved after the update and loaded
into a freshly built actor comes back equal, and `background_round_trip`: the same for a save
written in the background (`trainer.async_save`) while every one of those tensors is changed.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from tests.helpers import SEED_DEFAULTS

NUM_SAMPLES = 8


def synthetic_batch(vocab_size: int, multi_turn: bool = False):
    """8 random samples; `multi_turn`: some with a tool message between two turns."""
    from rlhf.rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(7)
    prompts, responses = [], []
    for _ in range(NUM_SAMPLES):
        p = int(torch.randint(3, 20, (1,), generator=gen))
        r = int(torch.randint(1, 12, (1,), generator=gen))
        prompts.append(torch.randint(3, vocab_size, (p,), generator=gen).tolist())
        responses.append(torch.randint(3, vocab_size, (r,), generator=gen).tolist())
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        scores_b=torch.rand(NUM_SAMPLES, generator=gen),
        data_sources=["synthetic"] * NUM_SAMPLES,
        uids=[str(i // 2) for i in range(NUM_SAMPLES)],
        response_masks=[multi_turn_mask(i, len(r)) for i, r in enumerate(responses)]
        if multi_turn
        else None,
    )


def multi_turn_mask(index: int, length: int) -> list[int]:
    """Odd samples of 5+ tokens are two turns with a 2-token tool message between them
    (tokens 1 and 2): the layouts must train on the policy's tokens only."""
    mask = [1] * length
    if index % 2 and length >= 5:
        mask[1:3] = [0, 0]
    return mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallel size")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    ctx = init_parallel(args.device, tp_size=args.tp, pp_size=args.pp, sp_size=args.sp)
    try:
        seed_everything(0)
        run(args, ctx)
    finally:
        teardown()


def run(args, ctx) -> None:
    import dataclasses

    from rlhf.config.budgets import MicroBatching
    from rlhf.engine import engine as stages
    from rlhf.engine.build import build_engine
    from rlhf.engine.micro_batch import MicroBatchPlanner
    from rlhf.trainer.preflight import load_policy_arch
    from rlhf.trainer.step import Experience

    cfg = load_config(
        None,
        [
            *SEED_DEFAULTS,
            f"actor_rollout_ref.model.path={args.model}",
            "actor_rollout_ref.actor.optim.lr=0.01",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.clip_ratio_c=null",
            "data.train_batch_size=4",
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={args.sp}",
            f"actor_rollout_ref.actor.megatron.dtype={args.dtype}",
        ],
    )
    arch = load_policy_arch(cfg)
    models = build_engine(cfg, arch, ctx, total_steps=1)
    actor, head = models.actor, models.logprob_head  # rollout temperature 1
    planner = MicroBatchPlanner(ctx, thd=False)
    batch = synthetic_batch(arch.vocab_size, multi_turn=True)
    budget = 40  # a few samples per micro-batch: several packed micro-batches per rank
    before, entropy = stages.compute_logprobs(actor, batch, planner, budget, head)
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(before.shape, generator=gen) * batch.mask_bt()
    zeros = torch.zeros_like(before)
    exp = Experience(batch, before, entropy, before, None, zeros, advantages, None)
    update = dataclasses.replace(models.actor_update, token_budget=budget)
    gradient = first_gradient(actor, update, exp, planner)
    # verl's fixed micro-batches (3 samples each, in order), each sample padded to the
    # longest of its micro-batch: the same log-probs and gradient
    padded, fixed = dataclasses.replace(planner, padded=True), MicroBatching(budget, samples=3)
    fixed_padded_logprobs, _ = stages.compute_logprobs(actor, batch, padded, fixed, head)
    fixed_update = dataclasses.replace(update, token_budget=fixed)
    (fixed_plan,) = padded.plan(batch, fixed)
    fixed_layout = [(mb.sample_ids, mb.tokens.shape[1]) for mb in fixed_plan]
    fixed_padded_gradient = first_gradient(actor, fixed_update, exp, padded)
    metrics, _ = stages.run_updates(update, exp.batch, exp, planner)
    weights_after_first_update = {
        n: p.detach().cpu().float().clone() for p, n in actor.module.global_names().items()
    }
    after, after_entropy = stages.compute_logprobs(actor, batch, planner, budget, head)
    # A second, PPO-style update from the new policy: 2 mini-batches x 2 epochs, where the
    # ratio leaves 1 after the first optimizer step and clipping engages.
    clipped = dataclasses.replace(update, mini_batch_samples=4, epochs=2)
    exp2 = dataclasses.replace(exp, old_logprobs_bt=after, old_entropy_bt=after_entropy)
    clipped_metrics, _ = stages.run_updates(clipped, exp2.batch, exp2, planner)
    final, _ = stages.compute_logprobs(actor, batch, planner, budget, head)
    fresh_actor = lambda: build_engine(cfg, arch, ctx, 1).actor  # noqa: E731
    round_trip = checkpoint_round_trip(actor, fresh_actor)
    background_round_trip = checkpoint_round_trip(actor, fresh_actor, background=True)
    if ctx.rank == 0:
        result = {
            "device": ctx.device.type,
            "param_dtypes": {str(p.dtype) for p in actor.module.parameters()},
            "master_dtypes": {
                str(p.dtype) for g in actor.optimizer.param_groups for p in g["params"]
            },
            "checkpoint_round_trip": round_trip,
            "fixed_padded_logprobs": fixed_padded_logprobs,
            "fixed_layout": fixed_layout,  # rank 0's micro-batches: samples, row length
            "background_round_trip": background_round_trip,
            "logprobs_before": before,
            "logprobs_after": after,
            "metrics": metrics,
            "advantages": advantages,
            "clipped_metrics": clipped_metrics,
            "logprobs_final": final,
            "batch": batch.to_objects(),
        }
        if args.tp == args.pp == 1:  # rank 0 holds every weight
            result["weights"] = weights_after_first_update
            result["gradient"] = gradient
            result["fixed_padded_gradient"] = fixed_padded_gradient
        torch.save(result, Path(args.out))


def first_gradient(actor, update, exp, planner) -> dict[str, torch.Tensor]:
    """The gradient of the update's (one) mini-batch loss before any step, per parameter
    (this rank's shards), through the trainer's own forward-backward."""
    (micro_batches,) = planner.plan(exp.batch, update.token_budget, update.mini_batch_samples)
    actor.compute_gradients(
        micro_batches, update.loss.head(exp, planner.mini_batch_counts(micro_batches))
    )
    grads = {
        n: p.main_grad.detach().cpu().float().clone()
        for p, n in actor.module.global_names().items()
    }
    actor.ddps[0].zero_grad_buffer()
    return grads


def flat_tensors(value) -> list[torch.Tensor]:
    """Every tensor inside nested dicts/lists, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in flat_tensors(value[k])]
    if isinstance(value, list | tuple):
        return [t for v in value for t in flat_tensors(v)]
    return []


def state_tensors(actor) -> list[torch.Tensor]:
    """The actor's weights, master weights and Adam moments (the live tensors)."""
    return flat_tensors(actor.module.state_dict()) + flat_tensors(actor.optimizer.state_dict())


def checkpoint_round_trip(actor, build_actor, background: bool = False) -> bool:
    """Save `actor`, load into `build_actor()`; True when every tensor is equal on all ranks.
    `background`: saved as under trainer.async_save, and every tensor is changed in place
    before the writer starts: what loads must be the state of the save."""
    import tempfile

    from rlhf.checkpoint.background import BackgroundSave, PendingWrite

    directory = [
        tempfile.mkdtemp(prefix="actor_ckpt_") if torch.distributed.get_rank() == 0 else None
    ]
    torch.distributed.broadcast_object_list(directory)
    saved = [t.detach().cpu().clone() for t in state_tensors(actor)]
    if background:
        writes = [
            PendingWrite(lambda: time.sleep(0.5)),
            *actor.save_in_background(Path(directory[0])),
        ]
        pending = BackgroundSave(1, Path(directory[0]), writes)
        with torch.no_grad():
            for tensor in state_tensors(actor):
                tensor.add_(1.0)
        pending.finish()
    else:
        actor.save(Path(directory[0]))
    fresh = build_actor()
    fresh.load(Path(directory[0]))
    loaded = state_tensors(fresh)
    same = len(saved) == len(loaded) and all(
        a.shape == b.shape and torch.equal(a, b.cpu()) for a, b in zip(saved, loaded)
    )
    verdict = torch.tensor([float(same)], device=actor.ctx.device)
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
    if torch.distributed.get_rank() == 0:  # every rank has read it: the all-reduce waited
        shutil.rmtree(directory[0], ignore_errors=True)
    return bool(verdict.item())


if __name__ == "__main__":
    main()
