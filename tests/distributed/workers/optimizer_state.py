"""Worker: PPO updates with and without Megatron's distributed optimizer; save and resume.

Builds the PPO models (GAE: actor, critic, reference) from the HF checkpoint and runs
`--steps` trainer steps (`learn_from_batch`) on the fixed synthetic batch of trainer_step.py,
each with 3 Adam steps per model (one mini-batch, 3 epochs). `--save DIR` writes actor and
critic (model, optimizer, LR schedule) after the first step through the trainer's
checkpoint code (`--background-save`: by a background writer while step 2 runs, as under
`trainer.async_save`); `--resume DIR` loads them into freshly built models and runs the
remaining steps. Rank 0 writes the weights of both models after each step (its own shards, and after
the last step the whole models in HF's layout, gathered over TP and PP), every step's
metrics and, per rank, the bytes of the real tensors by kind (weights, gradient buffers,
fp32 master weights held apart from the model's weights, Adam moments) next to the memory
planner's. `--optimizer group-step` makes Megatron pick `ParamGroupStepAdamW`, which keeps
Adam's step count the way Transformer Engine's and apex's FusedAdam do (what Megatron picks
on GPU), with torch's AdamW arithmetic.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from tests.distributed.workers.trainer_step import synthetic_batch
from tests.helpers import SEED_DEFAULTS

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
WRITER_DELAY_S = 2.0


class ParamGroupStepAdamW(torch.optim.AdamW):
    """FusedAdam's bookkeeping, torch's arithmetic: the step count lives in each param group
    (`group["step"]`) and the per-parameter state holds only the moments."""

    def __init__(self, params, adam_w_mode: bool = True, **kwargs) -> None:
        assert adam_w_mode, "Megatron asks for decoupled weight decay"
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if self.state[param]:
                    self.state[param]["step"] = torch.tensor(float(group["step"]))
        loss = super().step(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                self.state[param].pop("step", None)
        return loss


def use_param_group_step_adam() -> None:
    """Make Megatron's get_megatron_optimizer take the TE/apex branch with our optimizer."""
    import megatron.core.optimizer as megatron_optimizer

    megatron_optimizer.USING_PYTORCH_OPTIMIZER = False
    megatron_optimizer.Adam = ParamGroupStepAdamW
    megatron_optimizer.is_te_min_version = lambda *args, **kwargs: False


def hf_weights(model, arch, ctx) -> dict[str, torch.Tensor]:
    """The whole model in HF's layout (gathered over TP and PP) on rank 0, {} elsewhere; a
    value head as "value_head"."""
    from rlhf.models.mapping import Layout, resolve, shards_to_hf

    found = {}
    with model.on_device():
        for placement, name, param in model.module.placed_parameters():
            value = param.detach().float().contiguous()
            if name == "output_layer.weight" and value.shape[0] == 1:
                found["value_head"] = value
                continue
            rule, layer = resolve(arch, name, placement)
            shards = [value]
            if rule.layout is not Layout.REPLICATED and ctx.tp_size > 1:
                shards = [torch.empty_like(value) for _ in range(ctx.tp_size)]
                dist.all_gather(shards, value, group=ctx.tp_group)
            found.update(shards_to_hf(rule, layer, shards, arch))
    stages: list = [None] * dist.get_world_size()
    dist.all_gather_object(stages, found if ctx.tp_rank == 0 and ctx.dp_rank == 0 else {})
    return {k: v for stage in stages for k, v in stage.items()} if ctx.rank == 0 else {}


def on_device(fn, model):
    with model.on_device():
        return fn(model)


def real_bytes(model) -> dict[str, int]:
    """Bytes of the tensors the memory planner counts, from the model and its optimizer:
    weights (DDP's parameter buffer under the distributed optimizer), gradient buffers,
    fp32 master weights held apart from the weights, Adam's moments."""
    buffers = model.ddps[0].buffers
    if model.distributed_optimizer:
        weights = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    else:
        weights = sum(p.numel() * p.element_size() for p in model.module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    return {"weights": weights, "gradients": grads, **optimizer_bytes(model)}


def planned_bytes(cfg, arch, ctx, role: str) -> dict[str, int]:
    from rlhf.memory.planner import TrainedRole, trained_memory

    section = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    spec = TrainedRole(role, section.megatron, 1, value_head=role == "critic")
    row = trained_memory(
        arch, spec, dp=ctx.dp_size, sp=1, device="cpu", stage=ctx.pp_rank, dp_rank=ctx.dp_rank
    )
    return {
        "weights": row.weights,
        "gradients": row.gradients,
        "adam": row.optimizer_state,
        "master": row.master_weights,
    }


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


def save(models, directory: Path, rank: int, background: bool):
    """The trainer's checkpoint of both models; with `background`, the BackgroundSave
    writing it (its writer first sleeps, so the next step changes every tensor first)."""
    from rlhf.checkpoint.background import BackgroundSave, PendingWrite

    trained = {"actor": models.actor, "critic": models.critic}
    if rank == 0:
        for name in trained:
            (directory / name).mkdir(parents=True)
    dist.barrier()
    writes = [PendingWrite(lambda: time.sleep(WRITER_DELAY_S))]
    for name, model in trained.items():
        if background:
            writes += model.save_in_background(directory / name)
        else:
            model.save(directory / name)
        torch.save(model.scheduler.state_dict(), directory / f"{name}_scheduler_{rank}.pt")
    dist.barrier()
    return BackgroundSave(1, directory, writes) if background else None


def load(models, directory: Path, rank: int) -> None:
    for name, model in {"actor": models.actor, "critic": models.critic}.items():
        model.load(directory / name)
        sched = torch.load(directory / f"{name}_scheduler_0.pt", weights_only=False)
        model.scheduler.load_state_dict(sched)


def run(args, ctx) -> dict:
    from rlhf.algo import build_kl_controller
    from rlhf.config import validate_config
    from rlhf.engine.build import build_engine
    from rlhf.logging import Timer
    from rlhf.trainer.preflight import load_policy_arch
    from rlhf.trainer.step import Learning, learn_from_batch

    layout = [f"trainer.n_gpus_per_node={ctx.world_size}"]
    layout += [f"{r}.megatron.tensor_model_parallel_size={args.tp}" for r in ROLES]
    layout += [f"{r}.megatron.pipeline_model_parallel_size={args.pp}" for r in ROLES]
    layout += [f"{r}.megatron.use_distributed_optimizer={args.distributed}" for r in ROLES]
    layout += [f"{r}.megatron.dtype={args.dtype}" for r in ROLES]
    model = f"actor_rollout_ref.model.path={args.model}"
    cfg = load_config(None, [*SEED_DEFAULTS, model, *SETTINGS, *layout])
    arch = load_policy_arch(cfg)
    validate_config(cfg, ctx.world_size, arch)
    models = build_engine(cfg, arch, ctx, total_steps=args.steps)
    batch = synthetic_batch(arch.vocab_size)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    learning = Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer)
    first = 1
    if args.resume:
        load(models, Path(args.resume), ctx.rank)
        first = 2
    metrics, weights, freed, pending = {}, {}, {}, None
    for step in range(first, args.steps + 1):
        if args.offload and step == 2:  # the GPU path, forced on CPU: offloaded between uses
            for role in ROLE_MODELS:
                kinds = ("params",) if role == "ref" else ("params", "grads", "optimizer")
                getattr(models, role).offload_between_uses(kinds, role)
        if args.weights_only and step == 2:  # the colocated weight sync's view of the actor
            with models.actor.weights_on_device():
                freed = {"actor": resident_bytes(models.actor)}
        metrics[step] = learn_from_batch(models, batch, learning, kl_ctrl, Timer()).metrics
        if args.offload and step == 2:
            freed = {role: resident_bytes(getattr(models, role)) for role in ROLE_MODELS}
            freed["device_bytes"] = device_bytes(models, ctx.device)
        weights[step] = {role: weights_of(getattr(models, role)) for role in ("actor", "critic")}
        if args.save and step == 1:
            pending = save(models, Path(args.save), ctx.rank, args.background_save)
    if pending is not None:
        pending.finish()
    last = {role: hf_weights(getattr(models, role), arch, ctx) for role in ("actor", "critic")}
    return {
        "metrics": metrics,
        "weights": weights,
        "hf_weights": last,
        "bytes": all_ranks(
            {
                "actor": on_device(real_bytes, models.actor),
                "critic": on_device(real_bytes, models.critic),
            }
        ),
        "planned": all_ranks(
            {role: planned_bytes(cfg, arch, ctx, role) for role in ("actor", "critic")}
        ),
        "distributed": models.actor.distributed_optimizer,
        "resident_while_offloaded": all_ranks(freed),
    }


ROLE_MODELS = ("actor", "critic", "ref")


def device_bytes(models, device) -> dict[str, int]:
    """CUDA memory allocated with every model offloaded, and with all of them loaded back."""
    if device.type != "cuda":
        return {}
    offloaded = torch.cuda.memory_allocated()
    with models.actor.on_device(), models.critic.on_device(), models.ref.on_device():
        loaded = torch.cuda.memory_allocated()
    return {"offloaded": offloaded, "loaded": loaded}


def resident_bytes(model) -> dict[str, int]:
    """Bytes still held by the storages offloading covers (0 when all were offloaded)."""
    from rlhf.engine.offload import KINDS, model_tensors

    kinds = KINDS if hasattr(model, "ddps") else ("params",)
    return {k: sum(t.untyped_storage().nbytes() for t in model_tensors(model, k)) for k in kinds}


def weights_of(model) -> dict[str, torch.Tensor]:
    with model.on_device():
        return {n: p.detach().float().clone() for p, n in model.module.global_names().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--distributed", choices=["true", "false", "null"], default="null")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument(
        "--background-save", action="store_true", help="--save as trainer.async_save does"
    )
    parser.add_argument("--offload", action="store_true", help="offload between uses in step 2")
    parser.add_argument(
        "--weights-only", action="store_true", help="the actor's weights_on_device before step 2"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--optimizer", choices=["torch", "group-step"], default="torch")
    args = parser.parse_args()
    if args.optimizer == "group-step":
        use_param_group_step_adam()
    ctx = init_parallel(args.device, tp_size=args.tp, pp_size=args.pp)
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
