"""The rollout function (config key rollout.function): how one batch of prompts becomes samples.

    rollouts = rollout_batch(engine, prompts, spec, tokenizer, cfg)    # experience.generate_and_score's call

`generate` (the default) is one `engine.generate` call, spec.n samples per
prompt. A user's function, given as an import path `package.module:function`,
is called the same way,

    fn(engine, prompts, spec, tokenizer, cfg) -> Rollouts

with `engine` the run's RolloutEngine (rollout.engine), `prompts` the batch's
data.dataset.Prompt rows (token_ids, text, answer, row), `spec` its SamplingSpec
(n = rollout.n_samples, the step's seed), `tokenizer` the run's and `cfg` the whole
RLConfig. It returns Rollouts holding spec.n samples per prompt, prompt-major
(samples[i * n + j] is sample j of prompts[i], its prompt_index i); the reward
(data.reward) scores them afterwards, as it scores the built-in's. It runs on the
rank that holds the engine, in the synchronous loop and in the asynchronous
producer (where a push waits for the whole call); multi-turn episodes are
rollout.agent's, and partial rollouts (train.partial_rollouts) interrupt only the
built-in, so neither combines with a function of one's own.
"""

from __future__ import annotations

from typing import Protocol

from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.import_path import PluginError, load_callable


class RolloutFunction(Protocol):
    """The call every rollout function takes (see the module docstring)."""

    def __call__(self, engine, prompts, spec, tokenizer, cfg) -> Rollouts: ...


def generate(engine, prompts, spec, tokenizer, cfg) -> Rollouts:
    """The built-in rollout function: one engine.generate call on the prompts' token ids, spec.n samples each."""
    return engine.generate([p.token_ids for p in prompts], spec)


ROLLOUT_FUNCTIONS: dict[str, RolloutFunction] = {"generate": generate}
"""Names rollout.function accepts besides import paths."""


def get_rollout_function(value: str) -> RolloutFunction:
    """rollout.function -> the function: a built-in name, or an import path checked against RolloutFunction
    (PluginError, a ConfigError, naming the key, the value and the call it must take)."""
    if value in ROLLOUT_FUNCTIONS:
        return ROLLOUT_FUNCTIONS[value]
    if ":" not in value:
        raise PluginError(f"rollout.function={value!r}: use a built-in ({', '.join(sorted(ROLLOUT_FUNCTIONS))}) or an "
                          "import path 'package.module:function'")
    return load_callable("rollout.function", value, RolloutFunction)


def rollout_batch(engine, prompts: list, spec, tokenizer, cfg) -> Rollouts:
    """The samples of one batch of prompts by cfg.rollout.function; what a user's function returns is checked
    (the count and order of its samples, one line naming the key if they are wrong)."""
    value = cfg.rollout.function
    rollouts = get_rollout_function(value)(engine, prompts, spec, tokenizer, cfg)
    if value in ROLLOUT_FUNCTIONS:
        return rollouts
    want = len(prompts) * spec.n
    if not isinstance(rollouts, Rollouts) or rollouts.n_samples != spec.n or len(rollouts) != want:
        found = (f"Rollouts of {len(rollouts)} samples, n_samples={rollouts.n_samples}" if isinstance(rollouts, Rollouts)
                 else type(rollouts).__name__)
        raise PluginError(f"rollout.function={value!r} returned {found} for {len(prompts)} prompts: it must return "
                          f"Rollouts with n_samples={spec.n} and {want} samples, prompt-major")
    misplaced = [i for i, s in enumerate(rollouts) if s.prompt_index != i // spec.n]
    if misplaced:
        i = misplaced[0]
        raise PluginError(f"rollout.function={value!r}: sample {i} has prompt_index {rollouts.samples[i].prompt_index}, "
                          f"expected {i // spec.n} (samples are prompt-major: samples[i * n + j] answers prompts[i])")
    return rollouts


__all__ = ["ROLLOUT_FUNCTIONS", "RolloutFunction", "generate", "get_rollout_function", "rollout_batch"]
