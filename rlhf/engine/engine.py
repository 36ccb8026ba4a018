"""The training engine: a run's Megatron models behind the calls a PPO step makes.

`PPOEngine` is the face: `logprobs(batch, role)`, `values(batch)`,
`update(role, batch, targets)` (one optimizer step per mini-batch, `epochs` passes),
`serving(probe)` (the actor as a weight sync serves it, with its log-probs of the
parity probe) and the checkpoint calls. Below it, each model (`MegatronModel`,
`TrainableMegatronModel`) runs Megatron's schedule; `rlhf.engine.micro_batch` cuts batches
into packed micro-batches, `rlhf.engine.heads` turns the last stage's output into
log-probs, values or losses, and `rlhf.engine.build` builds the models a plan needs.

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
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf.checkpoint.background import PendingWrite
from rlhf.config.budgets import MicroBatching, TokenBudgets
from rlhf.config.schema import OptimConfig
from rlhf.data.images import ImageInputs
from rlhf.distributed.collectives import sum_over_dp_and_pp
from rlhf.distributed.context import ParallelContext
from rlhf.engine.heads import CriticValueHead, Head, LogprobHead, Loss, Targets
from rlhf.engine.micro_batch import MicroBatch, MicroBatchPlanner
from rlhf.engine.nonfinite import NonFiniteError, nonfinite_metrics, tensors_finite
from rlhf.engine.offload import KINDS, ModelOffloader
from rlhf.engine.optimizer_shards import (
    OptimizerCoordinate,
    coordinate,
    load_optimizer_shards,
    optimizer_shards_writer,
    save_optimizer_shards,
)
from rlhf.engine.route_replay import RouteReplay
from rlhf.engine.router_stats import RouterStats
from rlhf.models.chunks import ModelChunks
from rlhf.models.dist_ckpt import (
    load_distributed,
    save_distributed,
    save_distributed_in_background,
)
from rlhf.models.lora import adapters_off, spec_of
from rlhf.models.mapping import Placement
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.policy_servers import PolicyWeights
from rlhf.utils import round_up
from rlhf.weight_sync.probe import ProbeSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateSpec:
    """How one trained model is updated every step.

    role: 'actor' or 'critic' (the prefix of its grad_norm and lr metrics); token_budget:
    tokens per micro-batch; mini_batch_samples: samples per optimizer step; loss: what each
    mini-batch minimises (`PolicyLoss`, `ValueLoss`); kl_bound: end the step's epochs once
    a mini-batch's actor/ppo_kl exceeds it (None: never); on_nonfinite:
    `trainer.on_nonfinite` for a mini-batch whose gradients are not finite.
    """

    role: str
    model: TrainableMegatronModel
    token_budget: int | MicroBatching
    mini_batch_samples: int
    epochs: int
    loss: Loss
    kl_bound: float | None = None
    on_nonfinite: str = "stop"  # trainer.on_nonfinite (rlhf.engine.nonfinite)


class Updated(NamedTuple):
    """One model's updates of a step: the metrics averaged over the optimizer steps taken,
    and what was not finite in the mini-batches that were skipped."""

    metrics: dict[str, float]
    nonfinite: list[str]


@dataclass
class PPOEngine:
    """This rank's shards of a PPO run's Megatron models, behind the calls a step makes.

    `logprobs(batch, role)`, `values(batch)`, `update(role, batch, targets)`; the actor as
    a weight sync serves it (`serving`); checkpoints (`save`, `save_in_background`, `load`,
    `state_dict`, `load_state_dict`). ref is None without a KL to the reference; critic and
    critic_update are None for critic-free estimators. logprob_head: log-probs at the
    rollout temperature; probe_head: at temperature 1 (SGLang's prompt log-probs are
    unscaled). The reward model (`rlhf.engine.reward_model`) is the trainer's own stage.
    """

    actor: TrainableMegatronModel
    ref: MegatronModel | None
    critic: TrainableMegatronModel | None
    actor_update: UpdateSpec
    critic_update: UpdateSpec | None
    planner: MicroBatchPlanner
    budgets: TokenBudgets
    logprob_head: LogprobHead
    probe_head: LogprobHead

    # ---- forward passes -------------------------------------------------------------

    def logprobs(self, batch: RolloutBatch, role: str = "actor") -> tuple[Tensor, Tensor]:
        """[B, R] log-probs and entropies of the response tokens. 'actor': before the update
        (R3: on the engine's routes; R2: on the update's micro-batch plan, recording each
        micro-batch's routes for the update); 'ref': the frozen reference's."""
        if role == "ref":
            assert self.ref is not None, "no reference in this run"
            with rollout_routes(self.ref):  # R3: routed as the engine did
                return compute_logprobs(
                    self.ref, batch, self.planner, self.budgets.ref, self.logprob_head
                )
        replay = self.actor.route_replay
        if replay is None or replay.rollout_routes:
            with rollout_routes(self.actor):
                return compute_logprobs(
                    self.actor, batch, self.planner, self.budgets.old_log_prob, self.logprob_head
                )
        update = self.actor_update
        with replay.recording():
            logp, entropy = self.planner.per_sample(
                self.actor,
                batch,
                update.token_budget,
                self.logprob_head,
                ("logprobs", "entropy"),
                mini_batch_size=update.mini_batch_samples,
            )
        return logp, entropy

    def values(self, batch: RolloutBatch) -> Tensor:
        """[B, R] the critic's values of the response tokens."""
        assert self.critic is not None, "no critic in this run"
        return compute_values(self.critic, batch, self.planner, self.budgets.critic)

    def probe_logprobs(self, tokens: list[int], images: ImageInputs | None = None) -> Tensor:
        """The actor's log-probs of a weight sync's probe (`probe_logprobs`), at
        temperature 1 (SGLang's prompt log-probs are unscaled)."""
        return probe_logprobs(self.actor, tokens, self.planner, self.probe_head, images)

    @contextmanager
    def serving(self, probe: ProbeSequence, weights_only: bool) -> Iterator[PolicyWeights]:
        """Inside: the actor as a weight sync serves it (`PolicyServers.load_weights`), its
        weights on the device and its log-probs of the sync's probe computed
        (`probe_logprobs`). `weights_only`: next to sleeping colocated servers only its
        weights stay on the device (its gradients and optimizer state off it)."""
        actor = self.actor
        near = actor.weights_on_device() if weights_only else actor.on_device(("params",))
        with near:
            yield PolicyWeights(actor.module, self.probe_logprobs(probe.tokens, probe.inputs))

    # ---- updates --------------------------------------------------------------------

    def update(self, role: str, batch: RolloutBatch, targets: Targets) -> Updated:
        """`role`'s update of the step: `epochs` passes of one optimizer step per mini-batch
        of `batch`, the loss against `targets` (old log-probs, advantages, returns...).

        grad_norm, lr and the count of skipped updates come back as `<role>/grad_norm`,
        `<role>/lr` and `<role>/skipped_updates` (means over the updates taken), a
        mixture-of-experts model's routing as `<role>/moe/...` (`rlhf.engine.router_stats`).
        """
        spec = self.actor_update if role == "actor" else self.critic_update
        assert spec is not None, f"no {role} update in this run"
        return run_updates(spec, batch, targets, self.planner)

    # ---- checkpoints ----------------------------------------------------------------

    def trained(self) -> dict[str, TrainableMegatronModel]:
        """The models a checkpoint holds, by directory name."""
        critic = {"critic": self.critic} if self.critic is not None else {}
        return {"actor": self.actor, **critic}

    def nonfinite_weights(self) -> list[str]:
        """The trained models whose weights are not finite (none may be checkpointed)."""
        return [name for name, model in self.trained().items() if not model.weights_finite()]

    def save(self, directory: Path) -> None:
        """Each trained model (+ optimizer) under `directory/<name>` (all ranks call)."""
        for name, model in self.trained().items():
            model.save(directory / name)

    def save_in_background(self, directory: Path) -> list[PendingWrite]:
        """What `save` writes, snapshotted in host memory now, as background writes."""
        return [w for n, m in self.trained().items() for w in m.save_in_background(directory / n)]

    def load(self, directory: Path) -> None:
        """The trained models (+ optimizers) `save` wrote under `directory`."""
        for name, model in self.trained().items():
            model.load(directory / name)

    def state_dict(self) -> dict:
        """The LR schedules (kept in the trainer state beside the models)."""
        return {f"{name}_scheduler": m.scheduler.state_dict() for name, m in self.trained().items()}

    def load_state_dict(self, state: dict) -> None:
        for name, model in self.trained().items():
            model.scheduler.load_state_dict(state[f"{name}_scheduler"])


def compute_logprobs(
    model: MegatronModel,
    batch: RolloutBatch,
    planner: MicroBatchPlanner,
    budget: int | MicroBatching,
    head: LogprobHead,
) -> tuple[Tensor, Tensor]:
    """[B, R] log-probs and entropies of `model` over packed micro-batches."""
    keys = ("logprobs", "entropy")
    logp, entropy = planner.per_sample(model, batch, budget, head, keys)
    return logp, entropy


def compute_values(
    critic: MegatronModel,
    batch: RolloutBatch,
    planner: MicroBatchPlanner,
    budget: int | MicroBatching,
) -> Tensor:
    """[B, R] values of the response tokens."""
    (values,) = planner.per_sample(critic, batch, budget, CriticValueHead(), ("values",))
    return values


def probe_logprobs(
    actor: MegatronModel,
    tokens: list[int],
    planner: MicroBatchPlanner,
    head: LogprobHead,
    images: ImageInputs | None = None,
) -> Tensor:
    """log p(token_t | tokens_<t), t >= 1, through the same packed forward as training: what
    the servers' log-probs are compared with after a sync (`images`: the probe's picture).
    The probe goes in as one sample per DP rank (every rank's plan needs one)."""
    copies = planner.ctx.dp_size
    batch = RolloutBatch(
        prompt_ids=[tokens[:1]] * copies,
        response_ids=[tokens[1:]] * copies,
        scores_b=torch.zeros(copies),
        data_sources=["probe"] * copies,
        uids=[f"probe-{i}" for i in range(copies)],
        images=None if images is None else [images] * copies,
    )
    budget = round_up(len(tokens), planner.row_multiple)  # padded for Ulysses / Megatron SP
    logp, _ = compute_logprobs(actor, batch, planner, budget, head)
    return logp[0]


def run_updates(
    spec: UpdateSpec, batch: RolloutBatch, targets: Targets, planner: MicroBatchPlanner
) -> Updated:
    """`spec`'s updates over `batch` (`PPOEngine.update`), planned by `planner`."""
    replay = spec.model.route_replay  # R2: the old-log-prob pass's routes; R3: the engine's
    with spec.model.on_device(), replay.replaying() if replay else nullcontext():
        return _run_updates(spec, batch, targets, planner)  # (one reload for all)


def _run_updates(
    spec: UpdateSpec, batch: RolloutBatch, targets: Targets, planner: MicroBatchPlanner
) -> Updated:
    minis = planner.plan(batch, spec.token_budget, spec.mini_batch_samples)
    totals: dict[str, float] = {}
    steps = skipped = 0
    stop_note: dict[str, float] = {}
    found: list[str] = []
    for epoch in range(spec.epochs):
        for micro_batches in minis:
            head = spec.loss.head(targets, planner.mini_batch_counts(micro_batches))
            update = spec.model.train_mini_batch(micro_batches, head)
            if update.skipped:
                skipped += 1
                found += _nonfinite_update(spec, update.metrics())
                continue
            steps += 1
            for k, v in update.metrics().items():
                totals[k] = totals.get(k, 0.0) + v
            kl = spec.loss.ppo_kl(update.outputs)
            if kl is not None and should_stop_epochs(kl, spec.kl_bound):
                log.warning(
                    "early stop of PPO epochs (%s): ppo_kl %.4f > bound %.4f at epoch %d",
                    spec.loss.name,
                    kl,
                    spec.kl_bound,
                    epoch,
                )
                stop_note = {"actor/ppo_kl_stop_after_updates": float(steps)}
                break
        if stop_note:
            break
    averaged = {k: v / steps for k, v in totals.items()} | stop_note
    averaged["skipped_updates"] = float(skipped)
    prefixed = ("grad_norm", "lr", "skipped_updates")
    named = {
        (f"{spec.role}/{k}" if k in prefixed or k.startswith("moe/") else k): v
        for k, v in averaged.items()
    }
    return Updated(named, sorted(set(found)))


def rollout_routes(model: MegatronModel) -> AbstractContextManager[None]:
    """Inside: with rollout routing replay (R3) `model`'s forwards take the experts the
    engine routed each token to (`rlhf.engine.route_replay`); otherwise nothing."""
    replay = model.route_replay
    return replay.replaying() if replay is not None and replay.rollout_routes else nullcontext()


def _nonfinite_update(spec: UpdateSpec, metrics: dict[str, float]) -> list[str]:
    """What a mini-batch whose gradients were not finite (no step was taken) found; raises
    under `trainer.on_nonfinite=stop`."""
    names = [f"{spec.role}/{n}" if "/" not in n else n for n in nonfinite_metrics(metrics)]
    names = names or [f"{spec.role}/gradients"]
    if spec.on_nonfinite == "stop":
        raise NonFiniteError(
            f"{spec.role} update ({spec.loss.name}): not finite: {', '.join(names)} "
            "(trainer.on_nonfinite=stop; skip would skip such updates)"
        )
    return names


def should_stop_epochs(approx_kl: float, bound: float | None) -> bool:
    """True when the PPO epochs of the current step should end now.

    Checked after every mini-batch update: `approx_kl` is the approximate KL between the
    rollout policy and the policy being updated (`actor/ppo_kl`) on that mini-batch. Once it
    exceeds `bound`, the remaining mini-batches and epochs of this step are skipped, so one
    batch cannot move the policy arbitrarily far. A non-finite KL also stops; `bound=None`
    never stops.
    """
    if bound is None:
        return False
    return not math.isfinite(approx_kl) or approx_kl > bound


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
    routes are recorded or replayed (`rlhf.engine.route_replay`)."""
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
            **mb.model_inputs(),
        )
        if replay is not None:
            replay.after_forward(index, mb)

        def loss_func(output_tensor):
            loss, outputs = head(output_tensor, mb)
            if loss is None:  # forward only: Megatron still wants a scalar (a zero: a
                loss = output_tensor.new_zeros(())  # sum would read T x V logits again)
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


def set_training(module: nn.Module, training: bool) -> None:
    """`module.train(training)` unless the module is in that mode already (the trainer
    alone switches its models' modes, always at the root; the walk over every submodule
    took ~0.5 ms of each pass of the quickstart's models)."""
    if module.training != training:
        module.train(training)


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
    memory outside `on_device()` (rlhf.engine.offload), recorded as `owner` in the device
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
        set_training(self.module, False)
        with self.on_device(("params",)):
            return run_schedule(
                self.runners, micro_batches, head, True, 1.0, self.ctx, self.moe, self.route_replay
            )


class BaseModel(MegatronModel):
    """The reference of a LoRA run: the actor's own weights with its adapters off (no second
    copy of the model). Its forward passes run the actor's with every adapter's update left
    out; it has no optimizer and is never offloaded on its own (the actor's residency)."""

    def __init__(self, adapted: MegatronModel):  # a view: no MegatronModel.__init__
        self.adapted = adapted
        self.module, self.ctx, self.runners = adapted.module, adapted.ctx, adapted.runners
        self.moe, self.route_replay = adapted.moe, adapted.route_replay
        self.offloader = adapted.offloader

    def forward(self, micro_batches: list[MicroBatch], head: Head) -> list[dict]:
        with adapters_off(self.module):
            return self.adapted.forward(micro_batches, head)


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
        set_training(self.module, True)
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
        if not finite:  # no step: weights and optimizer state stay (rlhf.engine.nonfinite)
            return MiniBatchUpdate(summed, lr, math.nan, skipped=True)
        self.scheduler.step(increment=1)
        return MiniBatchUpdate(summed, lr, float(grad_norm), skipped=False)

    def gradients_finite(self) -> bool:
        """Every parameter's gradient finite on every rank (before the optimizer runs): DDP's
        gradient buffers, of which each trained parameter's `main_grad` is a view, checked
        whole (one reduction each rather than one per parameter)."""
        grads = [b.grad_data for d in self.ddps for b in (*d.buffers, *d.expert_parallel_buffers)]
        return tensors_finite(grads, self.ctx.device)

    def weights_finite(self) -> bool:
        """Every parameter finite on every rank (before a checkpoint is written)."""
        with self.on_device(("params",)):
            return tensors_finite([p.data for p in self.module.parameters()], self.ctx.device)

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """What the checkpoint holds: the model (a LoRA actor: its adapters alone, the
        frozen weights being the HF model's) and the plain optimizer's state."""
        model_sd = self.module.sharded_state_dict(adapters_only=self.adapters_only)
        if self.distributed_optimizer:  # its state goes through rlhf.engine.optimizer_shards
            return {"model": model_sd}
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading),
        }

    @property
    def adapters_only(self) -> bool:
        """A LoRA actor: only its adapters train, and only they are checkpointed."""
        return spec_of(self.module) is not None

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
        self.module.load_sharded(state["model"], adapters_only=self.adapters_only)
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
    _foreach_on_cpu(optimizer)
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


def _foreach_on_cpu(optimizer) -> None:
    """torch's Adam over CPU parameters updates them one at a time in Python unless told
    otherwise (its default multi-tensor path is for GPUs; on the GPU Megatron takes
    Transformer Engine's or apex's fused Adam). Its multi-tensor path: the same update,
    one call per step."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in part.optimizer.param_groups:
            on_cpu = all(p.device.type == "cpu" for p in group["params"])
            if "foreach" in group and on_cpu:
                group["foreach"] = True


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
