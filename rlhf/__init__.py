"""rlhf: KL-regularised PPO for LLMs on Megatron-Core with SGLang rollouts."""

__version__ = "0.1.0"
