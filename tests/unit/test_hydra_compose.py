"""Hydra's defaults lists and command-line grammar (rlhf.config.compose, rlhf.config.hydra_load):
verl's trainer config (tests/unit/verl_config, unchanged copies) composed exactly as verl's own
Hydra-generated flat file, `_self_` order, packages, nested defaults, `+`/`++`/`~`, the errors,
and verl's example scripts run against the composed tree through rlhf-train."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf.cli.train import main, parse_args
from rlhf.config.compose import HydraLoader, compose
from rlhf.config.hydra_load import load_command_line, load_with_notes
from rlhf.config.loader import ConfigError, all_keys
from rlhf.config.verl_keys import VERL_KEYS, VERL_SECTIONS
from rlhf.config.yaml_file import read_yaml
from tests.unit.test_verl_compat import REFUSED, SCRIPTS, script_overrides

VERL = Path(__file__).with_name("verl_config")
MODEL = "actor_rollout_ref.model.path=/models/x"


def test_verls_trainer_config_composes_as_verls_generated_file():
    composed = OmegaConf.to_container(compose(VERL, "ppo_megatron_trainer").tree)
    generated = read_yaml(VERL / "_generated_ppo_megatron_trainer.yaml", "reference", HydraLoader)
    assert composed == generated  # keys, values and the unresolved ${...} alike
    resolved = OmegaConf.to_container(OmegaConf.create(composed), resolve=True)
    assert resolved["critic"]["ppo_epochs"] == 1  # ${oc.select:actor_rollout_ref.actor...}
    assert resolved["actor_rollout_ref"]["actor"]["checkpoint"]["load_contents"] == [
        "model",
        "optimizer",
        "extra",
    ]  # the relative ${.save_contents}


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("defaults", "x"),
    [("[db: a, _self_]", 10), ("[_self_, db: a]", 20), ("[db: a]", 10)],
)
def test_self_decides_whose_values_win(tmp_path, defaults, x):
    write(tmp_path, {"c.yaml": f"defaults: {defaults}\ndb:\n  x: 10\n", "db/a.yaml": "x: 20\n"})
    assert OmegaConf.to_container(compose(tmp_path, "c").tree) == {"db": {"x": x}}


def test_packages_and_nested_defaults(tmp_path):
    files = {
        "c.yaml": "defaults:\n  - part@a.b: p\n  - common@top\n  - optional part: nothing\n",
        "part/p.yaml": "defaults:\n  - ../opt@o: fast\n  - base\n  - _self_\ny: 2\n",
        "part/base.yaml": "y: 1\nz: 3\n",
        "opt/fast.yaml": "lr: 0.1\n",
        "common.yaml": "k: ${a.b.y}\n",
        "g.yaml": "# @package _global_\ndefaults:\n  - part: p\n",
    }
    write(tmp_path, files)
    tree = OmegaConf.to_container(compose(tmp_path, "c").tree)
    assert tree == {"a": {"b": {"o": {"lr": 0.1}, "y": 2, "z": 3}}, "top": {"k": "${a.b.y}"}}
    chosen = compose(tmp_path, "c", {"part@a.b": "base"}).tree
    assert OmegaConf.to_container(chosen) == {
        "a": {"b": {"y": 1, "z": 3}},
        "top": {"k": "${a.b.y}"},
    }
    assert "part" in OmegaConf.to_container(compose(tmp_path, "g").tree)


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ({"c.yaml": "defaults: [db: nope]\n", "db/a.yaml": ""}, "group 'db' has no option 'nope'"),
        ({"c.yaml": "defaults: [other]\n"}, "other.yaml does not exist"),
        ({"c.yaml": "defaults: [{a: 1, b: 2}]\n"}, "defaults entry"),
        ({"c.yaml": "defaults: [db: a]\nx: 1\nx: 2\n", "db/a.yaml": ""}, "given twice"),
    ],
)
def test_composition_errors_are_one_line_naming_the_file(tmp_path, files, said):
    write(tmp_path, files)
    with pytest.raises(ConfigError) as e:
        load_with_notes(config_dir=tmp_path, config_name="c")
    assert said in str(e.value) and "\n" not in str(e.value) and "c.yaml" in str(e.value)


def test_command_line_grammar_on_the_composed_tree():
    def load(*overrides: str):
        return load_with_notes(
            None, [MODEL, *overrides], config_dir=VERL, config_name="ppo_megatron_trainer"
        )

    assert load("++trainer.nnodes=1").config.trainer.nnodes == 1
    assert load("trainer.experiment_name=1e-3").config.trainer.experiment_name == "1e-3"
    cfg = load("trainer.project_name=p", "trainer.experiment_name=e").config
    assert cfg.trainer.default_local_dir == "checkpoints/p/e"  # ${...} after the overrides
    assert (
        load("~trainer.logger").config.trainer.logger
        == load_with_notes(None, [MODEL]).config.trainer.logger
    )
    for bad, said in [
        ("+trainer.nnodes=2", "trainer.nnodes is already in the config"),
        ("~trainer.nope", "trainer.nope is not in the config"),
        ("trainer.n_gpus_per_nod=2", "did you mean 'trainer.n_gpus_per_node'"),
        ("actor_rollout_ref.model.lora.type=dora", "dora and vlm_lora are not built"),
        ("actor_rollout_ref.model.external_lib=x", "verl's setting has no equivalent here"),
        ("actor_rollout_ref.actor.use_torch_compile=true", "torch.compile is not used"),
        ("reward_model=nope", "group 'reward_model' has no option 'nope'"),
    ]:
        with pytest.raises(ConfigError, match=None) as e:
            load(bad)
        assert said in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))
    ignored = load("actor_rollout_ref.model.external_lib=null").ignored
    assert any(
        line.startswith("actor_rollout_ref.model.external_lib=null: verl's default")
        for line in ignored
    )
    # verl's Megatron LoRA section: its keys win over FSDP's flat ones in the same files
    lora = load("actor_rollout_ref.model.lora.rank=8").config.actor_rollout_ref.model
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_merge) == (8, 32.0, False)
    flat = load("actor_rollout_ref.model.lora_rank=8").config.actor_rollout_ref.model
    assert (flat.lora_rank, flat.lora_alpha) == (8, 32.0)


def test_a_config_file_with_a_defaults_list_composes(tmp_path):
    write(
        tmp_path,
        {"run.yaml": "defaults: [sec: s, _self_]\nhydra:\n  run: {dir: x}\ndata:\n  seed: 5\n"},
    )
    write(
        tmp_path, {"sec/s.yaml": "# @package _global_\ndata:\n  seed: 4\n  max_prompt_length: 64\n"}
    )
    loaded = load_with_notes(tmp_path / "run.yaml", [MODEL])
    assert (loaded.config.data.seed, loaded.config.data.max_prompt_length) == (5, 64)
    assert loaded.ignored[0].startswith("hydra:")


OURS = set(all_keys())


def _local(override: str, root: Path) -> str:
    """`override` with a model path (a Hub id in verl's scripts) pointing at a local dir."""
    key = override.partition("=")[0]
    return f"{key}={root}" if key.endswith(("model.path", "model_path")) else override


@pytest.mark.parametrize("name", SCRIPTS)
def test_verls_scripts_load_against_verls_composed_config(name, tmp_path, capsys):
    overrides = [o for o in script_overrides(name, tmp_path) if o not in REFUSED[name]]
    config = ["--config-path", str(VERL), "--config-name=ppo_megatron_trainer.yaml"]
    assert main([*config, *overrides, "--print-config"]) == 2  # verl's scripts name Hub ids
    hub = capsys.readouterr().err
    assert hub.count("\n") == 1 and "is a Hugging Face Hub id, not a local directory" in hub
    overrides = [_local(o, tmp_path) for o in overrides]  # as downloaded first
    args = [*config, *overrides]
    loaded = load_args(parse_args(args))
    code, printed = main([*args, "--print-config"]), capsys.readouterr()
    assert code == 0, printed.err  # the critic takes the actor's layout (rlhf.config.inherit)
    assert "# ignored: actor_rollout_ref.actor.checkpoint.{" in printed.out  # per section
    assert "save_contents=" in printed.out
    for item in overrides:  # none dropped: this system's, translated, or listed as ignored
        key = item.partition("=")[0].lstrip("+")
        mapped = key in OURS or key in VERL_KEYS or key.startswith(VERL_SECTIONS)
        assert mapped or any(line.startswith(key) for line in loaded.ignored), item
    fallback = ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", *overrides]
    loaded = load_args(parse_args(fallback))  # verl's package directory absent: our defaults
    assert loaded.ignored == [] and loaded.config.actor_rollout_ref.model.path
    capsys.readouterr()
    assert main([*fallback, "--print-config"]) == 0, capsys.readouterr().err


MULTI_TURN_CONFIG = """\
hydra:
  searchpath:
    - file://{search}
defaults:
  - ppo_trainer
  - _self_
data:
  max_response_length: 48
actor_rollout_ref:
  rollout:
    name: sglang
    multi_turn:
      enable: true
      max_assistant_turns: 3
"""


@pytest.mark.parametrize("search", ["verl", "absent"])
def test_a_config_beside_verls_scripts_finds_its_trainer_config_or_stands_in(search, tmp_path):
    """verl's multi-turn examples keep a config of their own that includes `ppo_trainer` from
    verl's directory through `hydra.searchpath`: found there when it is, else this system's
    defaults stand in, and the example's own keys (multi-turn on) count either way."""
    where = VERL if search == "verl" else tmp_path / "no_such_dir"
    (tmp_path / "mt.yaml").write_text(MULTI_TURN_CONFIG.format(search=where))
    loaded = load_with_notes(None, [MODEL], config_dir=tmp_path, config_name="mt")
    rollout = loaded.config.actor_rollout_ref.rollout
    assert rollout.multi_turn.enable and rollout.multi_turn.max_assistant_turns == 3
    assert loaded.config.data.max_response_length == 48
    stand_in = [line for line in loaded.ignored if line.startswith("ppo_trainer: ")]
    assert bool(stand_in) == (search == "absent"), loaded.ignored


def load_args(args):
    """What rlhf-train loads for its parsed command line."""
    return load_command_line(args.config, args.config_path, args.config_name, args.overrides)
