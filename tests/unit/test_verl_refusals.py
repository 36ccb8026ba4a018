"""Each refusal of a verl key says why and points at this system's setting (issue: 11.8% of a
verl user's overrides were refused unclearly): DAPO's reward-manager keys map to
reward.overlong_buffer, vLLM's engine knobs point at SGLang's, Megatron checkpoint formats,
host optimizers and profilers at what exists here; the did-you-mean does not cross sections on
one generic word; a Hugging Face Hub id as a model path is refused before anything starts."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, load_config, validate_config
from rlhf.config.loader import nearest_key

AR = "actor_rollout_ref"
OVERLONG = "+reward_model.reward_kwargs.overlong_buffer_cfg"
DAPO = [
    "reward_model.reward_manager=dapo",
    f"{OVERLONG}.enable=True",
    f"{OVERLONG}.len=4096",
    f"{OVERLONG}.penalty_factor=0.5",
    f"{OVERLONG}.log=False",
    "+reward_model.reward_kwargs.max_resp_len=20480",
    "data.max_response_length=20480",
]


def test_dapos_reward_manager_keys_set_the_overlong_shaping():
    shaping = load_config(None, DAPO).reward.overlong_buffer
    assert (shaping.enable, shaping.len, shaping.penalty_factor) == (True, 4096, 0.5)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ("reward_model.reward_manager=prime", "naive and dapo managers"),
        (f"{OVERLONG}.log=maybe", "expected true or false"),
        ("+reward_model.reward_kwargs.max_resp_len=100", "set them equal"),
        ("+reward_model.reward_kwargs.foo=1", "reward-manager argument has no equivalent"),
        ("reward_model.micro_batch_size_per_gpu=4", "reward_model.enable=false leaves unused"),
    ],
)
def test_what_the_reward_manager_cannot_take_is_refused_with_why(extra, said):
    with pytest.raises(ConfigError, match=said) as e:
        load_config(None, [*DAPO, extra])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("override", "points_at"),
    [
        (f"{AR}.rollout.max_num_batched_tokens=8192", "engine_kwargs.sglang.chunked_prefill_size"),
        (f"{AR}.rollout.enable_chunked_prefill=False", "chunked_prefill_size=-1"),
        (f"{AR}.actor.megatron.use_dist_checkpointing=True", "rlhf-convert mcore-to-hf"),
        (
            f"+{AR}.actor.megatron.override_optimizer_config.optimizer_offload_fraction=1",
            f"{AR}.actor.megatron.optimizer_offload=true",
        ),
        ("trainer.log_val_generations=10", "rollouts/step_N.jsonl"),
        ("global_profiler.tool=nsys", "global_profiler.steps"),
        ("critic.profiler.enable=True", "global_profiler.steps"),
    ],
)
def test_verls_engine_checkpoint_and_tooling_keys_point_at_the_setting_here(override, points_at):
    with pytest.raises(ConfigError, match=points_at):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override",
    [
        f"{AR}.rollout.enable_chunked_prefill=True",
        f"{AR}.actor.megatron.use_dist_checkpointing=False",
        f"{AR}.actor.megatron.use_mbridge=True",
        "trainer.log_val_generations=0",
        "critic.profiler.enable=False",
    ],
)
def test_their_verl_defaults_are_accepted(override):
    load_config(None, [override])


def test_vllms_enforce_eager_is_sglangs_disable_cuda_graph():
    cfg = load_config(None, [f"{AR}.rollout.enforce_eager=True"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.sglang == {"disable_cuda_graph": True}


@pytest.mark.parametrize(
    ("unknown", "near"),
    [
        ("global_profiler.tools", None),  # not ...multi_turn.tool_timeout_s
        ("critic.profiler.enabled", None),  # not algorithm.filter_groups.enable
        (f"{AR}.actor.checkpoint.async_save", "trainer.async_save"),
        ("algorithm.kl_ctrl.kl_coeff", "algorithm.kl_ctrl.kl_coef"),
        ("critic.megatron.sequence_parallel_size", "critic.megatron.sequence_parallel"),
    ],
)
def test_the_nearest_key_crosses_sections_only_on_a_specific_match(unknown, near):
    assert nearest_key(unknown) == near


@pytest.mark.parametrize("key", [f"{AR}.model.path", "critic.model.path", "reward.model_path"])
def test_a_hub_id_as_a_model_path_is_refused_with_the_way_out(key, tmp_path):
    overrides = [f"{AR}.model.path={tmp_path}", f"{key}=Qwen/Qwen2.5-7B-Instruct"]
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, overrides))
    message = str(e.value)
    assert message.startswith(f"{key}=Qwen/Qwen2.5-7B-Instruct is a Hugging Face Hub id")
    assert "hf download Qwen/Qwen2.5-7B-Instruct --local-dir DIR" in message
    validate_config(load_config(None, [f"{AR}.model.path={tmp_path}"]))  # a local one passes


def test_an_unknown_key_with_nothing_near_still_says_where_to_look():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.zzz_qqq=1"])
    message = str(e.value)
    assert message.startswith("unknown config key 'trainer.zzz_qqq'; no setting here is near it")
    assert "--print-config" in message and "docs/from-verl.md" in message
