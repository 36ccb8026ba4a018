"""Config loading: YAML + dotted overrides, types, ranges, references, error messages."""

from __future__ import annotations

import re

import pytest

from rlhf.cli import train, train_rm
from rlhf.config import ConfigError, dump_yaml, load_config
from rlhf.config.loader import all_keys, nearest_key
from rlhf.tools.base import load_tools

QUICKSTART = "configs/quickstart_cpu.yaml"


def test_quickstart_config_loads_with_its_values():
    cfg = load_config(QUICKSTART)
    assert cfg.data.train_batch_size == 16
    assert cfg.actor_rollout_ref.rollout.dtype == "float32"
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.trainer.default_local_dir == "runs/quickstart"


def test_overrides_parse_each_type():
    cfg = load_config(
        QUICKSTART,
        [
            "data.train_batch_size=16",
            "algorithm.kl_ctrl.kl_coef=1e-3",
            "actor_rollout_ref.rollout.temperature=0",
            "global_profiler.steps=[1,5,10]",
            "trainer.experiment_name=007",
        ],
    )
    assert cfg.data.train_batch_size == 16
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.actor_rollout_ref.rollout.temperature == 0.0
    assert isinstance(cfg.actor_rollout_ref.rollout.temperature, float)
    assert cfg.global_profiler.steps == [1, 5, 10]
    assert cfg.trainer.experiment_name == "007"  # string keys keep the text as given


def test_union_keys_take_each_member_type():
    cfg = load_config(
        QUICKSTART, ["data.train_files=[a.parquet,b.parquet]", "data.val_files=v/*.parquet"]
    )
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.data.val_files == "v/*.parquet"
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["data.train_files=3"])
    assert str(err.value) == "data.train_files: expected str | list[str] | None, got 3"


def test_null_override_and_bool_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("global_profiler:\n  steps: [2]\n")
    assert load_config(path).global_profiler.steps == [2]
    assert load_config(path, ["global_profiler.steps=null"]).global_profiler.steps is None


def test_string_references_resolve():
    cfg = load_config(None, ["trainer.experiment_name=abc"])
    assert cfg.trainer.default_local_dir == "runs/abc"
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir: references unknown key"):
        load_config(None, ["trainer.default_local_dir=runs/${trainer.nope}"])


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("actor_rollout_ref.rollout.temprature=0.5", "actor_rollout_ref.rollout.temperature"),
        ("algorithm.kl_ctrl.kl_coeff=0.1", "algorithm.kl_ctrl.kl_coef"),
        ("kl_coef=0.1", "algorithm.kl_ctrl.kl_coef"),
        ("actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron."),
        ("data.train_batchsize=4", "data.train_batch_size"),
    ],
)
def test_unknown_key_names_nearest_valid_key(override, suggestion):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    message = str(err.value)
    assert f"unknown config key '{key}'" in message
    assert f"did you mean '{suggestion}" in message


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  n_gpu_per_node: 2\n")
    with pytest.raises(
        ConfigError, match=r"'trainer.n_gpu_per_node'; did you mean 'trainer.n_gpus_per_node'"
    ):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_batch_size=abc", "data.train_batch_size: expected int, got 'abc'"),
        ("data.train_batch_size=2.5", "data.train_batch_size: expected int, got 2.5"),
        ("data.train_batch_size=true", "data.train_batch_size: expected int, got True"),
        (
            "algorithm.kl_ctrl.type=adaptiv",
            "algorithm.kl_ctrl.type: expected one of 'fixed', 'adaptive', got 'adaptiv'",
        ),
        ("global_profiler.steps=[1,x]", "global_profiler.steps[1]: expected int, got 'x'"),
        (
            "actor_rollout_ref.rollout.top_p=abc",
            "actor_rollout_ref.rollout.top_p: expected float, got 'abc'",
        ),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_batch_size=0", "data.train_batch_size: must be > 0, got 0"),
        (
            "actor_rollout_ref.rollout.top_p=1.5",
            "actor_rollout_ref.rollout.top_p: must be <= 1, got 1.5",
        ),
        ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef: must be >= 0, got -1.0"),
        (
            "actor_rollout_ref.actor.clip_ratio_low=1",
            "actor_rollout_ref.actor.clip_ratio_low: must be < 1, got 1.0",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_c=0.5",
            "actor_rollout_ref.actor.clip_ratio_c: must be > 1, got 0.5",
        ),
        # no float key takes NaN or inf, bounded or not, alone or in a list
        ("critic.cliprange_value=.nan", "critic.cliprange_value: must be a finite number, got nan"),
        (
            "actor_rollout_ref.actor.optim.betas=[0.9, -.inf]",
            "actor_rollout_ref.actor.optim.betas[1]: must be a finite number, got -inf",
        ),
        (
            "actor_rollout_ref.rollout.request_timeout_s=inf",
            "actor_rollout_ref.rollout.request_timeout_s: must be a finite number, got inf",
        ),
    ],
)
def test_out_of_range_values(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    assert str(err.value) == message


def test_malformed_inputs(tmp_path):
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(None, ["data.seed"])
    with pytest.raises(ConfigError, match=r"missing\.yaml does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    section = tmp_path / "section.yaml"
    section.write_text("data: 3\n")
    with pytest.raises(ConfigError, match="data: expected a mapping of keys, got 3"):
        load_config(section)


def test_dump_round_trips(tmp_path):
    cfg = load_config(QUICKSTART, ["global_profiler.steps=[3]", "actor_rollout_ref.rollout.n=4"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg


def test_every_key_has_a_doc():
    import dataclasses
    import typing

    from rlhf.config.schema import RLHFConfig

    def walk(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{prefix}{f.name} has no doc"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(RLHFConfig)
    assert "algorithm.kl_ctrl.horizon" in all_keys()
    assert nearest_key("zzzzzz") is None


def cli_error(capsys, path, main=train.main, prog="rlhf-train") -> str:
    """The one line (after the prefix) the command prints for `--config path`; exit 2."""
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: config error: config file {path}"), err
    return err[len(f"{prog}: config error: config file {path}") :].strip()


def alias_bomb(levels: int) -> str:
    """`levels` levels of nine aliases each: 9**levels strings once expanded. Issue 50 used
    nine (120 s and 1.7 GB in the loader); six expand in well under a second, so a loader
    that accepted aliases again fails this test quickly rather than swapping."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text",
    [alias_bomb(6), "trainer: &t\n  save_freq: 2\ndata:\n  seed: 3\n"],
    ids=["alias-bomb", "one-anchor"],
)
def test_anchors_and_aliases_are_refused(capsys, tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    line = cli_error(capsys, path)
    assert line.startswith(": line 1, column ") and "anchors and aliases (&" in line


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "data:\n  seed: 1\ntrainer:\n  save_freq: 2\ndata:\n  seed: 3\n",
            "'data' is given twice (lines 1 and 5)",
        ),
        (
            "data:\n  seed: 1\n  max_prompt_length: 8\n  seed: 3\n",
            "'seed' is given twice (lines 2 and 4)",
        ),
    ],
    ids=["section", "nested-key"],
)
def test_a_key_given_twice_is_refused_naming_both_lines(capsys, tmp_path, text, where):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert where in cli_error(capsys, path, train_rm.main, "rlhf-train-rm")
    assert where in cli_error(capsys, path)


def test_a_binary_file_or_a_directory_is_one_line(capsys, tmp_path):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x08\x01\x00\x00" + bytes(range(256)))
    assert cli_error(capsys, binary).startswith(": not a UTF-8 text file (byte 0x80 at offset 132)")
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"data:\x00\n")
    assert (
        cli_error(capsys, nul, train_rm.main, "rlhf-train-rm")
        == ": a binary file (NUL bytes), not YAML"
    )
    directory = tmp_path / "configs"
    directory.mkdir()
    assert cli_error(capsys, directory) == "is a directory, not a YAML file"
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [1, 2\n")
    assert cli_error(capsys, bad).startswith(": not valid YAML at line 2, column 1: ")


def test_the_tool_config_is_read_as_strictly(tmp_path):
    tool = "  - class_name: rlhf.tools.calculator.CalculatorTool\n    tool_schema: {}\n"
    for text, message in [
        ("tools:\n" + tool + "tools:\n" + tool, "'tools' is given twice (lines 1 and 4)"),
        ("tools: &t\n" + tool + "again: *t\n", "anchors and aliases (&t)"),
    ]:
        path = tmp_path / "tools.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_tools(path)
    with pytest.raises(ValueError, match="is a directory"):
        load_tools(tmp_path)
