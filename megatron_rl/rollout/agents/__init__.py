"""Multi-turn episodes: environments, tool-calling agents, and the runner that drives them on an engine.

    rollout.agent=single_turn | lookup | package.module:Class

The experience loop asks `EpisodeRunner.run` for samples and does not know
whether a sample had one turn or ten: one episode is one sample whose
response_loss_mask is True on model tokens and False on observation tokens.
See base (the interface), tools (ToolsAgent and vLLM's tool parsers), render
(observations as tokens), runner (the loop) and stats (metrics, traces).
"""

from megatron_rl.rollout.agents.base import (
    BUILTIN_AGENTS,
    AgentContext,
    AgentError,
    Environment,
    ModelTurn,
    SingleTurn,
    StepResult,
    load_agent,
)
from megatron_rl.rollout.agents.runner import EpisodeBatch, EpisodeRunner
from megatron_rl.rollout.agents.tools import Tool, ToolsAgent

__all__ = [
    "BUILTIN_AGENTS",
    "AgentContext",
    "AgentError",
    "Environment",
    "EpisodeBatch",
    "EpisodeRunner",
    "ModelTurn",
    "SingleTurn",
    "StepResult",
    "Tool",
    "ToolsAgent",
    "load_agent",
]
