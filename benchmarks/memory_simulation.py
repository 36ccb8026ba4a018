"""The memory planner against the memory simulation, per shipped GPU config and phase.

    python benchmarks/memory_simulation.py [--config configs/gsm8k_8gpu.yaml
        --model-shape configs/model_shapes/Qwen2.5-7B.json] [--gpu-memory-gb 80]
    python benchmarks/memory_simulation.py --store


For each shipped GPU config (or the one given), one rank's build and two training steps
run at the model's real shapes under fake tensors and a fake world
(`rlhf.trainer.memory_simulation`; a fresh process each, minutes on a CPU), and the bytes
each phase holds are set next to the planner's (`rlhf.memory.simulation_report`).
Prints one JSON object per config and phase: planned (the local layer spec, as
simulated), simulated (the trainer's tensors, plus SGLang, the sync's buffers and the
CUDA runtime from the planner), their ratio, and the planner's Transformer Engine plan.
Simulated, not run on a GPU. `--store` simulates every shipped config and writes the steps
to configs/model_shapes/simulated_memory.json, which a plain `rlhf-doctor --config C` of a
shipped config sets next to the planner (run it after changing a shipped config or shape,
or the trainer's memory).
"""

from __future__ import annotations

import argparse
import json

from rlhf.cli.doctor_simulate import (
    GPU_GB,
    SHIPPED,
    STORED,
    compare_config,
    simulate_config,
    store_shipped,
)
from rlhf.trainer.memory_simulation import SimulatedStep


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="default: every shipped GPU config")
    parser.add_argument("--model-shape", help="the HF config.json of --config's model")
    parser.add_argument("--gpu-memory-gb", type=float, default=GPU_GB)
    parser.add_argument("--store", action="store_true", help=f"every shipped config, into {STORED}")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.store:
        stored = store_shipped()
        steps = {c: SimulatedStep.from_json(e["step"]) for c, e in stored.items()}
        results = {
            c: compare_config(c, SHIPPED[c], step, None, args.gpu_memory_gb).to_json()
            for c, step in steps.items()
        }
        print(
            json.dumps(
                {"benchmark": "memory_simulation", "stored": str(STORED), "configs": results}
            )
        )
        return
    if args.config is not None and args.model_shape is None and args.config not in SHIPPED:
        raise SystemExit("give --model-shape for a config that is not shipped")
    configs = {args.config: args.model_shape or SHIPPED[args.config]} if args.config else SHIPPED
    results = {
        config: simulate_config(config, shape, args.overrides, args.gpu_memory_gb).to_json()
        for config, shape in configs.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "memory_simulation",
                "gpu_memory_gb": args.gpu_memory_gb,
                "configs": results,
            }
        )
    )


if __name__ == "__main__":
    main()
