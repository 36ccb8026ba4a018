"""Worker: a LoRA actor's stages at any TP/PP/DP layout (sequence parallel with TP).

On test_ppo_stages' synthetic batch, rank 0 writes to OUT: `ref_before` (the reference:
the base model, adapters off), `logprobs_before` (the adapted actor, which starts as the
base), the update's `metrics`, `logprobs_after`, `ref_after` (the reference after the
update), whether every base weight is `base_unchanged` bitwise and which parameters the
optimizer holds (`trained`); with every weight on rank 0 (1 rank) the `merged` weights the
sync would serve and the adapters (`adapters`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from tests.distributed.workers.ppo_stages import checkpoint_round_trip, synthetic_batch
from tests.helpers import SEED_DEFAULTS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="Megatron's sequence parallelism")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    parser.add_argument("--targets", default="all-linear", help="target_modules")
    parser.add_argument("--critic", action="store_true", help="a LoRA critic too (GAE)")
    parser.add_argument("--merge", action="store_true", help="model.lora_merge (MoE experts)")
    args = parser.parse_args()
    ctx = init_parallel(
        "cpu", tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, sequence_parallel=args.sp
    )
    try:
        seed_everything(0)
        run(args, ctx)
    finally:
        teardown()


def run(args, ctx) -> None:
    from rlhf.engine import engine as stages
    from rlhf.engine.build import build_engine
    from rlhf.engine.micro_batch import MicroBatchPlanner
    from rlhf.models.lora import is_lora_param, merged_weights
    from rlhf.trainer.preflight import load_policy_arch
    from rlhf.trainer.step import Experience

    cfg = load_config(
        None,
        [
            *SEED_DEFAULTS,
            f"actor_rollout_ref.model.path={args.model}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            f"actor_rollout_ref.model.target_modules={args.targets}",
            f"actor_rollout_ref.model.lora_merge={str(args.merge).lower()}",
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={args.ep}",
            "actor_rollout_ref.actor.optim.lr=0.05",
            "actor_rollout_ref.actor.use_kl_loss=true",  # a reference exists
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.clip_ratio_c=null",
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=4",
            f"actor_rollout_ref.actor.megatron.sequence_parallel={str(args.sp).lower()}",
            *([*CRITIC, f"critic.model.path={args.model}"] if args.critic else []),
        ],
    )
    arch = load_policy_arch(cfg)
    models = build_engine(cfg, arch, ctx, total_steps=1)
    actor, head = models.actor, models.logprob_head
    planner = MicroBatchPlanner(ctx, thd=False)
    batch = synthetic_batch(arch.vocab_size)
    names = actor.module.global_names()
    base = {n: p.detach().clone() for p, n in names.items() if not is_lora_param(n)}
    budget = 40
    ref_before, _ = stages.compute_logprobs(models.ref, batch, planner, budget, head)
    before, entropy = stages.compute_logprobs(actor, batch, planner, budget, head)
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(before.shape, generator=gen) * batch.mask_bt()
    zeros = torch.zeros_like(before)
    exp = Experience(batch, before, entropy, ref_before, None, zeros, advantages, None)
    update = dataclasses.replace(models.actor_update, token_budget=budget)
    metrics, _ = stages.run_updates(update, exp.batch, exp, planner)
    after, _ = stages.compute_logprobs(actor, batch, planner, budget, head)
    ref_after, _ = stages.compute_logprobs(models.ref, batch, planner, budget, head)
    unchanged = all(torch.equal(p, base[n]) for p, n in names.items() if n in base)
    trained = sorted(n for p, n in names.items() if p.requires_grad)
    round_trip = checkpoint_round_trip(actor, lambda: build_engine(cfg, arch, ctx, 1).actor)
    export_checkpoint(actor, arch, Path(args.out).with_suffix(""), args.model, ctx)
    critic = critic_update(models, cfg, arch, ctx, exp, planner, budget) if args.critic else None
    verdict = torch.tensor([float(unchanged)])
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
    if ctx.rank == 0:
        result = {
            "ref_before": ref_before,
            "ref_after": ref_after,
            "logprobs_before": before,
            "logprobs_after": after,
            "metrics": metrics,
            "base_unchanged": bool(verdict.item()),
            "trained": trained,
            "checkpoint_round_trip": round_trip,
            "checkpoint": str(Path(args.out).with_suffix("")),
            "batch": batch.to_objects(),
        }
        if args.critic:
            result["critic"] = critic
        if args.tp == args.pp == 1:
            merged = merged_weights(actor.module)
            result["merged"] = {n: merged[id(p)] for p, n in names.items() if id(p) in merged}
            result["adapters"] = {
                n: p.detach().clone() for p, n in names.items() if is_lora_param(n)
            }
        torch.save(result, Path(args.out))


CRITIC = [
    "algorithm.adv_estimator=gae",
    "critic.model.lora_rank=4",
    "critic.model.lora_alpha=8",
    "critic.optim.lr=0.05",
]


def critic_update(models, cfg, arch, ctx, exp, planner, budget: int) -> dict:
    """A LoRA critic's update on the batch (returns: its values plus noise): its values
    before and after, which parameters it trains, whether its trunk's weights are bitwise
    unchanged and its head moved, a checkpoint round trip and the checkpoint's tensors."""
    import tempfile

    from torch.distributed.checkpoint import FileSystemReader

    from rlhf.engine import engine as stages
    from rlhf.engine.build import build_engine

    critic, batch = models.critic, exp.batch
    names = critic.module.global_names()
    frozen = {n: p.detach().clone() for p, n in names.items() if not p.requires_grad}
    head = next((p.detach().clone() for p, n in names.items() if n.startswith("output_")), None)
    before = stages.compute_values(critic, batch, planner, budget)
    noise = torch.randn(before.shape, generator=torch.Generator().manual_seed(5))
    returns = before + noise * batch.mask_bt()
    targets = dataclasses.replace(exp, values_bt=before, returns_bt=returns)
    update = dataclasses.replace(models.critic_update, token_budget=budget)
    metrics, _ = stages.run_updates(update, batch, targets, planner)
    after = stages.compute_values(critic, batch, planner, budget)
    now = {n: p for p, n in names.items()}
    directory = [tempfile.mkdtemp(prefix="critic_") if ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(directory)
    critic.save(Path(directory[0]))
    saved = FileSystemReader(str(Path(directory[0]) / "model")).read_metadata()
    exported = Path(directory[0]) / "export"  # as a trainer checkpoint's critic/
    export_checkpoint(critic, arch, exported, cfg.critic.model.path, ctx, "value")
    trained = [None] * ctx.world_size  # every stage's (the head is on the last)
    torch.distributed.all_gather_object(trained, [n for p, n in names.items() if p.requires_grad])
    unchanged = torch.tensor([float(all(torch.equal(now[n], t) for n, t in frozen.items()))])
    torch.distributed.all_reduce(unchanged, op=torch.distributed.ReduceOp.MIN)
    return {
        "values_before": before,
        "values_after": after,
        "metrics": metrics,
        "trained": sorted({n for part in trained for n in part}),
        "trunk_unchanged": bool(unchanged.item()),
        "head_moved": None if head is None else not torch.equal(now["output_layer.weight"], head),
        "round_trip": checkpoint_round_trip(critic, lambda: build_engine(cfg, arch, ctx, 1).critic),
        "checkpoint_keys": sorted(saved.state_dict_metadata),
        "checkpoint": str(exported),
    }


def export_checkpoint(actor, arch, directory: Path, model_path: str, ctx, head: str = "lm") -> None:
    """The updated actor (or critic, `head` "value") as a trainer checkpoint's `actor/`
    (`critic/`): what rlhf-convert reads."""
    from rlhf.models.lora import spec_of
    from rlhf.models.mapping import Placement
    from rlhf.trainer.export import write_export_files

    directory.mkdir(parents=True, exist_ok=True)
    actor.save(directory)
    if ctx.rank == 0:
        padded, placement = actor.module.padded_vocab_size, Placement.of(ctx)
        spec = spec_of(actor.module)
        write_export_files(
            directory, model_path, arch, padded, torch.float32, placement, head, spec
        )
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
