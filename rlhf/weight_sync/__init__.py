"""Megatron shards -> HF-named full tensors -> SGLang servers, after every training step."""
