"""The form of a synthetic data spec, `synthetic:<task>[:<num_prompts>[:<seed>]]` (data.path, an eval set's path),
checked when a config loads; the tasks themselves are megatron_rl.data.tasks (whose TASKS must be these names)."""

from __future__ import annotations

from megatron_rl.config.core import ConfigError

SYNTHETIC_PREFIX = "synthetic:"
SPEC_FORM = "synthetic:<task>[:<num_prompts>[:<seed>]]"
SYNTHETIC_TASKS = ("add", "first_letter", "first_letter8", "last_letter", "lookup8")
"""The built-in tasks' names (megatron_rl.data.tasks.TASKS)."""


def parse_synthetic(spec: str, where: str = "data.path") -> tuple[str, int, int]:
    """'synthetic:first_letter:512:0' -> ('first_letter', 512, 0), or a ConfigError naming `where`, the key that
    holds the spec (checked when the config is validated, so `plan` refuses what `train` would)."""
    parts = spec[len(SYNTHETIC_PREFIX):].split(":")
    name = parts[0]
    if name not in SYNTHETIC_TASKS:
        raise ConfigError(f"{where}={spec!r}: unknown synthetic task {name!r}; known tasks: {', '.join(sorted(SYNTHETIC_TASKS))} "
                          f"(write {SPEC_FORM}, e.g. synthetic:first_letter8:512)")
    numbers = parts[1:]
    if len(numbers) > 2 or not all(n.isdecimal() for n in numbers) or (numbers and int(numbers[0]) < 1):
        raise ConfigError(f"{where}={spec!r}: expected {SPEC_FORM} with num_prompts >= 1 and seed >= 0 as whole numbers, "
                          f"e.g. synthetic:{name}:512:0")
    num = int(numbers[0]) if numbers else 1024
    seed = int(numbers[1]) if len(numbers) > 1 else 0
    return name, num, seed
