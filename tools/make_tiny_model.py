"""Runs the tiny model builder from a checkout; the code is rlhf/cli/make_tiny_model.py."""

import sys

from rlhf.cli.make_tiny_model import main

sys.exit(main())
