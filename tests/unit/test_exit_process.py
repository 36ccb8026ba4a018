"""`rlhf.utils.exit_process`, how `rlhf-train` ends: what Python does at exit but the final
teardown of every object: non-daemon threads joined, atexit handlers run, buffered stdout and
stderr written, the exit code kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from rlhf.utils import exit_process

    out = Path(sys.argv[1])
    atexit.register(lambda: (out / "atexit").write_text("ran"))

    def late_writer():
        time.sleep(0.5)
        (out / "thread").write_text("joined")

    threading.Thread(target=late_writer).start()

    class Finalized:
        def __del__(self):
            (out / "teardown").write_text("ran")

    keep = Finalized()  # freed only by the interpreter's teardown
    sys.stdout.write("buffered stdout")  # a pipe: block-buffered, no newline
    sys.stderr.write("buffered stderr")
    exit_process(3)
    """
)


def test_exit_process_ends_like_python_without_the_teardown(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered pipes
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered stdout"
    assert proc.stderr.endswith("buffered stderr")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert not (tmp_path / "teardown").exists()  # the part skipped
