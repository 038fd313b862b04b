"""R3 over multi-turn episodes on a real engine, checked against HF's router (tests/e2e/test_vllm_engine.py and
tests/e2e/test_vllm_server.py run it on an engine started with rollout.return_routed_experts=true).

Every position of prompt + all turns (observations included) must be routed
as HF's router routes the whole episode in one forward, up to float ties
(a top-k margin under 1e-5, as the single-turn R3 tests allow); the last
token, never an engine input, copies the row before it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.config import RolloutConfig
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rollout.agents import Environment, EpisodeRunner, StepResult
from megatron_rl.rollout.rewards import exact_match
from megatron_rl.rollout.sampling import SamplingSpec
from tests.e2e.vllm_helpers import hf_router_topk


class Observe(Environment):
    """An observation of 4 token ids after every turn, until the episode is cut at max_turns."""

    def step(self, turn):
        return StepResult(observation=[40 + turn.index, 41, 42, 43], reward=0.0)


def check_episode_routes(engine, model_dir, prompts: list[list[int]], seed: int) -> None:
    config = RolloutConfig(agent="single_turn", agent_max_turns=3, agent_reward="env", return_routed_experts=True)
    runner = EpisodeRunner(Observe, load_tokenizer(model_dir), exact_match, config)
    # about 60% of the vocabulary ends a turn: turns of one to a few tokens, so episodes have several
    spec = SamplingSpec(n=2, max_new_tokens=6, seed=seed, stop_token_ids=list(range(100, 256)), return_routed_experts=True)
    try:
        batch = runner.run(engine, [SimpleNamespace(token_ids=p, text="", answer="") for p in prompts], spec)
    finally:
        runner.close()
    layers, top_k = engine.model_info["num_moe_layers"], engine.model_info["top_k"]
    checked = observed = 0
    for s in batch.rollouts.samples:
        total = s.prompt_length + s.response_length
        assert s.routed_experts.shape == (total, layers, top_k) and s.routed_experts_include_prompt
        ids, margin = hf_router_topk(model_dir, s.token_ids, top_k)
        differ = (s.routed_experts.long().sort(dim=-1).values[:-1] != ids[:-1]).any(dim=-1)
        assert not (differ & (margin[:-1] > 1e-5)).any(), f"routes differ from HF's router for {s.prompt_index}/{s.sample_index}"
        assert torch.equal(s.routed_experts[-1], s.routed_experts[-2])
        checked += int((~differ).sum())
        observed += int((~s.response_loss_mask).sum())
    # several turns with observations between them, and turns longer than one token, were covered
    assert max(e.turns for e in batch.episodes) >= 2 and observed >= 4
    assert max(len(t) for e in batch.episodes for t in e.turn_token_ids) >= 2
    assert checked > 0.99 * sum((s.prompt_length + s.response_length - 1) * layers for s in batch.rollouts.samples)
