"""`rlhf-eval`: a policy's mean@N, best@N and maj@N per data source, on SGLang.

    rlhf-eval MODEL --data FILE.parquet [FILE ...] [--n 4] [--config CFG] [key=value ...]

MODEL is an HF model directory or a trainer checkpoint: `global_step_N`, its `actor/`, or a
`checkpoints/` directory (its newest complete, intact step). A checkpoint's HF copy is used when
`trainer.save_hf` wrote one (`actor_hf/`); otherwise the actor is exported to a temporary
directory first (`rlhf-convert mcore-to-hf`). An SGLang server is started on the model, or
`--server-url` names a running one (MODEL then only gives the tokenizer). The config (the
defaults, or `--config` and overrides) gives the prompt length policy (`data.*`), rewards
(`reward.*`), sampling (`actor_rollout_ref.rollout.val_kwargs`, which --n, --temperature,
--top-p and --max-response-length set) and the server settings (`rollout.*`). Without
--data the config's `data.val_files` are used. Prints a table and writes JSON (--output).
Errors in the inputs exit 2 with one line; an unreachable server or reward endpoint exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rlhf.checkpoint.manager import find_latest
from rlhf.config import RLHFConfig, load_config
from rlhf.errors import UserError, ends_in_one_line
from rlhf.reward.remote import RemoteRewardError
from rlhf.reward.validation import per_source_table
from rlhf.rollout.client import GenerateError

log = logging.getLogger("rlhf.cli.eval")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf-eval", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="HF model directory or trainer checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (reward.url=...)")
    parser.add_argument("--data", nargs="+", help="Parquet files (default: data.val_files)")
    parser.add_argument("--config", help="YAML run config (default: the built-in defaults)")
    parser.add_argument("--n", type=int, help="responses per prompt (sampled when > 1)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    parser.add_argument("--max-response-length", type=int, help="tokens per response")
    parser.add_argument("--server-url", help="a running SGLang server serving MODEL")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts sent at a time")
    parser.add_argument("--output", type=Path, default=Path("eval_results.json"))
    parser.add_argument("--samples", type=Path, help="also write every response as JSONL here")
    return parser.parse_args(argv)


def eval_config(args: argparse.Namespace) -> RLHFConfig:
    """The config with the command's shortcuts applied as overrides."""
    kw = "actor_rollout_ref.rollout.val_kwargs"
    shortcuts = []
    if args.n is not None:
        shortcuts += [f"{kw}.n={args.n}", f"{kw}.do_sample={str(args.n > 1).lower()}"]
    if args.temperature is not None:
        sample = str(args.temperature > 0).lower()
        shortcuts += [f"{kw}.temperature={args.temperature}", f"{kw}.do_sample={sample}"]
    if args.top_p is not None:
        shortcuts.append(f"{kw}.top_p={args.top_p}")
    if args.max_response_length is not None:
        shortcuts.append(f"data.max_response_length={args.max_response_length}")
    if args.server_url:
        shortcuts.append(f"actor_rollout_ref.rollout.server_urls=[{args.server_url}]")
    return load_config(args.config, [*shortcuts, *args.overrides])


def policy_hf_dir(model: Path, scratch: Path) -> Path:
    """An HF directory of the policy MODEL names (exported into `scratch` when needed)."""
    if not model.exists():
        raise FileNotFoundError(f"model not found: {model}")
    latest = find_latest(model)  # a checkpoints/ directory: its newest intact step
    if latest is not None:
        model = latest
    if (model / "actor").is_dir():
        model = model / "actor"
    if (model / "rlhf_checkpoint.json").is_file():
        if model.name == "critic":
            raise ValueError(f"{model} is a critic (a value model), not a policy")
        saved = model.parent / "actor_hf"
        if (saved / "config.json").is_file():
            return saved
        from rlhf.trainer.export import export_hf  # imports Megatron: only when needed

        log.info("exporting %s to HF (set trainer.save_hf to keep one per checkpoint)", model)
        export_hf(model, scratch / "hf")
        return scratch / "hf"
    if (model / "config.json").is_file():
        return model
    raise FileNotFoundError(
        f"{model} is neither an HF model directory (config.json) nor a trainer checkpoint "
        "(global_step_N, its actor/ or a checkpoints/ directory)"
    )


STAT_ORDER = ("mean", "best", "maj")


def format_table(table: dict[str, dict[str, float]], prompts: dict[str, int]) -> str:
    """One row per data source: its prompts and mean@N, best@N, maj@N."""
    names = {s for row in table.values() for s in row}
    stats = sorted(names, key=lambda s: STAT_ORDER.index(s.split("@")[0]))
    width = max(len("data_source"), *(len(s) for s in table))
    lines = [f"{'data_source':<{width}}  {'prompts':>7}" + "".join(f"  {s:>8}" for s in stats)]
    for source, row in sorted(table.items()):
        cells = "".join(f"  {row[s]:>8.3f}" if s in row else f"  {'-':>8}" for s in stats)
        lines.append(f"{source:<{width}}  {prompts[source]:>7}" + cells)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """The evaluation the command line asks for (`evaluate`), its table and JSON."""
    import torch

    from rlhf.rollout.batch import write_records
    from rlhf.rollout.evaluation import evaluate

    cfg = eval_config(args)
    data = args.data or cfg.data.val_files
    if not data:
        raise UserError("no data: pass --data FILE.parquet or set data.val_files")
    data_files = [data] if isinstance(data, str) else list(data)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log_dir = args.output.parent / f"{args.output.stem}_logs"  # the servers' logs
    with tempfile.TemporaryDirectory(prefix="rlhf_eval_") as scratch:
        hf_dir = policy_hf_dir(args.model, Path(scratch))
        result = evaluate(
            cfg,
            hf_dir,
            data_files,
            device=device,
            log_dir=log_dir,
            batch_size=args.batch_size,
        )
    kw = cfg.actor_rollout_ref.rollout.val_kwargs
    table = per_source_table(result.metrics)
    sampling = {
        "do_sample": kw.do_sample,
        "temperature": kw.temperature,
        "top_p": kw.top_p,
        "top_k": kw.top_k,
        "max_response_length": cfg.data.max_response_length,
    }
    report = {
        "model": str(args.model),
        "data_files": data_files,
        "n": kw.n,
        "sampling": sampling,
        "prompts": result.prompts_per_source,
        "per_source": table,
        "metrics": result.metrics,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    if args.samples:
        write_records(result.records, args.samples)
    print(format_table(table, result.prompts_per_source))
    print(f"wrote {args.output}")
    return report


def exit_code(prog: str, body: Callable[[], object]) -> int:
    """`body()` as a command that generates on SGLang (rlhf-eval, rlhf-rollout): 0; bad
    inputs one line and 2; an unreachable server or reward endpoint one line and 1."""
    try:
        body()
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (GenerateError, TimeoutError, ConnectionError, RemoteRewardError, RuntimeError) as e:
        print(f"{prog}: failed: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    return exit_code("rlhf-eval", lambda: run(args))


main = ends_in_one_line("rlhf-eval")(main)  # rlhf.errors: one line, exit 2 or 1


if __name__ == "__main__":
    sys.exit(main())
