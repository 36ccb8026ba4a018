"""Synchronous vs one-step-off vs asynchronous rollout, the same run in each mode.

    python benchmarks/async_vs_sync.py [--steps 8 --runs 3 --response-length 64 --staleness 1]

One SGLang CPU server (`python -m rlhf.cli.launch_servers`) is pinned to core 0 and every
`rlhf-train` run to core 1 (`taskset`), as a disaggregated server and trainer would hold
separate GPUs; with fewer than 2 cores nothing is pinned and the output says so. Each run is
GRPO on the quickstart's problems with a tiny random Qwen2 (its responses run to the length
limit, so generation is a real share of the step), the same prompts, samples and settings in
every mode, `trainer.rollout_mode` aside (truncated importance sampling on in all three).
Runs alternate between the modes, `--runs` times.

Per run, over steps 2.. (step 1 has nothing ahead in any mode): steps/s (steps over the sum of
their `timing_s/step`), generated tokens/s (their responses' tokens over the same time), the
fraction of that time in which the server generated while the trainer worked
(`async/overlap_s`: 0 for sync, whose generation is inside the step) and the mean staleness.
Prints one JSON object: every run, the median per mode, and each mode's median steps/s over
sync's (`speedup`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "one_step_off", "async")
KEY = "benchmark-async-vs-sync"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--staleness", type=int, default=1, help="async max_staleness")
    p.add_argument("--port", type=int, default=31500)
    return p.parse_args(argv)


def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if (os.cpu_count() or 1) >= 2 else []


def start_server(model: Path, port: int, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """The launcher on core 0; returns it and the URL once it announces the server."""
    command = [sys.executable, "-m", "rlhf.cli.launch_servers", "--model", str(model)]
    command += ["--device", "cpu", "--base-port", str(port), "--log-dir", str(log_dir)]
    command += ["--max-total-tokens", "32768"]
    proc = subprocess.Popen(
        pinned(0) + command, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("http://"):
            return proc, line.strip()
    raise RuntimeError(f"the server launcher exited with {proc.wait()} before announcing a URL")


def train(mode: str, run_dir: Path, args: argparse.Namespace, model: Path, data: Path, url: str):
    """One `rlhf-train` run in `mode` on core 1; its metrics rows by step."""
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.rollout.server_urls=[{url}]",
        "algorithm.rollout_correction.rollout_is=token",
        f"trainer.rollout_mode={mode}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[console]",
    ]
    if mode == "async":
        overrides.append(f"trainer.async_rollout.max_staleness={args.staleness}")
    config = REPO / "configs" / "quickstart_grpo_cpu.yaml"
    command = [sys.executable, "-m", "rlhf.cli.train", "--config", str(config), *overrides]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        code = subprocess.call(pinned(1) + command, stdout=out, stderr=subprocess.STDOUT)
    if code:
        raise RuntimeError(f"{mode} run failed ({code}); see {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): r for r in rows if "timing_s/step" in r}


def summarise(rows: dict[int, dict], run_dir: Path) -> dict[str, float]:
    """steps/s, tokens/s, both-busy fraction and staleness over steps 2.."""
    steps = [s for s in sorted(rows) if s >= 2]
    seconds = sum(rows[s]["timing_s/step"] for s in steps)
    tokens = 0
    for s in steps:
        lines = (run_dir / "rollouts" / f"step_{s}.jsonl").read_text().splitlines()
        tokens += sum(len(json.loads(line)["response_ids"]) for line in lines)
    overlap = sum(rows[s].get("async/overlap_s", 0.0) for s in steps)
    staleness = [rows[s].get("async/staleness_mean", 0.0) for s in steps]
    return {
        "steps_per_s": len(steps) / seconds,
        "tokens_per_s": tokens / seconds,
        "both_busy_fraction": overlap / seconds,
        "staleness_mean": statistics.mean(staleness),
        "wait_s_per_step": statistics.mean(rows[s].get("async/wait_s", 0.0) for s in steps),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("RLHF_SGLANG_API_KEY", KEY)
    from rlhf.quickstart.data import write_quickstart_data
    from rlhf.quickstart.tiny_model import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="async_vs_sync_") as tmp:
        root = Path(tmp)
        model = save_tiny_model(root / "model")
        write_quickstart_data(root / "data", num_train=256, num_val=8)
        server, url = start_server(model, args.port, root / "logs")
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        try:
            for i in range(args.runs):
                for mode in MODES:
                    run_dir = root / f"{mode}_{i}"
                    start = time.perf_counter()
                    rows = train(mode, run_dir, args, model, root / "data", url)
                    summary = summarise(rows, run_dir)
                    summary["wall_s"] = time.perf_counter() - start
                    runs[mode].append(summary)
        finally:
            server.terminate()
            server.wait(timeout=60)
    median = {
        mode: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for mode, results in runs.items()
    }
    base = median["sync"]["steps_per_s"]
    print(
        json.dumps(
            {
                "pinned": bool(pinned(0)),
                "steps": args.steps,
                "response_length": args.response_length,
                "max_staleness": args.staleness,
                "runs": runs,
                "median": median,
                "speedup": {mode: median[mode]["steps_per_s"] / base for mode in MODES},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
