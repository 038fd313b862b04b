"""How many requests a rollout client keeps in flight, how long it waits, and when a server is dead.

In flight: each engine runs at most `max_num_seqs` sequences at once (vLLM's
scheduler limit, reported by the engine's workers), and a completion request
for one prompt with n samples occupies n of them. So each engine gets
max(1, max_num_seqs // n) prompts at a time, and the client keeps
engines x that many in flight: 16 engines x (256 // 8) = 512 prompts, where a
fixed cap of 64 would leave 7 of every 8 sequence slots empty.

Dead or slow: a long request (thousands of tokens) may take longer than any
fixed timeout. A generation request therefore has no time limit of its own;
while it runs, the client asks its server's /health every
`health_interval_s` and counts the server dead only when /health stops
answering (HEALTH_FAILURES_TO_DEAD times in a row). A slow server is waited
for; a dead one fails the batch at once.

Start-up: loading a model's weights takes time in proportion to their size,
so rollout.server_start_timeout_s = 0 (the default) means
BASE_START_S + START_S_PER_GIB x the model's safetensors GiB:
300 s + 30 s/GiB x 57 GiB (Qwen3-30B-A3B in bf16) = 2,010 s.
"""

from __future__ import annotations

import os
from pathlib import Path

BASE_START_S = 300.0
"""Start-up time allowed for any model: importing vLLM, building the engine, the KV cache, warm-up."""

START_S_PER_GIB = 30.0
"""Start-up time allowed per GiB of weights (read from a shared file system at ~35 MB/s or faster)."""

HEALTH_FAILURES_TO_DEAD = 2
"""Consecutive unanswered /health checks after which a server with requests in flight is dead."""


def prompts_in_flight(max_num_seqs: int, n_samples: int) -> int:
    """Prompts (requests of n samples) one engine serves at once: max(1, max_num_seqs // n)."""
    if max_num_seqs < 1 or n_samples < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}, n_samples={n_samples}: both must be >= 1")
    return max(1, max_num_seqs // n_samples)


def model_gib(model_dir: str | os.PathLike) -> float:
    """GiB of the model's safetensors files (0 when the directory is not readable here, e.g. on another node)."""
    try:
        return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / (1 << 30)
    except OSError:
        return 0.0


def start_timeout_s(configured_s: float, model_dir: str | os.PathLike | None) -> float:
    """rollout.server_start_timeout_s when set (> 0), else scaled with the model's size (module docstring)."""
    if configured_s > 0:
        return float(configured_s)
    gib = model_gib(model_dir) if model_dir else 0.0
    return BASE_START_S + START_S_PER_GIB * gib


def health_interval_s(request_timeout_s: float) -> float:
    """How often a server with generation requests in flight is asked /health: the control-call timeout, at most 30 s."""
    return max(0.05, min(float(request_timeout_s), 30.0))
