"""Prompt data: tokenizers, datasets, samplers and packing."""
