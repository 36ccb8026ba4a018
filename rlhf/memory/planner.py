"""Will a config fit? Per-GPU memory by role and by kind, before anything is launched.

`plan_memory(PlanInputs.from_config(cfg, arch, world_size))` counts, for the pipeline stage
that needs the most, the bytes each role keeps on one GPU: the weights, gradient buffer,
fp32 master weights and Adam state of actor and critic (`rlhf.memory.params`: Megatron's
buffer layout, sharded by the distributed optimizer), the reference's weights, the
activations of one micro-batch at the configured token budget (`rlhf.memory.activations`)
and communication buffers (the weight-sync bucket), and SGLang's share
(`rollout.gpu_memory_utilization` of the GPU: its weights and KV cache). The GPU's peak is
the largest phase of a step, or of the build:

    build          the models built one by one (each at its build peak: DDP's parameter
                   and gradient buffers next to the loaded parameters, then next to the
                   master weights), each offloaded as it is done, while colocated servers
                   sleep (they start, then release)
    rollout        SGLang, plus whatever the trainer keeps resident (not offloaded)
    old_log_prob   resident + the actor's parameters + its forward activations (a
                   forward-only pass brings back the parameters alone)
    reference      resident + the reference's forward activations
    values         resident + the critic's parameters + its forward activations
    critic         resident + the critic's training activations
    actor          resident + the actor's training activations
    weight_sync    resident + the actor's parameters + the sync's gathers and bucket
                   (`sync_bytes`); next to sleeping colocated servers: the actor's weights
                   only (its gradients and optimizer state leave the GPU) + SGLang's weights
    kv_cache_wake  sleeping colocated servers: the actor's weights only + all of SGLang (the
                   log-prob probe, and the next rollout)
    probe          servers that do not sleep: the weight sync's phase after its buffers

On GPU every phase also counts GPU_RUNTIME_BYTES for what the allocator does not see (CUDA
context, NCCL). An offloaded part (megatron.param/grad/optimizer_offload, ref.param_offload)
is resident only in its own model's phases; with free_cache_engine SGLang holds memory in
the rollout phase only. Both are GPU features: on CPU the planner still reports what a GPU
run would need (device "cpu" plans the local spec's attention instead of fused attention;
device "local" is a GPU on the local spec, what the memory simulation runs).

Each phase is held to the real code at the shipped configs' shapes by the memory
simulation (`rlhf.trainer.memory_simulation`, `rlhf-doctor --simulate`, docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlhf.config.plan import RunPlan, resolve
from rlhf.config.rollout import RolloutConfig
from rlhf.config.schema import (
    ActorRolloutRefConfig,
    MegatronParallelConfig,
    ModelConfig,
    RLHFConfig,
    TrainerConfig,
)
from rlhf.config.validate import (
    distributed_optimizer_on,
    sequence_parallel_on,
    virtual_pipeline_size,
)
from rlhf.memory.activations import (
    ActivationShape,
    forward_peak,
    pipeline_in_flight,
    training_peak,
)
from rlhf.memory.host import host_bytes_per_rank
from rlhf.memory.moe import MoEShape, replicated_params
from rlhf.memory.params import (
    GradBuffer,
    lora_params,
    mla_replicated_params,
    stage_layers,
    stage_params,
)
from rlhf.models.families import ModelArch, Recompute, padded_vocab_size
from rlhf.models.lora import LoraSpec, lora_spec

GIB = 1024**3
KINDS = (
    "weights",
    "gradients",
    "master_weights",
    "optimizer_state",
    "activations",
    "communication",
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
# CUDA context, cuBLAS workspaces and NCCL buffers of a trainer process on a GPU (a few
# hundred MiB each; what the allocator cannot see), added to every phase on GPU.
GPU_RUNTIME_BYTES = 2 * GIB
# a GPU planned with Megatron's local layer spec instead of Transformer Engine's: what the
# memory simulation runs (`rlhf.trainer.memory_simulation`), compared phase by phase
LOCAL_SPEC = "local"
# the forward-only pass of each trained model: a phase of its own (`_phases`)
FORWARD_PHASES = {"actor": "old_log_prob", "critic": "values"}
BUILD_ORDER = ("actor", "reference", "critic")  # as `build_engine` builds them


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one role holds on one GPU, by kind; `offloaded` kinds live on the CPU between
    the role's own phases."""

    role: str
    weights: int = 0
    gradients: int = 0
    master_weights: int = 0
    optimizer_state: int = 0
    activations: int = 0
    communication: int = 0
    offloaded: frozenset[str] = field(default_factory=frozenset)
    # a trained model's forward-only pass (old log-probs, values) at its forward budget
    forward_activations: int = 0
    experts: int = 0  # of weights, gradients, master weights and Adam state: the routed experts'
    # while the model is built: the loaded parameters, until DDP has copied them into its
    # parameter buffer (the distributed optimizer's) and freed them
    build_transient: int = 0

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.master_weights + self.optimizer_state

    @property
    def resident(self) -> int:
        """What stays on the GPU while other roles run."""
        return sum(getattr(self, k) for k in KINDS[:4] if k not in self.offloaded)

    @property
    def total(self) -> int:
        return self.static + self.activations + self.communication

    @property
    def build(self) -> int:
        """The peak while the model is built: DDP's buffers (parameters, gradients) next to
        the loaded parameters until they are copied in and freed (`build_transient`), then
        next to the master weights the optimizer makes; Adam's state comes at the first
        step (simulated: `rlhf.trainer.memory_simulation`)."""
        return self.weights + self.gradients + max(self.build_transient, self.master_weights)


@dataclass(frozen=True)
class MemoryPlan:
    rows: tuple[RoleMemory, ...]
    phases: dict[str, int]  # bytes on the GPU at the peak of each phase
    gpu_bytes: int | None
    host_bytes: int = 0  # RAM a node needs for its trainer ranks (`rlhf.memory.host`)

    def row(self, role: str) -> RoleMemory:
        return next(r for r in self.rows if r.role == role)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_bytes is None else self.peak <= self.gpu_bytes


@dataclass(frozen=True)
class TrainedRole:
    """What the planner needs of a trained (or frozen) model's config."""

    name: str
    megatron: MegatronParallelConfig
    token_budget: int
    value_head: bool = False
    forward_budget: int | None = None  # tokens of a forward-only micro-batch (None: token_budget)
    lora: LoraSpec | None = None  # trained: only these adapters (the weights frozen)
    shares_weights: bool = False  # a LoRA run's reference: the actor's weights, adapters off


def _flash(device: str) -> bool:
    """GPU runs use Transformer Engine's fused attention; CPU runs the local spec (and the
    memory simulation: device "local")."""
    return device not in ("cpu", LOCAL_SPEC)


def expert_sizes(m: MegatronParallelConfig) -> tuple[int, int]:
    """EP and expert-TP (null: TP) of a model's config."""
    return m.expert_model_parallel_size, m.expert_tensor_parallel_size or (
        m.tensor_model_parallel_size
    )


@dataclass(frozen=True)
class StageCount:
    """One rank's parameters on a stage and DDP's two buffers: the dense parameters' over
    DP (x Ulysses SP), the routed experts' over expert-DP."""

    numel: int
    dense: GradBuffer
    experts: GradBuffer
    frozen: int = 0  # parameters outside DDP's buffers (a LoRA actor's weights)

    @property
    def buffer_numel(self) -> int:
        return self.dense.numel + self.experts.numel

    def owned(self, dp_rank: int, expert_dp_rank: int) -> int:
        return self.dense.owned[dp_rank] + self.experts.owned[expert_dp_rank]


def stage_count(
    arch: ModelArch,
    padded: int,
    m: MegatronParallelConfig,
    stage: int,
    groups: tuple[int, int],
    distributed: bool,
    value_head: bool,
    lora: LoraSpec | None = None,
) -> StageCount:
    """`groups`: the distributed optimizer's DP x SP and expert-DP sizes; `lora`: only
    these adapters train (DDP's buffer holds them alone)."""
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    ep, etp = expert_sizes(m)
    params = stage_params(
        arch,
        padded,
        tp=tp,
        pp=pp,
        stage=stage,
        value_head=value_head,
        ep=ep,
        etp=etp,
        vp=virtual_pipeline_size(m),
    )
    if lora is not None:
        vp = virtual_pipeline_size(m)
        adapters = lora_params(arch, lora, tp=tp, pp=pp, stage=stage, vp=vp, ep=ep, etp=etp)
        frozen = sum(p.numel for p in params)
        dense = GradBuffer.layout([p for p in adapters if not p.expert], groups[0], distributed)
        experts = GradBuffer.layout([p for p in adapters if p.expert], groups[1], distributed)
        return StageCount(frozen + sum(p.numel for p in adapters), dense, experts, frozen)
    dense = GradBuffer.layout([p for p in params if not p.expert], groups[0], distributed)
    experts = GradBuffer.layout([p for p in params if p.expert], groups[1], distributed)
    return StageCount(sum(p.numel for p in params), dense, experts)


def activation_shape(
    arch: ModelArch, m: MegatronParallelConfig, tokens: int, *, sp: int, stage: int
) -> ActivationShape:
    """One rank's micro-batch of `tokens` on pipeline stage `stage`, MoE layers included."""
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    sequence_parallel = sequence_parallel_on(m.sequence_parallel, tp)
    moe, moe_layers = None, 0
    if arch.moe is not None:
        moe = MoEShape.of(
            arch.moe,
            tokens,
            tp=tp,
            etp=expert_sizes(m)[1],
            seq_split=tp if sequence_parallel else 1,
            aux_loss=m.moe_aux_loss_coeff > 0,
        )
        layers = stage_layers(arch.num_layers, pp, stage, virtual_pipeline_size(m))
        moe_layers = sum(arch.is_moe_layer(i) for i in layers)
    return ActivationShape.of(
        arch,
        tokens,
        padded_vocab_size(arch.vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, tp),
        tp=tp,
        pp=pp,
        sp=sp,
        element=DTYPE_BYTES[m.dtype],
        sequence_parallel=sequence_parallel,
        moe=moe,
        moe_layers=moe_layers,
    )


def trained_memory(
    arch: ModelArch,
    role: TrainedRole,
    *,
    dp: int,
    sp: int,
    device: str,
    stage: int,
    dp_rank: int = 0,
    expert_dp_rank: int = 0,
    train: bool = True,
) -> RoleMemory:
    """One rank's bytes for `role` on pipeline stage `stage` (DP rank `dp_rank`, and in
    the expert grid expert-DP rank `expert_dp_rank`)."""
    m = role.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    ep, etp = expert_sizes(m)
    vp = virtual_pipeline_size(m)
    padded = padded_vocab_size(arch.vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, tp)
    element = DTYPE_BYTES[m.dtype]
    group = dp * sp  # the distributed optimizer shards over DP x SP
    if (group * tp) % (etp * ep):
        raise ValueError(
            f"expert-TP ({etp}) x EP ({ep}) x PP ({pp}) does not divide the world size "
            f"({group * tp * pp})"
        )
    expert_dp = group * tp // (etp * ep)  # world / (expert-TP x EP x PP)
    distributed = train and distributed_optimizer_on(m, group)
    count = stage_count(
        arch, padded, m, stage, (group, expert_dp), distributed, role.value_head, role.lora
    )
    shape = activation_shape(arch, m, role.token_budget, sp=sp, stage=stage)
    last, lm_head = stage == pp - 1, not role.value_head
    flash = _flash(device)
    forward = _forward_activations(arch, role, sp=sp, stage=stage, flash=flash)
    if not train:
        return RoleMemory(
            role.name,
            weights=0 if role.shares_weights else count.numel * element,
            activations=forward,
            experts=count.experts.numel * element,
        )
    owned = count.owned(dp_rank, expert_dp_rank)
    trained = count.numel - count.frozen
    owned_experts = count.experts.owned[expert_dp_rank]
    switches = {
        "weights": m.param_offload,
        "gradients": m.grad_offload,
        "master_weights": m.optimizer_offload,
        "optimizer_state": m.optimizer_offload,
    }
    offloaded = {kind for kind, on in switches.items() if on}
    master = 4 if element == 2 else 0  # fp32 master weights of 16-bit models
    return RoleMemory(
        role.name,
        weights=(count.frozen + (count.buffer_numel if distributed else trained)) * element,
        gradients=count.buffer_numel * 4,  # fp32 (bf16 models reduce gradients in fp32)
        master_weights=owned * master,
        optimizer_state=2 * owned * 4,  # Adam's exp_avg and exp_avg_sq, fp32
        activations=training_peak(
            shape,
            Recompute.of(m),
            flash=flash,
            last_stage=last,
            lm_head=lm_head,
            first_stage=stage == 0,
            gradient_from_next=pp > 1 and (stage < pp - 1 or vp > 1),
            in_flight=pipeline_in_flight(pp, stage, vp),
            chunks=vp,
        ),
        offloaded=frozenset(offloaded),
        forward_activations=forward,
        experts=count.experts.numel * (element + 4) + owned_experts * (master + 8),
        build_transient=trained * element if distributed else 0,
    )


def _forward_activations(
    arch: ModelArch, role: TrainedRole, *, sp: int, stage: int, flash: bool
) -> int:
    """The peak of one forward-only micro-batch of `role` (at its forward budget)."""
    m = role.megatron
    tokens = role.forward_budget or role.token_budget
    shape = activation_shape(arch, m, tokens, sp=sp, stage=stage)
    last = stage == m.pipeline_model_parallel_size - 1
    return forward_peak(shape, flash=flash, last_stage=last, lm_head=not role.value_head)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on, taken from a config (knobs change these)."""

    arch: ModelArch
    roles: tuple[TrainedRole, ...]  # actor first; critic when used
    reference: TrainedRole | None
    ref_offload: bool
    world_size: int
    sp: int
    rollout_tp: int
    rollout_dtype: str
    rollout_fraction: float  # of the GPU, SGLang's weights and KV cache (colocated)
    colocated: bool
    release_rollout: bool  # free_cache_engine on a GPU
    sync_bucket: int
    device: str
    ranks_per_node: int = 1
    async_save: bool = False  # trainer.async_save: a snapshot of every trained model at once
    adapter_sync: bool = False  # LoRA: the weight sync sends the adapters alone

    @classmethod
    def from_config(
        cls, cfg: RLHFConfig, arch: ModelArch, world_size: int | None = None, device: str = "cuda"
    ) -> PlanInputs:
        """The planner's one reader of the whole config: its run plan for `world_size` ranks
        (default: nnodes x n_gpus_per_node; a clear error for sizes that do not divide) and
        the sections the plan does not hold."""
        world = world_size or cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        plan = resolve(cfg, world)
        critic = cfg.critic
        return cls.of(
            plan, arch, device, cfg.actor_rollout_ref, critic.megatron, cfg.trainer, critic.model
        )

    @classmethod
    def of(
        cls,
        plan: RunPlan,
        arch: ModelArch,
        device: str,
        aro: ActorRolloutRefConfig,
        critic: MegatronParallelConfig,
        trainer: TrainerConfig,
        critic_model: ModelConfig | None = None,
    ) -> PlanInputs:
        """From the run plan (which models, their token budgets, the world and SP sizes) and
        the sections it does not resolve: the actor's and critic's Megatron settings, the
        reference's offload, the rollout's share of the GPU, the node size, async saves."""
        budgets = plan.budgets
        # forward-only passes (old log-probs, values) have phases of their own
        lora = lora_spec(aro.model)
        actor = TrainedRole(
            "actor",
            aro.actor.megatron,
            budgets.actor.tokens,
            False,
            budgets.old_log_prob.tokens,
            lora=lora,
        )
        roles = [actor]
        if plan.critic is not None:
            critic_lora = lora_spec(critic_model) if critic_model is not None else None
            roles.append(
                TrainedRole("critic", critic, budgets.critic.tokens, True, lora=critic_lora)
            )
        reference = (
            TrainedRole(
                "reference", aro.actor.megatron, budgets.ref.tokens, shares_weights=bool(lora)
            )
            if plan.reference
            else None
        )
        rollout, world = aro.rollout, plan.layout.world_size
        return cls(
            arch,
            tuple(roles),
            reference,
            aro.ref.param_offload,
            world,
            plan.layout.sp_size,
            rollout.tensor_model_parallel_size,
            rollout.dtype,
            rollout.gpu_memory_utilization,
            not rollout.server_urls,
            rollout.free_cache_engine and device != "cpu",
            rollout.update_weights_bucket_megabytes * 1024**2,
            device,
            min(world, trainer.n_gpus_per_node),
            trainer.async_save,
            lora is not None and not aro.model.lora_merge,
        )


def hf_param_count(arch: ModelArch) -> int:
    """Parameters of the whole (unsharded) HF model, as SGLang loads it."""
    full = stage_params(arch, arch.vocab_size, tp=1, pp=1, stage=0)
    return sum(p.numel for p in full)


def _rank_rows(inputs: PlanInputs, stage: int, gpu_bytes: int | None) -> list[RoleMemory]:
    actor_m = inputs.roles[0].megatron
    tp, pp = actor_m.tensor_model_parallel_size, actor_m.pipeline_model_parallel_size
    dp = inputs.world_size // (tp * pp * inputs.sp)
    rows = [
        trained_memory(inputs.arch, r, dp=dp, sp=inputs.sp, device=inputs.device, stage=stage)
        for r in inputs.roles
    ]
    padded = padded_vocab_size(inputs.arch.vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, tp)
    element = DTYPE_BYTES[actor_m.dtype]
    ep, _ = expert_sizes(actor_m)
    lora = inputs.roles[0].lora
    if inputs.adapter_sync and lora is not None:
        sync = adapter_sync_bytes(inputs.arch, lora, element)
    else:
        sync = sync_bytes(inputs.arch, padded, tp, element, inputs.sync_bucket, ep)
    rows[0] = replace(rows[0], communication=sync)
    if inputs.reference is not None:
        ref = trained_memory(
            inputs.arch,
            inputs.reference,
            dp=dp,
            sp=inputs.sp,
            device=inputs.device,
            stage=stage,
            train=False,
        )
        offloaded = frozenset({"weights"}) if inputs.ref_offload else frozenset()
        rows.append(replace(ref, offloaded=offloaded))
    if inputs.colocated:
        fraction = inputs.rollout_fraction
        tp, dtype = inputs.rollout_tp, inputs.rollout_dtype
        rows.append(rollout_memory(inputs.arch, tp, dtype, fraction, gpu_bytes))
    return rows


def rollout_memory(
    arch: ModelArch, tp: int, dtype: str, fraction: float, gpu_bytes: int | None
) -> RoleMemory:
    """A colocated SGLang server's share of the GPU (`fraction` of `gpu_bytes`): its weights
    on one of its `tp` ranks in `dtype`, the rest KV cache."""
    element = DTYPE_BYTES[dtype]
    weights = rollout_weight_bytes(arch, tp, element)
    share = int(fraction * gpu_bytes) if gpu_bytes else weights
    experts = expert_param_count(arch) * element // tp
    return RoleMemory(
        "rollout", weights=weights, activations=max(0, share - weights), experts=experts
    )


def expert_param_count(arch: ModelArch) -> int:
    """Parameters of all the routed experts of the model."""
    if arch.moe is None:
        return 0
    per_expert = 3 * arch.moe.ffn_hidden_size * arch.hidden_size  # gate, up, down
    return sum(arch.moe.layers) * arch.moe.num_experts * per_expert


def rollout_weight_bytes(arch: ModelArch, rollout_tp: int, element: int) -> int:
    """SGLang's weights on one of its TP ranks: the model split over its TP ranks (the
    routed experts too: over its TP, or over its EP with `engine_kwargs.sglang.ep_size`,
    E x moe_ffn / TP per rank either way), except each MoE layer's router (and shared-expert
    gate; multi-latent attention's down projections and norms), which every rank holds
    whole."""
    replicated = replicated_params(arch.moe, arch.hidden_size) if arch.moe else 0
    if arch.mla is not None:
        replicated += mla_replicated_params(arch)
    split = hf_param_count(arch) - replicated
    return split * element // rollout_tp + replicated * element


def _phases(rows: list[RoleMemory], inputs: PlanInputs) -> dict[str, int]:
    by_role = {r.role: r for r in rows}
    rollout, actor = by_role.get("rollout"), by_role["actor"]
    trainer = [r for r in rows if r.role != "rollout"]
    resident = sum(r.resident for r in trainer)
    kept = rollout.total if rollout is not None and not inputs.release_rollout else 0

    def running(role: RoleMemory, extra: int) -> int:
        return resident - role.resident + role.static + extra + kept

    built = sorted(trainer, key=lambda r: BUILD_ORDER.index(r.role))
    phases = {"build": _build_peak(built, kept)}
    phases["rollout"] = resident + (rollout.total if rollout is not None else 0)
    for row in trainer:
        phases[row.role] = running(row, row.activations)
        if row.role in FORWARD_PHASES:  # a forward-only pass: its parameters come back alone
            weights = row.weights if "weights" in row.offloaded else 0
            phases[FORWARD_PHASES[row.role]] = resident + weights + row.forward_activations + kept
    if rollout is not None and inputs.release_rollout:
        # PolicyServers.load_weights next to sleeping servers: only the actor's weights on
        # the GPU (its gradients and optimizer state off it); SGLang's weights wake for the
        # sync, then its KV cache for the probe and the next rollout
        weights_only = resident - actor.resident + actor.weights
        phases["weight_sync"] = weights_only + rollout.weights + actor.communication
        phases["kv_cache_wake"] = weights_only + rollout.total
    else:  # PolicyServers.load_weights brings back the actor's parameters, not the rest
        weights = actor.weights if "weights" in actor.offloaded else 0
        phases["weight_sync"] = resident + weights + actor.communication + kept
        phases["probe"] = resident + weights + kept  # the log-prob probe, after the sync
    runtime = GPU_RUNTIME_BYTES if inputs.device != "cpu" else 0
    return {name: value + runtime for name, value in phases.items()}


def _build_peak(trainer: list[RoleMemory], kept: int) -> int:
    """The models are built one after the other (actor, reference, critic), each offloaded
    as it is done, while sleeping colocated servers hold nothing (`kept`: what servers that
    do not sleep hold); Adam's state does not exist before the first step."""
    peak, built = 0, 0
    for row in trainer:
        peak = max(peak, built + row.build)
        built += row.resident - (0 if "optimizer_state" in row.offloaded else row.optimizer_state)
    return peak + kept


def sync_bytes(
    arch: ModelArch, padded_vocab: int, tp: int, element: int, bucket: int, ep: int = 1
) -> int:
    """What a weight sync adds on a stage leader (`WeightSyncer.sync`), with B the bucket
    (a tensor larger than `bucket` forms its own) and L the largest parameter. The tensor
    transport delivers a packed bucket while the next ones are gathered and packed
    (`Deliveries`): while a bucket is gathered the previous one waits to be packed and the
    one before is being delivered (3 B), next to the current parameter's gathered copies:
    its all-gathered TP shards and their HF-layout copy (2 L, TP > 1 only), or for a routed
    expert's gate/up weight G its expert-TP slices, every EP rank's copy and their HF
    tensors ((2 EP + 1) G, `rlhf.weight_sync.gather`); while a bucket is packed, it, its
    flat copy, the next bucket and the delivered one are alive (4 B)."""
    h = arch.hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
    largest = max(padded_vocab, 2 * arch.ffn_hidden_size, qkv) * h * element
    full = max(bucket, largest)
    gathered = 2 * largest if tp > 1 else 0
    if arch.moe is not None:
        expert_gate_up = 2 * arch.moe.ffn_hidden_size * h * element
        gathered = max(gathered, (2 * ep + 1) * expert_gate_up)
    return max(3 * full + gathered, 4 * full)


def adapter_sync_bytes(arch: ModelArch, spec: LoraSpec, element: int) -> int:
    """What an adapter-only sync adds on the sender (`rlhf.weight_sync.adapters`), at most:
    every layer's adapters whole, in PEFT's form (a fused layer's A once per projection:
    three for q/k/v, two for gate/up), gathered and then copied: twice that."""
    whole = sum(p.numel for p in lora_params(arch, spec, tp=1, pp=1, stage=0))
    shared_a = {"linear_qkv": 2, "linear_fc1": 1}  # the extra copies of A
    extra = sum(n for layer, n in shared_a.items() if layer in spec.targets)
    return 2 * (whole + arch.num_layers * extra * spec.rank * arch.hidden_size) * element


def plan_stage(inputs: PlanInputs, stage: int, gpu_bytes: int | None) -> MemoryPlan:
    """The plan of one pipeline stage's ranks."""
    rows = _rank_rows(inputs, stage, gpu_bytes)
    sleep = inputs.colocated and inputs.release_rollout
    host = host_bytes_per_rank(rows, sleep, inputs.async_save) * inputs.ranks_per_node
    return MemoryPlan(tuple(rows), _phases(rows, inputs), gpu_bytes, host)


def plan_memory(inputs: PlanInputs, gpu_bytes: int | None = None) -> MemoryPlan:
    """Per-GPU memory of `inputs` (`PlanInputs.from_config`) on GPUs of `gpu_bytes`: the
    plan of the pipeline stage with the highest peak."""
    pp = inputs.roles[0].megatron.pipeline_model_parallel_size
    return max((plan_stage(inputs, s, gpu_bytes) for s in range(pp)), key=lambda p: p.peak)


def kv_cache_bytes_per_token(arch: ModelArch, rollout_tp: int, dtype: str) -> int:
    """SGLang's KV cache per token on one GPU: K and V of every layer, for the KV heads of
    one rollout TP rank (replicated when there are fewer heads than ranks); with
    multi-latent attention the kv latent and the rotary key of every layer, on every rank."""
    if arch.mla is not None:
        latent = arch.mla.kv_lora_rank + arch.mla.rope_dim
        return arch.num_layers * latent * DTYPE_BYTES[dtype]
    heads = max(1, arch.num_query_groups // rollout_tp)
    return 2 * arch.num_layers * heads * arch.head_dim * DTYPE_BYTES[dtype]


def planned_kv_cache_tokens(rollout: RolloutConfig, arch: ModelArch, gpu_bytes: int) -> int:
    """The KV-cache tokens a colocated server gets in the plan: its share of the GPU
    (`rollout.gpu_memory_utilization`) less its weights, per token (the plan's rollout row);
    given to SGLang as `--max-total-tokens`, so the cache does not depend on what is free when
    it starts."""
    tp, dtype = rollout.tensor_model_parallel_size, rollout.dtype
    row = rollout_memory(arch, tp, dtype, rollout.gpu_memory_utilization, gpu_bytes)
    return row.activations // kv_cache_bytes_per_token(arch, tp, dtype)
