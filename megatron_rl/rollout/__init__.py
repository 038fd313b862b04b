"""Rollout: the RolloutEngine protocol and the vLLM engines (in-process and servers).

    from megatron_rl.rollout import VLLMEngine, SamplingSpec
    engine = VLLMEngine(model_dir, cfg.rollout)
    rollouts = engine.generate(prompt_ids, SamplingSpec.from_config(cfg.rollout, seed=step))

engine_protocol.py: every member callers use of an engine (RolloutEngine and its capabilities);
engine.py: errors, bounded restart-and-retry; vllm_engine.py:
in-process vllm.LLM; server_engine.py: OpenAI-compatible vLLM servers;
server_supervisor.py: starts, watches and restarts a server's process; server_main.py: what
that process runs (vLLM's API server); colocated.py: servers hosted by trainer ranks (rollout.engines > 1);
config/placement.py: which of the four placements a config asks for (the one place
the interacting settings are decided); engine_base.py: what the engines share around
generation (restarts, sleep mode; their end of the push is weight_sync.engine_side);
engine_options.py, engine_env.py, engine_files.py: the vLLM options an engine starts with, its
processes' environment, the socket and store files vLLM leaves; prompts.py: the prompts an engine
takes; samples.py: its outputs as RolloutSamples;
worker_ext.py: runs inside vLLM's worker (weight pushes, MoE re-pack,
routed-expert capture); routing.py: matching captures to samples;
sampling.py: SamplingSpec -> vLLM; rewards.py: reward functions.
Importing this package does not import vLLM.
"""

from megatron_rl.config.core import ConfigError
from megatron_rl.config.placement import Placement, resolve_placement
from megatron_rl.rollout.engine import (
    EngineStartError,
    PromptError,
    RolloutError,
    RolloutFailedError,
)
from megatron_rl.rollout.engine_protocol import RolloutEngine
from megatron_rl.rollout.routing import RoutedExpertsError
from megatron_rl.rollout.sampling import SamplingSpec
from megatron_rl.rollout.server_engine import VLLMServerEngine
from megatron_rl.rollout.server_supervisor import VLLMServer
from megatron_rl.rollout.vllm_engine import VLLMEngine


def make_engine(model_dir, config, **kwargs) -> RolloutEngine:
    """The engine a RolloutConfig places (config.placement): servers at server_urls, or one vLLM engine in this
    process or its own. Colocated servers (rollout.engines > 1) are started by every trainer rank instead
    (rollout.colocated.start_colocated_servers)."""
    placement = resolve_placement(config)
    config = placement.rollout_config(config)
    if placement.kind == "remote_servers":
        return VLLMServerEngine(config.server_urls, config, model_dir=model_dir, **kwargs)
    if placement.kind == "colocated_servers":
        raise ConfigError(
            f"rollout.engines={placement.engines}: colocated engines are vLLM servers hosted by the trainer's ranks, "
            "started on every rank by megatron_rl.rollout.colocated.start_colocated_servers (the trainer does this)"
        )
    return VLLMEngine(model_dir, config, **kwargs)


__all__ = [
    "EngineStartError",
    "PromptError",
    "RolloutEngine",
    "RolloutError",
    "RolloutFailedError",
    "RoutedExpertsError",
    "SamplingSpec",
    "VLLMEngine",
    "VLLMServer",
    "VLLMServerEngine",
    "make_engine",
    "Placement",
    "resolve_placement",
]
