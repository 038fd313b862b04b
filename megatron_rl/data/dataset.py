"""Prompt datasets: jsonl or parquet files, or a built-in synthetic task.

Each row holds a prompt (text, or chat messages) and a reference answer that
the reward compares against. Rows are checked when the file is read: a
missing field, a wrong type, an empty prompt or an empty (null) answer is an
error naming the file, the row and the field. Prompts longer than the limit
are dropped and counted, or rejected (`data.long_prompts`).

The sampler is deterministic in (seed, epoch) and its position is a plain
dict, so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config.core import read_json_file
from megatron_rl.data.tasks import SYNTHETIC_PREFIX, synthetic_rows
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.extras import import_extra


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, row and field."""


@dataclass(kw_only=True)
class Prompt:
    """One prompt ready for the engine."""

    index: int
    """Row number in the source file (0-based)."""
    token_ids: list[int]
    """Prompt token ids (chat template applied when configured)."""
    text: str
    """Prompt text as read (messages joined for chat rows)."""
    answer: Any
    """Reference answer passed to the reward."""
    row: dict = field(default_factory=dict)
    """The source row as read (agents, megatron_rl.rollout.agents, may read fields beyond prompt and answer)."""


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Rows of a .jsonl / .json / .parquet file, or of a `synthetic:<task>` name."""
    spec = str(path)
    if spec.startswith(SYNTHETIC_PREFIX):
        return synthetic_rows(spec)
    p = Path(spec)
    if not p.is_file():
        raise DatasetError(f"dataset file {spec!r} does not exist: set data.path to a .jsonl/.parquet file or synthetic:<task>")
    if p.suffix == ".parquet":
        import_extra("pyarrow", extra="data", feature=f"reading {spec}")
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises its own error types
            raise DatasetError(f"{spec}: not a readable parquet file ({err}); write it again or use .jsonl") from None
    if p.suffix == ".json":
        data = read_json_file(p, DatasetError, "fix the file or use .jsonl (one row per line)")
        if not isinstance(data, list):
            raise DatasetError(f"{spec}: a .json dataset must hold a list of rows, got {type(data).__name__}")
        return data
    if p.suffix != ".jsonl":
        raise DatasetError(f"{spec}: unsupported dataset format {p.suffix!r}; use .jsonl, .json or .parquet")
    rows = []
    with p.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DatasetError(f"{spec}:{line_no}: not valid JSON ({err.msg}); fix or remove that line") from None
    return rows


def _prompt_text(row: Any, where: str, prompt_key: str) -> str | list[dict[str, str]]:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise DatasetError(f"{where}: missing field {prompt_key!r} (fields: {sorted(row)}); set data.prompt_key to the prompt's field")
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: field {prompt_key!r} as chat messages needs {{'role': str, 'content': str}} items, got {m!r}")
        if not any(m["content"].strip() for m in prompt):
            raise DatasetError(f"{where}: field {prompt_key!r} holds only empty messages")
        return prompt
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {prompt_key!r} must be a string or chat messages, got {type(prompt).__name__}")
    if not prompt.strip():
        raise DatasetError(f"{where}: field {prompt_key!r} is empty")
    return prompt


class PromptDataset:
    """Tokenised prompts with a seeded, resumable order."""

    def __init__(
        self,
        path: str | os.PathLike,
        tokenizer: Tokenizer,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        apply_chat_template: bool = False,
        max_prompt_tokens: int = 0,
        long_prompts: str = "drop",
        shuffle: bool = True,
        seed: int = 0,
    ):
        rows = read_rows(path)
        if not rows:
            raise DatasetError(f"dataset {str(path)!r} holds no rows: point data.path at a non-empty file")
        self.prompts: list[Prompt] = []
        self.num_dropped_long = 0
        for index, row in enumerate(rows):
            where = f"{path} row {index}"
            prompt = _prompt_text(row, where, prompt_key)
            if answer_key not in row:
                raise DatasetError(f"{where}: missing field {answer_key!r} (fields: {sorted(row)}); set data.answer_key")
            answer = row[answer_key]
            if answer is None or (isinstance(answer, str) and not answer.strip()):
                raise DatasetError(
                    f"{where}: field {answer_key!r} is empty ({answer!r}): the reward compares each response with it; "
                    "fill it in or remove the row"
                )
            if isinstance(prompt, list):
                ids = tokenizer.apply_chat_template(prompt)
                text = "\n".join(m["content"] for m in prompt)
            else:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if apply_chat_template else tokenizer.encode(prompt)
                text = prompt
            if not ids:
                raise DatasetError(f"{where}: the prompt tokenises to nothing; check the tokenizer ({prompt!r})")
            if max_prompt_tokens and len(ids) > max_prompt_tokens:
                if long_prompts == "error":
                    raise DatasetError(
                        f"{where}: prompt has {len(ids)} tokens > rollout.max_prompt_tokens={max_prompt_tokens}; "
                        "raise the limit or set data.long_prompts=drop"
                    )
                self.num_dropped_long += 1
                continue
            self.prompts.append(Prompt(index=index, token_ids=list(ids), text=text, answer=row[answer_key], row=row))
        if not self.prompts:
            raise DatasetError(
                f"dataset {str(path)!r}: all {len(rows)} prompts are longer than rollout.max_prompt_tokens={max_prompt_tokens}"
            )
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def __len__(self) -> int:
        return len(self.prompts)

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.prompts), generator=gen).tolist()

    def next_batch(self, num_prompts: int) -> list[Prompt]:
        """The next `num_prompts` prompts, wrapping into a new (reshuffled) epoch."""
        batch = []
        while len(batch) < num_prompts:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.prompts[self._order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != len(self.prompts):
            raise DatasetError(
                f"checkpoint's data position is for a dataset of {state.get('size')} prompts, this one has {len(self.prompts)}: "
                "resume with the same data.path and rollout.max_prompt_tokens"
            )
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self._order = self._epoch_order()
