"""One rank of a config's training step at its real shapes, without a GPU: the bytes each
phase keeps on the device, counted from the real code.

    python -m rlhf.trainer.memory_simulation --config configs/gsm8k_8gpu.yaml \
        --model-shape configs/model_shapes/Qwen2.5-7B.json [--rank R] [key=value ...]

prints one JSON object (`SimulatedStep`). Why: the memory planner (`rlhf.memory.planner`)
counts bytes by formula; this runs the trainer's own code for one rank of the config's
layout and counts what is alive on the device, phase by phase, so that the planner is held
to the code: the models as `build_engine` builds them (Megatron's local spec, DDP, the
Megatron optimizer, each offloaded as configured), one step's `learn_from_batch` (old
log-probs, reference, values, advantages, the critic's and actor's updates) and the weight
load's device residency and log-prob probe (`PolicyServers.load_weights`), with the device
ledger's phases as in a run.

How: a fake world (`rlhf.distributed.fake_world`: the config's TP, PP, DP, EP groups for
one rank, collectives answered by torch's fake process group) and a simulated device
(`rlhf.memory.fake_device`: fake tensors, the meta device standing in for the GPU, live
storages counted). Where the simulation differs from a GPU run (each is in `deviations`):

- the local layer spec, not Transformer Engine's (no TE here): compare it with the
  planner's local-spec plan; the weight files are not read (the parameters are created on
  the host, and reach the device as `.to(device)` moves them);
- the batch is synthetic: equal samples (the config's prompt and response lengths, cut to
  divide every token budget) that fill each micro-batch to exactly its token budget, one
  mini-batch per model (`ppo_mini_batch_size` set to the batch) and one epoch; two steps
  run and the second one's phases are reported (Adam's state exists from the first
  optimizer step on, and is resident in every later phase that keeps it);
- mixture-of-experts layers route with Megatron's drop-and-pad at capacity factor 1 (every
  expert gets exactly its share of the tokens x top-k: the planner's balanced routing); the
  dropless dispatcher's split sizes depend on the router's values, which fake tensors lack;
- under pipeline parallelism the simulated rank is on the last stage (the first stage
  receives the metric names from the last by an object broadcast, which one rank alone
  cannot answer) and micro-batches have fixed shapes (`variable_seq_lengths` off: every
  micro-batch holds the same tokens, so the tensors sent are the same and no shape is
  exchanged);
- the weight sync's gather and bucket buffers are not run (the transports talk to SGLang):
  the sync phase is the actor's residency during the load, the planner adds `sync_bytes`;
  SGLang's own memory and the CUDA runtime are the planner's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from rlhf.config import RLHFConfig, load_config
from rlhf.config.plan import RunPlan, resolve
from rlhf.config.rollout import RolloutConfig
from rlhf.config.schema import DataConfig
from rlhf.config.validate import ParallelLayout
from rlhf.distributed.context import ParallelContext
from rlhf.engine.engine import PPOEngine
from rlhf.engine.micro_batch import row_multiple
from rlhf.memory.fake_device import LiveBytes, simulated_device
from rlhf.memory.ledger import ledger, reset
from rlhf.models.families import ModelArch, arch_from_hf_config
from rlhf.rollout.batch import RolloutBatch

AR = "actor_rollout_ref"
DEVIATIONS = (
    "local layer spec (no Transformer Engine); weight files not read",
    "synthetic batch filling every micro-batch to its token budget; the second of 2 steps",
)
MOE_DEVIATION = "MoE routing: Megatron's drop-and-pad at capacity factor 1 (balanced)"
PP_DEVIATION = "pipeline: last stage simulated, fixed micro-batch shapes"


@dataclass(frozen=True)
class PhasePeak:
    """A phase on the simulated rank: the most bytes alive on the device inside it, and
    what was alive when it began."""

    peak: int
    start: int
    seconds: float


@dataclass(frozen=True)
class SimulatedStep:
    """What one rank keeps on the device, phase by phase (the trainer's tensors only)."""

    config: str
    rank: int
    pp_stage: int
    phases: dict[str, PhasePeak]
    deviations: tuple[str, ...]
    seconds: float
    ledger: str = ""  # the device ledger's table of the simulated step

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SimulatedStep:
        phases = {name: PhasePeak(**p) for name, p in data["phases"].items()}
        return cls(**{**data, "phases": phases, "deviations": tuple(data["deviations"])})


class Meter(Protocol):
    """Records each phase's peak (the step's timer as `learn_from_batch` calls it)."""

    peaks: dict[str, PhasePeak]
    models: PPOEngine | None

    def stage(self, name: str) -> AbstractContextManager[None]: ...

    def live(self) -> int:
        """Bytes on the device now."""
        ...


@dataclass
class PhasePeaks:
    """The simulated device's phases: live bytes counted under fake tensors."""

    counter: LiveBytes
    peaks: dict[str, PhasePeak] = field(default_factory=dict)
    models: PPOEngine | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start, began = self.counter.reset_peak(), time.perf_counter()
        yield
        self.counter.refresh()
        seconds = round(time.perf_counter() - began, 2)
        self.peaks[name] = PhasePeak(self.counter.peak, start, seconds)

    def live(self) -> int:
        return self.counter.refresh()


@dataclass
class MeasuredPeaks:
    """A real CPU run's phases: the models' storages at each start, and the most bytes
    allocated above it inside (torch.profiler's allocation events, `rlhf.memory.measure`)."""

    peaks: dict[str, PhasePeak] = field(default_factory=dict)
    models: PPOEngine | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        from rlhf.memory.measure import allocation_peak, profiling_memory

        start, began = self.live(), time.perf_counter()
        with profiling_memory() as prof:
            yield
        seconds = round(time.perf_counter() - began, 2)
        self.peaks[name] = PhasePeak(start + allocation_peak(prof), start, seconds)

    def live(self) -> int:
        """The storages of the models' parameters, gradient buffers and optimizer state."""
        from rlhf.engine.offload import KINDS, StorageOffloader, model_tensors

        if self.models is None:
            return 0
        m = self.models
        models = [x for x in (m.actor, m.critic, m.ref) if x is not None]
        kinds = [(x, k) for x in models for k in KINDS if k == "params" or hasattr(x, "ddps")]
        return StorageOffloader.of(t for x, k in kinds for t in model_tensors(x, k)).nbytes


@dataclass(frozen=True)
class SyntheticBatch:
    """Samples of `sample_tokens` tokens each (the first `prompt_tokens` the prompt),
    `per_rank` of them on every DP rank."""

    sample_tokens: int
    prompt_tokens: int
    per_rank: int
    dp_size: int
    group_size: int

    @property
    def size(self) -> int:
        return self.per_rank * self.dp_size

    def batch(self) -> RolloutBatch:
        n, response = self.size, self.sample_tokens - self.prompt_tokens
        return RolloutBatch(
            prompt_ids=[[5] * self.prompt_tokens for _ in range(n)],
            response_ids=[[7] * response for _ in range(n)],
            scores_b=torch.arange(n, dtype=torch.float32) % 2,  # every group has two scores
            data_sources=["simulated"] * n,
            uids=[f"prompt-{i // self.group_size}" for i in range(n)],
        )


def synthetic_batch(plan: RunPlan, data: DataConfig) -> SyntheticBatch:
    """Equal samples whose length divides the token budget of every pass that runs (at most
    `data`'s prompt plus response length, a multiple of what a packed row's length must be
    under the plan's layout), enough on each DP rank to fill a whole number of micro-batches
    of every pass, PP of them at least (a pipeline keeps PP micro-batches in flight), and a
    whole number of GRPO groups."""
    layout, budgets = plan.layout, plan.budgets
    multiple = row_multiple(layout.sp_size, layout.tp_size if layout.sequence_parallel else 1)
    dp_size, pp_size = layout.dp_size, layout.pp_size
    passes = [budgets.actor, budgets.old_log_prob]
    passes += [budgets.critic] if plan.critic is not None else []
    passes += [budgets.ref] if plan.reference else []
    tokens = [b.tokens for b in passes]
    longest = data.max_prompt_length + data.max_response_length
    fitting = [n for n in range(multiple, longest + 1, multiple) if math.gcd(*tokens) % n == 0]
    if not fitting:
        raise ValueError(f"no sample length up to {longest} divides the budgets {tokens}")
    length, whole = max(fitting), math.lcm(*tokens)
    per_rank_tokens = whole * -(-pp_size * max(tokens) // whole)
    per_rank, group = per_rank_tokens // length, plan.samples_per_prompt
    while (per_rank * dp_size) % group:
        per_rank += whole // length
    response = min(data.max_response_length, length // 2)
    return SyntheticBatch(length, length - response, per_rank, dp_size, group)


def _model_dir(hf_config: dict, root: Path) -> Path:
    """An HF directory with `hf_config` and no weights (`HFCheckpointReader` opens it)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return root


def simulation_config(
    config: str, overrides: list[str], model_dir: Path, batch: SyntheticBatch | None, moe: bool
) -> RLHFConfig:
    """The config with the simulation's changes (the module docstring's list); `moe`: the
    model has experts."""
    changes = [f"{AR}.model.path={model_dir}", f"critic.model.path={model_dir}"]
    if batch is not None:
        mini = batch.size // batch.group_size
        changes += [f"{AR}.actor.ppo_mini_batch_size={mini}", f"{AR}.actor.ppo_epochs=1"]
        changes += [f"critic.ppo_mini_batch_size={mini}", "critic.ppo_epochs=1"]
    cfg = load_config(config, [*overrides, *changes])
    for megatron in (cfg.actor_rollout_ref.actor.megatron, cfg.critic.megatron):
        if moe:
            megatron.moe_expert_capacity_factor = 1.0
            megatron.override_transformer_config["moe_pad_expert_input_to_capacity"] = True
    return cfg


@contextmanager
def _weights_not_read() -> Iterator[None]:
    """`load_hf_weights` does nothing inside: the simulated directory has no weights (the
    parameters are on the host then; they reach the device with `.to(device)` after it)."""
    from rlhf.engine import build as setup
    from rlhf.models import builder

    loaders = builder.load_hf_weights, setup.load_hf_weights
    builder.load_hf_weights = setup.load_hf_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        builder.load_hf_weights, setup.load_hf_weights = loaders


def simulated_rank(world: int, pp_size: int) -> int:
    """The first rank of the last pipeline stage (rank 0 without pipeline parallelism)."""
    return world - world // pp_size


def simulate(
    config: str, hf_config: dict, overrides: list[str] | None = None, rank: int | None = None
) -> SimulatedStep:
    """One rank's step of `config` for the model of `hf_config` (an HF config.json), in
    this process (once: it holds torch.distributed and Megatron's groups meanwhile)."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(hf_config, Path(tmp) / "model")
        arch = arch_from_hf_config(hf_config)
        moe = arch.moe is not None
        cfg = simulation_config(config, overrides or [], model_dir, None, moe)
        world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        plan = resolve(cfg, world)
        layout = plan.layout
        batch = synthetic_batch(plan, cfg.data)
        cfg = simulation_config(config, overrides or [], model_dir, batch, moe)
        rank = simulated_rank(world, layout.pp_size) if rank is None else rank

        def step(ctx: ParallelContext, meter: Meter) -> None:
            _phases(cfg, arch, ctx, batch.batch(), meter)  # the batch on the simulated device

        peaks, ledger_table, stage = _run_step(layout, world, rank, step)
    deviations = list(DEVIATIONS)
    if arch.moe is not None:
        deviations.append(MOE_DEVIATION)
    if layout.pp_size > 1:
        deviations.append(PP_DEVIATION)
    return SimulatedStep(
        config,
        rank,
        stage,
        peaks,
        tuple(deviations),
        round(time.perf_counter() - began, 1),
        ledger_table,
    )


def measure(
    config: str, model_dir: str | Path, overrides: list[str] | None = None
) -> SimulatedStep:
    """The same step measured for real on the CPU (one process: a config of one rank), the
    model read from `model_dir`: what proves the simulation at a small shape."""
    began = time.perf_counter()
    hf_config = json.loads(Path(model_dir, "config.json").read_text())
    arch = arch_from_hf_config(hf_config)
    cfg = simulation_config(config, overrides or [], Path(model_dir), None, arch.moe is not None)
    plan = resolve(cfg, 1)
    layout = plan.layout
    batch = synthetic_batch(plan, cfg.data)
    cfg = simulation_config(config, overrides or [], Path(model_dir), batch, arch.moe is not None)
    from rlhf.distributed import bootstrap

    ctx = _init_parallel(layout)
    try:
        reset()
        meter = MeasuredPeaks()
        _phases(cfg, arch, ctx, batch.batch(), meter)
    finally:
        bootstrap.teardown()
    seconds = round(time.perf_counter() - began, 1)
    return SimulatedStep(config, 0, 0, meter.peaks, ("measured on the CPU",), seconds, "")


def _run_step(
    layout: ParallelLayout,
    world: int,
    rank: int,
    step: Callable[[ParallelContext, Meter], None],
) -> tuple[dict[str, PhasePeak], str, int]:
    """`step` on rank `rank` of a fake world of `world` ranks in `layout`, on the simulated
    device: its phases' peaks, the device ledger's table and the rank's pipeline stage."""
    from rlhf.distributed import bootstrap
    from rlhf.distributed.fake_world import fake_world

    with fake_world(world, rank):
        ctx = _init_parallel(layout)
        try:
            ctx = dataclasses.replace(ctx, device=torch.device("meta"))
            reset()
            with simulated_device() as counter, _weights_not_read():
                meter = PhasePeaks(counter)
                step(ctx, meter)
            return meter.peaks, ledger().table(), ctx.pp_rank
        finally:
            bootstrap.teardown()


def _init_parallel(layout):
    from rlhf.distributed import bootstrap

    ctx = bootstrap.init_layout("cpu", layout)
    bootstrap.seed_everything(0)
    return ctx


def _phases(
    cfg: RLHFConfig, arch: ModelArch, ctx: ParallelContext, batch: RolloutBatch, meter: Meter
) -> None:
    """The build, two steps' learning and weight loads, each phase in `meter`: the
    simulation's one reader of the whole config (`build_engine` and `learn_from_batch` take
    it)."""
    from rlhf.algo import build_kl_controller
    from rlhf.engine.build import build_engine
    from rlhf.trainer.step import Learning, learn_from_batch

    with meter.stage("build"), ledger().phase("build"):
        models = build_engine(cfg, arch, ctx, total_steps=1)
    meter.models = models
    if ctx.pp_size > 1:  # every micro-batch holds the same tokens: fixed shapes
        for model in (models.actor, models.critic, models.ref):
            if model is not None:
                model.module.config.variable_seq_lengths = False
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    for _ in range(2):  # the second step's phases: Adam's state exists, as from then on
        learn_from_batch(
            models,
            batch,
            Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer),
            kl_ctrl,
            meter,
        )
        _load_weights(cfg.actor_rollout_ref.rollout, models, arch, meter)
    live = meter.live()
    meter.peaks["rollout"] = PhasePeak(live, live, 0.0)


def _load_weights(rollout: RolloutConfig, models: PPOEngine, arch: ModelArch, meter: Meter) -> None:
    """`PolicyServers.load_weights`' residency: the actor's weights alone next to sleeping
    colocated servers (its parameters otherwise), the sync, then the log-prob probe."""
    from rlhf.weight_sync.probe import probe_tokens

    sleeps = rollout.server_urls is None and rollout.free_cache_engine
    actor = models.actor  # as `PPOEngine.serving` holds it: the probe's forward, then the sync
    near_servers = actor.weights_on_device() if sleeps else actor.on_device(("params",))
    with ledger().phase("update_weights"), near_servers:
        with meter.stage("probe"):
            models.probe_logprobs(probe_tokens(arch.vocab_size))
        # during the sync: the gather and buckets (the planner's `sync_bytes`) besides
        live = meter.live()
        meter.peaks["sync"] = PhasePeak(live, live, 0.0)


def simulate_in_subprocess(
    config: str, model_shape: str | Path, overrides: list[str] | None = None, timeout: int = 1800
) -> SimulatedStep:
    """`simulate` in a fresh Python process (torch.distributed and Megatron's groups are
    process-wide); raises with the process's last lines when it fails."""
    command = [sys.executable, "-m", "rlhf.trainer.memory_simulation", "--config", config]
    command += ["--model-shape", str(model_shape), *(overrides or [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"the memory simulation of {config} failed:\n{tail}")
    return SimulatedStep.from_json(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model-shape", help="an HF config.json: simulate")
    parser.add_argument("--model", help="an HF model directory: measure on the CPU instead")
    parser.add_argument("--rank", type=int, help="default: rank 0, or the last stage's first")
    parser.add_argument("--layers", type=int, help="fewer layers than the model's (tests)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.model is not None:
        print(json.dumps(measure(args.config, args.model, args.overrides).to_json()))
        return
    hf_config = json.loads(Path(args.model_shape).read_text())
    if args.layers:
        hf_config["num_hidden_layers"] = args.layers
    step = simulate(args.config, hf_config, args.overrides, args.rank)
    print(json.dumps(step.to_json()))


if __name__ == "__main__":
    main()
