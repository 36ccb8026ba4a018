"""The training engine: the Megatron models of a run behind logprobs / values / update."""
