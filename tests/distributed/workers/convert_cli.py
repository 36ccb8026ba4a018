"""Worker: `rlhf-convert ARGS` on the launched ranks (WORLD_SIZE set, so it runs as it does
under the torchrun it would start itself); rank 0's output goes to OUT_FILE.

    convert_cli.py OUT_FILE ARGS...
"""

from __future__ import annotations

import contextlib
import os
import sys

from rlhf.cli.convert import main

if __name__ == "__main__":
    out_file, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("RANK", "0") == "0":
        with open(out_file, "w") as out, contextlib.redirect_stdout(out):
            code = main(args)
    else:
        code = main(args)
    sys.exit(code)
