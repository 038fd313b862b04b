"""Rollout batch types: what the rollout engine hands the trainer.

Shapes use P = prompt length, R = response length, L = number of MoE layers
(in model order, dense layers skipped), K = experts per token (top-k),
B = samples in the batch, T = longest prompt + response in the batch.

One `RolloutSample` per generated sample; `Rollouts` holds them prompt-major
(`samples[i * n + j]` is sample j of prompt i), and `Rollouts.to_padded()` lays
them out as right-padded [B, T] tensors aligned with the token ids the trainer
feeds its model.

Rollout logprobs are the engine's log-probabilities of the sampled tokens
under the distribution it sampled from: log_softmax(logits / temperature),
renormalised over the top-k / top-p set when those are active (vLLM's
`logprobs_mode="processed_logprobs"`). With top_k=-1 and top_p=1 this is
exactly what the trainer computes as log_softmax(logits / temperature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass
class RolloutSample:
    """One sampled response to one prompt.

    Routed experts (MoE, when asked for): `routed_experts[t, l, k]` is the k-th
    expert MoE layer l sent one token to, int8 when every id is below 128, else int16 (-1: no route). Row t is the token at sequence
    position t (prompt positions 0..P-1, then the response) when
    `routed_experts_include_prompt`, else response token t (position P + t).
    The rows are the routing computed when that token was the model's INPUT,
    which is what a trainer replaying routes over [prompt + response] needs.
    The last response token is sampled but never fed back through the engine,
    so its row is a copy of the row before it: valid expert ids (replay needs
    them) that affect nothing the loss uses, since that position only predicts
    a token past the end of the sequence and causal attention keeps every
    other position from seeing it.
    """

    prompt_index: int
    """Index of the prompt in the generate() call."""
    sample_index: int
    """Index of this sample among the n samples of its prompt (0..n-1)."""
    prompt_token_ids: torch.Tensor
    """[P] int64: the prompt as given."""
    response_token_ids: torch.Tensor
    """[R] int64: sampled tokens, including the EOS / stop token that ended it (R >= 1)."""
    rollout_logprobs: torch.Tensor
    """[R] float32: engine logprob of each sampled token (see the module docstring)."""
    finish_reason: FinishReason
    """'stop' (EOS, stop token or stop string) or 'length' (max_new_tokens or the context limit)."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended it; None for EOS or length."""
    weight_version: int
    """Version of the weights that generated it (the version of the last push; 0 = the model directory's)."""
    routed_experts: torch.Tensor | None = None
    """[R, L, K] or [P + R, L, K] int8 / int16, or None when not asked for (see the class docstring)."""
    routed_experts_include_prompt: bool = False
    """Whether routed_experts rows start at the prompt (True) or at the response (False)."""
    token_versions: torch.Tensor | None = None
    """[R] int64: the weight version each response token was sampled with (partial rollouts continue a
    sample under newer weights, so one response can hold several); None = every token is `weight_version`.
    `weight_version` is then the oldest of them."""
    response_loss_mask: torch.Tensor | None = None
    """[R] bool: True on the tokens the model sampled, False on observation tokens a multi-turn episode
    appended between turns (tool results, environment messages; megatron_rl.rollout.agents): those are
    context for the forward pass, out of the loss and of every denominator. None = every response token."""

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_token_ids.numel())

    @property
    def response_length(self) -> int:
        return int(self.response_token_ids.numel())

    @property
    def token_ids(self) -> torch.Tensor:
        """[P + R] int64: prompt then response."""
        return torch.cat([self.prompt_token_ids, self.response_token_ids])


@dataclass
class PaddedRollouts:
    """Rollouts laid out as right-padded tensors, one row per sample.

    Position t of row b holds token t of sample b; `rollout_logprobs[b, t]` is
    the engine logprob of that token (0 where `response_mask` is False), i.e.
    the logprob the trainer computes from its logits at position t - 1.
    """

    tokens: torch.Tensor
    """[B, T] int64: prompt + response, right-padded with pad_token_id."""
    response_mask: torch.Tensor
    """[B, T] bool: True on response tokens."""
    attention_mask: torch.Tensor
    """[B, T] bool: True on real (non-padding) tokens."""
    rollout_logprobs: torch.Tensor
    """[B, T] float32: engine logprob of each response token, 0 elsewhere."""
    prompt_lengths: torch.Tensor
    """[B] int64."""
    response_lengths: torch.Tensor
    """[B] int64."""
    routed_experts: "torch.Tensor | PackedRoutes | None"
    """[B, T, L, K] int8 (every expert id below 128) or int16 aligned with `tokens`; -1 on padding (and on prompt
    positions when they were not captured); `PackedRoutes` (the same without padding) from to_padded(pack_routes=True)."""
    weight_version: int
    """Weight version of the rollouts."""
    token_versions: torch.Tensor | None = None
    """[B, T] int64: the weight version each response token was sampled with, -1 elsewhere."""


@dataclass
class PackedRoutes:
    """The engine's routes of a batch's rows back to back, without padding (R3, rollout.return_routed_experts).

    Row b's positions 0 .. length_b - 1 are ``values[offsets[b]:offsets[b + 1]]``; positions past a row's
    length hold nothing. The trainer's step batch carries its routes so (`Rollouts.to_padded(pack_routes=True)`
    in experience.assemble_experience): rank 0 and the shares `Actor.distribute` sends hold no routes for
    padding, where padded rows would hold L x K ids for every position up to T (94 x 8 bytes a position for
    Qwen3-235B).
    """

    values: torch.Tensor
    """[N, L, K] int8 / int16 expert ids of every row's positions, rows in order; -1 where the engine captured none."""
    offsets: torch.Tensor
    """[B + 1] int64: offsets[0] = 0, offsets[B] = N."""

    @classmethod
    def from_samples(cls, samples) -> "PackedRoutes":
        """The routes of rollout samples (`RolloutSample.routed_experts`, with or without prompt rows), in the widest
        of their types (rollout.routing.compact_routes: int8 or int16)."""
        missing = [b for b, s in enumerate(samples) if s.routed_experts is None]
        if missing:
            raise ValueError(f"sample {missing[0]} has no routed experts while sample 0 has")
        dtype = torch.int16 if any(s.routed_experts.dtype != torch.int8 for s in samples) else torch.int8
        parts, lengths = [], []
        for s in samples:
            routes = s.routed_experts.to(dtype)
            if not s.routed_experts_include_prompt:  # prompt positions: not captured
                routes = torch.cat([routes.new_full((s.prompt_length, *routes.shape[1:]), -1), routes])
            parts.append(routes)
            lengths.append(s.prompt_length + s.response_length)
        values = torch.cat(parts)
        offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([p.shape[0] for p in parts]).cumsum(0)
        if [p.shape[0] for p in parts] != lengths:
            b = next(i for i, (p, n) in enumerate(zip(parts, lengths)) if p.shape[0] != n)
            raise ValueError(f"sample {b}'s routed experts cover {parts[b].shape[0]} positions, its tokens {lengths[b]}")
        return cls(values, offsets)

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.offsets.nbytes

    def lengths(self) -> torch.Tensor:
        return self.offsets.diff()

    def token_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row [N], position [N]) of each entry of `values`."""
        lengths = self.lengths()
        rows = torch.repeat_interleave(torch.arange(self.batch_size), lengths)
        return rows, torch.arange(self.values.shape[0]) - self.offsets[:-1].repeat_interleave(lengths)

    def at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, L, K] routes at (rows [N], positions [N]), each position within its row's length."""
        return self.values[self.offsets[rows] + positions]

    def select(self, rows: torch.Tensor) -> "PackedRoutes":
        """The rows `rows` (a [b] int64 index), in that order."""
        lengths = self.lengths()[rows]
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        starts = self.offsets[rows].repeat_interleave(lengths)
        index = starts + torch.arange(int(offsets[-1])) - offsets[:-1].repeat_interleave(lengths)
        return PackedRoutes(self.values[index], offsets)

    def to_padded(self, width: int) -> torch.Tensor:
        """[B, width, L, K], -1 past each row's length (the layout of `PaddedRollouts.routed_experts`)."""
        out = self.values.new_full((self.batch_size, width, *self.values.shape[1:]), -1)
        rows, positions = self.token_index()
        keep = positions < width
        out[rows[keep], positions[keep]] = self.values[keep]
        return out


@dataclass
class Rollouts:
    """The samples of one generate() call, prompt-major: samples[i * n_samples + j]."""

    samples: list[RolloutSample]
    """All samples, prompt-major."""
    n_samples: int
    """Samples per prompt (the group size)."""
    weight_version: int
    """Weight version every sample was generated with."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Engine-side numbers: generate_s, response_tokens, restarts, ..."""

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    @property
    def num_prompts(self) -> int:
        return len(self.samples) // self.n_samples if self.n_samples else 0

    def group(self, prompt_index: int) -> list[RolloutSample]:
        """The n samples of one prompt."""
        start = prompt_index * self.n_samples
        return self.samples[start : start + self.n_samples]

    def to_padded(self, pad_token_id: int = 0, *, pack_routes: bool = False) -> PaddedRollouts:
        """Right-pad into [B, T] tensors (see PaddedRollouts); pack_routes: the engine routes as `PackedRoutes`
        (each sample's positions back to back, no padding: the trainer's step batch) instead of [B, T, L, K]."""
        if not self.samples:
            raise ValueError("Rollouts.to_padded: no samples")
        batch = len(self.samples)
        total = max(s.prompt_length + s.response_length for s in self.samples)
        tokens = torch.full((batch, total), pad_token_id, dtype=torch.int64)
        response_mask = torch.zeros(batch, total, dtype=torch.bool)
        attention_mask = torch.zeros(batch, total, dtype=torch.bool)
        logprobs = torch.zeros(batch, total, dtype=torch.float32)
        versions = torch.full((batch, total), -1, dtype=torch.int64)
        routes = None
        if self.samples[0].routed_experts is not None:  # the widest of the samples' types (compact_routes: int8 or int16)
            routes = PackedRoutes.from_samples(self.samples)
            routes = routes if pack_routes else routes.to_padded(total)
        for b, s in enumerate(self.samples):
            p, r = s.prompt_length, s.response_length
            tokens[b, : p + r] = s.token_ids
            attention_mask[b, : p + r] = True
            response_mask[b, p : p + r] = True if s.response_loss_mask is None else s.response_loss_mask
            logprobs[b, p : p + r] = s.rollout_logprobs
            versions[b, p : p + r] = s.weight_version if s.token_versions is None else s.token_versions
        return PaddedRollouts(
            tokens=tokens,
            response_mask=response_mask,
            attention_mask=attention_mask,
            rollout_logprobs=logprobs,
            prompt_lengths=torch.tensor([s.prompt_length for s in self.samples], dtype=torch.int64),
            response_lengths=torch.tensor([s.response_length for s in self.samples], dtype=torch.int64),
            routed_experts=routes,
            weight_version=self.weight_version,
            token_versions=versions,
        )
