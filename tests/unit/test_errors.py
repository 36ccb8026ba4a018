"""One error taxonomy (rlhf.errors): each exception a run can stop on is the user's (exit 2)
or external (exit 1), and the command lines end on it with one line saying which."""

from __future__ import annotations

import pytest

from rlhf.checkpoint.background import CheckpointWriterError
from rlhf.checkpoint.run_lock import RunDirBusy, RunDirUnusable
from rlhf.checkpoint.storage import CheckpointStorageError
from rlhf.config import ConfigError
from rlhf.data.parquet import DataError
from rlhf.errors import EXTERNAL_ERRORS, USER_ERRORS, one_line
from rlhf.models.hf_io import CheckpointFileError
from rlhf.reward.remote import RemoteRewardError
from rlhf.reward.workers import RewardFunctionError
from rlhf.rollout.client import GenerateError
from rlhf.sglang_api import ServerLost, ServerUnavailable, SGLangAPIError
from rlhf.trainer.nonfinite import NonFiniteError

USER = [ConfigError, DataError, CheckpointFileError, RunDirBusy, RunDirUnusable]
USER += [CheckpointStorageError, CheckpointWriterError, FileNotFoundError, PermissionError]


@pytest.mark.parametrize("cls", USER, ids=lambda c: c.__name__)
def test_the_users_errors_exit_2_in_one_line(cls):
    assert issubclass(cls, USER_ERRORS) and not issubclass(cls, EXTERNAL_ERRORS)
    if cls is DataError:  # made of the problems found (file, row, column each)
        return
    assert one_line("rlhf-train", cls("data.train_files: no such file")) == (
        2,
        "rlhf-train: error: data.train_files: no such file",
    )


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (GenerateError("http://h:1 unreachable"), "rlhf-train: rollout failed: http://h:1 "),
        (SGLangAPIError("http://h:1 said 500", "http://h:1", False), "rlhf-train: rollout failed"),
        (ServerLost("http://h:1 died"), "rlhf-train: rollout failed: "),
        (ServerUnavailable("http://h:1 did not answer"), "rlhf-train: rollout failed: "),
        (RemoteRewardError("http://r:2 timed out"), "rlhf-train: reward failed: "),
        (RewardFunctionError("row 0 raised"), "rlhf-train: reward failed: "),
        (NonFiniteError("actor/pg_loss is nan"), "rlhf-train: stopped: "),
        (FloatingPointError("nan"), "rlhf-train: stopped: "),
        (TimeoutError("no answer in 60 s"), "rlhf-train: failed: "),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else "",
)
def test_external_failures_exit_1_in_one_line(error, line):
    assert isinstance(error, EXTERNAL_ERRORS) and not isinstance(error, USER_ERRORS)
    code, said = one_line("rlhf-train", error)
    assert code == 1 and said.startswith(line)
