"""Runs rlhf-doctor from a checkout; the code is rlhf/cli/doctor.py."""

import sys

from rlhf.cli.doctor import main

sys.exit(main())
