"""The error taxonomy every command line shares: what a run stops on, as one line and an exit
code.

- `UserError` (exit 2): something the user gave cannot be used: the config, the data, a model
  or checkpoint directory, the run directory. Fixing the input fixes the run.
- `ExternalError` (exit 1): something outside the input failed: an SGLang server, a reward
  endpoint or the user's reward function at run time, a step's numbers (NaN/inf).

Each exception class of the project derives from one of the two (besides its builtin base,
which callers may still catch); `kind` is the word the line starts with after the program's
name (an empty one: the message follows the name). A few builtins count too: a missing or
unwritable path is the user's, a timeout or a refused connection is external.

Every command's `main` is wrapped in `ends_in_one_line(program)`, which turns an error of
either kind that reaches it into that line on stderr and the exit code; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec


class UserError(Exception):
    """An input the run cannot use; exit 2."""

    kind = "error"


class ExternalError(Exception):
    """A failure outside the input; exit 1."""

    kind = "failed"


USER_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, PermissionError)
EXTERNAL_ERRORS = (ExternalError, TimeoutError, ConnectionError, FloatingPointError)


def one_line(program: str, error: BaseException) -> tuple[int, str]:
    """The exit code and the line `program` ends with on `error` (a `USER_ERRORS` or
    `EXTERNAL_ERRORS` one)."""
    user = isinstance(error, USER_ERRORS)
    default = "error" if user else "stopped" if isinstance(error, FloatingPointError) else "failed"
    kind = getattr(error, "kind", default)
    text = str(error) or type(error).__name__
    return (2 if user else 1), f"{program}: {kind}: {text}" if kind else f"{program}: {text}"


P = ParamSpec("P")


def ends_in_one_line(program: str) -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Decorate a command's `main(argv) -> exit code`: a `USER_ERRORS` or `EXTERNAL_ERRORS`
    error it raises ends it with `one_line`'s line on stderr and exit code (2 or 1)."""

    def wrap(main: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(main)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except (*USER_ERRORS, *EXTERNAL_ERRORS) as e:
                code, line = one_line(program, e)
                print(line, file=sys.stderr, flush=True)
                return code

        return run

    return wrap
