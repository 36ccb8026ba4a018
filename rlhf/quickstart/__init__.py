"""The CPU quickstart's fixtures: arithmetic problems, a tiny tokenizer and model, a warm start.

Built locally (no model hub): `make quickstart`, the tests and the benchmarks use them.
"""
