"""The CPU quickstart's fixtures: arithmetic problems, a tiny tokenizer and model, a warm start;
for the tool-use quickstart, multiplication problems, a tokenizer and a warm start for tool calls.

Built locally (no model hub): `make quickstart`, the tests and the benchmarks use them.
"""
