"""The PPO loop and its stages."""
