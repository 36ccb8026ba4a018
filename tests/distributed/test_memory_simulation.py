"""The memory simulation proven against reality at a small shape (rlhf.trainer.memory_simulation).

The same config, model and synthetic batch run twice, each in a process of its own: once for
real on the CPU (gloo, a real checkpoint, every phase's allocations measured by
torch.profiler, the models' storages summed at each phase's start), once simulated (a fake
world, fake tensors, the meta device standing in for the GPU, live storages counted). What
each phase adds above its start must agree to the byte's order of a percent, and what is
alive at each start too: the simulation also counts the few tensors that are no model's
(Megatron's rotary-embedding caches), which the real count leaves out. The shipped configs at
their real widths are the slow test at the end.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.trainer.memory_simulation import SimulatedStep

CONFIG = "configs/quickstart_cpu.yaml"
STEP_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor", "probe")
NOT_MODEL_STATE = 256 * 1024  # rotary caches of the tiny model: 0.18 MiB


def _run(*args: str) -> SimulatedStep:
    command = [sys.executable, "-m", "rlhf.trainer.memory_simulation", "--config", CONFIG, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return SimulatedStep.from_json(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_simulated_step_allocates_what_the_real_one_does(tiny_qwen2_dir):
    real = _run("--model", str(tiny_qwen2_dir)).phases
    simulated = _run("--model-shape", str(tiny_qwen2_dir / "config.json")).phases
    for phase in STEP_PHASES:
        added_real = real[phase].peak - real[phase].start
        added_simulated = simulated[phase].peak - simulated[phase].start
        assert added_simulated == pytest.approx(added_real, rel=0.01), phase
    for phase in (*STEP_PHASES, "sync", "rollout"):
        extra = simulated[phase].start - real[phase].start
        assert 0 <= extra <= NOT_MODEL_STATE, (phase, real[phase], simulated[phase])
    # the build reads the weight files on the host (their slices), which the simulation skips
    assert simulated["build"].peak == pytest.approx(real["build"].peak, rel=0.10)


def _shallow(config: str, layers_per_stage: int, root: Path) -> str:
    """The shape of `config`'s model with `layers_per_stage` layers on each pipeline stage."""
    from rlhf.cli.doctor_simulate import SHIPPED

    path = f"configs/{config}.yaml"
    shape = json.loads(Path(SHIPPED[path]).read_text())
    pp = load_config(path).actor_rollout_ref.actor.megatron.pipeline_model_parallel_size
    shape["num_hidden_layers"] = layers_per_stage * pp
    out = root / f"{config}_{layers_per_stage}.json"
    out.write_text(json.dumps(shape))
    return str(out)


@pytest.mark.slow(reason="one rank of each shipped GPU config at its real widths: a minute each")
@pytest.mark.parametrize("config", ["gsm8k_8gpu", "qwen3_30b_a3b_grpo_8gpu", "gsm8k_2node"])
def test_every_shipped_config_is_planned_within_ten_percent_at_its_widths(config, tmp_path):
    """Each config at its real widths, layout and batch with two and four layers per pipeline
    stage (a layer of Qwen3-30B-A3B takes 6 s to simulate; the whole depths, 10 minutes, are
    `benchmarks/memory_simulation.py --store`, whose stored result the planner is held to in
    tests/unit/test_doctor_stored_simulation.py): every phase within 10% of the planner, and
    so is what two more layers add (the per-layer terms, which a shallow model alone would
    hide behind the embeddings and the logits). The 0.5B config's widths are the 7B's kind."""
    from concurrent.futures import ThreadPoolExecutor

    from rlhf.cli.doctor_simulate import simulate_config

    path = f"configs/{config}.yaml"
    shapes = [_shallow(config, layers, tmp_path) for layers in (2, 4)]
    with ThreadPoolExecutor(2) as pool:  # each a subprocess: the two cores
        two, four = pool.map(lambda shape: simulate_config(path, shape), shapes)
    assert not two.problems, two.report()
    assert not four.problems, four.report()
    for small, big in zip(two.rows, four.rows, strict=True):
        planned, simulated = big.planned - small.planned, big.simulated - small.simulated
        if planned > 2**29:  # half a GiB and more: the phases the layers' state shows in
            assert simulated == pytest.approx(planned, rel=0.10), (small.phase, two.report())


def test_the_doctor_sets_the_simulation_next_to_the_planner(tiny_qwen2_dir, capsys):
    from rlhf.cli.doctor import main

    main(["--config", CONFIG, "--model-config", str(tiny_qwen2_dir / "config.json"), "--simulate"])
    out = capsys.readouterr().out
    assert re.search(r"memory simulation +\| PASS", out), out
    assert "simulated, not run on a GPU" in out
    for phase in ("build", "old_log_prob", "update_actor", "sync", "probe", "rollout"):
        assert f"\n{phase} " in out, phase
