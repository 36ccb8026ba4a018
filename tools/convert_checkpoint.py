"""Runs rlhf-convert from a checkout; the code is rlhf/cli/convert.py."""

import sys

from rlhf.cli.convert import main

sys.exit(main())
