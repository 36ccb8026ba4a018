"""Seconds per step of the quickstart warm start, alone and while other processes keep every
core busy, for each torch thread count.

    python benchmarks/warm_start.py [--steps 150 --threads 1,2]

The warm start (`rlhf.quickstart.warm_start`) runs inside the quickstart and the learning
tests, often next to an SGLang server or another run. A torch CPU op with more threads than
free cores waits at every barrier for a thread that is not running, so its time depends on the
load far more than on the work. Each case trains a fresh tiny model for `--steps` steps of
the default recipe (the schedule shortened to that many steps). The load is one busy Python
loop per core, in separate processes. Prints one JSON object: per case, wall seconds and
milliseconds per step; `loaded_over_alone` per thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

from rlhf.quickstart.tiny_model import save_tiny_model
from rlhf.quickstart.warm_start import WarmStartConfig, warm_start


def busy_processes(count: int) -> list[subprocess.Popen]:
    """`count` processes that each spin one core until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def timed_warm_start(steps: int, threads: int) -> float:
    """Wall seconds of the training loop of a `steps`-step warm start on `threads` threads."""
    cfg = replace(WarmStartConfig(), num_steps=steps, warmup_steps=min(30, steps // 5))
    cfg = replace(cfg, num_threads=threads)
    with tempfile.TemporaryDirectory() as tmp:
        return warm_start(save_tiny_model(tmp), cfg).seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--busy", type=int, default=os.cpu_count(), help="busy processes")
    args = parser.parse_args()
    cases, ratios = [], {}
    for threads in [int(t) for t in args.threads.split(",")]:
        alone = timed_warm_start(args.steps, threads)
        load = busy_processes(args.busy)
        try:
            loaded = timed_warm_start(args.steps, threads)
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
        for name, seconds in (("alone", alone), ("loaded", loaded)):
            cases.append(
                {
                    "threads": threads,
                    "load": name,
                    "seconds": round(seconds, 2),
                    "ms_per_step": round(1000 * seconds / args.steps, 1),
                }
            )
        ratios[str(threads)] = round(loaded / alone, 2)
    report = {
        "benchmark": "warm_start",
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "busy_processes": args.busy,
        "cases": cases,
        "loaded_over_alone": ratios,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
