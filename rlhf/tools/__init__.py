"""Tools the policy calls during multi-turn rollouts (rlhf.rollout.multi_turn)."""
