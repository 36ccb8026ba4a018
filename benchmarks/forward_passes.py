"""The trainer's forward-only passes against transformers' forward, in the trainer's process.

    python benchmarks/forward_passes.py [--steps 10 --hidden 256 --layers 3 --prompts 16 --n 2]

Runs `rlhf-train` at `ppo_vs_plain.py`'s step shape (its tiny Qwen2, the quickstart's
problems, its overrides: each pass over the whole batch in one micro-batch) with the
engine's forward-only passes wrapped: right after each old-log-prob, reference and values
pass, transformers runs a forward over the same sequences, right-padded in one batch, in the
same process at the same point of the step: `plain_ppo.py`'s own passes,
`AutoModelForCausalLM` and the log-softmax of the next tokens beside the log-prob passes,
`AutoModelForTokenClassification` (one label) beside the values pass, from the model's
initial weights (what a forward costs does not depend on them), with the CPU compatibility
layer's function mode paused: a plain loop's own process has none. rlhf's side is the
engine's whole call (`PPOEngine.logprobs`, `.values`: planning, Megatron's forward, the
head, the gather). The transformers forwards add to the run's steps; its other timings are
not this benchmark's.

Prints one JSON object: per pass the medians of both sides' seconds (steps 2 on) and
their ratio.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.machinery
import json
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PASSES = ("old_log_prob", "ref", "values")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps of the run (1 warm-up)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument(
        "--micro-batch", type=int, help="rlhf's samples per micro-batch (default: all)"
    )
    parser.add_argument("overrides", nargs="*", help="extra rlhf-train overrides (key=value)")
    return parser.parse_args()


class PlainForwards:
    """transformers' forwards over a step batch's sequences, timed (models load at first)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.models: dict = {}

    def model(self, kind: str):
        if kind not in self.models:
            import torch
            from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

            auto = AutoModelForCausalLM if kind == "policy" else AutoModelForTokenClassification
            extra = {} if kind == "policy" else {"num_labels": 1}
            loaded = auto.from_pretrained(self.model_dir, dtype=torch.float32, **extra)
            self.models[kind] = loaded.eval()
        return self.models[kind]

    def seconds(self, batch, kind: str) -> float:
        """The plain loop's pass (`plain_ppo.logprobs` or `.values_of`) over `batch`."""
        import torch
        from plain_ppo import logprobs, padded, values_of

        from rlhf.distributed import cpu_compat

        tokens, attention, _ = padded(batch.prompt_ids, batch.response_ids, pad=0)
        model, run = self.model(kind), logprobs if kind == "policy" else values_of
        with torch.no_grad(), cpu_compat.paused():
            start = time.perf_counter()
            run(model, tokens, attention)
            return time.perf_counter() - start


def timed_pass(method, name_of, plain: PlainForwards, out: Path):
    """`method` (PPOEngine.logprobs or .values) timed, each call followed by the plain forward
    over its batch; one JSON line per call to `out` under the pass's name (`name_of` the
    call's further arguments)."""

    @functools.wraps(method)
    def call(engine, batch, *args, **kwargs):
        start = time.perf_counter()
        result = method(engine, batch, *args, **kwargs)
        ours = time.perf_counter() - start
        name = name_of(*args, **kwargs)
        theirs = plain.seconds(batch, "critic" if name == "values" else "policy")
        with out.open("a") as rows:
            rows.write(json.dumps({"pass": name, "rlhf": ours, "transformers": theirs}) + "\n")
        return result

    return call


def log_prob_pass(role: str = "actor") -> str:
    return {"actor": "old_log_prob", "ref": "ref"}[role]


class WrapEngine(importlib.abc.MetaPathFinder):
    """Wraps the engine's passes as `rlhf.engine.engine` is imported inside the trainer (after
    `rlhf-train` set up the process: its OpenMP and malloc settings precede torch's import)."""

    def __init__(self, plain: PlainForwards, out: Path):
        self.plain, self.out = plain, out

    def find_spec(self, name, path, target=None):
        if name != "rlhf.engine.engine":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        assert spec is not None and spec.loader is not None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            engine = module.PPOEngine
            engine.logprobs = timed_pass(engine.logprobs, log_prob_pass, self.plain, self.out)
            engine.values = timed_pass(engine.values, lambda: "values", self.plain, self.out)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def in_trainer(out: str, model_dir: str, argv: list[str]) -> None:
    """This process as `rlhf-train argv`, its passes wrapped (`WrapEngine`)."""
    sys.meta_path.insert(0, WrapEngine(PlainForwards(model_dir), Path(out)))
    sys.argv = ["rlhf-train", *argv]
    runpy.run_module("rlhf.cli.train", run_name="__main__")


def report(rows: list[dict]) -> dict:
    """Per pass: the medians of both sides (the first step's call left out), their ratio."""
    result = {}
    for name in PASSES:
        calls = [row for row in rows if row["pass"] == name][1:]
        if not calls:
            sys.exit(f"forward_passes: no {name} pass timed after the first step")
        ours = statistics.median(row["rlhf"] for row in calls)
        theirs = statistics.median(row["transformers"] for row in calls)
        result[name] = {"rlhf_s": ours, "transformers_s": theirs, "ratio": ours / theirs}
    return result


def main() -> None:
    if sys.argv[1:2] == ["--in-trainer"]:
        in_trainer(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    args = parse_args()
    from ppo_vs_plain import rlhf_arguments, step_inputs

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, train = step_inputs(args, root)
        out = root / "passes.jsonl"
        argv = rlhf_arguments(args, model, train, root / "run")
        cmd = [sys.executable, __file__, "--in-trainer", str(out), str(model), *argv]
        with (root / "run.log").open("w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode:
            sys.exit(f"forward_passes: rlhf-train exited {done.returncode}:\n" + tail(root))
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(json.dumps({"setup": vars(args), "passes": report(rows)}, indent=2))


def tail(root: Path) -> str:
    return "\n".join((root / "run.log").read_text().splitlines()[-20:])


if __name__ == "__main__":
    main()
