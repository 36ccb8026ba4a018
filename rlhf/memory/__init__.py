"""Memory: what a config needs per GPU (planner, report) and what a call allocates (measure)."""
