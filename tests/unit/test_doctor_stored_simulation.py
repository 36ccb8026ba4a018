"""A plain `rlhf-doctor --config C` of a shipped config sets the planner next to the stored
simulation (rlhf.cli.doctor_simulate.check_stored), and the stored one is of the shipped
files: a shipped config or shape edited without `benchmarks/memory_simulation.py --store`
fails here."""

from __future__ import annotations

import json
import re

import pytest

from rlhf.cli import doctor_simulate
from rlhf.cli.doctor import main
from rlhf.cli.doctor_simulate import SHIPPED, STORED, check_stored, digest

CONFIG, SHAPE = "configs/gsm8k_8gpu.yaml", "configs/model_shapes/Qwen2.5-7B.json"


def test_the_stored_simulation_is_of_the_shipped_configs_and_shapes():
    stored = json.loads(STORED.read_text())
    assert sorted(stored) == sorted(SHIPPED)
    for config, shape in SHIPPED.items():
        assert stored[config]["model_shape"] == shape
        assert stored[config]["digest"] == digest(config, shape), (
            f"{config} or {shape} changed: run benchmarks/memory_simulation.py --store"
        )


@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_every_shipped_config_fits_and_is_planned_within_ten_percent_at_its_whole_depth(config):
    """The planner as it is now against each config's stored simulation at its whole depth:
    every phase within 10% and 8% of 80 GiB free."""
    check, report = check_stored(config, None)
    assert check.status == "PASS", report or check.detail


def test_a_shipped_config_gets_its_stored_simulation_at_once(capsys):
    main(["--config", CONFIG, "--model-config", SHAPE])
    out = capsys.readouterr().out
    assert re.search(r"memory simulation +\| PASS +\| every phase within 10%", out), out
    assert "(stored, simulated," in out  # the detail column wraps after it
    for phase in ("build", "old_log_prob", "update_actor", "sync", "probe", "rollout"):
        assert f"\n{phase} " in out, phase


@pytest.mark.parametrize(
    "changed",
    [
        ["--model-config", SHAPE, "data.train_batch_size=512"],
        ["--model-config", "configs/model_shapes/Qwen2.5-14B.json"],
    ],
)
def test_a_config_not_as_shipped_gets_none(changed, capsys):
    main(["--config", CONFIG, *changed])
    assert "memory simulation" not in capsys.readouterr().out


def test_a_stale_stored_simulation_is_said_to_be(tmp_path, monkeypatch, capsys):
    stored = json.loads(STORED.read_text())
    stored[CONFIG]["digest"] = "0" * 64
    (tmp_path / "stored.json").write_text(json.dumps(stored))
    monkeypatch.setattr(doctor_simulate, "STORED", tmp_path / "stored.json")
    main(["--config", CONFIG, "--model-config", SHAPE])
    out = capsys.readouterr().out
    assert re.search(r"memory simulation +\| WARN +\| the stored one is of an older", out), out
