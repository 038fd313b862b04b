"""Episodes without an engine: a hand-worked two-turn episode through the batch and GSPO and its R3 routes
(hand-made captures), tools' failure paths, and naming an agent that cannot be used.

The engine-driven checks (token identity, single-turn parity, limits) are in tests/e2e/test_agents_engine.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import compute_loss_denominators, get_policy_loss
from megatron_rl.config import AlgorithmConfig
from megatron_rl.config.core import ConfigError
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.agents import AgentContext, AgentError, ModelTurn, Tool, ToolsAgent, load_agent
from megatron_rl.rollout.agents.routes import EpisodeCapture, episode_routes
from megatron_rl.rollout.agents.runner import Episode
from megatron_rl.rollout.agents.stats import EpisodeStats, episode_trace
from megatron_rl.rollout.partial import SegmentOutput
from megatron_rl.rollout.routing import CaptureIndex, RequestCapture, RoutedExpertsError

from tests.extras import VLLM_EXTRA

needs_vllm = pytest.mark.extra(VLLM_EXTRA, "vllm")  # vLLM's tool parsers / weight-transfer engines

PROMPT = [5, 6, 7]
TURN1, LP1 = [10, 11, 2], [-1.0, -0.5, -0.25]
OBS = [20, 21]
TURN2, LP2 = [12, 2], [-0.75, -0.125]


def two_turn_episode() -> Episode:
    e = Episode(0, 0, SimpleNamespace(token_ids=PROMPT), seed=None, prompt_ids=list(PROMPT))
    e.add_model_tokens(SegmentOutput(TURN1, LP1, "stop"), version=3)
    e.add_observation(OBS)
    e.add_model_tokens(SegmentOutput(TURN2, LP2, "stop"), version=4)
    return e


def test_two_turn_episode_batch_by_hand():
    padded = Rollouts(samples=[two_turn_episode().to_sample(eos_id=2)], n_samples=1, weight_version=3).to_padded(0)
    # positions: 0-2 prompt, 3-5 turn 1, 6-7 observation, 8-9 turn 2
    assert padded.tokens[0].tolist() == PROMPT + TURN1 + OBS + TURN2
    assert padded.response_mask[0].tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2
    assert padded.rollout_logprobs[0].tolist() == [0.0] * 3 + LP1 + [0.0, 0.0] + LP2
    assert padded.token_versions[0].tolist() == [-1] * 3 + [3, 3, 3, 3, 3, 4, 4]
    assert int(padded.response_lengths[0]) == 7 and int(padded.prompt_lengths[0]) == 3
    denom = compute_loss_denominators([padded.response_mask])
    assert (denom.global_num_tokens, denom.global_num_sequences) == (5, 1)  # model tokens only


def _gspo(lp, old, mask, adv):
    cfg = AlgorithmConfig(loss="gspo")
    denom = compute_loss_denominators([mask])
    return get_policy_loss("gspo")(lp, old, adv, mask, cfg, denom)


def test_gspo_on_an_episode_counts_model_tokens_only():
    padded = Rollouts(samples=[two_turn_episode().to_sample(eos_id=2)], n_samples=1, weight_version=3).to_padded(0)
    old = padded.rollout_logprobs.to(torch.float64)
    delta = torch.tensor([[0, 0, 0, 1e-4, -2e-4, 3e-4, 0, 0, 2e-4, 1e-4]], dtype=torch.float64)
    lp = (old + delta).clone()
    lp[0, 6:8] = torch.tensor([-9.0, 4.0])  # observation positions: any value must change nothing
    lp.requires_grad_(True)
    adv = torch.tensor([1.5], dtype=torch.float64)
    loss, metrics = _gspo(lp, old, padded.response_mask, adv)
    loss.backward()
    # GSPO Eq. 7 by hand: s = exp(mean of the 5 model tokens' log ratios), inside the clip range: loss = -A s
    model = [3, 4, 5, 8, 9]
    s = math.exp(sum(float(delta[0, t]) for t in model) / 5)
    assert float(loss) == pytest.approx(-1.5 * s, rel=1e-12)
    expected = torch.zeros_like(lp)
    expected[0, model] = -1.5 * s / 5
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=1e-15)
    # the same tokens with the observation positions left out of the mask by hand give the same loss and gradient
    hand = torch.zeros_like(padded.response_mask)
    hand[0, model] = True
    lp2 = (old + delta).detach().requires_grad_(True)
    loss2, _ = _gspo(lp2, old, hand, adv)
    loss2.backward()
    assert float(loss2) == float(loss)
    torch.testing.assert_close(lp2.grad, lp.grad, rtol=0, atol=0)


def test_failed_episode_leaves_the_loss():
    e = two_turn_episode()
    e.failed = "step: RuntimeError: x"
    sample = e.to_sample(eos_id=2)
    assert not bool(sample.response_loss_mask.any())
    before = Episode(1, 0, SimpleNamespace(token_ids=PROMPT), seed=None, prompt_ids=list(PROMPT), failed="reset: boom")
    placeholder = before.to_sample(eos_id=2)  # failed before any turn: one placeholder token, out of the loss
    assert placeholder.response_token_ids.tolist() == [2] and placeholder.response_loss_mask.tolist() == [False]


def test_trace_shows_the_mask():
    tok = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    trace = episode_trace(two_turn_episode(), tok, 1.0)
    assert [(s["kind"], s["text"]) for s in trace["segments"]] == [("model", "10 11 2"), ("obs", "20 21"), ("model", "12 2")]


# -- tools ---------------------------------------------------------------------------------------------


def _schema(name: str) -> dict:
    return {"name": name, "parameters": {"type": "object", "properties": {}}}


def ok(x: int = 1) -> str:
    return f"ok {x}"


def boom() -> str:
    raise RuntimeError("kaput")


def hang() -> str:
    time.sleep(3)
    return "late"


def number() -> int:
    return 7


async def nap() -> str:
    await asyncio.sleep(0.3)
    return "rested"


class Kit(ToolsAgent):
    tool_parser = "hermes"

    def get_tools(self):
        return [Tool(f, _schema(f.__name__)) for f in (ok, boom, hang, number, nap)]


def _agent(parser: str = "") -> tuple[Kit, EpisodeStats]:
    stats = EpisodeStats()
    cfg = RolloutConfig(agent_tool_timeout_s=0.5, agent_tool_parser=parser)
    return Kit(AgentContext(tokenizer=SimpleNamespace(), config=cfg, stats=stats)), stats


def _turn(text: str) -> ModelTurn:
    return ModelTurn(index=0, token_ids=[1], text=text, finish_reason="stop")


def _call(name: str, args: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


@needs_vllm
def test_tool_results_and_failures_become_observations():
    agent, stats = _agent()
    agent.step(_turn("no call"))  # the first parse imports vLLM's parser: not part of what is timed
    start = time.perf_counter()
    result = agent.step(_turn(_call("ok", '{"x": 3}') + _call("boom") + _call("hang") + _call("number") + _call("missing")))
    elapsed = time.perf_counter() - start
    assert not result.done
    contents = [m["content"] for m in result.observation]
    assert contents == [
        "ok 3",
        "error: boom: RuntimeError: kaput",
        "error: hang timed out after 0.5 s",
        "error: number returned int, not text",
        "error: no tool named 'missing' (tools: boom, hang, nap, number, ok)",
    ]
    assert all(m["role"] == "tool" for m in result.observation)
    assert elapsed < 2.5  # the hung tool was abandoned at its timeout
    assert stats.tool_calls == {"ok": 1, "boom": 1, "hang": 1, "number": 1, "missing": 1}
    assert stats.tool_errors == {"boom": 1, "hang": 1, "number": 1, "missing": 1}
    metrics = stats.take()
    assert metrics["agent/tool_errors/boom"] == 1.0 and metrics["agent/tool_errors/ok"] == 0.0


@needs_vllm
def test_calls_of_one_turn_run_concurrently_and_async_tools_work():
    agent, _ = _agent()
    agent.step(_turn("no call"))
    start = time.perf_counter()
    result = agent.step(_turn(_call("nap") + _call("nap") + _call("nap")))
    assert [m["content"] for m in result.observation] == ["rested"] * 3
    assert time.perf_counter() - start < 0.8  # three 0.3 s naps side by side


@needs_vllm
def test_malformed_call_no_call_and_bad_arguments(caplog):
    agent, stats = _agent()
    malformed = agent.step(_turn('<tool_call>{"name": "ok", "argu'))
    assert not malformed.done and malformed.observation.startswith("error: malformed tool call")
    assert stats.malformed == 1
    assert agent.step(_turn("the answer is b")).done  # no call: the final answer
    bad = agent.step(_turn(_call("ok", '{"y": 1}')))
    assert bad.observation[0]["content"].startswith("error: ok: TypeError")
    pythonic, stats2 = _agent("pythonic")  # rollout.agent_tool_parser overrides the class's parser
    assert pythonic.step(_turn("[ok(x=5)]")).observation[0]["content"] == "ok 5"
    assert not pythonic.step(_turn("[ok(x=")).done and stats2.malformed == 1
    # counted, not logged: vLLM's parsers log a traceback at ERROR for every malformed call
    assert not [r for r in caplog.records if r.name.startswith("vllm.tool_parsers")]


@needs_vllm
def test_the_lookup_demo_ends_an_episode_at_a_malformed_call():
    """LookupAgent.malformed_ends_episode: a call the pythonic parser cannot read is the final answer (scored 0 by
    the exact reward), counted; a readable call still gets the row's value."""
    from megatron_rl.rollout.agents.lookup import LookupAgent

    stats = EpisodeStats()
    agent = LookupAgent(AgentContext(tokenizer=SimpleNamespace(), config=RolloutConfig(), stats=stats))
    agent.reset(SimpleNamespace(row={"key": "c"}, answer="f"))
    assert agent.step(_turn("[lookup(key='c')]")).observation[0]["content"] == "f"
    ended = agent.step(_turn("[lookup(k(key='()]"))
    assert ended.done and ended.observation is None and stats.malformed == 1


@needs_vllm
def test_unknown_parser_and_agents_that_cannot_be_used():
    agent, _ = _agent("no_such_parser")
    with pytest.raises(AgentError, match="tool parser 'no_such_parser' is not one of vLLM's: set rollout.agent_tool_parser"):
        agent.step(_turn("x"))
    with pytest.raises(AgentError, match="cannot import module 'no_such_pkg.mod'"):
        load_agent("no_such_pkg.mod:Agent")
    with pytest.raises(AgentError, match=r"a subclass of megatron_rl.rollout.agents.Environment \(or ToolsAgent\) expected; "
                                         "got class ModelTurn"):
        load_agent("megatron_rl.rollout.agents.base:ModelTurn")
    with pytest.raises(AgentError, match=r"rollout.agent=.nonsense.: use a built-in \(lookup, single_turn\) or an import path"):
        load_agent("nonsense")
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.config.core import from_dict
    from megatron_rl.preflight import check_plugins

    cfg = load_config(RLConfig, None, ["rollout.agent=no_such_pkg:X"])  # the config layer imports no user code
    with pytest.raises(ConfigError, match="rollout.agent='no_such_pkg:X'"):
        check_plugins(cfg)  # the start-up check, on every rank, before any work
    RolloutConfig(agent="single_turn", return_routed_experts=True).validate()  # R3 covers episodes
    with pytest.raises(ConfigError, match="routes would not be those its tokens were sampled with"):
        from_dict(RLConfig, {"train": {"max_staleness": 1, "partial_rollouts": True},
                             "rollout": {"agent": "single_turn", "return_routed_experts": True}})
    assert load_agent("lookup").__name__ == "LookupAgent"


# -- R3 over episodes (agents.routes) ----------------------------------------------------------------


def _capture(prompt: list[int], tokens: list[int], positions: list[int], tag: int) -> RequestCapture:
    """A request's capture as the worker records it: 1 MoE layer, top-2, route of position p = (p, tag)."""
    routes = np.array([[[p, tag]] for p in positions], dtype=np.int16)
    return RequestCapture(prompt_token_ids=prompt, positions=np.array(positions), token_ids=np.array(tokens), routes=routes)


def test_episode_routes_take_each_position_from_its_first_request():
    # PROMPT (positions 0-2) | TURN1 (3-5) | OBS (6-7) | TURN2 (8-9). Request 0 has the 3 prompt tokens as input and
    # samples TURN1: it computes 0-4 (prefill 0-2, decode inputs 10, 11; the EOS at 5 is never its input).
    # Request 1 has the 8 tokens so far as input and samples TURN2: it computes 0-8 (prefill 0-7, decode input 12).
    episode = two_turn_episode()
    assert episode.requests == [(3, 3), (8, 2)]
    tokens = PROMPT + TURN1 + OBS + TURN2
    request0 = _capture(PROMPT, tokens[:5], [0, 1, 2, 3, 4], tag=10)
    request1 = _capture(tokens[:8], tokens[:9], list(range(9)), tag=20)  # other routes for 0-4: a push between turns
    other = _capture(PROMPT, PROMPT + [10, 99], [0, 1, 2, 3, 4], tag=30)  # another episode: same prompt, other tokens
    index = CaptureIndex([other, request1, request0])
    rows = episode_routes(tokens, episode.requests, index, layers=1, top_k=2, where="e")
    # 0-4 from request 0; 5 (turn 1's last token), 6-7 (observation), 8 from request 1; 9 (never an input) copies 8
    expected = [[p, 10] for p in range(5)] + [[p, 20] for p in range(5, 9)] + [[8, 20]]
    assert rows.dtype == torch.int8 and rows[:, 0, :].tolist() == expected  # ids below 128: one byte each

    # request 0's capture lost (an engine restart): request 1's prefill covers its positions
    rows = episode_routes(tokens, episode.requests, CaptureIndex([request1]), layers=1, top_k=2, where="e")
    assert rows[:, 0, :].tolist() == [[p, 20] for p in range(9)] + [[8, 20]]
    # request 1's capture lost: positions 5-9 were computed by no request
    with pytest.raises(RoutedExpertsError, match=r"episode 7: .* 5 of its 10 positions, first 5"):
        episode_routes(tokens, episode.requests, CaptureIndex([request0]), layers=1, top_k=2, where="episode 7")
    # a failed episode (out of the loss) gets experts 0, 1 where nothing was computed
    rows = episode_routes(tokens, episode.requests, CaptureIndex([request0]), layers=1, top_k=2, where="e", allow_missing=True)
    assert rows[:, 0, :].tolist() == [[p, 10] for p in range(5)] + [[0, 1]] * 5

    # attached to the sample: prompt rows too, or the response's only; the batch puts them at their positions
    for include_prompt, start in ((True, 0), (False, 3)):
        sample = episode.to_sample(eos_id=2)
        EpisodeCapture(captures=[request0, request1], layers=1, top_k=2, on=True).attach([episode], [sample], include_prompt)
        assert sample.routed_experts[:, 0, :].tolist() == expected[start:]
        padded = Rollouts(samples=[sample], n_samples=1, weight_version=3).to_padded()
        assert padded.routed_experts[0, :, 0, :].tolist() == [[-1, -1]] * start + expected[start:]
