"""The prompts an engine takes: token-id lists that fit its context and its vocabulary."""

from __future__ import annotations

from typing import Sequence

from megatron_rl.rollout.engine import PromptError


def check_prompts(prompts: Sequence[Sequence[int]], max_model_len: int, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints, or PromptError naming the first bad one."""
    if not isinstance(prompts, (list, tuple)):
        raise PromptError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raise PromptError(f"prompt {index} is a string; the engine takes token ids (tokenise it first)")
        ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError(f"prompt {index} is empty")
        if len(ids) >= max_model_len:
            raise PromptError(
                f"prompt {index} has {len(ids)} tokens but the engine's context is {max_model_len} tokens "
                "(prompt + response, rollout.max_model_len) and needs room for at least one new token: "
                "drop or truncate it (data.long_prompts=drop, rollout.max_prompt_tokens)"
            )
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise PromptError(f"prompt {index}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
        checked.append(ids)
    return checked
