"""Runs rlhf-plot from a checkout; the code is rlhf/cli/plot.py."""

import sys

from rlhf.cli.plot import main

sys.exit(main())
