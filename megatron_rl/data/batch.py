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
    routed_experts: torch.Tensor | None
    """[B, T, L, K] int8 (every expert id below 128) or int16 aligned with `tokens`; -1 on padding (and on prompt
    positions when they were not captured)."""
    weight_version: int
    """Weight version of the rollouts."""
    token_versions: torch.Tensor | None = None
    """[B, T] int64: the weight version each response token was sampled with, -1 elsewhere."""


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

    def to_padded(self, pad_token_id: int = 0, *, with_routes: bool = True) -> PaddedRollouts:
        """Right-pad into [B, T] tensors (see PaddedRollouts); with_routes=False leaves routed_experts None (the
        actor's `train_batch_from_rollouts(..., pack_routes=True)` takes them from the samples, unpadded)."""
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
        first = self.samples[0].routed_experts
        if first is not None and with_routes:  # the widest of the samples' types (rollout.routing.compact_routes: int8 or int16)
            wide = any(s.routed_experts is not None and s.routed_experts.dtype != torch.int8 for s in self.samples)
            routes = torch.full((batch, total, first.shape[1], first.shape[2]), -1, dtype=torch.int16 if wide else torch.int8)
        for b, s in enumerate(self.samples):
            p, r = s.prompt_length, s.response_length
            tokens[b, : p + r] = s.token_ids
            attention_mask[b, : p + r] = True
            response_mask[b, p : p + r] = True if s.response_loss_mask is None else s.response_loss_mask
            logprobs[b, p : p + r] = s.rollout_logprobs
            versions[b, p : p + r] = s.weight_version if s.token_versions is None else s.token_versions
            if routes is not None:
                if s.routed_experts is None:
                    raise ValueError(f"sample {b} has no routed experts while sample 0 has")
                start = 0 if s.routed_experts_include_prompt else p
                routes[b, start : p + r] = s.routed_experts
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
