"""Run `rlhf-train` in this process and SIGKILL it the moment checkpoint N is published.

    python kill_after_publish_driver.py N --config ... key=value ...

The kill lands after `latest_checkpointed_iteration.txt` names step N and before anything
else the step does (pruning, or a metrics row still to be written): the instant at which a
row written after the checkpoint would be lost for good, since the rerun resumes after N.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from rlhf.checkpoint.manager import CheckpointManager
from rlhf.cli import train

publish = CheckpointManager._publish


def publish_then_die(self: CheckpointManager, tmp: Path, step: int) -> None:
    publish(self, tmp, step)
    if step == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    CheckpointManager._publish = publish_then_die  # type: ignore[method-assign]
    sys.exit(train.main(sys.argv[2:]))
