"""User reward functions that misbehave end the step in one line naming the sample, within
`reward.timeout_s`, whatever they do: raise on some rows, return a non-number or NaN, never
return (also with SIGTERM ignored), or kill their process; the workers stay usable."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlhf.config import load_config
from rlhf.reward import RewardInput, RewardScorer
from rlhf.reward.scorer import NonFiniteReward, probe_reward_function
from rlhf.reward.workers import RewardFunctionError

pytestmark = pytest.mark.reliability

USER_CODE = """
import os, signal, time

def picky(data_source, solution_str, ground_truth, extra_info):
    if "boom" in solution_str:
        raise KeyError("no such answer")
    return float(solution_str == ground_truth)

def wordy(data_source, solution_str, ground_truth, extra_info):
    return "correct"

def not_a_number(data_source, solution_str, ground_truth, extra_info):
    return math.nan if solution_str == "nan" else 1.0

def stuck(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            pass
    return 1.0

def with_a_process(data_source, solution_str, ground_truth, extra_info):
    import multiprocessing
    checker = multiprocessing.get_context("fork").Process(target=len, args=("x",))
    checker.start()
    checker.join()
    return float(checker.exitcode == 0)

def crashing(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "exit":
        os._exit(3)
    return 0.5
"""


def scorer(tmp_path, name: str, *overrides: str) -> RewardScorer:
    path = tmp_path / "user_reward.py"
    path.write_text("import math\n" + USER_CODE)
    cfg = load_config(None, [f"reward.custom_fn={path}:{name}", *overrides])
    return RewardScorer.from_config(cfg.reward)


def item(response: str, row: int = 0) -> RewardInput:
    return RewardInput("gsm8k", response, "4", origin=f"row {row} of train.parquet")


def test_a_raise_names_the_row_and_the_error_and_the_workers_go_on(tmp_path):
    score = scorer(tmp_path, "picky", "reward.num_workers=2")
    try:
        with pytest.raises(RewardFunctionError) as err:
            score([item("4", 0), item("boom", 7), item("5", 8)])
        message = str(err.value)
        assert "row 7 of train.parquet" in message and "'boom'" in message
        assert "KeyError: 'no such answer'" in message and "\n" not in message
        assert score([item("4"), item("5"), item("4")]) == [1.0, 0.0, 1.0]
    finally:
        score.close()


def test_a_non_number_is_refused_naming_the_sample(tmp_path):
    score = scorer(tmp_path, "wordy")
    try:
        with pytest.raises(RewardFunctionError, match=r"row 3 of .* returned 'correct'; expected"):
            score([item("x", 3)])
    finally:
        score.close()


def test_a_nan_is_the_non_finite_error_naming_the_sample(tmp_path):
    score = scorer(tmp_path, "not_a_number")
    try:
        with pytest.raises(NonFiniteReward, match=r"returned nan for row 5 of train.parquet"):
            score([item("ok", 4), item("nan", 5)])
    finally:
        score.close()


def test_a_call_that_never_returns_is_killed_after_the_timeout(tmp_path):
    score = scorer(tmp_path, "stuck", "reward.timeout_s=1", "reward.num_workers=2")
    try:
        start = time.monotonic()
        with pytest.raises(RewardFunctionError, match=r"within 1 s \(reward.timeout_s\) on row 2"):
            score([item("a", 0), item("b", 1), item("hang", 2), item("c", 3)])
        assert time.monotonic() - start < 30  # not the 150 s+ of an unbounded wait
        assert score([item("a"), item("b")]) == [1.0, 1.0]  # no answer left over from before
    finally:
        score.close()
    assert score.workers is not None and not score.workers.workers


def test_a_worker_that_dies_is_named_and_replaced(tmp_path):
    score = scorer(tmp_path, "crashing")
    try:
        with pytest.raises(RewardFunctionError, match=r"worker died \(exit code 3\) on row 9"):
            score([item("exit", 9)])
        assert score([item("fine")]) == [0.5]
    finally:
        score.close()


def test_the_startup_probe_catches_a_function_that_fails_on_an_empty_response(tmp_path):
    from rlhf.data.parquet import PromptRow

    row = PromptRow("gsm8k", "q", {"style": "rule", "ground_truth": "4"}, file="t.parquet", row=0)
    path = tmp_path / "user_reward.py"
    path.write_text("import math\n" + USER_CODE)
    cfg = load_config(None, [f"reward.custom_fn={path}:wordy"])
    with pytest.raises(RewardFunctionError, match=r"row 0 of t.parquet, an empty response"):
        probe_reward_function(cfg.reward, row)
    probe_reward_function(load_config(None, [f"reward.custom_fn={path}:picky"]).reward, row)


def test_workers_outlive_the_sigterm_a_scheduler_sends_to_every_process(tmp_path):
    """SLURM signals the whole job: the trainer decides when the run ends (after the step)."""
    score = scorer(tmp_path, "picky")
    try:
        assert score([item("4")]) == [1.0]
        assert score.workers is not None
        for worker in score.workers.workers:
            os.kill(worker.process.pid, signal.SIGTERM)
            os.kill(worker.process.pid, signal.SIGINT)
        time.sleep(0.5)
        assert score([item("4"), item("3")]) == [1.0, 0.0]
    finally:
        score.close()


def test_a_function_may_start_processes_of_its_own(tmp_path):
    """Verifiers and sandboxes often run the check in a child process."""
    score = scorer(tmp_path, "with_a_process")
    try:
        assert score([item("x")]) == [1.0]
    finally:
        score.close()
