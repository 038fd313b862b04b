"""Routed-expert captures -> per-sample rows, without an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.rollout.routing import (
    CaptureIndex,
    RequestCapture,
    RoutedExpertsError,
    assemble_routes,
    decode_captures,
    encode_captures,
)

L, K = 3, 2


def _routes_for(positions) -> np.ndarray:
    """Distinct, recognisable ids: expert (10 * layer + position) % 97, +1 for the second choice."""
    pos = np.asarray(positions)[:, None, None]
    layer = np.arange(L)[None, :, None]
    choice = np.arange(K)[None, None, :]
    return ((10 * layer + pos) % 97 + choice).astype(np.int16)


def _capture(prompt, response, computed_positions, chunks=1) -> RequestCapture:
    seq = list(prompt) + list(response)
    pos = np.array(computed_positions, dtype=np.int64)
    return RequestCapture(
        prompt_token_ids=list(prompt),
        positions=pos,
        token_ids=np.array([seq[p] for p in pos], dtype=np.int64),
        routes=_routes_for(pos),
    )


def test_rows_align_with_input_positions_and_last_row_copies():
    prompt, response = [1, 5, 6], [7, 8, 9, 2]
    capture = _capture(prompt, response, range(6))  # positions 0..5: the last token (position 6) is never an input
    full = assemble_routes(capture, prompt, response, include_prompt=True, where="s")
    assert full.shape == (7, L, K) and full.dtype == torch.int8  # every id below 128: one byte each (compact_routes)
    assert torch.equal(full[:6], torch.from_numpy(_routes_for(range(6))).to(torch.int8))
    assert torch.equal(full[6], full[5])
    resp = assemble_routes(capture, prompt, response, include_prompt=False, where="s")
    assert torch.equal(resp, full[3:])


def test_one_token_response_copies_the_last_prompt_row():
    capture = _capture([1, 5], [2], [0, 1])
    rows = assemble_routes(capture, [1, 5], [2], include_prompt=False, where="s")
    assert rows.shape == (1, L, K) and torch.equal(rows[0], torch.from_numpy(_routes_for([1])[0]))


def test_missing_prompt_positions_are_an_error_naming_the_sample():
    # prefix-cache hit: positions 0..3 were not recomputed
    capture = _capture([1, 5, 6, 7, 8], [9, 2], [4, 5])
    with pytest.raises(RoutedExpertsError, match=r"prompt 3 sample 1: no routing was computed for 4 position\(s\) starting at 0"):
        assemble_routes(capture, [1, 5, 6, 7, 8], [9, 2], include_prompt=True, where="prompt 3 sample 1")
    assert assemble_routes(capture, [1, 5, 6, 7, 8], [9, 2], include_prompt=False, where="x").shape == (2, L, K)
    with pytest.raises(RoutedExpertsError, match="no routed-expert capture"):
        assemble_routes(None, [1], [2], include_prompt=False, where="x")


def test_recomputed_positions_take_the_latest_chunk():
    capture = _capture([1, 5], [6, 2], [0, 1, 2])
    capture.positions = np.concatenate([capture.positions, [1, 2]])  # preempted and recomputed
    capture.token_ids = np.concatenate([capture.token_ids, [5, 6]])
    capture.routes = np.concatenate([capture.routes, np.full((2, L, K), 50, dtype=np.int16)])
    rows = assemble_routes(capture, [1, 5], [6, 2], include_prompt=True, where="x")
    assert (rows[1:] == 50).all() and capture.key() == (1, 5, 6)


def test_index_matches_by_tokens_and_hands_out_duplicates():
    a = _capture([1, 5], [6, 7, 2], range(4))
    b = _capture([1, 5], [6, 7, 2], range(4))
    c = _capture([1, 5], [8, 2], range(3))
    index = CaptureIndex([a, b, c])
    assert index.take((1, 5, 8)) is c
    assert {id(index.take((1, 5, 6, 7))), id(index.take((1, 5, 6, 7)))} == {id(a), id(b)}
    assert index.take((1, 5, 9)) is None


def test_encode_decode_round_trip():
    captures = [_capture([1, 5], [6, 2], range(3)), _capture([1], [4, 4, 2], range(3))]
    for data in (encode_captures(captures),):
        decoded = decode_captures(data)
        assert [d.prompt_token_ids for d in decoded] == [[1, 5], [1]]
        for want, got in zip(captures, decoded):
            assert np.array_equal(want.positions, got.positions) and np.array_equal(want.routes, got.routes)
            assert np.array_equal(want.token_ids, got.token_ids)
    assert decode_captures(encode_captures([])) == []


def test_routes_take_one_byte_each_up_to_expert_127_and_two_above():
    from megatron_rl.data.batch import RolloutSample, Rollouts

    prompt, response = [1, 5, 6], [7, 8, 9, 2]
    capture = _capture(prompt, response, range(6))
    capture.routes[2, 0, 1] = 127  # the largest id int8 holds
    narrow = assemble_routes(capture, prompt, response, include_prompt=True, where="s")
    assert narrow.dtype == torch.int8 and int(narrow[2, 0, 1]) == 127
    capture.routes[2, 0, 1] = 200  # a model of more than 128 experts (DeepSeek-V3's 256)
    wide = assemble_routes(capture, prompt, response, include_prompt=True, where="s")
    assert wide.dtype == torch.int16 and int(wide[2, 0, 1]) == 200
    assert torch.equal(wide.to(torch.int64)[:2], narrow.to(torch.int64)[:2])  # the same ids, -1 alike

    def sample(routes):
        return RolloutSample(prompt_index=0, sample_index=0, prompt_token_ids=torch.tensor(prompt),
                             response_token_ids=torch.tensor(response), rollout_logprobs=torch.zeros(4), finish_reason="stop",
                             stop_reason=None, weight_version=0, routed_experts=routes, routed_experts_include_prompt=True)

    # a step's padded routes take the widest of its samples' types; -1 pads
    padded = Rollouts([sample(narrow), sample(wide)], n_samples=2, weight_version=0).to_padded()
    assert padded.routed_experts.dtype == torch.int16 and torch.equal(padded.routed_experts[1], wide)
    assert torch.equal(padded.routed_experts[0], narrow.to(torch.int16))
    only_narrow = Rollouts([sample(narrow), sample(narrow)], n_samples=2, weight_version=0).to_padded()
    assert only_narrow.routed_experts.dtype == torch.int8
