"""Write a tiny random HF model + tokenizer to a directory (no hub access needed).

    rlhf-make-tiny-model OUT_DIR [--family qwen2] [--seed 0] [--force] [--warm-start]

--family qwen3_moe builds the tiny mixture-of-experts model of `make quickstart-moe` (8
experts, top-2; rlhf/quickstart/tiny_model.py, TinyMoESpec).

Skips the work when OUT_DIR already holds a model, unless --force is given.
--warm-start then fine-tunes the model into a weak arithmetic "base model" (right format,
correct about a third of the time; see rlhf/quickstart/warm_start.py), which the CPU quickstart
needs for PPO to have any reward to learn from. It takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rlhf.quickstart.tiny_model import FAMILIES, TinyModelSpec, save_tiny_model

WARM_START_MARKER = "warm_start.json"  # written last: its presence means the warm start finished


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="fine-tune it into a weak arithmetic base model (rlhf.quickstart.warm_start)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    marker = out / WARM_START_MARKER
    if (out / "config.json").is_file() and not args.force:
        if not args.warm_start or marker.is_file():
            print(f"tiny model already present in {out}")
            return 0
        print(f"{out} holds a model that was not warm-started (no {marker.name}); rebuilding it")
    save_tiny_model(out, TinyModelSpec.for_family(args.family, args.seed))
    print(f"wrote tiny {args.family} model and tokenizer to {out}")
    if args.warm_start:
        from rlhf.quickstart.warm_start import warm_start

        result = warm_start(out)
        marker.write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
        summary = (
            f"warm start: {result.num_steps} steps in {result.seconds:.1f}s, final loss "
            f"{result.final_loss:.4f} (target entropy {result.target_entropy:.4f})"
        )
        if result.final_load_balancing_loss is not None:
            summary += f", load balance {result.final_load_balancing_loss:.3f} (1: even)"
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
