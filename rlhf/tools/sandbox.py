"""The Python code tool: the policy's code runs in a sandboxed subprocess.

Each call gets a fresh temporary working directory holding the code as `main.py`, and a new
process (`python -I rlhf/tools/sandbox_boot.py`, its own session) that limits itself before
running it (sandbox_boot.py: CPU seconds, memory, file sizes and count, no processes, no
sockets, no paths outside its directory). From here:

- time: the whole process group is killed after `timeout_s` of wall clock (a `time.sleep`,
  a blocked read), the kernel stops it after `cpu_s` of CPU time (an infinite loop): a
  `timeout` tool error;
- output: stdout and stderr together go to a file, which the kernel stops at `file_mb`
  (10 GB of prints end there with an error in the code); the first `max_output_bytes`
  are returned, with a note that the output was cut when there was more: an `error`;
- network: the process runs in a new network namespace (`unshare --net`, root or user
  namespaces) when this machine allows it (checked once), else the audit hook alone refuses
  sockets;
- anything else that fails (a raise, a refused operation, a crash, memory exhausted) is the
  process's output plus its exit status, as an `error`.

The directory is removed after the call. Settings: timeout_s (10), cpu_s (5), memory_mb
(1024), max_output_bytes (4096), file_mb (1), max_files (16), python (the interpreter to run
the code with; default this one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf.tools.base import TIMEOUT, Tool, ToolResult

BOOT = Path(__file__).with_name("sandbox_boot.py")
SETTINGS = {
    "timeout_s": 10.0,
    "cpu_s": 5,
    "memory_mb": 1024,
    "max_output_bytes": 4096,
    "file_mb": 1,
    "max_files": 16,
    "python": sys.executable,
}


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """`unshare` arguments that give a process an empty network namespace here, or ()."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net"), (unshare, "--net", "--map-root-user")):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
            if done.returncode == 0:
                return prefix
    return ()


class PythonSandbox(Tool):
    """Runs the `code` argument; returns what it printed (see the module for the limits)."""

    def __init__(self, schema: dict[str, Any], settings: dict[str, Any]):
        super().__init__(schema, settings)
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(SETTINGS)}")
        merged = {**SETTINGS, **settings}
        self.timeout_s = float(merged["timeout_s"])
        self.cpu_s, self.memory_mb = int(merged["cpu_s"]), int(merged["memory_mb"])
        self.max_output_bytes = int(merged["max_output_bytes"])
        self.file_mb, self.max_files = int(merged["file_mb"]), int(merged["max_files"])
        self.python = str(merged["python"])

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        return await self.run(str(arguments.get("code", "")))

    async def run(self, code: str) -> ToolResult:
        """Run `code` in a fresh sandbox."""
        workdir = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-"))
        output = workdir.with_name(workdir.name + ".out")  # outside the code's directory
        try:
            (workdir / "main.py").write_text(code)
            return await self._run_in(workdir, output)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            output.unlink(missing_ok=True)

    def argv(self, workdir: Path) -> list[str]:
        limits = [self.cpu_s, self.memory_mb, self.file_mb, self.max_files]
        boot = [self.python, "-I", str(BOOT), str(workdir), *map(str, limits)]
        return [*network_namespace_prefix(), *boot]

    async def _run_in(self, workdir: Path, output: Path) -> ToolResult:
        """Run in `workdir`, stdout and stderr into the file `output`: a file, not a pipe, so
        that the kernel's file size limit bounds what the code can print (`file_mb`) and no
        unread pipe can keep a killed process from being reaped."""
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(workdir),
                cwd=workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir)},
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
            _kill_group(proc)  # whatever it left running
        with output.open("rb") as out:
            text = out.read(self.max_output_bytes).decode("utf-8", errors="replace")
        if output.stat().st_size > self.max_output_bytes:
            return ToolResult.failed(
                f"the output exceeded {self.max_output_bytes} bytes and was cut:\n{text}"
            )
        if code == -signal.SIGXCPU:
            return ToolResult.failed(f"the code used its {self.cpu_s} s of CPU time", TIMEOUT)
        if code != 0:
            return ToolResult.failed(f"exit status {_status(code)}\n{text}")
        return ToolResult(text)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)
