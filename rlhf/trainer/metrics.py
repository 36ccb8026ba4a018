"""What a run logs besides its stages' own numbers: rollout lengths, validation scores,
throughput and MFU, and the experiment trackers it writes to.

Throughput and MFU of a PPO step, against a matmul rate measured on this machine.

MFU divides the model FLOPs a step needed by the FLOPs the hardware could have done in the
step's wall time. The peak is measured (a large fp32/bf16 matmul, once per run) rather than
read from a spec sheet, so the number means the same thing on a laptop CPU and on an H200.

Which experiment-tracker runs a training run logs to: new ones, or those of its checkpoint.

Each checkpoint keeps the W&B/MLflow/SwanLab run ids in its trainer state (`TRACKERS_KEY`),
so a run resumed from checkpoint N continues the runs that wrote N, also when N is older
than the last step they logged (`rlhf.logging.backends`). Only a checkpoint of this run
directory counts: one of another run (`trainer.resume_mode=<path>`) starts new tracker runs,
so that two run directories never write into one tracker run.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.checkpoint import read_trainer_state
from rlhf.config.plan import RunPlan
from rlhf.config.schema import TrainerConfig
from rlhf.logging import MetricTracker
from rlhf.logging.backends import TrackerResume
from rlhf.models.families import ModelArch
from rlhf.rollout.batch import RolloutBatch


def reward_style_metrics(batch: RolloutBatch) -> dict[str, float]:
    """`reward/<style>/mean` and the count of each reward style, when a batch mixes rule and
    model rows (before overlong shaping: the rewards as the scorers gave them)."""
    styles = batch.styles()
    if set(styles) == {"rule"}:
        return {}
    groups: dict[str, list[float]] = defaultdict(list)
    for style, score in zip(styles, batch.scores_b.tolist()):
        groups[style].append(score)
    metrics = {f"reward/{s}/mean": sum(v) / len(v) for s, v in groups.items()}
    return metrics | {f"reward/{s}/count": float(len(v)) for s, v in groups.items()}


def rollout_metrics(batch: RolloutBatch, max_response_length: int) -> dict[str, float]:
    """verl-named length metrics of one rollout batch."""
    lengths = [len(r) for r in batch.response_ids]
    return {
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/min": min(lengths),
        "response_length/clip_ratio": sum(n >= max_response_length for n in lengths) / len(lengths),
        "prompt_length/mean": sum(len(p) for p in batch.prompt_ids) / batch.size,
    }


def model_passes(plan: RunPlan) -> tuple[int, int]:
    """(forward-only passes, update epochs) of one step over its batch, all models."""
    forwards = 1 + int(plan.reference) + int(plan.critic is not None)
    epochs = plan.actor.epochs + (plan.critic.epochs if plan.critic is not None else 0)
    return forwards, epochs


@dataclass(frozen=True)
class StepMeter:
    """A step's performance yardsticks: tokens, tokens/s per rank, and MFU against
    `peak_flops` (measured per rank) for `passes` = `model_passes(plan)`."""

    arch: ModelArch
    world_size: int
    peak_flops: float
    passes: tuple[int, int]

    def metrics(self, batch: RolloutBatch, step_s: float) -> dict[str, float]:
        tokens = sum(batch.sequence_lengths)
        flops = ppo_step_flops(self.arch, tokens, tokens / batch.size, *self.passes)
        return {
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / step_s / self.world_size,
            "perf/mfu": flops / step_s / (self.peak_flops * self.world_size),
        }


def flops_per_token(arch: ModelArch, seq_len: float) -> float:
    """Forward FLOPs per token: 2 x matmul parameters + attention scores (2 x 2 x s x d)."""
    h, layers, kv = arch.hidden_size, arch.num_layers, arch.num_query_groups * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.ffn_hidden_size
    matmul = layers * per_layer + h * arch.vocab_size
    attention = layers * 2 * q * seq_len  # QK^T and PV, causal: half of 2 x s x q each
    return 2.0 * matmul + 2.0 * attention


def ppo_step_flops(
    arch: ModelArch, num_tokens: int, seq_len: float, forward_passes: int, train_epochs: int
) -> float:
    """Model FLOPs of one step: `forward_passes` forward-only passes (old log-probs, and the
    reference's and the critic's when there are those) plus forward + backward (3x forward)
    of `train_epochs` update epochs over the batch (actor and critic together)."""
    forward = flops_per_token(arch, seq_len) * num_tokens
    return forward_passes * forward + 3 * forward * train_epochs


def matmul_size(device: torch.device) -> int:
    """The side of the yardstick's matmul: on a GPU large enough (~1.1 TFLOP, about a
    millisecond on an H200) that the GPU, not the host launching kernels (a few
    microseconds each), sets the rate; a 1024 matmul there ran at the launch rate and
    understated the peak, inflating MFU."""
    return 8192 if device.type == "cuda" else 1024


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int | None = None
) -> float:
    """Sustained FLOP/s of a square matmul on `device` (a same-run yardstick for MFU)."""
    size = size or matmul_size(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    repeats, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        a @ b
        repeats += 1
    _sync(device)
    return 2.0 * size**3 * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


log = logging.getLogger(__name__)

TRACKERS_KEY = "trackers"  # trainer_state.json: backend name -> run id


def tracker_state(tracker: MetricTracker | None) -> dict[str, dict[str, str]]:
    """The trainer-state entry that names the tracker runs (empty off the main rank)."""
    return {TRACKERS_KEY: tracker.run_ids() if tracker is not None else {}}


def tracker_resume(resume_path: Path | None, checkpoint_root: Path) -> TrackerResume | None:
    """What the tracker of a run resumed from `resume_path` continues; None for a new run."""
    if resume_path is None:
        return None
    state = read_trainer_state(resume_path)
    step = int(state["step"])
    run_ids = dict(state.get(TRACKERS_KEY, {}))  # none in checkpoints from before the key
    if run_ids and resume_path.resolve().parent != checkpoint_root.resolve():
        log.info(
            "%s is not a checkpoint of this run directory (%s): its tracker runs %s are "
            "left alone, new ones start",
            resume_path,
            checkpoint_root,
            run_ids,
        )
        run_ids = {}
    return TrackerResume(step, run_ids)


def build_tracker(
    trainer: TrainerConfig, config: dict, resume_path: Path | None, checkpoint_root: Path
) -> MetricTracker:
    """The run's tracker (main rank only): `trainer.logger` backends, continuing the tracker
    runs of the checkpoint it resumes from; `config`: the run's config as a dict."""
    resume = tracker_resume(resume_path, checkpoint_root)
    return MetricTracker.from_config(trainer, config, resume)
