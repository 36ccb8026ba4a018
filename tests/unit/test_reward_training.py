"""Reward-model training's data and config (`rlhf-train-rm`): a pair's sides tokenize as the
PPO sample the reward model will score, pairs are laid out two samples each, and bad
configs and data are refused in one line."""

from __future__ import annotations

import pytest

from rlhf.cli.train_rm import main
from rlhf.config.loader import ConfigError, load_config
from rlhf.config.reward_training import RewardModelRunConfig, validate_reward_training
from rlhf.data.parquet import DataError, write_rows
from rlhf.data.preference import (
    PreferencePair,
    TokenizedPair,
    read_preference_pairs,
    split_shared,
    tokenize_pairs,
)
from rlhf.quickstart.arithmetic import make_problems
from rlhf.quickstart.preferences import make_preference_pairs
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.quickstart.warm_start import prompt_ids
from rlhf.trainer.reward_training import pair_batch


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_a_side_tokenizes_as_the_ppo_sample_it_stands_for(tokenizer):
    """Prompt with the generation prompt, the reply, EOS: what the policy generates and the
    reward model scores in PPO (not the template's closing newline)."""
    row = make_problems(1, seed=4)[0]
    pair = PreferencePair(row["prompt"], "#### 7", [{"role": "assistant", "content": "#### 12"}])
    (tokenized,), dropped = tokenize_pairs([pair], tokenizer, True, 200)
    assert dropped == 0
    prompt = prompt_ids(tokenizer, row)
    for reply, side in (("#### 7", tokenized.chosen), ("#### 12", tokenized.rejected)):
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        assert tokenized.shared + side == prompt + reply_ids + [tokenizer.eos_token_id]
    assert tokenized.shared[: len(prompt)] == prompt  # the prompt is shared


def test_shared_tokens_leave_each_side_one():
    assert split_shared([1, 2, 3], [1, 2, 4]) == 2
    assert split_shared([1, 2], [1, 2, 3]) == 1  # one side is a prefix of the other
    assert split_shared([5], [6]) == 0


def test_overlong_sides_are_named_or_dropped(tmp_path, tokenizer):
    rows = make_preference_pairs(3, seed=2)
    rows[1] = {**rows[1], "rejected": [{"role": "assistant", "content": "#### 1" * 40}]}
    path = write_rows(rows, tmp_path / "pairs.parquet")
    pairs = read_preference_pairs([path])
    with pytest.raises(DataError) as e:
        tokenize_pairs(pairs, tokenizer, True, 60)
    assert f"{path}: row 1, column 'rejected': " in str(e.value)
    assert "more than max_length 60" in str(e.value) and len(e.value.problems) == 1
    kept, dropped = tokenize_pairs(pairs, tokenizer, True, 60, drop_overlong=True)
    assert (len(kept), dropped) == (2, 1)


def test_pairs_are_two_samples_each_chosen_first():
    pairs = [TokenizedPair([1, 2], [3], [4, 5], 0.5), TokenizedPair([7], [8, 9], [10], 0.0)]
    batch = pair_batch(pairs)
    assert batch.prompt_ids == [[1, 2], [1, 2], [7], [7]]
    assert batch.response_ids == [[3], [4, 5], [8, 9], [10]]
    assert batch.uids == ["pair0", "pair0", "pair1", "pair1"]


def rm_config(*overrides: str) -> RewardModelRunConfig:
    return load_config(
        None,
        ["model.path=m", "data.train_files=t.parquet", *overrides],
        schema=RewardModelRunConfig,
    )


def test_config_rules_name_their_keys():
    with pytest.raises(ConfigError, match=r"did you mean 'data\.train_batch_size'"):
        rm_config("data.train_batch=4")
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.model\.path'"):
        rm_config("actor_rollout_ref.model.path=x")  # a PPO key is not a reward-model key
    cfg = rm_config("data.train_batch_size=6", "trainer.n_gpus_per_node=4")
    with pytest.raises(ConfigError, match=r"train_batch_size \(6\) must be a multiple of .* 4"):
        validate_reward_training(cfg, 4)
    cfg = rm_config("data.max_length=100", "model.max_token_len_per_gpu=150")
    with pytest.raises(ConfigError, match="cannot hold a pair"):
        validate_reward_training(cfg)
    with pytest.raises(ConfigError, match=r"data\.train_files: required"):
        validate_reward_training(load_config(None, ["model.path=m"], schema=RewardModelRunConfig))
    assert validate_reward_training(rm_config("trainer.n_gpus_per_node=2"), 2).dp_size == 2


def test_cli_says_a_config_error_in_one_line(capsys):
    assert main(["model.path=m", "data.train_file=x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhf-train-rm: config error: unknown config key 'data.train_file'")
    assert "\n" not in err
