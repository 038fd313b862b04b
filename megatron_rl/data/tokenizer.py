"""Tokenizers: a Hugging Face tokenizer directory or a sentencepiece model file.

Both give the same small interface (`encode`, `decode`, `eos_id`, `pad_id`,
`vocab_size`, `apply_chat_template`), so datasets and rewards do not care which
one they hold. A sentencepiece `.model` is used through sentencepiece itself:
with transformers 5.x, `LlamaTokenizer(vocab_file=...)` builds without error
but encodes every text to an empty list.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol



class TokenizerError(ValueError):
    """A tokenizer that cannot be found or used; the message names the path and the fix."""

class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer."""

    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


class HFTokenizer:
    """A transformers tokenizer loaded from a directory (tokenizer.json / tokenizer.model + config)."""

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer

        self.path = str(path)
        self._tok = AutoTokenizer.from_pretrained(self.path)
        if self._tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer in {self.path!r} has no eos token: set eos_token in its tokenizer_config.json")
        self.eos_id = int(self._tok.eos_token_id)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise TokenizerError(
                f"tokenizer in {self.path!r} has no chat template: set data.apply_chat_template=false "
                "or add a chat_template to its tokenizer_config.json"
            )
        out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)


class SentencePieceTokenizer:
    """A sentencepiece model file used through sentencepiece itself."""

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece as spm

        self.path = str(model_file)
        self._sp = spm.SentencePieceProcessor(model_file=self.path)
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise TokenizerError(f"sentencepiece model {self.path!r} has no eos piece: train it with eos_id set")
        self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else self.eos_id
        self.vocab_size = int(self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([i for i in ids if i != self.eos_id and i != self.pad_id])

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        # A bare sentencepiece model carries no template; a plain role-tagged layout is used.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode(text)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """An HF tokenizer directory or a sentencepiece `.model` file -> Tokenizer."""
    p = Path(path)
    if p.is_file() and p.suffix == ".model":
        return SentencePieceTokenizer(p)
    if p.is_dir():
        if any((p / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return HFTokenizer(p)
        raise TokenizerError(
            f"directory {str(p)!r} holds no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model): "
            "point data.tokenizer at an HF tokenizer directory or a sentencepiece .model file"
        )
    raise TokenizerError(
        f"tokenizer path {str(p)!r} does not exist or is neither a directory nor a .model file: "
        "point data.tokenizer at an HF tokenizer directory or a sentencepiece .model file"
    )
