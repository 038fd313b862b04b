"""megatron_rl: RL post-training of mixture-of-experts LLMs on megatron-core with vLLM rollouts."""

__version__ = "0.1.0"
