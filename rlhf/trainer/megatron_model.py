"""One model of the PPO trio on Megatron-Core: schedule-driven forwards, updates, checkpoints.

Every forward and backward goes through Megatron's forward-backward schedule, so pipeline
parallelism works for all three models. Losses arrive already normalised by the *global*
token/sequence counts of their mini-batch (`rlhf.algo.losses`), so the mini-batch loss is
the plain sum over micro-batches and DP ranks. Megatron divides each micro-batch loss by
the number of micro-batches, multiplies it by the CP size (it expects each CP rank's loss to
cover only its own tokens; ours is the whole loss on every SP rank) and averages gradients
over DP x CP; `loss_scale` undoes all three.
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rlhf.checkpoint.background import PendingWrite
from rlhf.config.schema import OptimConfig
from rlhf.distributed.collectives import sum_over_dp_and_pp
from rlhf.distributed.context import ParallelContext
from rlhf.models.chunks import ModelChunks
from rlhf.models.dist_ckpt import (
    load_distributed,
    save_distributed,
    save_distributed_in_background,
)
from rlhf.models.mapping import Placement
from rlhf.trainer.micro_batch import MicroBatch
from rlhf.trainer.nonfinite import tensors_finite
from rlhf.trainer.offload import KINDS, ModelOffloader
from rlhf.trainer.optimizer_shards import (
    OptimizerCoordinate,
    coordinate,
    load_optimizer_shards,
    optimizer_shards_writer,
    save_optimizer_shards,
)
from rlhf.trainer.route_replay import RouteReplay
from rlhf.trainer.router_stats import RouterStats

log = logging.getLogger(__name__)

# (loss or None for forward-only passes, detached per-micro-batch outputs or metrics)
HeadOutput = tuple[torch.Tensor | None, dict[str, torch.Tensor]]


class Head(Protocol):
    """What the last pipeline stage computes from its output for one micro-batch."""

    def __call__(self, output: torch.Tensor, mb: MicroBatch, /) -> HeadOutput: ...


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer and LR schedule of one trained model need."""

    optim: OptimConfig
    grad_clip: float
    total_steps: int  # optimizer steps of the whole run (LR decay horizon)
    distributed: bool = False  # shard master weights and Adam state over DP (x SP)


def run_schedule(
    runners: list,
    micro_batches: list[MicroBatch],
    head: Head,
    forward_only: bool,
    loss_scale: float,
    ctx: ParallelContext,
    moe: bool = False,
    replay: RouteReplay | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Megatron's forward(-backward) over `micro_batches`; head outputs (last stage only).

    `runners`: the model chunks (or their DDP wrappers) in order; with several, Megatron's
    interleaved 1F1B runs them, every chunk reading the micro-batches from its own iterator
    (their count is a multiple of PP: `MicroBatchPlanner`). `moe`: the model has
    mixture-of-experts layers (they are told which tokens are padding); `replay`: its
    routes are recorded or replayed (`rlhf.trainer.route_replay`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        routing = {"padding_mask": padding_for(chunk, mb.padding_mask, ctx)} if moe else {}
        index = runners.index(chunk) if replay is not None else 0
        if replay is not None:
            replay.before_forward(index, mb)
        output = chunk(
            mb.tokens,
            mb.position_ids,
            mb.attention_mask,
            packed_seq_params=mb.packed_seq_params,
            **routing,
        )
        if replay is not None:
            replay.after_forward(index, mb)

        def loss_func(output_tensor):
            loss, outputs = head(output_tensor, mb)
            if loss is None:  # forward only: Megatron still wants a scalar
                loss = output_tensor.sum() * 0.0
            return loss * loss_scale, outputs

        return output, loss_func

    interleaved = len(runners) > 1
    schedule = get_forward_backward_func(ctx.pp_size, len(runners) if interleaved else None)
    data = [iter(micro_batches) for _ in runners] if interleaved else iter(micro_batches)
    return schedule(
        forward_step_func=forward_step,
        data_iterator=data,
        model=runners,
        num_microbatches=len(micro_batches),
        seq_length=max(mb.num_tokens for mb in micro_batches),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def padding_for(
    chunk, padding_mask: torch.Tensor | None, ctx: ParallelContext
) -> torch.Tensor | None:
    """The padding mask a model chunk takes ([1, T], True = padding), so that its MoE layers
    leave padding out of the router's statistics and losses. Megatron-Core (0.16) scatters
    it over the sequence-parallel TP ranks only on the first pipeline stage; a later
    stage's chunk gets its TP rank's slice of the row here."""
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(chunk, "config")
    if padding_mask is None or not config.sequence_parallel:
        return padding_mask
    if get_attr_wrapped_model(chunk, "pre_process"):
        return padding_mask
    size = padding_mask.shape[1] // ctx.tp_size
    start = ctx.tp_rank * size
    return padding_mask[:, start : start + size]


@dataclass(frozen=True)
class MiniBatchUpdate:
    """One optimizer step over a mini-batch.

    outputs: the loss head's metrics summed over micro-batches and DP ranks (the mini-batch
    values); grad_norm: NaN when skipped; skipped: a gradient was not finite on some rank,
    so no step was taken (weights, optimizer state and LR schedule stay).
    """

    outputs: dict[str, float]
    lr: float
    grad_norm: float
    skipped: bool

    def metrics(self) -> dict[str, float]:
        """The logging view: the outputs, `lr` and `grad_norm`."""
        return self.outputs | {"lr": self.lr, "grad_norm": self.grad_norm}


class MegatronModel:
    """A frozen model (reference policy): forward passes only.

    `offload_between_uses(kinds, owner)` keeps "params", "grads" and/or "optimizer" in CPU
    memory outside `on_device()` (rlhf.trainer.offload), recorded as `owner` in the device
    ledger; a forward pass brings back the parameters only.
    """

    def __init__(self, module, ctx: ParallelContext):
        self.module = ModelChunks.of(module, Placement.of(ctx))
        self.runners: list = list(self.module)  # what the schedule calls, chunk by chunk
        self.ctx = ctx
        self.moe = self.module.config.num_moe_experts is not None
        self.route_replay: RouteReplay | None = None  # set for routing replay (R2, R3)
        self.offloader = ModelOffloader(self, ())
        if self.module.config.pipeline_model_parallel_size > 1:
            self.module.config.variable_seq_lengths = True  # packed rows differ in length

    @classmethod
    def frozen(
        cls, module, ctx: ParallelContext, owner: str, offload: bool = False
    ) -> MegatronModel:
        """A frozen model (reference, reward model): no gradients; its weights on the CPU
        between uses when `offload`."""
        model = cls(module, ctx)
        for p in module.parameters():
            p.requires_grad_(False)
        model.offload_between_uses(("params",) if offload else (), owner)
        return model

    def offload_between_uses(self, kinds: tuple[str, ...], owner: str) -> None:
        """Keep `kinds` in CPU memory except inside `on_device()` (offloaded now); what is
        resident is recorded as `owner`'s in the device ledger from now on."""
        self.offloader = ModelOffloader(self, kinds, owner)
        self.offloader.note_resident()
        if kinds:
            self.offloader.offload()

    def on_device(self, kinds: tuple[str, ...] = KINDS) -> AbstractContextManager[None]:
        """The offloaded ones of `kinds` are back on the device inside this context
        (re-entrant)."""
        return self.offloader.on_device(kinds)

    def weights_on_device(self) -> AbstractContextManager[None]:
        """The weights on the device inside this context (all a frozen model has)."""
        return self.offloader.on_device(("params",))

    @torch.no_grad()
    def forward(self, micro_batches: list[MicroBatch], head: Head) -> list[dict]:
        """A forward-only pass: the parameters alone on the device."""
        self.module.eval()
        with self.on_device(("params",)):
            return run_schedule(
                self.runners, micro_batches, head, True, 1.0, self.ctx, self.moe, self.route_replay
            )


class TrainableMegatronModel(MegatronModel):
    """Actor or critic: DDP, Megatron optimizer (Adam, grad clip) and LR schedule."""

    def __init__(self, module, ctx: ParallelContext, settings: OptimizerSettings):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        super().__init__(module, ctx)
        config = self.module.config
        # bf16 weights keep fp32 gradient buffers (reduced in fp32) for the fp32 master copy
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=config.bf16, use_distributed_optimizer=settings.distributed
        )
        # one DDP per chunk; as in Megatron's training loop, later chunks keep one bucket
        self.ddps = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(self.module)
        ]
        self.runners = list(self.ddps)
        config.finalize_model_grads_func = finalize_model_grads
        self.distributed_optimizer = settings.distributed
        self.optimizer, self.scheduler = build_optimizer(self.ddps, settings)
        self.router_stats = (
            RouterStats(
                self.module,
                config.num_layers,
                config.num_moe_experts,
                config.moe_router_topk,
                ctx.device,
            )
            if self.moe
            else None
        )

    def weights_on_device(self) -> AbstractContextManager[None]:
        """Only the weights on the device inside this context (a colocated weight sync):
        the gradient buffers and optimizer state leave it for the duration."""
        return self.offloader.weights_only()

    def compute_gradients(self, micro_batches: list[MicroBatch], head: Head) -> list[dict]:
        """Forward-backward of a mini-batch from zeroed gradients: afterwards every
        parameter's `main_grad` holds the gradient of the mini-batch loss (reduced over
        DP x SP); returns the head outputs of this rank's micro-batches (last stage)."""
        with self.on_device():
            return self._compute_gradients(micro_batches, head)

    def _compute_gradients(self, micro_batches: list[MicroBatch], head: Head) -> list[dict]:
        self.module.train()
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Megatron divides by the micro-batch count and multiplies by the CP (= SP) size in
        # the schedule, then averages gradients over DP x SP: undo all of it.
        scale = len(micro_batches) * self.ctx.dp_sp_size / self.ctx.sp_size
        return run_schedule(
            self.runners, micro_batches, head, False, scale, self.ctx, self.moe, self.route_replay
        )

    def train_mini_batch(self, micro_batches: list[MicroBatch], head: Head) -> MiniBatchUpdate:
        """One optimizer step over this rank's micro-batches of a mini-batch (identical on
        every rank); no step when a gradient was not finite on some rank."""
        with self.on_device():
            outputs = self.compute_gradients(micro_batches, head)
            finite = self.gradients_finite()
            if finite:
                ok, grad_norm, _ = self.optimizer.step()
                finite = bool(ok)
        summed = reduce_metrics(outputs, self.ctx)
        if self.router_stats is not None:  # mixture-of-experts: the routing of this update
            summed |= self.router_stats.collect()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not finite:  # no step: weights and optimizer state stay (rlhf.trainer.nonfinite)
            return MiniBatchUpdate(summed, lr, math.nan, skipped=True)
        self.scheduler.step(increment=1)
        return MiniBatchUpdate(summed, lr, float(grad_norm), skipped=False)

    def gradients_finite(self) -> bool:
        """Every parameter's gradient finite on every rank (before the optimizer runs)."""
        params: list[Any] = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.main_grad for p in params]  # DDP's fp32 gradient, set on each parameter
        return tensors_finite(grads, self.ctx.device)

    def weights_finite(self) -> bool:
        """Every parameter finite on every rank (before a checkpoint is written)."""
        with self.on_device(("params",)):
            return tensors_finite([p.data for p in self.module.parameters()], self.ctx.device)

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        model_sd = self.module.sharded_state_dict()
        if self.distributed_optimizer:  # its state goes through rlhf.trainer.optimizer_shards
            return {"model": model_sd}
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading),
        }

    def optimizer_coordinate(self) -> OptimizerCoordinate:
        ctx = self.ctx
        return coordinate(self.optimizer, (ctx.tp_rank, ctx.tp_size), (ctx.pp_rank, ctx.pp_size))

    def param_names(self) -> dict:
        """Parameter -> name with its global layer index (`ModelChunks.global_names`)."""
        return self.module.global_names()

    def save(self, directory: Path) -> None:
        """`model/`: the model (+ the plain optimizer) in Megatron's distributed format, the
        layout rlhf-convert reads; `optimizer/`: the distributed optimizer's state, when
        it is on (all ranks call)."""
        with self.on_device():
            self._save(directory)

    def save_in_background(self, directory: Path) -> list[PendingWrite]:
        """What `save` writes, as a snapshot in host memory taken now and writes for the
        background writer (`rlhf.checkpoint.background`); all ranks call."""
        with self.on_device():
            (directory / "model").mkdir(exist_ok=True)
            model = PendingWrite(
                *save_distributed_in_background(self.sharded_state_dict(), directory / "model")
            )
            if not self.distributed_optimizer:
                return [model]
            where = self.optimizer_coordinate()
            shards = optimizer_shards_writer(
                self.optimizer, self.param_names(), where, directory / "optimizer"
            )
            return [model, PendingWrite(shards)]

    def load(self, directory: Path) -> None:
        with self.on_device():
            self._load(Path(directory))

    def _save(self, directory: Path) -> None:
        (directory / "model").mkdir(exist_ok=True)
        save_distributed(self.sharded_state_dict(), directory / "model")
        if not self.distributed_optimizer:
            return
        where = self.optimizer_coordinate()
        save_optimizer_shards(self.optimizer, self.param_names(), where, directory / "optimizer")

    def _load(self, directory: Path) -> None:
        if not directory.is_dir():
            raise FileNotFoundError(f"no model checkpoint at {directory}")
        saved_distributed = (directory / "optimizer").is_dir()
        if saved_distributed != self.distributed_optimizer:
            saved, now = ("with", "without") if saved_distributed else ("without", "with")
            raise ValueError(
                f"{directory} was saved {saved} the distributed optimizer and this run is "
                f"{now} it: set megatron.use_distributed_optimizer={saved_distributed} as the "
                "saving run had it"
            )
        model_dir = directory / "model"
        if not model_dir.is_dir():  # written before model/ existed: the plain optimizer's
            model_dir = directory
        state = load_distributed(self.sharded_state_dict(is_loading=True), model_dir)
        self.module.load_sharded(state["model"])
        if saved_distributed:
            where = self.optimizer_coordinate()
            load_optimizer_shards(
                self.optimizer, self.param_names(), where, directory / "optimizer"
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])


def build_optimizer(ddps: list, settings: OptimizerSettings):
    """Megatron's Adam(W) over the DDP-wrapped chunks and its LR/weight-decay scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optim = settings.optim
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        clip_grad=settings.grad_clip,
        bf16=ddps[0].module.config.bf16,  # fp32 master weights and Adam state for bf16 weights
        params_dtype=next(ddps[0].module.parameters()).dtype,
        use_distributed_optimizer=settings.distributed,
    )
    optimizer = get_megatron_optimizer(config, ddps)
    decay_steps = max(settings.total_steps, optim.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def reduce_metrics(outputs: list[dict], ctx: ParallelContext) -> dict[str, float]:
    """Sum per-micro-batch metrics over micro-batches, DP ranks and (from the last) PP stage."""
    names = sorted(outputs[0]) if outputs else []
    names = broadcast_names(names, ctx)
    total = torch.zeros(len(names), dtype=torch.float64, device=ctx.device)
    for out in outputs:
        total += torch.stack([out[n].double().reshape(()) for n in names]).to(ctx.device)
    return dict(zip(names, sum_over_dp_and_pp(total, ctx).tolist()))


def broadcast_names(names: list[str], ctx: ParallelContext) -> list[str]:
    """The metric names the last pipeline stage produced, on every stage."""
    if ctx.pp_group is None:
        return names
    holder: list[list[str] | None] = [names if ctx.is_last_stage else None]
    dist.broadcast_object_list(holder, src=ctx.pp_stage_ranks[-1], group=ctx.pp_group)
    assert holder[0] is not None
    return holder[0]
