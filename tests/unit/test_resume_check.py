"""A resume whose settings differ from its checkpoint's: layout changes go on (said), changes
to what is trained are refused naming each key with both values unless accepted, and the
changes no acceptance makes work are refused outright."""

from __future__ import annotations

import json
import logging

import pytest

from rlhf.config import ConfigError, dump_yaml, load_config
from rlhf.trainer.preflight import CHECKPOINT_CONFIG, check_resume, is_free

QUICKSTART = "configs/quickstart_cpu.yaml"
AR = "actor_rollout_ref"
PROMPTS = 64


def checkpoint(tmp_path, *overrides: str, critic: bool = True, world_size: int = 1):
    """A checkpoint directory as the trainer writes it, as far as the check reads it."""
    cfg = load_config(QUICKSTART, list(overrides))
    path = tmp_path / "global_step_3"
    (path / "actor").mkdir(parents=True)
    if critic:
        (path / "critic").mkdir()
    (path / CHECKPOINT_CONFIG).write_text(dump_yaml(cfg))
    sampler = {"num_prompts": PROMPTS, "batch_size": cfg.data.train_batch_size}
    (path / "trainer_state.json").write_text(json.dumps({"step": 3, "sampler": sampler}))
    (path / "COMPLETE").write_text(json.dumps({"step": 3, "world_size": world_size}))
    return path


def resume(path, *overrides: str, prompts: int = PROMPTS, ranks: int = 1) -> None:
    check_resume(load_config(QUICKSTART, list(overrides)), path, prompts, ranks, ranks)


def test_layout_and_operations_may_change_and_are_said(tmp_path, caplog):
    path = checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="rlhf.trainer.preflight"):
        resume(
            path,
            f"{AR}.actor.megatron.tensor_model_parallel_size=2",
            "trainer.total_training_steps=99",
            f"{AR}.rollout.weight_sync_transport=disk",
            f"{AR}.actor.use_dynamic_bsz=false",  # micro-batching: the same gradients
            "data.use_sequence_packing=false",
        )
    assert "tensor_model_parallel_size (1 -> 2)" in caplog.text
    assert "data.use_sequence_packing (True -> False)" in caplog.text
    assert "trainer.total_training_steps" in caplog.text


def test_what_is_trained_is_refused_naming_keys_values_and_both_ways_out(tmp_path):
    path = checkpoint(tmp_path)
    changes = [f"{AR}.model.path=/other/model", "data.max_response_length=32"]
    with pytest.raises(ConfigError) as err:
        resume(path, *changes)
    message = str(err.value)
    assert "3 setting(s) differ" in message  # critic.model.path follows the actor's
    assert f"{AR}.model.path (" in message and "-> '/other/model')" in message
    assert "data.max_response_length (16 -> 32)" in message
    assert "trainer.resume_mode=disable" in message
    keys = f"data.max_response_length,{AR}.model.path,critic.model.path"
    accept = f"trainer.resume_accept_changes=[{keys}]"
    assert accept in message
    resume(path, *changes, accept)  # the line the message gives is accepted as written
    resume(path, *changes, "trainer.resume_accept_changes=[data,actor_rollout_ref.model,critic]")


def test_an_unknown_entry_in_the_accept_list_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"'data\.max_len' is neither a config key nor"):
        resume(checkpoint(tmp_path), "trainer.resume_accept_changes=[data.max_len]")


def test_the_prompt_order_cannot_continue_over_other_prompts_or_batch_sizes(tmp_path):
    path = checkpoint(tmp_path)
    everything = "trainer.resume_accept_changes=[data]"
    with pytest.raises(ConfigError, match=r"over 16 prompts per step .* this run has 4"):
        resume(path, "data.train_batch_size=4", everything)
    with pytest.raises(ConfigError, match=r"over 64 training prompts .* this run has 50"):
        resume(path, everything, prompts=50)


def test_a_critic_the_checkpoint_does_not_hold_cannot_resume(tmp_path):
    grpo = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"]
    path = checkpoint(tmp_path, *grpo, critic=False)
    with pytest.raises(ConfigError, match="trains a critic and the checkpoint holds none"):
        resume(path, "trainer.resume_accept_changes=[algorithm,actor_rollout_ref.actor]")
    # the other way (the critic dropped) changes the estimator: refused unless accepted
    gae = checkpoint(tmp_path / "gae")
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator \('gae' -> 'grpo'\)"):
        resume(gae, *grpo)


def test_which_keys_are_layout():
    assert is_free(f"{AR}.actor.megatron.pipeline_model_parallel_size")
    assert is_free("critic.ppo_micro_batch_size_per_gpu")
    assert is_free(f"{AR}.rollout.num_servers")
    assert not is_free(f"{AR}.rollout.temperature")
    assert not is_free(f"{AR}.actor.megatron.dtype")
    assert not is_free(f"{AR}.actor.optim.lr")
    assert not is_free("reward.custom_fn")


def test_a_checkpoint_resumes_on_as_many_processes_as_wrote_it(tmp_path):
    with pytest.raises(ConfigError, match=r"written by 1 process\(es\), and this run has 2"):
        resume(checkpoint(tmp_path), ranks=2)


def test_plain_and_distributed_optimizer_states_do_not_load_into_each_other(tmp_path):
    """A checkpoint of 2 ranks with the plain optimizer resumed where the distributed one is
    on (its default at 2 data-parallel ranks), and the other way: one line naming the key."""
    path = checkpoint(tmp_path, world_size=2)
    with pytest.raises(ConfigError, match=r"actor's optimizer state was saved without the distr"):
        resume(path, ranks=2)
    off = [f"{role}.megatron.use_distributed_optimizer=false" for role in (f"{AR}.actor", "critic")]
    resume(path, *off, ranks=2)
    (path / "actor" / "optimizer").mkdir()
    with pytest.raises(ConfigError, match=r"use_distributed_optimizer=true, as the saving run"):
        resume(path, *off, ranks=2)
