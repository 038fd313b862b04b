"""Observations as tokens: the tokenizer's chat template for a tool / user message, appended after the model's turn.

Only the observation is rendered; the conversation so far stays the exact
token ids (the model's own tokens are never re-tokenised, so a chat template
that drops earlier reasoning when a conversation is re-rendered changes
nothing here). With a chat template, the observation's tokens are the text the
template adds for the messages (with the generation prompt of the next
assistant turn): render([anchor] + messages, add_generation_prompt) minus
render([anchor]); without one, a plain `role: content` layout, as
SentencePieceTokenizer.apply_chat_template does.
"""

from __future__ import annotations

from typing import Any

_ANCHOR = [{"role": "user", "content": "x"}]


class ObservationRenderer:
    """Turns an observation (text, messages or token ids) into the token ids appended to an episode."""

    def __init__(self, tokenizer: Any, default_role: str = "user"):
        self.tokenizer = tokenizer
        self.default_role = default_role
        hf = getattr(tokenizer, "_tok", None)
        self._hf = hf if getattr(hf, "chat_template", None) else None

    def messages(self, observation: Any, role: str | None = None) -> list[dict]:
        if isinstance(observation, str):
            return [{"role": role or self.default_role, "content": observation}]
        if isinstance(observation, dict):
            return [observation]
        return list(observation)

    def render(self, observation: Any, role: str | None = None) -> list[int]:
        """Token ids of an observation (token ids pass through unchanged)."""
        if observation is None:
            return []
        if isinstance(observation, (list, tuple)) and observation and all(isinstance(t, int) for t in observation):
            return [int(t) for t in observation]
        messages = self.messages(observation, role)
        if self._hf is None:
            text = "".join(f"{m['role']}: {m['content']} " for m in messages) + "assistant:"
            return list(self.tokenizer.encode(text))
        prefix = self._hf.apply_chat_template(_ANCHOR, tokenize=False)
        full = self._hf.apply_chat_template(_ANCHOR + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(prefix):
            raise ValueError(
                "the tokenizer's chat template renders a conversation differently once messages follow (its prefix "
                f"changed: {prefix[-40:]!r}); observations cannot be appended as tokens: give the environment's "
                "observations as token ids"
            )
        return list(self.tokenizer.encode(full[len(prefix):]))

    def prompt(self, observation: Any) -> list[int]:
        """Token ids of a first observation that replaces the row's prompt."""
        if isinstance(observation, (list, tuple)) and observation and all(isinstance(t, int) for t in observation):
            return [int(t) for t in observation]
        if isinstance(observation, str):
            return list(self.tokenizer.encode(observation))
        return list(self.tokenizer.apply_chat_template(self.messages(observation)))
