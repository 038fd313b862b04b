"""DAPO's length handling (Yu et al. 2025, arXiv 2503.14476, Sec. 3.4 "Overlong Reward Shaping").

* Soft overlong punishment, Eq. (13), added to the task reward:

      R_length(y) = 0                                  if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                  = -1                                 if |y| > L_max

  scaled by a penalty factor (1 in the paper). L_max is the generation length
  limit (rollout.max_new_tokens), L_cache the buffer (algorithm.overlong_buffer).
* Overlong filtering: responses cut at the length limit (no EOS; finish
  reason "length") are masked out of the loss.
"""

from __future__ import annotations

import torch


def soft_overlong_punishment(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """R_length of DAPO Eq. (13) times ``penalty_factor``, per response: [N] float32, all <= 0.

    ``overlong_buffer`` 0 disables the punishment (all zeros).
    """
    if overlong_buffer < 0 or max_response_length < 1 or overlong_buffer > max_response_length:
        raise ValueError(
            f"overlong_buffer={overlong_buffer}, max_response_length={max_response_length}: "
            "need 0 <= algorithm.overlong_buffer <= rollout.max_new_tokens"
        )
    lengths = response_lengths.to(torch.float32)
    if overlong_buffer == 0:
        return torch.zeros_like(lengths)
    expected = float(max_response_length - overlong_buffer)
    ramp = (expected - lengths) / overlong_buffer
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), ramp)
    penalty = torch.where(lengths > max_response_length, torch.full_like(lengths, -1.0), penalty)
    return penalty * penalty_factor


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """response_mask [B, T] with the rows of truncated [B] (no EOS, cut at the limit) zeroed."""
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(f"truncated {tuple(truncated.shape)} must be [B] for response_mask {tuple(response_mask.shape)}")
    return response_mask & ~truncated.to(torch.bool).unsqueeze(-1)


__all__ = ["overlong_filter_mask", "soft_overlong_punishment"]
