"""Command-line entry points (console scripts and `python -m rlhf.cli.<name>`)."""
