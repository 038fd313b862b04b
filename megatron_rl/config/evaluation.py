"""Held-out evaluation sets: `data.eval_sets: {name: path | {path: ..., k: ..., ...}}`.

    data:
      eval_sets:
        aime24: {path: data/aime24.parquet, k: 32, max_new_tokens: 8192}
        math500: data/math500.jsonl            # k = 1 and the defaults below

The sampling defaults are those the reasoning-model papers and the RL frameworks
report their scores with: temperature 0.6 and top-p 0.95 (DeepSeek-R1, 2025,
section 5.1 "Evaluation Setup"; Qwen3's recommended thinking-mode settings),
the response budget of training (rollout.max_new_tokens) unless set.

With rollout.agent set, every sample is a whole episode of that agent (its
tools, parser and rollout.agent_* limits; max_new_tokens is then per turn) and
its score is the episode's reward (rollout.agent_reward; `answer` scores the final
model turn with the set's reward).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.core import ConfigError, check_at_least, from_dict
from megatron_rl.config.synthetic import SYNTHETIC_PREFIX, parse_synthetic

SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(kw_only=True)
class EvalSetConfig:
    """One held-out set, evaluated whole: every prompt, k samples each."""

    path: str = ""
    """jsonl / json / parquet file (or synthetic:<task>:<n>:<seed>) with the prompt and answer fields of training
    data (data.prompt_key, data.answer_key) and an optional `data_source` column (metrics per source)."""
    k: int = 1
    """Samples per prompt (mean@k, pass@k and maj@k are computed over them)."""
    temperature: float = 0.6
    """Sampling temperature (DeepSeek-R1's evaluation setting)."""
    top_p: float = 0.95
    """Nucleus sampling mass (DeepSeek-R1's evaluation setting)."""
    max_new_tokens: int = 0
    """Response budget in tokens; 0 = rollout.max_new_tokens."""
    reward: str = ""
    """Reward function (a registered name or 'module:function'); empty = data.reward."""
    pass_at: list[int] = field(default_factory=list)
    """k values of pass@k to report; empty = 1, 2, 4, ... (powers of two below k) and k itself."""
    correct_at: float = 1.0
    """A sample counts as correct (pass@k, maj@k, accuracy) when its reward is >= this."""
    save_responses: bool = True
    """Keep every response's text in eval/step_<n>.json (besides its reward, length and final answer)."""

    def check(self, where: str) -> None:
        """Raise naming `where` (e.g. data.eval_sets.aime24) when a value is out of range."""
        if not self.path:
            raise ConfigError(f"{where}.path is empty: give the set's .jsonl/.parquet file")
        if self.path.startswith(SYNTHETIC_PREFIX):
            parse_synthetic(self.path, f"{where}.path")
        if self.k < 1:
            raise ConfigError(f"{where}.k={self.k}: samples per prompt must be >= 1")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"{where}.temperature={self.temperature}, {where}.top_p={self.top_p}: need temperature > 0, top_p in (0, 1]")
        check_at_least(f"{where}.max_new_tokens", self.max_new_tokens, 0, "0 = rollout.max_new_tokens")
        bad = [k for k in self.pass_at if not 1 <= k <= self.k]
        if bad:
            raise ConfigError(
                f"{where}.pass_at={self.pass_at}: pass@{bad[0]} needs at least {bad[0]} samples per prompt but {where}.k={self.k}; "
                f"raise k or ask only for pass@1..{self.k}"
            )

    def pass_ks(self) -> list[int]:
        """The pass@k values reported: pass_at, or the powers of two below k and k."""
        if self.pass_at:
            return sorted(set(self.pass_at))
        ks, power = [], 1
        while power < self.k:
            ks.append(power)
            power *= 2
        return [*ks, self.k]


def parse_eval_sets(raw: dict[str, Any], where: str = "data.eval_sets") -> dict[str, EvalSetConfig]:
    """{name: path | mapping of EvalSetConfig fields} -> {name: EvalSetConfig}, every entry checked."""
    sets = {}
    for name, value in raw.items():
        entry = f"{where}.{name}"
        if not isinstance(name, str) or not SET_NAME.match(name):
            raise ConfigError(f"{where}: set name {name!r} must be letters, digits, '_', '.' or '-' (it names metrics and files)")
        if isinstance(value, str):
            value = {"path": value}
        if isinstance(value, EvalSetConfig):
            config = value
        elif isinstance(value, dict):
            config = from_dict(EvalSetConfig, value, entry)
        else:
            raise ConfigError(f"{entry}: expected a file path or a mapping of {sorted(EvalSetConfig.__dataclass_fields__)}, got {value!r}")
        config.check(entry)
        sets[name] = config
    return sets
