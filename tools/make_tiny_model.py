"""Write a tiny random HF model + tokenizer to a directory (no hub access needed).

    python tools/make_tiny_model.py OUT_DIR [--family qwen2] [--seed 0] [--force]

Skips the work when OUT_DIR already holds a model, unless --force is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf.models.tiny_hf import FAMILIES, TinyModelSpec, save_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if (out / "config.json").is_file() and not args.force:
        print(f"tiny model already present in {out}")
        return 0
    save_tiny_model(out, TinyModelSpec(family=args.family, seed=args.seed))
    print(f"wrote tiny {args.family} model and tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
