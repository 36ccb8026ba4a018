"""Process bootstrap, Megatron parallel state and the CPU compatibility layer."""
