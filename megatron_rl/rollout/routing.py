"""Routed-expert captures: what the worker records and how samples get their rows.

The worker extension records, for every request it computes, the sequence
positions it ran, the input token at each position and, per MoE layer, the
top-k expert ids of that token (`RequestCapture`). Captures are matched to
samples by token content, not by request id: vLLM rewrites request ids
internally (a random suffix, a child id per sample of n), and a server's ids
are not the client's. A sample's key is prompt + response[:-1], exactly the
tokens the engine fed through the model; two samples with the same key had
the same routing, so either capture serves.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl.weight_sync.buckets import safetensors_metadata


class RoutedExpertsError(RuntimeError):
    """Routed experts could not be assembled for a sample."""


@dataclass
class RequestCapture:
    """What the engine computed for one request."""

    prompt_token_ids: list[int]
    """The request's prompt."""
    positions: np.ndarray
    """[N] int64: sequence positions computed (in step order; a recomputed position appears again)."""
    token_ids: np.ndarray
    """[N] int64: input token at each of those positions."""
    routes: np.ndarray
    """[N, L, K] int16: top-k expert ids per MoE layer for each computed position."""

    def key(self) -> tuple[int, ...]:
        """prompt + the computed tokens past the prompt, in position order."""
        prompt_len = len(self.prompt_token_ids)
        by_position: dict[int, int] = {}
        for pos, tok in zip(self.positions.tolist(), self.token_ids.tolist()):
            if pos >= prompt_len:
                by_position[pos] = tok
        tail = [by_position[p] for p in sorted(by_position)]
        return tuple(self.prompt_token_ids) + tuple(tail)


def encode_captures(captures: list[RequestCapture]) -> bytes:
    """Bytes for a process or HTTP boundary (safetensors with a JSON header of prompts)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    prompts = []
    for i, c in enumerate(captures):
        tensors[f"{i}.positions"] = torch.from_numpy(np.ascontiguousarray(c.positions, dtype=np.int64))
        tensors[f"{i}.token_ids"] = torch.from_numpy(np.ascontiguousarray(c.token_ids, dtype=np.int64))
        tensors[f"{i}.routes"] = torch.from_numpy(np.ascontiguousarray(c.routes, dtype=np.int16))
        prompts.append(list(map(int, c.prompt_token_ids)))
    if not tensors:  # safetensors needs a header; an empty capture is still valid
        tensors["empty"] = torch.zeros(0)
    return save(tensors, metadata={"prompts": json.dumps(prompts)})


def decode_captures(data: bytes | str) -> list[RequestCapture]:
    from safetensors.torch import load

    if isinstance(data, str):
        data = base64.b64decode(data)
    tensors = load(data)
    prompts = json.loads(safetensors_metadata(data).get("prompts", "[]"))
    return [
        RequestCapture(
            prompt_token_ids=prompts[i],
            positions=tensors[f"{i}.positions"].numpy(),
            token_ids=tensors[f"{i}.token_ids"].numpy(),
            routes=tensors[f"{i}.routes"].numpy(),
        )
        for i in range(len(prompts))
    ]


class CaptureIndex:
    """Captures by key; each capture is handed out once (n identical samples take n captures)."""

    def __init__(self, captures: list[RequestCapture]):
        self._by_key: dict[tuple[int, ...], list[RequestCapture]] = {}
        for c in captures:
            self._by_key.setdefault(c.key(), []).append(c)

    def take(self, key: tuple[int, ...]) -> RequestCapture | None:
        found = self._by_key.get(key)
        if not found:
            return None
        return found.pop() if len(found) > 1 else found[0]


def compact_routes(rows: np.ndarray) -> torch.Tensor:
    """[T, L, K] routes as a tensor of the narrowest signed type holding them: int8 when every expert id is below
    128 (models of up to 128 experts: Qwen3-MoE, Mixtral, Moonlight), else int16. Lossless; R3's routes are
    most of a step's bytes (a Qwen3-235B token: 94 layers x top-8 ids, against about 21 bytes for the rest of
    its row), so this halves the samples' routes, and with them the step's batch on rank 0 and every share
    actor.distribute sends (each rank then keeps uint8 ids of its own tokens and layers: actor.routing.replay_routes).
    """
    narrow = rows.size == 0 or int(rows.max()) < 128
    return torch.from_numpy(rows.astype(np.int8 if narrow else np.int16))  # a copy: a view would keep all of `rows`


def assemble_routes(
    capture: RequestCapture | None,
    prompt_ids: list[int],
    response_ids: list[int],
    include_prompt: bool,
    where: str,
) -> torch.Tensor:
    """[R, L, K] (or [P + R, L, K] with include_prompt) rows for one sample (int8 or int16: `compact_routes`).

    Row for position t = the routing computed when token t was the input. The
    final response token is never an input: its row copies the row before it
    (see RolloutSample). Raises RoutedExpertsError naming `where` when a
    needed position was not computed (e.g. prompt tokens served from the
    prefix cache).
    """
    if capture is None:
        raise RoutedExpertsError(f"{where}: no routed-expert capture matches this sample's tokens")
    prompt_len, resp_len = len(prompt_ids), len(response_ids)
    total = prompt_len + resp_len
    layers, top_k = capture.routes.shape[1], capture.routes.shape[2]
    rows = np.full((total, layers, top_k), -1, dtype=np.int16)
    filled = np.zeros(total, dtype=bool)
    positions = capture.positions.astype(np.int64)
    keep = positions < total
    rows[positions[keep]] = capture.routes[keep]  # later chunks (recomputation) overwrite earlier ones
    filled[positions[keep]] = True
    last = total - 1
    rows[last] = rows[last - 1]
    filled[last] = filled[last - 1]
    start = 0 if include_prompt else prompt_len
    missing = np.nonzero(~filled[start:])[0]
    if missing.size:
        first = int(missing[0]) + start
        raise RoutedExpertsError(
            f"{where}: no routing was computed for {missing.size} position(s) starting at {first} "
            f"(prompt length {prompt_len}). Prompt tokens served from vLLM's prefix cache are not recomputed: "
            "start the engine with return_routed_experts=True (which disables prefix caching) to capture prompt routes."
        )
    return compact_routes(rows[start:])
