"""Episode metrics per step and jsonl traces of whole episodes.

Metrics (`EpisodeStats.take()`, then reset): agent/turns_mean, agent/turns_max,
agent/model_tokens, agent/observation_tokens, agent/episodes, agent/cut_max_turns,
agent/cut_budget, agent/cut_length, agent/failed_episodes, agent/malformed_tool_calls,
agent/tool_calls/<tool>, agent/tool_errors/<tool>, agent/tool_latency_s/<tool> (mean),
agent/tool_latency_s_max.

Traces (rollout.agent_trace_every): a few whole episodes per traced step, one
json line each, with the text split into segments marked `model` (in the loss)
or `obs` (observation tokens, out of the loss), the reward and how it ended.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class EpisodeStats:
    """Counters the runner and the tools add to (thread-safe for tool records)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.trace_episodes = 0
        self.reset()

    def reset(self) -> None:
        self.turns: list[int] = []
        self.model_tokens = self.observation_tokens = 0
        self.cuts: dict[str, int] = {}
        self.failed_episodes = 0
        self.failed_logged = getattr(self, "failed_logged", 0)
        self.engine_requests = self.engine_restarts = self.interrupted_turns = 0
        self.wall_s = 0.0
        self.tool_calls: dict[str, int] = {}
        self.tool_errors: dict[str, int] = {}
        self.tool_seconds: dict[str, float] = {}
        self.tool_seconds_max = 0.0
        self.malformed = 0
        self.traced: list[dict] = []

    def record_tool(self, name: str, error: str | None, seconds: float | None) -> None:
        with self._lock:
            if error == "malformed":
                self.malformed += 1
                return
            self.tool_calls[name] = self.tool_calls.get(name, 0) + 1
            if error is not None:
                self.tool_errors[name] = self.tool_errors.get(name, 0) + 1
            if seconds is not None:
                self.tool_seconds[name] = self.tool_seconds.get(name, 0.0) + seconds
                self.tool_seconds_max = max(self.tool_seconds_max, seconds)

    def count(self, what: str, n: int = 1) -> None:
        """Add n to a counter: observation_tokens, engine_requests, engine_restarts, interrupted_turns, failed_episodes, or cut_<reason>."""
        with self._lock:
            if what.startswith("cut_"):
                self.cuts[what[4:]] = self.cuts.get(what[4:], 0) + n
            else:
                setattr(self, what, getattr(self, what) + n)

    def add_episodes(self, episodes: list) -> None:
        with self._lock:
            self.turns += [e.turns for e in episodes]
            self.model_tokens += sum(e.model_tokens for e in episodes)

    def maybe_keep_trace(self, episodes: list, tokenizer: Any, rewards) -> None:
        """Keep the first `trace_episodes` episodes of this batch for the next trace (when traces are on)."""
        if not self.trace_episodes or self.traced:
            return
        for e, reward in list(zip(episodes, rewards.tolist()))[: self.trace_episodes]:
            self.traced.append(episode_trace(e, tokenizer, reward))

    def take(self) -> dict[str, float]:
        """This step's metrics; the counters start again."""
        with self._lock:
            turns = self.turns or [0]
            metrics = {
                "agent/episodes": float(len(self.turns)),
                "agent/turns_mean": sum(turns) / len(turns),
                "agent/turns_max": float(max(turns)),
                "agent/model_tokens": float(self.model_tokens),
                "agent/observation_tokens": float(self.observation_tokens),
                "agent/failed_episodes": float(self.failed_episodes),
                "agent/malformed_tool_calls": float(self.malformed),
                "agent/engine_requests": float(self.engine_requests),
                "agent/engine_restarts": float(self.engine_restarts),
                "agent/interrupted_turns": float(self.interrupted_turns),
                "agent/tool_latency_s_max": self.tool_seconds_max,
            }
            for cut in ("max_turns", "budget", "length"):
                metrics[f"agent/cut_{cut}"] = float(self.cuts.get(cut, 0))
            for name, calls in self.tool_calls.items():
                metrics[f"agent/tool_calls/{name}"] = float(calls)
                metrics[f"agent/tool_errors/{name}"] = float(self.tool_errors.get(name, 0))
                metrics[f"agent/tool_latency_s/{name}"] = self.tool_seconds.get(name, 0.0) / calls
            traced = self.traced
            self.reset()
        self.last_trace = traced
        return metrics


def episode_trace(episode: Any, tokenizer: Any, reward: float) -> dict:
    """One episode as a json-able dict: segments of text marked model / obs (the loss mask, visible)."""
    segments, start = [], 0
    ids, mask = episode.response, episode.mask
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            segments.append({"kind": "model" if mask[start] else "obs", "tokens": end - start, "text": tokenizer.decode(ids[start:end])})
            start = end
    return {
        "prompt": tokenizer.decode(episode.prompt_ids),
        "segments": segments,
        "turns": episode.turns,
        "reward": reward,
        "cut": episode.cut,
        "failed": episode.failed,
        "weight_versions": sorted(set(episode.versions)),
    }


def write_trace(path: str | Path, step: int, traced: list[dict]) -> None:
    """Append this step's traced episodes to a jsonl file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in traced:
            f.write(json.dumps({"step": step, **row}) + "\n")
