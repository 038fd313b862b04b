"""Routed experts (R3) of multi-turn episodes: one row per position, from the request that first computed it.

An episode is several engine requests. Request k's input is the conversation
so far (its first L_k tokens); it samples n_k tokens, so the engine computes
positions 0 .. L_k + n_k - 2 with it (the last sampled token is never an
input). The next request's prefill computes the whole conversation again,
including what request k never computed: the last token of turn k and the
observation after it. So position p takes its route from the FIRST request of
the episode that computed p:

    prompt P=3, turn 0 samples 3 tokens, observation of 2 tokens, turn 1 samples 2:
    positions        0  1  2 | 3  4  5 | 6  7 | 8  9
    request 0 (L=3)  x  x  x   x  x           computes 0..4 (its last token, 5, is never an input)
    request 1 (L=8)  .  .  .   .  .  x   x  x   x     computes 0..8; first for 5, 6, 7, 8
    row 9 (the episode's last token, never an input) copies row 8, as for single-turn samples.

Why the first: it is the routing the episode's tokens were sampled under. With
rollout.return_routed_experts the engine runs without prefix caching, so every
turn re-prefills the whole conversation and each position is computed (again)
by every later request; without a weight push in between, those recomputations
give the same routes (up to float ties). With train.max_staleness and no
partial rollouts a push may land between two turns: a model token then keeps
the route of the weights that sampled it, while the last token of the turn
before the push and the observation after it take the routes the NEW weights
computed in the next turn's prefill (the weights that sampled the tokens which
follow them). Partial rollouts (a push inside a turn) are refused with R3.

Captures are matched to requests by token content (rollout.routing): request
k's capture is the one whose key is the episode's first L_k + n_k - 1 tokens.
A request whose capture is missing (e.g. an engine restarted during the batch)
is skipped: the later requests' prefills cover its positions; a position no
capture covers is an error naming the episode. The engine records every request
while the batch runs: with train.max_staleness, an evaluation that runs between
two turns is recorded too (its captures match no episode; they only cost memory).
"""

from __future__ import annotations

from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from megatron_rl.rollout.engine_protocol import RolloutEngine
from megatron_rl.rollout.routing import CaptureIndex, RequestCapture, RoutedExpertsError, compact_routes


def episode_routes(
    token_ids: Sequence[int],
    requests: Sequence[tuple[int, int]],
    index: CaptureIndex,
    *,
    layers: int,
    top_k: int,
    where: str,
    allow_missing: bool = False,
) -> torch.Tensor:
    """[T, L, K] routes of one episode's T tokens, int8 or int16 (rollout.routing.compact_routes; see the module docstring).

    requests: (L_k input tokens, n_k sampled tokens) of every engine request, in order.
    allow_missing: positions no capture covers get experts 0..K-1 instead of an error (a failed episode: out of
    the loss, its forward only needs valid ids).
    """
    total = len(token_ids)
    rows = np.full((total, layers, top_k), -1, dtype=np.int16)
    filled = np.zeros(total, dtype=bool)
    for start, produced in requests:
        end = start + produced - 1  # positions 0 .. end-1 were inputs of this request
        capture = index.take(tuple(int(t) for t in token_ids[:end]))
        if capture is None:
            continue
        own_rows, own_filled = _capture_rows(capture, min(end, total), layers, top_k)
        first = own_filled & ~filled[: len(own_filled)]
        rows[: len(own_filled)][first] = own_rows[first]
        filled[: len(own_filled)] |= own_filled
    if total > 1 and not filled[-1] and filled[-2]:  # the last token is never an input: its row copies the one before
        rows[-1], filled[-1] = rows[-2], True
    missing = np.nonzero(~filled)[0]
    if missing.size and not allow_missing:
        raise RoutedExpertsError(
            f"{where}: no engine request of the episode computed {missing.size} of its {total} positions, first "
            f"{int(missing[0])} (requests (input tokens, sampled): {list(requests)}); the engine must run with "
            "rollout.return_routed_experts=true (no prefix caching) for the whole batch of episodes"
        )
    rows[missing] = np.arange(top_k, dtype=np.int16)[None, :]
    return compact_routes(rows)


def _capture_rows(capture: RequestCapture, length: int, layers: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """One request's rows for positions < length (a position recomputed within the request keeps its last route)."""
    if capture.routes.shape[1:] != (layers, top_k):
        raise RoutedExpertsError(f"a capture has routes {tuple(capture.routes.shape[1:])} per token, the engine {(layers, top_k)}")
    rows = np.full((length, layers, top_k), -1, dtype=np.int16)
    filled = np.zeros(length, dtype=bool)
    positions = capture.positions.astype(np.int64)
    keep = positions < length
    rows[positions[keep]] = capture.routes[keep]
    filled[positions[keep]] = True
    return rows, filled


@dataclass
class EpisodeCapture:
    """What `capture_routes` hands the runner: the captures of the batch once the block has ended."""

    captures: list[RequestCapture] | None = None
    """None while capturing (or with capture off)."""
    layers: int = 0
    top_k: int = 0
    on: bool = False

    def attach(self, episodes: Sequence[Any], samples: Sequence[Any], include_prompt: bool) -> None:
        """Give every sample its routed_experts ([P + R] rows, or [R] without include_prompt); no-op with capture off."""
        if not self.on:
            return
        index = CaptureIndex(self.captures or [])
        for episode, sample in zip(episodes, samples):
            rows = episode_routes(
                sample.token_ids.tolist(), episode.requests, index, layers=self.layers, top_k=self.top_k,
                where=f"episode of prompt {sample.prompt_index} sample {sample.sample_index}", allow_missing=bool(episode.failed),
            )
            sample.routed_experts = rows if include_prompt else rows[sample.prompt_length:]
            sample.routed_experts_include_prompt = include_prompt


@contextmanager
def capture_routes(engine: RolloutEngine, on: bool) -> Iterator[EpisodeCapture]:
    """Record the routes of every engine request made inside the block (every turn of a batch of episodes).

    By the engine's start_route_capture() and collect_route_capture() (rollout.engine_protocol.RolloutEngine).
    Collected on the way out, also when the block raises (the engine stops recording).
    """
    result = EpisodeCapture(on=on)
    if not on:
        yield result
        return
    info = engine.model_info
    result.layers, result.top_k = int(info.get("num_moe_layers", 0)), int(info.get("top_k", 0))
    if not result.layers:
        raise RoutedExpertsError("rollout.return_routed_experts=true, but the engine's model has no MoE layers: turn it off")
    engine.start_route_capture()
    try:
        yield result
    except BaseException:
        with suppress(Exception):  # stop recording; the block's own error is the one to report
            engine.collect_route_capture()
        raise
    result.captures = engine.collect_route_capture()
