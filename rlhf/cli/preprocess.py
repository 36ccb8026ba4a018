"""rlhf-preprocess: check prompt Parquet files, convert GSM8K, MATH-500, DAPO-Math and AIME,
write the quickstart data.

    rlhf-preprocess check FILE... [--prompt_key prompt] [--custom_fn path/to/file.py:function]
                                  [--images]   # rows with images, for a vision-language policy
    rlhf-preprocess gsm8k --input DIR_OR_FILE --local_dir OUT
    rlhf-preprocess math500 --input test.jsonl --local_dir OUT          # -> OUT/test.parquet
    rlhf-preprocess dapo-math --input dapo-math-17k.parquet --local_dir OUT  # -> train.parquet
    rlhf-preprocess aime --input FILE... --local_dir OUT [--data_source aime24]  # -> test
    rlhf-preprocess quickstart --local_dir OUT [--num_train 256] [--num_val 64] [--seed 0]
    rlhf-preprocess quickstart-tools --local_dir OUT [--num_train 256] [--num_val 64] [--seed 0]
    rlhf-preprocess quickstart-vlm --local_dir OUT [--num_train 256] [--num_val 64] [--seed 0]
    rlhf-preprocess geo3k --input RELEASE_DIR_OR_FILES --local_dir OUT  # -> <split>.parquet
    rlhf-preprocess quickstart-rm --local_dir OUT [--num_pairs 2048] [--num_val_pairs 256]

`check` runs the loader's validation: for each file it prints the rows and data sources and
exits 0, or prints every problem (file, row, column, what is wrong) and exits 1. FILE may be
a path, a glob or a URI. Like training startup it checks each rule row against the built-in
rule rewards (a known data_source, a ground truth its rule can score); `--custom_fn`, the
run's `reward.custom_fn`, is imported and then accepts any data source and ground truth.
`gsm8k`, `math500`, `dapo-math` and `aime` work offline on the public releases' files (jsonl
or Parquet; rlhf/data/gsm8k.py and rlhf/data/math_sets.py name the formats). Errors in the
inputs of a conversion, or a `--custom_fn` that does not load, print one line and exit 2.
`quickstart-tools` writes the tool-use quickstart's multiplication problems and, next to them,
the tool config file listing the calculator (rlhf/quickstart/calculator_task.py).
`quickstart-rm` writes the reward-model quickstart's preference pairs and its PPO prompts
(rlhf/quickstart/preferences.py).
"""

from __future__ import annotations

import argparse
import sys

from rlhf.data.geo3k import preprocess_geo3k
from rlhf.data.gsm8k import preprocess_gsm8k
from rlhf.data.math_sets import MATH_SETS, preprocess_math
from rlhf.data.parquet import FileReport, GroundTruthCheck, Problem, check_files
from rlhf.errors import UserError, ends_in_one_line
from rlhf.quickstart.data import write_quickstart_data, write_tools_quickstart_data
from rlhf.quickstart.preferences import write_reward_quickstart_data
from rlhf.quickstart.shapes_task import make_shape_rows
from rlhf.reward import check_ground_truth, load_custom_fn
from rlhf.reward.math import last_boxed

_MATH_HELP = {
    "math500": "MATH-500 test.jsonl (or Parquet) -> test.parquet (HuggingFaceH4/MATH-500)",
    "dapo-math": "DAPO-Math-17k Parquet (verl schema or open-r1's Processed) -> train.parquet",
    "aime": "AIME jsonl/Parquet files (2024, 2025 releases) -> test.parquet",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf-preprocess", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate prompt Parquet files")
    check.add_argument("files", nargs="+", help="paths, globs or URIs")
    check.add_argument("--prompt_key", default="prompt", help="column holding the prompt")
    check.add_argument(
        "--images",
        action="store_true",
        help="the rows are for a vision-language policy: read and check their images",
    )
    check.add_argument(
        "--custom_fn",
        help="the run's reward.custom_fn (path/to/file.py:function; imported, i.e. run): it "
        "decides which data sources and ground truths it scores, so they are not checked",
    )
    gsm8k = sub.add_parser("gsm8k", help="GSM8K release -> train/test Parquet in our schema")
    gsm8k.add_argument("--input", required=True, help="GSM8K directory or one train/test file")
    gsm8k.add_argument("--local_dir", required=True, help="output directory")
    for command, help_text in _MATH_HELP.items():
        math_cmd = sub.add_parser(command, help=help_text)
        math_cmd.add_argument("--input", required=True, nargs="+", help="the release's file(s)")
        math_cmd.add_argument("--local_dir", required=True, help="output directory")
        if command == "aime":
            math_cmd.add_argument(
                "--data_source",
                default=MATH_SETS["aime"].data_source,
                help="the rows' data_source, starting with 'aime' (aime24, aime25: one "
                "validation metric each)",
            )
    geo3k = sub.add_parser(
        "geo3k", help="Geometry3K Parquet release (hiyouga/geometry3k) -> <split>.parquet"
    )
    geo3k.add_argument("--input", required=True, nargs="+", help="the release's files or folder")
    geo3k.add_argument("--local_dir", required=True, help="output directory")
    quick = sub.add_parser("quickstart", help="write the arithmetic train/val Parquet files")
    vlm = sub.add_parser(
        "quickstart-vlm", help="write the vision quickstart's pictures (count the squares)"
    )
    tools = sub.add_parser(
        "quickstart-tools",
        help="write the tool-use quickstart's train/val Parquet files and calculator config",
    )
    for quick_cmd in (quick, tools, vlm):
        quick_cmd.add_argument("--local_dir", required=True, help="output directory")
        quick_cmd.add_argument("--num_train", type=int, default=256)
        quick_cmd.add_argument("--num_val", type=int, default=64)
        quick_cmd.add_argument("--seed", type=int, default=0)
    rm = sub.add_parser(
        "quickstart-rm",
        help="write the reward-model quickstart's preference pairs and PPO prompts",
    )
    rm.add_argument("--local_dir", required=True, help="output directory")
    rm.add_argument("--num_pairs", type=int, default=2048)
    rm.add_argument("--num_val_pairs", type=int, default=256)
    return parser.parse_args(argv)


def _reports(
    spec: str, prompt_key: str, check: GroundTruthCheck | None, images: bool
) -> list[FileReport]:
    try:
        return check_files(
            spec, prompt_key, key="FILE", check_ground_truth=check, takes_images=images
        )
    except (FileNotFoundError, ValueError) as e:
        message = str(e).removeprefix("FILE: ")
        return [FileReport(spec, problems=[Problem(spec, None, None, message)])]


def run_check(
    files: list[str], prompt_key: str, custom_fn: str | None = None, images: bool = False
) -> int:
    check: GroundTruthCheck | None = check_ground_truth
    if custom_fn:
        try:
            load_custom_fn(custom_fn)
        except ValueError as e:  # rlhf.reward.registry's: the user's file does not load
            raise UserError(str(e)) from e
        check = None
    reports = [r for spec in files for r in _reports(spec, prompt_key, check, images)]
    problems = [p for r in reports for p in r.problems]
    for report in reports:
        if not report.problems:
            sources = ", ".join(f"{s} ({n})" for s, n in sorted(report.data_sources.items()))
            print(f"{report.file}: {report.num_rows} rows; data sources: {sources}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        bad = len({p.file for p in problems})
        print(f"{len(problems)} problem(s) in {bad} of {len(reports)} file(s)", file=sys.stderr)
        return 1
    return 0


def _preprocess_math(args: argparse.Namespace) -> dict:
    data_source = getattr(args, "data_source", None)
    if data_source is not None and not data_source.startswith("aime"):
        raise UserError(
            f"--data_source {data_source!r} must start with 'aime' (the AIME reward rule)"
        )
    return preprocess_math(args.command, args.input, args.local_dir, last_boxed, data_source)


def _write_tools_quickstart(args: argparse.Namespace) -> dict:
    train, val, tool_config = write_tools_quickstart_data(
        args.local_dir, args.num_train, args.num_val, args.seed
    )
    print(f"wrote tool config: {tool_config}")
    return {"train": (train, args.num_train), "val": (val, args.num_val)}


@ends_in_one_line("rlhf-preprocess")  # bad inputs: one line, exit 2
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "check":
        return run_check(args.files, args.prompt_key, args.custom_fn, args.images)
    try:
        if args.command == "gsm8k":
            written = preprocess_gsm8k(args.input, args.local_dir)
        elif args.command in MATH_SETS:
            written = _preprocess_math(args)
        elif args.command == "geo3k":
            written = preprocess_geo3k(args.input, args.local_dir)
        elif args.command == "quickstart-vlm":
            paths = write_quickstart_data(
                args.local_dir, args.num_train, args.num_val, args.seed, make_shape_rows
            )
            written = {"train": (paths[0], args.num_train), "val": (paths[1], args.num_val)}
        elif args.command == "quickstart-tools":
            written = _write_tools_quickstart(args)
        elif args.command == "quickstart-rm":
            written = write_reward_quickstart_data(
                args.local_dir, args.num_pairs, args.num_val_pairs
            )
        else:
            paths = write_quickstart_data(args.local_dir, args.num_train, args.num_val, args.seed)
            written = {"train": (paths[0], args.num_train), "val": (paths[1], args.num_val)}
    except ValueError as e:  # the converters' (rlhf.data, rlhf.quickstart): bad input files
        raise UserError(str(e)) from e
    for split, (path, rows) in written.items():
        print(f"wrote {split}: {path} ({rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
