"""Rollout generation on SGLang servers."""
