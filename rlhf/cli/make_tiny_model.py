"""Write a tiny random HF model + tokenizer to a directory (no hub access needed).

    rlhf-make-tiny-model OUT_DIR [--family qwen2] [--seed 0] [--force] [--warm-start] [--tools]

--family qwen3_moe builds the tiny mixture-of-experts model of `make quickstart-moe` (8
experts, top-2; rlhf/quickstart/tiny_model.py, TinyMoESpec).

Skips the work when OUT_DIR already holds a model, unless --force is given.
--warm-start then fine-tunes the model into a weak arithmetic "base model" (right format,
correct about a third of the time; see rlhf/quickstart/warm_start.py), which the CPU quickstart
needs for PPO to have any reward to learn from. It takes about a minute on 2 cores.

--family qwen2_5_vl builds the tiny vision-language model of `make quickstart-vlm` (a
Qwen2.5-VL with its processor; rlhf/quickstart/shapes_task.py); --warm-start then teaches it
to count the squares in a picture, right about 40% of the time (about a minute).

--tools builds the model of `make quickstart-tools` (a dense family): its tokenizer has merges
for tool calls and the tools prompt (rlhf/quickstart/calculator_task.py), and --warm-start
then teaches it to call the calculator about 30% of the time and answer alone otherwise
(rlhf/quickstart/tool_warm_start.py; under a minute on 2 cores). A directory that holds the
other kind of model is rebuilt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rlhf.errors import ends_in_one_line
from rlhf.quickstart.shapes_task import save_tiny_vlm, shapes_warm_start
from rlhf.quickstart.tiny_model import FAMILIES, MOE_FAMILIES, TinyModelSpec, save_tiny_model
from rlhf.tools.parser import OPEN

VLM_FAMILY = "qwen2_5_vl"
WARM_START_MARKER = "warm_start.json"  # written last: its presence means the warm start finished


@ends_in_one_line("rlhf-make-tiny-model")  # an unwritable OUT_DIR: one line, exit 2
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=(*FAMILIES, VLM_FAMILY), default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="fine-tune it into a weak arithmetic base model (rlhf.quickstart.warm_start)",
    )
    parser.add_argument(
        "--tools",
        action="store_true",
        help="the tool-use quickstart's model (rlhf.quickstart.calculator_task; with "
        "--warm-start: rlhf.quickstart.tool_warm_start)",
    )
    args = parser.parse_args(argv)
    if args.tools and args.family in (*MOE_FAMILIES, VLM_FAMILY):
        parser.error(f"--tools builds a dense text model, not {args.family}")
    out = Path(args.out_dir)
    marker = out / WARM_START_MARKER
    if (out / "config.json").is_file() and not args.force:
        if has_tools_tokenizer(out) != args.tools:
            print(
                f"{out} holds a model {'without' if args.tools else 'with'} --tools; rebuilding it"
            )
        elif not args.warm_start or marker.is_file():
            print(f"tiny model already present in {out}")
            return 0
        else:
            print(
                f"{out} holds a model that was not warm-started (no {marker.name}); rebuilding it"
            )
    marker.unlink(missing_ok=True)
    build_model(out, args.family, args.seed, args.tools)
    print(f"wrote tiny {args.family} model and tokenizer to {out}")
    if args.warm_start:
        result = run_warm_start(out, args.tools, args.family)
        marker.write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
        summary = (
            f"warm start: {result.num_steps} steps in {result.seconds:.1f}s, final loss "
            f"{result.final_loss:.4f} (target entropy {result.target_entropy:.4f})"
        )
        if result.final_load_balancing_loss is not None:
            summary += f", load balance {result.final_load_balancing_loss:.3f} (1: even)"
        print(summary)
    return 0


def has_tools_tokenizer(model_dir: Path) -> bool:
    """Whether the tokenizer in `model_dir` is the tools model's (`<tool_call>` is a token)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    added = json.loads(path.read_text()).get("added_tokens", [])
    return any(token.get("content") == OPEN for token in added)


def build_model(out: Path, family: str, seed: int, tools: bool) -> None:
    """The random tiny model of `family`, with the tools tokenizer if `tools`."""
    if family == VLM_FAMILY:
        save_tiny_vlm(out, seed)
        return
    spec = TinyModelSpec.for_family(family, seed)
    if not tools:
        save_tiny_model(out, spec)
        return
    from rlhf.quickstart.tools_tokenizer import build_tools_tokenizer

    save_tiny_model(out, spec, tokenizer=build_tools_tokenizer())


def run_warm_start(out: Path, tools: bool, family: str):
    """The quickstart's warm start of the model in `out`, or the tools or vision model's."""
    if family == VLM_FAMILY:
        return shapes_warm_start(out)
    if tools:
        from rlhf.quickstart.tool_warm_start import tool_warm_start

        return tool_warm_start(out)
    from rlhf.quickstart.warm_start import warm_start

    return warm_start(out)


if __name__ == "__main__":
    sys.exit(main())
