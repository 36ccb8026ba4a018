"""verl's defaults for keys a config leaves unset (issue: a verl script that leaves them out
trains what it trains in verl), the critic taking the actor's batch and layout unless set
(rlhf.config.inherit), and the shipped configs keeping this project's choices explicitly."""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from rlhf.config.hydra_load import load_with_notes
from rlhf.config.inherit import CRITIC_FROM_ACTOR
from rlhf.config.loader import default_of
from rlhf.config.validate import kl_in_reward
from tests.unit.test_hydra_compose import MODEL, VERL

AR = "actor_rollout_ref"


def test_unset_keys_mean_what_they_mean_in_verl():
    cfg = load_config(None, [])
    assert cfg.algorithm.kl_ctrl.type == "fixed"
    assert not kl_in_reward(cfg.algorithm, cfg.actor_rollout_ref.actor)
    assert cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.data.max_response_length == 512
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.do_sample, val.temperature, val.n) == (False, 0.0, 1)
    assert cfg.trainer.early_stop.rollback_val_ratio is None  # rollback is opt-in


@pytest.mark.parametrize(("device", "dtype"), [("cuda", "bfloat16"), ("cpu", "float32")])
def test_the_training_dtype_is_bf16_on_gpus_and_fp32_on_the_cpu(device, dtype):
    cfg = load_config(None, [f"trainer.device={device}"])
    assert cfg.actor_rollout_ref.actor.megatron.dtype == dtype
    assert cfg.critic.megatron.dtype == dtype
    own = load_config(None, [f"trainer.device={device}", f"{AR}.actor.megatron.dtype=float32"])
    assert own.actor_rollout_ref.actor.megatron.dtype == "float32"  # set: kept


def _other(key: str) -> object:
    """A value for `key` other than its default."""
    default = default_of(key)
    if isinstance(default, bool):
        return not default
    if key.endswith("loss_agg_mode"):
        return "seq-mean-token-sum"
    if key.endswith(".sequence_parallel"):  # bool | None
        return True
    if default is None or isinstance(default, int):
        return (default or 1) * 2
    raise AssertionError(key)


@pytest.mark.parametrize("critic_key", sorted(CRITIC_FROM_ACTOR))
def test_the_critic_takes_the_actors_value_unless_set(critic_key):
    actor_key = CRITIC_FROM_ACTOR[critic_key]
    value = _other(actor_key)
    inherited = load_config(None, [f"{actor_key}={value}"])
    assert _read(inherited, critic_key) == value
    default = default_of(critic_key)
    text = "null" if default is None else default
    own = load_config(None, [f"{actor_key}={value}", f"{critic_key}={text}"])
    assert _read(own, critic_key) == default


def _read(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_verls_files_give_the_critic_its_own_layout_which_follows_the_actors_here():
    """verl's megatron_critic.yaml says TP 1 whatever the actor's: the script's actor TP 4
    becomes the critic's too, and the files' TP 1 is listed as ignored; the user's own
    critic TP stays (and then has to match)."""
    tp = "megatron.tensor_model_parallel_size"
    loaded = load_with_notes(
        None, [MODEL, f"{AR}.actor.{tp}=4"], config_dir=VERL, config_name="ppo_megatron_trainer"
    )
    assert loaded.config.critic.megatron.tensor_model_parallel_size == 4
    assert any(
        line.startswith(f"critic.{tp}=1: the critic takes the actor's (4)")
        for line in loaded.ignored
    ), loaded.ignored
    own = load_with_notes(
        None,
        [MODEL, f"{AR}.actor.{tp}=4", f"critic.{tp}=2"],
        config_dir=VERL,
        config_name="ppo_megatron_trainer",
    )
    assert own.config.critic.megatron.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    "config",
    [
        "quickstart_cpu",
        "gsm8k_8gpu",
        "gsm8k_2node",
        "gsm8k_qwen2.5-0.5b_1gpu",
        "quickstart_rm_ppo_cpu",
    ],
)
def test_the_ppo_configs_keep_adaptive_kl_in_the_reward(config):
    cfg = load_config(f"configs/{config}.yaml")
    assert (
        kl_in_reward(cfg.algorithm, cfg.actor_rollout_ref.actor)
        and cfg.algorithm.kl_ctrl.type == "adaptive"
    )
