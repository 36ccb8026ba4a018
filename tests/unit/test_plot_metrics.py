"""rlhf-plot renders a real PNG from metrics.jsonl and fails in one line on a bad run dir."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from rlhf.cli.plot import main, panels, plot_metrics, read_rows, series


def synthetic_rows(num_steps: int = 12) -> list[dict[str, float]]:
    """A run's metrics: validation every 4th step, entropy missing, one NaN loss."""
    rows = []
    for step in range(1, num_steps + 1):
        row = {
            "step": step,
            "critic/score/mean": 0.1 + 0.05 * step,
            "actor/reward_kl_penalty": 0.002 * step,
            "actor/ppo_kl": 0.01 / step,
            "actor/reward_kl_penalty_coeff": 0.001 * (1 + 0.01 * step),
            "actor/pg_loss": -0.1 * math.sin(step),
            "critic/vf_loss": math.nan if step == 3 else 1.0 / step,
            "timing_s/step": 2.0,
        }
        if step % 4 == 0:
            row["val/test_score/gsm8k"] = 0.05 * step
            row["val/test_score/math"] = 0.02 * step
        rows.append(row)
    return rows


def write_run(run_dir, rows) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (run_dir / "metrics.jsonl").write_text(text)


def assert_png(path, min_size: tuple[int, int] = (400, 300)) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size[0] >= min_size[0] and image.size[1] >= min_size[1]
        image.verify()


def test_main_writes_a_png_next_to_the_metrics(tmp_path, capsys):
    write_run(tmp_path, synthetic_rows())
    assert main([str(tmp_path)]) == 0
    assert_png(tmp_path / "metrics.png")
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'metrics.png'}"


def test_out_option_and_partial_metrics(tmp_path):
    rows = [{"step": s, "critic/score/mean": 0.1 * s} for s in range(1, 4)]
    rows[1]["val/test_score/gsm8k"] = 0.2
    write_run(tmp_path / "run", rows)
    out = tmp_path / "plots" / "reward.png"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    assert_png(out, min_size=(400, 100))
    assert not (tmp_path / "run" / "metrics.png").exists()


def test_series_keeps_steps_with_the_key_and_the_last_of_a_repeated_step():
    rows = [
        {"step": 1, "a": 1.0},
        {"step": 2},
        {"step": 3, "a": 3.0},
        {"step": 2, "a": 2.5},  # a resumed run re-logged step 2
    ]
    assert series(rows, "a") == ([1, 2, 3], [1.0, 2.5, 3.0])
    assert series(rows, "missing") == ([], [])


def test_panels_skip_missing_metrics():
    assert panels(synthetic_rows()) == [
        ("reward", ["critic/score/mean", "val/test_score/gsm8k", "val/test_score/math"], []),
        ("KL", ["actor/reward_kl_penalty", "actor/ppo_kl"], ["actor/reward_kl_penalty_coeff"]),
        ("losses", ["actor/pg_loss", "critic/vf_loss"], []),  # entropy never logged
    ]
    only_coef = [{"step": 1, "actor/reward_kl_penalty_coeff": 0.001}]
    assert panels(only_coef) == [("KL", ["actor/reward_kl_penalty_coeff"], [])]


def test_plot_metrics_needs_some_known_metric(tmp_path):
    with pytest.raises(ValueError, match="none of the plotted metrics were logged"):
        plot_metrics([{"step": 1, "timing_s/step": 1.0}], tmp_path / "x.png")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "metrics.jsonl: no such file"),
        ("", "metrics.jsonl: empty, no steps to plot"),
        ("\n\n", "metrics.jsonl: empty, no steps to plot"),
        ('{"step": 1}\n{not json\n', "metrics.jsonl:2: not JSON"),
        ('{"loss": 1}\n', "metrics.jsonl:1: expected an object with a 'step' key"),
    ],
)
def test_bad_metrics_file_exits_2_with_one_line(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("rlhf-plot: error: ")
    assert message in err
    assert not (tmp_path / "metrics.png").exists()


def test_read_rows_skips_blank_lines(tmp_path):
    write_run(tmp_path, synthetic_rows(3))
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + "\n")
    assert [row["step"] for row in read_rows(path)] == [1, 2, 3]
