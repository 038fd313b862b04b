"""Rollout: the RolloutEngine protocol and the vLLM engines (in-process and servers).

    from megatron_rl.rollout import VLLMEngine, SamplingSpec
    engine = VLLMEngine(model_dir, cfg.rollout)
    rollouts = engine.generate(prompt_ids, SamplingSpec.from_config(cfg.rollout, seed=step))

engine.py: protocol, errors, bounded restart-and-retry; vllm_engine.py:
in-process vllm.LLM; server_engine.py: OpenAI-compatible vLLM servers;
colocated.py: servers hosted by trainer ranks (rollout.engines > 1);
worker_ext.py: runs inside vLLM's worker (weight pushes, MoE re-pack,
routed-expert capture); routing.py: matching captures to samples;
sampling.py: SamplingSpec -> vLLM; rewards.py: reward functions.
Importing this package does not import vLLM.
"""

from megatron_rl.config.core import ConfigError
from megatron_rl.rollout.engine import (
    EngineStartError,
    PromptError,
    RolloutEngine,
    RolloutError,
    RolloutFailedError,
)
from megatron_rl.rollout.routing import RoutedExpertsError
from megatron_rl.rollout.sampling import SamplingSpec
from megatron_rl.rollout.server_engine import VLLMServer, VLLMServerEngine
from megatron_rl.rollout.vllm_engine import VLLMEngine


def make_engine(model_dir, config, **kwargs) -> RolloutEngine:
    """The engine a RolloutConfig names: in-process (engine=vllm) or servers (engine=vllm_server)."""
    if config.engine == "vllm_server":
        if not config.server_urls:
            raise ConfigError(
                "rollout.engine=vllm_server needs rollout.server_urls=[http://host:port, ...] (servers started with "
                "`megatron-rl serve`), or a launch by launch/slurm.sbatch with cluster.rollout_gpus, which starts them"
            )
        return VLLMServerEngine(config.server_urls, config, model_dir=model_dir, **kwargs)
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
]
