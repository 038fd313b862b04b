"""A policy loss (docs/extending.md): CISPO (MiniMax-M1, arXiv
2506.13585, its CISPO objective), with this folder on PYTHONPATH:
algorithm.loss=cispo_loss:cispo_loss

    J = 1 / (sum_i |y_i|) sum_i sum_t
            sg[clip(r_it, 1 - eps_low, 1 + eps_high)] A_i log pi(y_it)

The clipped ratio weighs a REINFORCE term: every token keeps a gradient,
a clipped one a bounded weight (PPO's clip drops clipped tokens').
"""

from __future__ import annotations

from megatron_rl.algorithms.metrics import sum_metric

DEFAULT_EPS = (1.0, 0.28)
"""(eps_low, eps_high) where the config leaves them None: no lower bound,
the upper one as in the paper."""


def cispo_loss(logprobs, old_logprobs, advantages, response_mask, cfg,
               denom, *, ref_logprobs=None, rollout_logprobs=None,
               entropy=None):
    low = DEFAULT_EPS[0] if cfg.eps_low is None else cfg.eps_low
    high = DEFAULT_EPS[1] if cfg.eps_high is None else cfg.eps_high
    mask = response_mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).detach().clamp(-20, 20)
    weight = log_ratio.exp().clamp(1 - low, 1 + high)
    terms = weight * advantages.unsqueeze(-1) * logprobs * mask
    # this microbatch's share of the mean over the step's tokens
    loss_sum = -terms.sum() / denom.tokens
    value = sum_metric(loss_sum.detach())
    return loss_sum, {"pg_loss/sum": value, "loss/sum": value}
