"""How to sample: SamplingSpec, and its translation to vLLM's SamplingParams / the completions API.

Seeds: with `seed` set, prompt i of a batch gets its own seed mixed from
(seed, i) and vLLM gives sample j of that prompt seed_i + j, so samples differ
across prompts and the whole batch is reproducible. Change `seed` every step
(e.g. train.seed + step) or every step draws the same noise.

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, so the
logprob of a sampled token is log_softmax(logits / temperature), renormalised
over the top-k / top-p set when those are active. The trainer's logprobs
match it when it divides its logits by the same temperature and samples with
top_k=-1, top_p=1 (the usual RL setting); with truncation the trainer would
have to apply the same top-k / top-p mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(kw_only=True)
class SamplingSpec:
    """Sampling settings for one generate() call."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 (or 0) disables."""
    max_new_tokens: int = 64
    """Maximum response length in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (the response ends after the token that completes one; finish_reason 'stop')."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides EOS (the stop token is kept in the response)."""
    seed: int | None = None
    """Batch seed (see the module docstring); None = the engine's own random stream."""
    return_routed_experts: bool = False
    """Return each token's top-k experts per MoE layer (R3)."""
    ignore_eos: bool = False
    """Keep sampling past EOS (benchmarks)."""

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingSpec.n={self.n}: must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"SamplingSpec.temperature={self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec.max_new_tokens={self.max_new_tokens}: must be >= 1")

    @classmethod
    def from_config(cls, rollout_config: Any, **overrides: Any) -> "SamplingSpec":
        """The spec a RolloutConfig describes, with `overrides` (e.g. seed=step) applied."""
        spec = cls(
            n=rollout_config.n_samples,
            temperature=rollout_config.temperature,
            top_p=rollout_config.top_p,
            top_k=rollout_config.top_k,
            max_new_tokens=rollout_config.max_new_tokens,
            stop=list(rollout_config.stop),
            stop_token_ids=list(rollout_config.stop_token_ids),
            return_routed_experts=rollout_config.return_routed_experts,
        )
        return replace(spec, **overrides)


def prompt_seed(seed: int | None, prompt_index: int) -> int | None:
    """A per-prompt seed from the batch seed (splitmix64 of both; vLLM adds the sample index)."""
    if seed is None:
        return None
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(prompt_index) + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return int(x >> 2)  # below 2**62: room for vLLM's + j inside int64


def _common_args(spec: SamplingSpec, seed: int | None) -> dict[str, Any]:
    return {
        "n": spec.n,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k if spec.top_k > 0 else -1,
        "max_tokens": spec.max_new_tokens,
        "stop": list(spec.stop) or None,
        "stop_token_ids": list(spec.stop_token_ids) or None,
        "seed": seed,
        "logprobs": 0,  # the sampled token's logprob only
        "ignore_eos": spec.ignore_eos,
    }


def to_vllm_params(spec: SamplingSpec, prompt_index: int):
    """vllm.SamplingParams for one prompt of the batch."""
    from vllm import SamplingParams

    args = _common_args(spec, prompt_seed(spec.seed, prompt_index))
    return SamplingParams(**args, detokenize=bool(spec.stop))


def to_vllm_segment_params(spec: SamplingSpec, max_new_tokens: int, seed: int | None):
    """vllm.SamplingParams for one sample's segment of a partial rollout (rollout.partial): n=1, DELTA outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    args = _common_args(replace(spec, n=1, max_new_tokens=max_new_tokens), seed)
    return SamplingParams(**args, detokenize=False, output_kind=RequestOutputKind.DELTA)


def to_completion_request(spec: SamplingSpec, prompt_index: int, prompt_ids: list[int], model: str) -> dict[str, Any]:
    """Body of POST /v1/completions for one prompt: token ids in, token ids and logprobs out."""
    args = _common_args(spec, prompt_seed(spec.seed, prompt_index))
    body = {"model": model, "prompt": list(map(int, prompt_ids)), "return_token_ids": True}
    body.update({k: v for k, v in args.items() if v is not None})
    return body


def to_turn_request(spec: SamplingSpec, max_new_tokens: int, seed: int | None, token_ids: list[int], model: str) -> dict[str, Any]:
    """Body of POST /v1/completions for one turn of an episode (rollout.agents): one sample, its own seed."""
    args = _common_args(replace(spec, n=1, max_new_tokens=max_new_tokens), seed)
    body = {"model": model, "prompt": list(map(int, token_ids)), "return_token_ids": True}
    body.update({k: v for k, v in args.items() if v is not None})
    return body
