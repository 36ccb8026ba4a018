"""Runs the environment check from a checkout; the code is rlhf/cli/check_env.py."""

import sys

from rlhf.cli.check_env import main

sys.exit(main())
