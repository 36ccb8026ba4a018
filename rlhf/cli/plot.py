"""rlhf-plot: one PNG of a run's reward, KL and loss curves, read from its metrics.jsonl.

    rlhf-plot RUN_DIR [--out PNG]        (default: RUN_DIR/metrics.png)

A look at a run where TensorBoard is not at hand: a headless node, a CI artifact, a bug
report. `metrics.jsonl` (written by `rlhf.logging.MetricTracker`) has one object per step;
validation is logged only every few steps, so each curve is drawn from the steps that have
its key, and a metric the run never logged is left out. A step logged twice (a resumed run
appends to the file) keeps its last value. Rendering uses matplotlib's Agg canvas: no
display, no pyplot state. A missing, empty or unreadable file exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlhf.errors import UserError, ends_in_one_line

SCORE_KEY = "critic/score/mean"
VAL_PREFIX = "val/test_score/"
KL_KEYS = ("actor/reward_kl_penalty", "actor/ppo_kl")
KL_COEF_KEY = "actor/reward_kl_penalty_coeff"
LOSS_KEYS = ("actor/pg_loss", "critic/vf_loss", "actor/entropy")

Row = Mapping[str, float]


class MetricsError(ValueError, UserError):
    """A metrics.jsonl that cannot be plotted: not JSON, no steps, none of the plotted keys."""


def read_rows(path: Path) -> list[dict[str, float]]:
    """The step objects of a metrics.jsonl file (blank lines skipped)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is RUN_DIR a run directory?)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsError(f"{path}:{number}: not JSON ({e.msg})") from e
        if not isinstance(row, dict) or "step" not in row:
            raise MetricsError(f"{path}:{number}: expected an object with a 'step' key")
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path}: empty, no steps to plot")
    return rows


def series(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have `key`, by step; a repeated step keeps its last."""
    by_step = {row["step"]: row[key] for row in rows if isinstance(row.get(key), int | float)}
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


Panel = tuple[str, list[str], list[str]]


def panels(rows: Sequence[Row]) -> list[Panel]:
    """(title, keys, keys on a twin y-axis) of each panel with at least one logged key."""
    logged = {key for row in rows for key, value in row.items() if isinstance(value, int | float)}
    val_keys = sorted(key for key in logged if key.startswith(VAL_PREFIX))
    layout = [
        ("reward", [SCORE_KEY, *val_keys], []),
        ("KL", list(KL_KEYS), [KL_COEF_KEY]),
        ("losses", list(LOSS_KEYS), []),
    ]
    kept = []
    for title, keys, twin_keys in layout:
        keys = [key for key in keys if key in logged]
        twin_keys = [key for key in twin_keys if key in logged]
        if not keys:  # only the twin-axis metric: it gets the main axis
            keys, twin_keys = twin_keys, []
        if keys:
            kept.append((title, keys, twin_keys))
    return kept


def _draw(ax: Axes, rows: Sequence[Row], keys: Sequence[str], **style: str) -> None:
    for key in keys:
        steps, values = series(rows, key)
        ax.plot(steps, values, label=key, marker="." if len(steps) < 50 else None, **style)  # type: ignore[arg-type]


def _draw_panel(ax: Axes, rows: Sequence[Row], panel: Panel) -> None:
    title, keys, twin_keys = panel
    _draw(ax, rows, keys)
    lines = list(ax.get_lines())
    if twin_keys:
        twin = ax.twinx()
        _draw(twin, rows, twin_keys, color="tab:gray", linestyle="--")
        twin.set_ylabel(", ".join(twin_keys), fontsize="small")
        lines += twin.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], fontsize="small")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def plot_metrics(rows: Sequence[Row], out_path: str | Path) -> Path:
    """Render the reward, KL and loss panels of `rows` to a PNG; empty panels are left out."""
    kept = panels(rows)
    if not kept:
        known = [SCORE_KEY, f"{VAL_PREFIX}*", *KL_KEYS, KL_COEF_KEY, *LOSS_KEYS]
        raise MetricsError(f"none of the plotted metrics were logged: {', '.join(known)}")
    fig = Figure(figsize=(8, 3 * len(kept)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(kept), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, kept):
        _draw_panel(ax, rows, panel)
        ax.xaxis.set_tick_params(labelbottom=True)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf-plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/metrics.png)")
    return parser.parse_args(argv)


@ends_in_one_line("rlhf-plot")  # a missing or unplottable file: one line, exit 2
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or args.run_dir / "metrics.png"
    written = plot_metrics(read_rows(args.run_dir / "metrics.jsonl"), out)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
