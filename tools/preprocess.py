"""Runs rlhf-preprocess from a checkout; the code is rlhf/cli/preprocess.py."""

import sys

from rlhf.cli.preprocess import main

sys.exit(main())
