"""The episode interface: an Environment a user writes in one small class.

    class Guess(Environment):                    # rollout.agent=my_pkg.guess:Guess
        def reset(self, prompt):                 # None: the episode starts from the row's prompt tokens
            self.target = int(prompt.answer)
        def step(self, turn):                    # after every model turn (may be `async def`)
            guess = int(turn.text.strip() or -1)
            if guess == self.target:
                return StepResult(reward=1.0, done=True)
            return StepResult(observation="higher" if guess < self.target else "lower")

One instance per episode. `reset(prompt)` may return the first observation (a
text, chat messages, or token ids) instead of the row's prompt; `step(turn)`
gets the model's turn (its exact token ids and their text) and returns the next
observation, a reward and whether the episode is over. The runner
(agents.runner) appends the observation as tokens, rendered with the
tokenizer's chat template as a message of role `observation_role`, after the
model's own tokens, which are never re-tokenised.

The reward of an episode (rollout.agent_reward): `answer` = data.reward on the
final model turn's text (the default: single-turn tasks and tool agents whose
last turn is the answer), `env` = the sum of the rewards `step` returned,
`both` = their sum.

An exception raised by `reset` or `step` fails that episode only: it stays in
the batch with no token in the loss and reward 0, is counted
(`agent/failed_episodes`) and the first ones are logged with their traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from megatron_rl.config.core import ConfigError
from megatron_rl.rollout.import_path import load_object

Observation = Union[str, list, None]
"""A text (one message of the environment's observation_role), chat messages [{'role', 'content'}, ...],
token ids (list[int], appended verbatim), or None (nothing)."""


class AgentError(ConfigError):
    """rollout.agent names nothing usable; the message says what to change (reported like a bad config value)."""


@dataclass(kw_only=True)
class ModelTurn:
    """One model turn of an episode, as the engine sampled it."""

    index: int
    """0 for the first turn."""
    token_ids: list[int]
    """The sampled tokens, including the EOS / stop token that ended the turn."""
    text: str
    """Their text (decoded for reading only: the episode keeps the token ids)."""
    finish_reason: str
    """'stop' (EOS or a stop token) or 'length' (the turn's max_new_tokens)."""


@dataclass(kw_only=True)
class StepResult:
    """What the environment answers to one model turn."""

    observation: Observation = None
    """Appended after the model's turn when the episode goes on (see Observation)."""
    reward: float | None = None
    """Reward of this step (summed over the episode for rollout.agent_reward=env/both)."""
    done: bool = False
    """The episode is over: no more turns."""


@dataclass(kw_only=True)
class AgentContext:
    """What every environment instance may use (the runner builds one per run)."""

    tokenizer: Any
    """megatron_rl.data.tokenizer.Tokenizer of the run."""
    config: Any
    """The RolloutConfig (rollout.agent_* limits)."""
    stats: Any = None
    """agents.runner.EpisodeStats: tool counters (ToolsAgent records into it)."""
    extra: dict = field(default_factory=dict)
    """Free for user code (shared by all episodes of the run)."""


class Environment:
    """One episode's environment (see the module docstring). Subclass it and override reset and step."""

    observation_role: str = "user"
    """Chat role the text observations are rendered as."""

    def __init__(self, context: AgentContext):
        self.context = context

    def reset(self, prompt: Any) -> Observation:
        """Start an episode on `prompt` (data.dataset.Prompt: token_ids, text, answer, row); None = its prompt tokens."""
        return None

    def step(self, turn: ModelTurn) -> StepResult:
        """The environment's answer to the model's turn (may be a coroutine function)."""
        return StepResult(done=True)


class SingleTurn(Environment):
    """One completion per sample (what rollout.agent="" does), on the episode machinery."""

    def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True)


BUILTIN_AGENTS: dict[str, str] = {
    "single_turn": "megatron_rl.rollout.agents.base:SingleTurn",
    "lookup": "megatron_rl.rollout.agents.lookup:LookupAgent",
}
"""Names rollout.agent accepts besides import paths."""


def load_agent(name: str) -> type[Environment]:
    """rollout.agent -> the Environment subclass it names, or AgentError saying what to change."""
    path = BUILTIN_AGENTS.get(name, name)
    if ":" not in path:
        raise AgentError(f"rollout.agent={name!r}: use a built-in ({', '.join(sorted(BUILTIN_AGENTS))}) or an import path 'package.module:Class'")
    expected = "a subclass of megatron_rl.rollout.agents.Environment (or ToolsAgent)"
    cls = load_object("rollout.agent", path, expected, AgentError)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        found = f"class {cls.__name__}" if isinstance(cls, type) else f"{type(cls).__name__} {getattr(cls, '__name__', repr(cls))}"
        raise AgentError(f"rollout.agent={name!r}: {expected} expected; got {found}")
    return cls
