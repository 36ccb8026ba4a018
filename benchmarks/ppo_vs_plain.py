"""rlhf's PPO step against a plain PyTorch loop doing the same work, back to back in one run.

    python benchmarks/ppo_vs_plain.py [--steps 6 --hidden 256 --layers 3 --prompts 16 --n 2]

Builds a tiny Qwen2 (random weights, the quickstart tokenizer) and the quickstart's problems,
then runs `rlhf-train` (critic + GAE, KL in the reward, one epoch of one mini-batch, a real
SGLang server) and `benchmarks/plain_ppo.py` (HF generate + padded forwards + AdamW in one
process) for the same number of steps, with the same prompts per step, samples, response
length and loss settings, each pass over the whole batch at once (rlhf: one micro-batch of
all the step's samples; `--micro-batch N` sets fewer). The first step of each side is a
warm-up and is left out of the medians. `--yardstick trl` runs `benchmarks/trl_ppo.py`
(TRL's PPOTrainer on the same work, a reward model in place of the rule) in place of the
plain loop, reported under the same name.

Prints one JSON object: for each side the median seconds per stage (`timing_s/*`), the
median step, `startup_s` (launch to the start of the first step), `teardown_s` (the end of
the last step to the process's exit, the final checkpoint included), `outside_steps_s`
(their sum: the run's wall time less its steps'), `peak_pss_gb` (the
largest sum over the side's processes, SGLang's included, of their proportional set size,
sampled every `--pss-interval` s, and every `--pss-step-interval` s while the timed steps
run) and each process's share at that sample (`pss_at_peak_gb`), and the sampler's own time
as a share of the run (`pss_sampling_core_share`: reading PSS walks each process's page
tables, ~10 ms a process here; a sample slowed the step it fell in by ~70 ms on rlhf's side
and ~15 ms on the plain loop's, so at one a second nearly every step had one and the median
step counted it);
`step_ratio` (rlhf / plain), `training_ratio` (the updates, advantages and weight sync
against the plain loop's updates and advantages, TRL's whole update stage),
`startup_ratio`; `rounds`: with `--rounds N`, both sides run N times, alternating which
goes first, the sides reported are those of the round with the median step ratio, and
`rounds` lists every round's ratios (step, each stage, training, outside the steps) and its
weight sync's seconds; and the compute floor: the step's model FLOPs (generation = one
forward per token, old log-probs, reference and values forwards, forward + backward of
both updates) over a matmul rate measured in this run, with each side's step as a
multiple of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
STAGES = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
    "update",  # TRL's policy and critic update, one loss (benchmarks/trl_ppo.py)
    "write_rollouts",
    "other",
    "log",  # the previous step's record (rlhf's loop, outside its steps)
    "step",
)
YARDSTICKS = {"plain": "plain_ppo.py", "trl": "trl_ppo.py"}
TRAINING = ("update_critic", "update_actor", "adv", "update_weights", "update")  # "training"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per side (1 warm-up)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument(
        "--micro-batch",
        type=int,
        help="rlhf's samples per micro-batch, every pass (default: the whole step's, as the "
        "plain loop does each pass over the whole batch at once)",
    )
    parser.add_argument(
        "--pss-interval",
        type=float,
        default=1.0,
        help="seconds between PSS samples before the first step's end and after the last "
        "step's: each reads every process's page tables (~10 ms a process here), time taken "
        "from the run it measures",
    )
    parser.add_argument(
        "--pss-step-interval",
        type=float,
        default=4.0,
        help="seconds between PSS samples while the timed steps run (a sample slows the "
        "step it falls in: ~70 ms of rlhf's six processes, ~15 ms of the plain loop's one; "
        "sampled less often than a step, most steps and so the median step have none)",
    )
    parser.add_argument(
        "--yardstick",
        choices=sorted(YARDSTICKS),
        default="plain",
        help="the other side, reported as `plain`: benchmarks/plain_ppo.py (transformers "
        "alone), or benchmarks/trl_ppo.py (TRL's PPOTrainer, a reward model in place of the "
        "rule)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run both sides this many times, alternating which goes first, and report the "
        "round whose step ratio is the median (the upper of an even count), with every "
        "round's ratios: the machine's speed drifts within a run's minute as much as the "
        "code's differences",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="keep the runs here: a new or empty directory (default: a temp dir)",
    )
    parser.add_argument("overrides", nargs="*", help="extra rlhf-train overrides (key=value)")
    return parser.parse_args()


class PeakPSS:
    """The largest sum of PSS over a process and its descendants, sampled in a thread, with
    each process's share at that sample (`at_peak`, by `label`); also the wall time `watch`
    (the file the run writes a JSON row to after each step) first had content. Samples come
    every `interval_s`, and every `step_interval_s` between the first row and the
    `steps`-th (the timed steps)."""

    def __init__(
        self, pid: int, interval_s: float, watch: Path, steps: int, step_interval_s: float
    ):
        self.root, self.interval_s, self.peak = psutil.Process(pid), interval_s, 0
        self.steps, self.step_interval_s = steps, step_interval_s
        self.at_peak: dict[str, int] = {}
        self.samples: list[tuple[float, int]] = []  # (wall time, sum)
        self.sampling_s = 0.0  # the sampler's own time: reading PSS walks each page table
        self.watch = watch
        self.watch_seen: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = -math.inf
        while not self._done.is_set():
            rows = json_rows(self.watch)
            if self.watch_seen is None and rows:
                self.watch_seen = time.time()
            interval = self.step_interval_s if 0 < rows < self.steps else self.interval_s
            if time.monotonic() - last >= interval:
                last = time.monotonic()
                if not self._sample():
                    return
                self.sampling_s += time.monotonic() - last
            self._done.wait(0.05)

    def _sample(self) -> bool:
        """One PSS sample of the process tree; False once the root has exited."""
        shares: dict[str, int] = {}
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                name = label(proc, self.root)
                shares[name] = shares.get(name, 0) + proc.memory_full_info().pss
        self.samples.append((time.time(), sum(shares.values())))
        if sum(shares.values()) > self.peak:
            self.peak, self.at_peak = sum(shares.values()), shares
        return True

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def peak_between(self, start: float, end: float) -> float:
        """The largest sum sampled in [start, end), GB."""
        return max((n for t, n in self.samples if start <= t < end), default=0) / 1024**3


def json_rows(path: Path) -> int:
    """The JSON rows (lines starting with "{") a run has written to `path` so far."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.startswith(b"{"))


def label(proc: psutil.Process, root: psutil.Process) -> str:
    """A process's part in a run: the trainer, SGLang's processes by their titles, a fork of
    the trainer (a background checkpoint writer), or another helper by its module."""
    if proc.pid == root.pid:
        return "trainer"
    cmdline = proc.cmdline()
    if not cmdline:  # exited, not yet reaped
        return "other: exited"
    if cmdline[0].startswith("sglang::"):
        return cmdline[0].split()[0]
    if "sglang.launch_server" in " ".join(cmdline):  # held launches: one titled string
        return "sglang::http"
    if cmdline == root.cmdline():
        return "trainer fork (checkpoint writer)"
    module = next((a for a in cmdline[1:] if not a.startswith("-")), "")
    return f"other: {Path(module).name or cmdline[0]}"


def run_side(args, cmd: list[str], log: Path, watch: Path) -> tuple[float, float, PeakPSS]:
    """Run `cmd` (stdout to `log`; a JSON row to `watch` after each step); (launch wall time,
    seconds to its exit, its PeakPSS)."""
    launched = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        pss = PeakPSS(proc.pid, args.pss_interval, watch, args.steps, args.pss_step_interval)
        code = proc.wait()
        wall = time.time() - launched
        pss.stop()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({code}); see {log}")
    return launched, wall, pss


def outside_steps(launched: float, wall: float, rows: list[dict], startup: float, pss) -> dict:
    """The seconds of a run spent outside its steps: in all, before the first (start-up) and
    after the last (teardown, the final checkpoint included); the peak PSS (GB) during the
    steps and during the teardown."""
    steps = sum(r["timing_s/step"] for r in rows)
    first, last = launched + startup, launched + startup + steps
    return {
        "startup_s": startup,
        "teardown_s": wall - steps - startup,
        "outside_steps_s": wall - steps,
        "peak_pss_steps_gb": pss.peak_between(first, last),
        "peak_pss_teardown_gb": pss.peak_between(last, launched + wall + 1),
        "pss_sampling_core_share": pss.sampling_s / wall,
    }


def medians(rows: list[dict]) -> dict[str, float]:
    timed = rows[1:] if len(rows) > 1 else rows  # the first step warms up
    keys = [f"timing_s/{s}" for s in STAGES if f"timing_s/{s}" in timed[0]]
    return {k: statistics.median(r[k] for r in timed) for k in keys}


def rlhf_arguments(args, model: Path, train: Path, run_dir: Path) -> list[str]:
    """`rlhf-train`'s arguments for this benchmark's step shape (`benchmarks/forward_passes.py`
    runs the same)."""
    micro = args.micro_batch or args.prompts * args.n  # the old-log-prob, ref passes follow
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        "data.val_files=null",
        f"data.train_batch_size={args.prompts}",
        f"data.max_response_length={args.response}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"critic.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"critic.ppo_micro_batch_size_per_gpu={micro}",
        "trainer.save_freq=-1",
        *args.overrides,
    ]
    return ["--config", str(REPO / "configs" / "quickstart_cpu.yaml"), *overrides]


def rlhf_side(args, model: Path, train: Path, root: Path) -> dict:
    run_dir = root / "rlhf_run"
    cmd = [sys.executable, "-m", "rlhf.cli.train", *rlhf_arguments(args, model, train, run_dir)]
    metrics = run_dir / "metrics.jsonl"
    launched, wall, pss = run_side(args, cmd, root / "rlhf.log", watch=metrics)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert pss.watch_seen is not None and rows[0]["step"] == 1
    # the first row is written when step 1 ends (the file is watched every 0.05 s)
    first_start = pss.watch_seen - rows[0]["timing_s/step"]
    return {
        "median_s": medians(rows),
        **outside_steps(launched, wall, rows, first_start - launched, pss),
        "peak_pss_gb": pss.peak / 1024**3,
        "pss_at_peak_gb": {k: v / 1024**3 for k, v in sorted(pss.at_peak.items())},
        "tokens": statistics.median(r["perf/total_num_tokens"] for r in rows),
    }


def plain_side(args, model: Path, train: Path, root: Path) -> dict:
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / YARDSTICKS[args.yardstick]),
        str(model),
        str(train),
        "--steps",
        str(args.steps),
        "--prompts",
        str(args.prompts),
        "--n",
        str(args.n),
        "--response",
        str(args.response),
    ]
    launched, wall, pss = run_side(args, cmd, root / "plain.log", watch=root / "plain.log")
    lines = (root / "plain.log").read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.startswith("{")]
    return {
        "median_s": medians(rows),
        **outside_steps(launched, wall, rows, rows[0]["t_start"] - launched, pss),
        "peak_pss_gb": pss.peak / 1024**3,
        "tokens": statistics.median(r["tokens"] for r in rows),
    }


def compute_floor_s(model: Path, tokens: float, samples: int) -> tuple[float, float]:
    """(seconds, FLOPs) of the step's model FLOPs at this run's measured fp32 matmul rate."""
    import torch

    from rlhf.models.families import load_arch
    from rlhf.trainer.metrics import measure_matmul_flops, ppo_step_flops

    arch = load_arch(model)
    # forward-only: generation (one forward per token), old log-probs, reference, values;
    # updates: actor and critic, one epoch each
    flops = ppo_step_flops(arch, int(tokens), tokens / samples, 4, 2)
    return flops / measure_matmul_flops(torch.device("cpu"), torch.float32), flops


def one_round(args, model: Path, train: Path, root: Path, plain_first: bool) -> dict:
    """Both sides, one after the other, in `root`: {"rlhf": ..., "plain": ...}."""
    root.mkdir(parents=True, exist_ok=True)
    sides = {"rlhf": rlhf_side, "plain": plain_side}
    order = ["plain", "rlhf"] if plain_first else ["rlhf", "plain"]
    done = {name: sides[name](args, model, train, root) for name in order}
    return {"rlhf": done["rlhf"], "plain": done["plain"]}


def ratios(result: dict) -> dict:
    """rlhf / plain of one round: the step, each stage both sides time, training (the
    updates, advantages and rlhf's weight sync, which the plain loop has none of), outside
    the steps."""
    rlhf, plain = result["rlhf"]["median_s"], result["plain"]["median_s"]
    training = [f"timing_s/{s}" for s in TRAINING]
    return {
        "step_ratio": rlhf["timing_s/step"] / plain["timing_s/step"],
        "stages": {k[len("timing_s/") :]: rlhf[k] / plain[k] for k in rlhf if k in plain},
        "training_ratio": sum(rlhf.get(k, 0.0) for k in training)
        / sum(plain.get(k, 0.0) for k in training),
        "update_weights_s": rlhf.get("timing_s/update_weights"),
        "outside_steps_ratio": result["rlhf"]["outside_steps_s"]
        / result["plain"]["outside_steps_s"],
    }


def step_inputs(args, root: Path) -> tuple[Path, Path]:
    """This benchmark's model (a tiny Qwen2 of `--hidden` x `--layers`) and training prompts
    under `root` (`benchmarks/forward_passes.py` uses the same)."""
    from rlhf.quickstart.data import write_quickstart_data
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    model = save_tiny_model(root / "model", TinyModelSpec.scaled(args.hidden, args.layers))
    train, _ = write_quickstart_data(root / "data", num_train=256, num_val=8)
    return model, train


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        if root.exists() and any(root.iterdir()):  # a run there would resume, not measure
            sys.exit(f"ppo_vs_plain: --out {root} is not empty; name a new directory")
        root.mkdir(parents=True, exist_ok=True)
        model, train = step_inputs(args, root)
        rounds = [
            one_round(
                args, model, train, root / f"round{i}" if args.rounds > 1 else root, i % 2 == 1
            )
            for i in range(args.rounds)
        ]
        summaries = [ratios(r) for r in rounds]
        by_step = sorted(range(len(rounds)), key=lambda i: summaries[i]["step_ratio"])
        median = by_step[len(rounds) // 2]
        rlhf, plain = rounds[median]["rlhf"], rounds[median]["plain"]
        floor_s, flops = compute_floor_s(model, rlhf["tokens"], args.prompts * args.n)
    step = {"rlhf": rlhf["median_s"]["timing_s/step"], "plain": plain["median_s"]["timing_s/step"]}
    print(
        json.dumps(
            {
                "setup": {
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "prompts": args.prompts,
                    "n": args.n,
                    "response": args.response,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "yardstick": args.yardstick,
                    "pss_interval_s": args.pss_interval,
                    "pss_step_interval_s": args.pss_step_interval,
                },
                "rlhf": rlhf,
                "plain": plain,
                "step_ratio": step["rlhf"] / step["plain"],
                "startup_ratio": rlhf["startup_s"] / plain["startup_s"],
                "outside_steps_ratio": rlhf["outside_steps_s"] / plain["outside_steps_s"],
                "training_ratio": summaries[median]["training_ratio"],
                "rounds": summaries,
                "compute_floor": {
                    "step_flops": flops,
                    "floor_s": floor_s,
                    "rlhf_x_floor": step["rlhf"] / floor_s,
                    "plain_x_floor": step["plain"] / floor_s,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
