"""One error taxonomy (rlhf.errors): each exception a run can stop on is the user's (exit 2)
or external (exit 1), and the command lines end on it with one line saying which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlhf.checkpoint.background import CheckpointWriterError
from rlhf.checkpoint.run_lock import RunDirBusy, RunDirUnusable
from rlhf.checkpoint.storage import CheckpointStorageError
from rlhf.cli import check_env, convert, plot, preprocess, ray_train
from rlhf.cli.doctor_placement import LaunchEnvError
from rlhf.cli.ray_plan import LaunchError
from rlhf.config import ConfigError
from rlhf.data.files import DataFileError
from rlhf.data.parquet import DataError
from rlhf.data.prompts import PromptError
from rlhf.engine.nonfinite import NonFiniteError
from rlhf.errors import EXTERNAL_ERRORS, USER_ERRORS, ends_in_one_line, one_line
from rlhf.logging.tracker import TrackerError
from rlhf.models.hf_io import CheckpointFileError
from rlhf.models.model_dir import ModelDirError
from rlhf.reward.remote import RemoteRewardError
from rlhf.reward.workers import RewardFunctionError
from rlhf.rollout.client import GenerateError
from rlhf.rollout.offline import RolloutDirError
from rlhf.sglang_api import ServerLost, ServerUnavailable, SGLangAPIError

REPO = Path(__file__).resolve().parents[2]

USER = [ConfigError, DataError, CheckpointFileError, RunDirBusy, RunDirUnusable]
USER += [CheckpointStorageError, CheckpointWriterError, FileNotFoundError, PermissionError]
USER += [DataFileError, PromptError, ModelDirError, TrackerError, RolloutDirError, LaunchEnvError]


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


def test_a_launch_error_is_external_and_its_line_is_the_message():
    assert one_line("rlhf-ray-train", LaunchError("no GPUs")) == (1, "rlhf-ray-train: no GPUs")


def bad_launch(*_):
    raise LaunchError("the Ray cluster did not hold 2 node(s) of {'GPU': 8.0} (SPREAD)")


# Each command's `main` on an input it cannot use: (main, argv with {tmp}, exit code, line).
CASES = {
    "rlhf-plot": (
        plot.main,
        ["{tmp}"],
        2,
        "rlhf-plot: error: {tmp}/metrics.jsonl: no such file (is RUN_DIR a run directory?)",
    ),
    "rlhf-convert": (
        convert.main,
        ["hf-to-mcore", "{tmp}/hf", "{tmp}/out", "--tp", "0"],
        2,
        "rlhf-convert: error: --tp 0: a parallel size is at least 1",
    ),
    "check_env": (
        check_env.main,
        ["{tmp}/cpu.lock"],
        2,
        "check_env: error: [Errno 2] No such file or directory: '{tmp}/cpu.lock'",
    ),
    "rlhf-preprocess": (
        preprocess.main,
        ["aime", "--input", "{tmp}/a.jsonl", "--local_dir", "{tmp}", "--data_source", "x"],
        2,
        "rlhf-preprocess: error: --data_source 'x' must start with 'aime' (the AIME reward rule)",
    ),
    "rlhf-ray-train": (  # launch() stubbed: a cluster too small for the run
        ray_train.main,
        ["--config", "{tmp}/run.yaml"],
        1,
        "rlhf-ray-train: the Ray cluster did not hold 2 node(s) of {{'GPU': 8.0}} (SPREAD)",
    ),
}


@pytest.mark.parametrize("program", CASES)
def test_commands_end_on_a_bad_input_in_one_line(program, tmp_path, monkeypatch, capsys):
    """The shared wrapper (rlhf.errors.ends_in_one_line): exit 2 for the user's input, 1 for
    what failed outside it, one line on stderr, no traceback."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(ray_train, "load_run", lambda trainer_args: None)
    monkeypatch.setattr(ray_train, "launch", bad_launch)
    main, argv, code, line = CASES[program]
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == code
    err = capsys.readouterr().err
    assert err == line.format(tmp=tmp_path) + "\n"


def test_other_exceptions_keep_their_traceback():
    """A bug is neither kind: the wrapper lets it through."""

    @ends_in_one_line("rlhf-x")
    def main(argv: list[str] | None = None) -> int:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        main([])


def _wrapped(path: Path) -> bool | None:
    """Whether the module's `main` is wrapped in `ends_in_one_line` (a decorator, or
    `main = ends_in_one_line(...)(main)`); None: it has no `main`."""
    tree = ast.parse(path.read_text())
    wrapped: bool | None = None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            wrapped = any("ends_in_one_line" in ast.unparse(d) for d in node.decorator_list)
        elif isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["main"]:
            wrapped = wrapped or "ends_in_one_line" in ast.unparse(node.value)
    return wrapped


def test_every_command_main_is_wrapped():
    mains = {p.name: _wrapped(p) for p in sorted((REPO / "rlhf" / "cli").glob("*.py"))}
    assert [name for name, wrapped in mains.items() if wrapped is False] == []
    assert sum(1 for wrapped in mains.values() if wrapped) >= 11
