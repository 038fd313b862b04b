"""A rollout function (docs/extending.md), with this folder on
PYTHONPATH: rollout.function=instruction_rollout:with_instruction

Every prompt goes to the engine after one fixed instruction. Each sample
holds the tokens the engine was given (the instruction, then the
prompt), so the trainer's logprobs are taken on exactly what was
sampled; the reward reads the response as before.
"""

from __future__ import annotations

INSTRUCTION = "Answer with a number only.\n"


def with_instruction(engine, prompts, spec, tokenizer, cfg):
    """spec.n samples of each prompt, prompt-major, as engine.generate
    returns them."""
    prefix = tokenizer.encode(INSTRUCTION)
    return engine.generate([prefix + p.token_ids for p in prompts], spec)
