"""An agent environment (docs/extending.md), with this folder on
PYTHONPATH: rollout.agent=guess_environment:Guess. The model guesses the
row's answer, a number, and is told "higher" or "lower" until it hits it;
rollout.agent_reward=env scores an episode by the rewards step returned.
"""

from __future__ import annotations

from megatron_rl.rollout.agents import Environment, ModelTurn, StepResult


class Guess(Environment):
    def reset(self, prompt):
        self.target = int(prompt.answer)
        return None  # the episode starts from the row's prompt

    def step(self, turn: ModelTurn) -> StepResult:
        text = turn.text.strip()
        if not text.lstrip("-").isdigit():
            return StepResult(observation="a number, please", reward=0.0)
        guess = int(text)
        if guess == self.target:
            return StepResult(reward=1.0, done=True)
        hint = "higher" if guess < self.target else "lower"
        return StepResult(observation=hint, reward=0.0)
