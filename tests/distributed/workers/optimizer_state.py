"""Worker: PPO updates with and without Megatron's distributed optimizer; save and resume.

Builds the PPO models (GAE: actor, critic, reference) from the HF checkpoint and runs
`--steps` trainer steps (`train_on_batch`) on the fixed synthetic batch of trainer_step.py,
each with 3 Adam steps per model (one mini-batch, 3 epochs). `--save DIR` writes actor and
critic (model, optimizer, LR schedule) after the first step through the trainer's
checkpoint code; `--resume DIR` loads them into freshly built models and runs the remaining
steps. Rank 0 writes the final weights of both models, every step's metrics and, per rank,
the bytes of the optimizer state (Adam moments) and of fp32 master weights held apart from
the model's weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from tests.distributed.workers.trainer_step import synthetic_batch

SETTINGS = [
    "algorithm.adv_estimator=gae",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # one mini-batch ...
    "actor_rollout_ref.actor.ppo_epochs=3",  # ... three times: 3 Adam steps per step
    "actor_rollout_ref.actor.optim.lr=0.002",
    "critic.ppo_mini_batch_size=2",
    "critic.ppo_epochs=3",
    "critic.optim.lr=0.001",
    "algorithm.kl_ctrl.kl_coef=0.05",
    "algorithm.kl_ctrl.type=fixed",  # the controller is trainer state, not saved here
]
ROLES = ("actor_rollout_ref.actor", "critic")


def optimizer_bytes(model) -> dict[str, int]:
    """Bytes of Adam's state and of master weights that are not the model's own tensors."""
    model_storages = {p.untyped_storage().data_ptr() for p in model.module.parameters()}
    parts = getattr(model.optimizer, "chained_optimizers", [model.optimizer])
    adam = master = 0
    for part in parts:
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if param.untyped_storage().data_ptr() not in model_storages:
                    master += param.numel() * param.element_size()
                for key in ("exp_avg", "exp_avg_sq"):
                    value = inner.state.get(param, {}).get(key)
                    if value is not None:
                        adam += value.numel() * value.element_size()
    return {"adam": adam, "master": master}


def all_ranks(value: dict) -> list[dict]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def save(models, directory: Path, rank: int) -> None:
    trained = {"actor": models.actor, "critic": models.critic}
    if rank == 0:
        for name in trained:
            (directory / name).mkdir(parents=True)
    dist.barrier()
    for name, model in trained.items():
        model.save(directory / name)
        torch.save(model.scheduler.state_dict(), directory / f"{name}_scheduler_{rank}.pt")
    dist.barrier()


def load(models, directory: Path, rank: int) -> None:
    for name, model in {"actor": models.actor, "critic": models.critic}.items():
        model.load(directory / name)
        sched = torch.load(directory / f"{name}_scheduler_0.pt", weights_only=False)
        model.scheduler.load_state_dict(sched)


def run(args, ctx) -> dict:
    from rlhf.algo import build_kl_controller
    from rlhf.config import validate_config
    from rlhf.logging import Timer
    from rlhf.trainer.setup import build_ppo_models, load_policy_arch
    from rlhf.trainer.step import train_on_batch

    layout = [f"trainer.n_gpus_per_node={ctx.world_size}"]
    layout += [f"{r}.megatron.tensor_model_parallel_size={args.tp}" for r in ROLES]
    layout += [f"{r}.megatron.use_distributed_optimizer={args.distributed}" for r in ROLES]
    layout += [f"{r}.megatron.dtype={args.dtype}" for r in ROLES]
    cfg = load_config(None, [f"actor_rollout_ref.model.path={args.model}", *SETTINGS, *layout])
    arch = load_policy_arch(cfg)
    validate_config(cfg, ctx.world_size, arch)
    models = build_ppo_models(cfg, arch, ctx, total_steps=args.steps)
    batch = synthetic_batch(arch.vocab_size)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    first = 1
    if args.resume:
        load(models, Path(args.resume), ctx.rank)
        first = 2
    metrics, weights = {}, {}
    for step in range(first, args.steps + 1):
        _, metrics[step] = train_on_batch(models, batch, cfg, kl_ctrl, Timer())
        weights[step] = {"actor": weights_of(models.actor), "critic": weights_of(models.critic)}
        if args.save and step == 1:
            save(models, Path(args.save), ctx.rank)
    return {
        "metrics": metrics,
        "weights": weights,
        "bytes": all_ranks({"actor": optimizer_bytes(models.actor),
                            "critic": optimizer_bytes(models.critic)}),
        "distributed": models.actor.distributed_optimizer,
    }  # fmt: skip


def weights_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--distributed", choices=["true", "false", "null"], default="null")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()
    ctx = init_parallel("cpu", tp_size=args.tp)
    try:
        seed_everything(0)
        result = run(args, ctx)
        if ctx.rank == 0:
            torch.save(result, Path(args.out))
            print(json.dumps(result["bytes"]))
    finally:
        teardown()


if __name__ == "__main__":
    main()
