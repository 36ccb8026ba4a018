"""`rlhf-train-rm` on this rank (the fork-server launcher's ranks run it as torchrun's would)."""

from __future__ import annotations

import sys

from rlhf.cli.train_rm import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    if code:
        raise SystemExit(code)
