"""Inputs that used to end in a traceback, deep in a run, now fail in one line naming the file
or key, before any SGLang server starts (issue 18, items 4 and 7; one test per letter).

Each runs the real entry point (`rlhf.cli.train.main`, `rlhf.cli.doctor.main`,
`rlhf.cli.convert.main` in-process, or `python -m rlhf.cli.convert` where torchrun would be
involved) on the tiny Qwen2 model and quickstart data.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.checkpoint.manager import CheckpointManager
from rlhf.cli import convert, doctor, train
from rlhf.config import dump_yaml, load_config
from rlhf.quickstart.data import write_quickstart_data
from rlhf.utils import free_port
from tests.helpers import REPO, ppo_overrides, small_filesystem

pytestmark = pytest.mark.reliability

QUICKSTART = str(REPO / "configs" / "quickstart_cpu.yaml")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(autouse=True)
def no_sglang_server(monkeypatch):
    """Every case must fail before a server starts; one that would start fails the test. The
    launches `rlhf-train` holds meanwhile (`rlhf.cli.train.held_servers`) are all let go:
    the held processes, which the fixture yields."""
    from rlhf.rollout import sglang_server

    def start(self):
        raise AssertionError(f"an SGLang server was started ({self.url})")

    monkeypatch.setattr(sglang_server.SGLangServer, "start", start)
    held = []
    hold = sglang_server.hold_servers

    def recorded(env, count, module=sglang_server.SERVER_MODULE):
        hold(env, count, module)
        held.extend(h.proc for h in sglang_server._HELD[-count:])

    monkeypatch.setattr(sglang_server, "hold_servers", recorded)
    yield held
    assert not sglang_server._HELD and all(p.poll() is not None for p in held)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=16, num_val=8)


def model_copy(src: Path, dst: Path, drop: tuple[str, ...] = (), **config) -> Path:
    """A copy of the model at `src` with `config` merged into config.json, `drop` removed."""
    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(hf | config))
    for name in drop:
        (dst / name).unlink()
    return dst


def one_line(stderr: str, prefix: str) -> str:
    """The single line of `stderr` starting with `prefix`; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr
    return lines[0]


def table_row(table: str, name: str) -> str:
    """The row `name` of rlhf-doctor's table, its wrapped lines joined."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    return " ".join(lines[start:end])


def train_error(capsys, model: Path, data, tmp_path: Path, *extra: str) -> tuple[int, str]:
    """rlhf-train's exit code and its one line, for a run of `model` on `data`."""
    overrides = ppo_overrides(model, data, tmp_path / "run", 1, *extra)
    code = train.main(["--config", QUICKSTART, *overrides])
    return code, one_line(capsys.readouterr().err, "rlhf-train: ")


@pytest.mark.parametrize(
    "config",
    [{"model_type": "gemma2"}, {"model_type": "mistral", "sliding_window": 128}],
    ids=["gemma2", "mistral-sliding-window"],
)
def test_a_unsupported_family(
    capsys, monkeypatch, tiny_qwen2_dir, data, tmp_path, config, no_sglang_server
):
    model = model_copy(tiny_qwen2_dir, tmp_path / "model", **config)
    code, line = train_error(capsys, model, data, tmp_path)
    assert code == 2 and line.startswith("rlhf-train: error: actor_rollout_ref.model.path=")
    assert str(model) in line and repr(config["model_type"]) in line
    assert len(no_sglang_server) == 1  # held while it checked; let go (the fixture asserts)

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    args = ["--config", QUICKSTART, *ppo_overrides(model, data, tmp_path / "run", 1)]
    assert doctor.main(args) == 1
    row = table_row(capsys.readouterr().out, "model/data")
    assert "| FAIL " in row and repr(config["model_type"]) in row


@pytest.mark.parametrize("filtered", [False, True], ids=["truncation-error", "filtered"])
def test_b_every_prompt_too_long(capsys, tiny_qwen2_dir, data, tmp_path, filtered):
    extra = ["data.max_prompt_length=4", f"data.filter_overlong_prompts={filtered}"]
    code, line = train_error(capsys, tiny_qwen2_dir, data, tmp_path, *extra)
    assert code == 2 and "no prompts left" in line
    assert str(data[0]) in line and "data.max_prompt_length=4" in line
    assert "shortest" in line and "longest" in line


def test_c_empty_train_files(capsys, tiny_qwen2_dir, data, tmp_path):
    code, line = train_error(capsys, tiny_qwen2_dir, data, tmp_path, "data.train_files=[]")
    assert code == 2 and line.startswith("rlhf-train: error: data.train_files")


def test_d_unreachable_external_server(capsys, tiny_qwen2_dir, data, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    extra = [
        f"actor_rollout_ref.rollout.server_urls=[{url}]",
        "actor_rollout_ref.rollout.request_retries=0",
        "actor_rollout_ref.rollout.retry_backoff_s=0.01",
    ]
    code, line = train_error(capsys, tiny_qwen2_dir, data, tmp_path, *extra)
    assert code == 1 and line.startswith("rlhf-train: rollout failed: ") and url in line


def test_e_truncated_safetensors(capsys, tiny_qwen2_dir, data, tmp_path):
    model = model_copy(tiny_qwen2_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    code, line = train_error(capsys, model, data, tmp_path)
    assert code == 2 and "actor_rollout_ref.model.path" in line and str(weights) in line

    assert convert.main(["hf-to-mcore", str(model), str(tmp_path / "mcore")]) == 2
    line = one_line(capsys.readouterr().err, "rlhf-convert: ")
    assert line.startswith("rlhf-convert: error: ") and str(weights) in line
    assert not (tmp_path / "mcore").exists()


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.lr", "critic.optim.lr"])
def test_f_infinite_learning_rate(capsys, tiny_qwen2_dir, data, tmp_path, key):
    code, line = train_error(capsys, tiny_qwen2_dir, data, tmp_path, f"{key}=.inf")
    assert code == 2 and line.startswith(f"rlhf-train: config error: {key}: ")
    assert "finite" in line


def test_g_convert_kv_heads_not_divisible_by_tp(tmp_path):
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    model = save_tiny_model(tmp_path / "model", TinyModelSpec(num_key_value_heads=1))
    cmd = [
        sys.executable,
        "-m",
        "rlhf.cli.convert",
        "hf-to-mcore",
        str(model),
        str(tmp_path / "mcore"),
        "--tp",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    line = one_line(proc.stdout + proc.stderr, "rlhf-convert: ")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line
    assert str(model / "config.json") in line and "num_key_value_heads (1)" in line


def test_h_missing_tokenizer_files(capsys, tiny_qwen2_dir, data, tmp_path):
    model = model_copy(tiny_qwen2_dir, tmp_path / "model", drop=TOKENIZER_FILES)
    code, line = train_error(capsys, model, data, tmp_path)
    assert code == 2 and line.startswith(f"rlhf-train: error: {model}: ")
    assert "tokenizer.json" in line


def test_i_read_only_run_directory(capsys, tiny_qwen2_dir, data, tmp_path):
    with small_filesystem(tmp_path / "ro", 1024, read_only=True) as ro:
        overrides = ppo_overrides(tiny_qwen2_dir, data, ro / "run", 1)
        code = train.main(["--config", QUICKSTART, *overrides])
    line = one_line(capsys.readouterr().err, "rlhf-train: ")
    assert code == 2
    assert line.startswith(f"rlhf-train: error: run directory {ro / 'run'} cannot be written")


def test_j_checkpoint_directory_too_small(capsys, tiny_qwen2_dir, data, tmp_path):
    with small_filesystem(tmp_path / "small", 1024) as small:
        overrides = ppo_overrides(tiny_qwen2_dir, data, small / "run", 2)
        code = train.main(["--config", QUICKSTART, *overrides])
        assert not (small / "run" / "logs").exists()  # no server log either
    line = one_line(capsys.readouterr().err, "rlhf-train: ")
    assert code == 2
    checkpoints = small / "run" / "checkpoints"
    assert line.startswith(f"rlhf-train: error: checkpoint directory {checkpoints} has ")
    assert "a checkpoint of this run takes about" in line


def test_k_weights_of_another_size_than_config_json(capsys, tiny_qwen2_dir, data, tmp_path):
    hidden = json.loads((tiny_qwen2_dir / "config.json").read_text())["hidden_size"]
    model = model_copy(tiny_qwen2_dir, tmp_path / "model", hidden_size=hidden * 2)
    code, line = train_error(capsys, model, data, tmp_path)
    assert code == 2 and line.startswith(f"rlhf-train: error: actor_rollout_ref.model.path={model}")
    assert "in the safetensors but config.json implies" in line
    assert "the weights and config.json are of different models" in line


def test_l_tokenizer_larger_than_the_embedding(capsys, tiny_qwen2_dir, data, tmp_path):
    from transformers import AutoTokenizer

    model = model_copy(tiny_qwen2_dir, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tokenizer) + 5)])
    tokenizer.save_pretrained(model)
    code, line = train_error(capsys, model, data, tmp_path)
    assert code == 2 and line.startswith(f"rlhf-train: error: actor_rollout_ref.model.path={model}")
    assert (
        f"the tokenizer has {vocab + 5} tokens but the model's embedding has {vocab} rows" in line
    )


def test_m_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    assert train.main(["--config", QUICKSTART]) == 130
    line = one_line(capsys.readouterr().err, "rlhf-train: ")
    assert line.startswith("rlhf-train: interrupted (Ctrl-C); the steps since the latest")


def test_n_overrides_before_and_after_the_options(capsys):
    args = ["--config", QUICKSTART, "data.seed=3", "--print-config", "trainer.save_freq=7"]
    assert train.main(args) == 0
    printed = capsys.readouterr().out
    assert "seed: 3" in printed and "save_freq: 7" in printed


def test_o_a_resume_that_would_mix_two_runs(capsys, tiny_qwen2_dir, data, tmp_path):
    """A checkpoint written under data.max_response_length=16, resumed with 32: one line
    naming the key, both values and both ways out; the run's config.yaml is kept."""
    run_dir = tmp_path / "run"
    cfg = load_config(QUICKSTART, ppo_overrides(tiny_qwen2_dir, data, run_dir, 1))
    with CheckpointManager(run_dir / "checkpoints").writing(1) as tmp:  # as the trainer does
        for role in ("actor", "critic"):
            (tmp / role).mkdir()
        (tmp / "config.yaml").write_text(dump_yaml(cfg))
        sampler = {"num_prompts": 16, "batch_size": cfg.data.train_batch_size}
        (tmp / "trainer_state.json").write_text(json.dumps({"step": 1, "sampler": sampler}))
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    code, line = train_error(capsys, tiny_qwen2_dir, data, tmp_path, "data.max_response_length=32")
    assert code == 2 and line.startswith("rlhf-train: error: resume from ")
    assert "data.max_response_length (16 -> 32)" in line and "resume_mode=disable" in line
    assert "trainer.resume_accept_changes=[data.max_response_length]" in line
    assert (run_dir / "config.yaml").read_text() == dump_yaml(cfg)


def test_p_a_reward_function_that_returns_text(capsys, tiny_qwen2_dir, data, tmp_path):
    user = tmp_path / "user_reward.py"
    user.write_text(
        "def judge(data_source, solution_str, ground_truth, extra_info):\n    return 'ok'\n"
    )
    code, line = train_error(
        capsys, tiny_qwen2_dir, data, tmp_path, f"reward.custom_fn={user}:judge"
    )
    assert code == 1
    assert line.startswith("rlhf-train: reward failed: the reward function failed on row 0 of ")
    assert "an empty response (the startup check)" in line and "returned 'ok'" in line
