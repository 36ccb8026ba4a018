"""The Python code tool: the policy's code runs behind a kernel boundary.

Each call starts a fresh sandbox (rlhf.tools.isolation: bubblewrap namespaces, nobody, a
read-only minimal root with the bare standard library, a seccomp filter) whose one
writable directory, a `disk_mb` tmpfs, holds the code as `main.py`; inside, the bare
interpreter limits itself (rlhf/tools/sandbox_boot.py) and runs it. From here:

- time: the sandbox is killed after `timeout_s` of wall clock (a `time.sleep`, a blocked
  read), the kernel stops the code after `cpu_s` of CPU time (an infinite loop): a
  `timeout` tool error;
- output: stdout and stderr together go to a file outside, which the kernel stops at
  `file_mb`; the first `max_output_bytes` are returned, with a note that the output was cut
  when there was more: an `error`;
- anything else that fails (a raise, a refused operation, a crash, memory exhausted past
  `memory_mb`, a full directory) is the process's output plus its exit status, an `error`.

Nothing of a call is left afterwards: no process (the PID namespace ends with it), no
file (the tmpfs goes with its mount namespace; the output file is removed).

Settings: timeout_s (10), cpu_s (5), memory_mb (1024), max_output_bytes (4096), file_mb (1),
disk_mb (16), python (the interpreter whose installation runs the code; default this one's
base installation), packages (distributions of the trainer's environment the code may
import, with their dependencies: e.g. [numpy, sympy]; none by default), insecure_local
(false; true runs the code as a plain child process of the trainer, with the resource
limits only: for code you trust, on a machine without bubblewrap).

If this machine cannot provide the boundary (no bubblewrap, no libseccomp, no user
namespaces), the tool refuses to start, saying what is missing, unless insecure_local.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf.tools import isolation
from rlhf.tools.base import TIMEOUT, Tool, ToolResult

BOOT = Path(__file__).with_name("sandbox_boot.py")
SETTINGS: dict[str, Any] = {
    "timeout_s": 10.0,
    "cpu_s": 5,
    "memory_mb": 1024,
    "max_output_bytes": 4096,
    "file_mb": 1,
    "disk_mb": 16,
    "python": sys.executable,
    "packages": [],
    "insecure_local": False,
}
REPLACED = {"max_files": "disk_mb (the size of the code's one writable directory)"}


class PythonSandbox(Tool):
    """Runs the `code` argument; returns what it printed (see the module for the limits)."""

    def __init__(self, schema: dict[str, Any], settings: dict[str, Any]):
        super().__init__(schema, settings)
        for key in set(settings) & set(REPLACED):
            raise ValueError(f"setting {key!r} was replaced by {REPLACED[key]}")
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(SETTINGS)}")
        merged = {**SETTINGS, **settings}
        self.timeout_s = float(merged["timeout_s"])
        self.cpu_s, self.memory_mb = int(merged["cpu_s"]), int(merged["memory_mb"])
        self.max_output_bytes = int(merged["max_output_bytes"])
        self.file_mb, self.disk_mb = int(merged["file_mb"]), int(merged["disk_mb"])
        self.insecure = bool(merged["insecure_local"])
        self.python = isolation.interpreter(str(merged["python"]))
        self.packages = _packages(merged["packages"], self.python)
        if not self.insecure:
            missing = isolation.check_machine()
            if missing is not None:
                raise ValueError(
                    f"the sandbox cannot start: {missing}; `insecure_local: true` runs the "
                    "code without it (trusted code only: it then sees your files and network)"
                )
            self.mounts = isolation.system_mounts() + isolation.interpreter_mounts(
                self.python, self.packages, BOOT
            )

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        return await self.run(str(arguments.get("code", "")))

    async def run(self, code: str) -> ToolResult:
        """Run `code` in a fresh sandbox."""
        fd, name = tempfile.mkstemp(prefix="rlhf-sandbox-", suffix=".out")
        os.close(fd)
        output = Path(name)
        try:
            if self.insecure:
                return await self._run_insecure(code, output)
            return await self._run_isolated(code, output)
        finally:
            output.unlink(missing_ok=True)

    def boot_argv(self, boot: Path | str, package_dirs: list[str]) -> list[str]:
        limits = [self.cpu_s, self.memory_mb, self.file_mb]
        python = self.python.executable
        return [python, "-I", "-S", "-B", str(boot), *map(str, limits), *package_dirs]

    async def _run_isolated(self, code: str, output: Path) -> ToolResult:
        bwrap = shutil.which("bwrap") or "bwrap"
        code_fd = isolation.memfd("main.py", code.encode("utf-8", errors="replace"))
        filter_fd = isolation.memfd("seccomp", isolation.seccomp_filter())
        try:
            argv = isolation.bwrap_argv(bwrap, self.disk_mb, code_fd, filter_fd, self.mounts)
            package_dirs = [isolation.PACKAGES] if self.packages else []
            argv += self.boot_argv(isolation.BOOT_INSIDE, package_dirs)
            return await self._run_in(argv, "/", output, (code_fd, filter_fd), bwrap=True)
        finally:
            os.close(code_fd)
            os.close(filter_fd)

    async def _run_insecure(self, code: str, output: Path) -> ToolResult:
        workdir = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-"))
        try:
            (workdir / "main.py").write_text(code, errors="replace")
            package_dirs = sorted({str(Path(p).parent) for p in self.packages.values()})
            argv = self.boot_argv(BOOT, package_dirs)
            return await self._run_in(argv, str(workdir), output, (), bwrap=False)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run_in(
        self, argv: list[str], cwd: str, output: Path, fds: tuple[int, ...], bwrap: bool
    ) -> ToolResult:
        """Run `argv`, stdout and stderr into the file `output`: a file, not a pipe, so that
        the kernel's file size limit bounds what the code can print (`file_mb`) and no
        unread pipe can keep a killed process from being reaped."""
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                pass_fds=fds,
                env=isolation.environment(cwd),  # bwrap's own: nothing of the trainer's
            )
        try:
            code = await asyncio.wait_for(proc.wait(), timeout=self.timeout_s)
        except TimeoutError:
            _kill_group(proc)
            await proc.wait()
            return ToolResult.failed(
                f"the code did not finish within {self.timeout_s:g} s", TIMEOUT
            )
        finally:
            _kill_group(proc)  # whatever it left running (insecure_local)
        return self._result(code, output, bwrap)

    def _result(self, code: int, output: Path, bwrap: bool) -> ToolResult:
        with output.open("rb") as out:
            text = out.read(self.max_output_bytes).decode("utf-8", errors="replace")
        if output.stat().st_size > self.max_output_bytes:
            return ToolResult.failed(
                f"the output exceeded {self.max_output_bytes} bytes and was cut:\n{text}"
            )
        signo = -code if code < 0 else code - 128 if bwrap and code > 128 else 0
        if signo == signal.SIGXCPU:
            return ToolResult.failed(f"the code used its {self.cpu_s} s of CPU time", TIMEOUT)
        if code != 0:
            return ToolResult.failed(f"exit status {_status(code, signo)}\n{text}")
        return ToolResult(text)


def _packages(names: Any, python: isolation.Interpreter) -> dict[str, str]:
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"packages must be a list of distribution names, got {names!r}")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if names and python.version != here:
        raise ValueError(
            f"packages come from the trainer's Python {here}; python= is {python.version}"
        )
    return isolation.distribution_paths(names)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _status(code: int, signo: int) -> str:
    if signo > 0:
        with contextlib.suppress(ValueError):
            return f"{code} (killed by {signal.Signals(signo).name})"
    return str(code)
