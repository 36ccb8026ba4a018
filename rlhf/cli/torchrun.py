"""`python -m rlhf.cli.torchrun ...`: torch's `torch.distributed.run`, with a scheduler's
signal ending it like the workers it waited for instead of in a traceback.

SLURM (and Kubernetes) signal every process of a job: the workers end after their step,
with a checkpoint when it fits (`rlhf.trainer.stopping`), each saying so in one line, and
torchrun waits for them (`launch/torchrun.sh` sets `--shutdown-timeout`); torchrun itself
then raised `SignalException` with a 30-line traceback and exited 1. Here it exits 128 + the
signal, as the workers do, after one line. Everything else is torchrun's own behaviour.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

from rlhf.errors import ends_in_one_line


@ends_in_one_line("torchrun")
def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except SignalException as e:
        print(
            f"torchrun: stopped by {e.sigval.name}; the workers ended as their own lines say",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
