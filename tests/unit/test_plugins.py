"""Plug-ins by import path: each of the seven keys takes a user's module written to a temporary folder, which the
run calls where it calls its built-in, with numbers worked out by hand; a function of the wrong call is refused at
start in one line naming the key, the value, the expected call and the function's own."""

from __future__ import annotations

import importlib
import json
import math
import textwrap

import pytest
import torch

from megatron_rl.algorithms import (
    ADVANTAGES, GROUP_FILTERS, IS_CORRECTIONS, POLICY_LOSSES, DynamicSamplingAccumulator, DynamicSamplingExhausted,
    compute_advantages, compute_loss_denominators, get_policy_loss, kept_samples,
)
from megatron_rl.algorithms.importance import importance_weights, is_correction_params
from megatron_rl.config import ConfigError, RLConfig, from_dict
from megatron_rl.config.algorithm import GROUP_FILTER_NAMES
from megatron_rl.config.rollout import ROLLOUT_FUNCTION_NAMES
from megatron_rl.plugins import load_plugins
from megatron_rl.rollout.function import ROLLOUT_FUNCTIONS, generate, get_rollout_function
from megatron_rl.rollout.import_path import PluginError
from megatron_rl.rollout.rewards import compute_rewards, exact_match, get_reward_fn

LOSS_CALL = ("fn(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *, ref_logprobs, rollout_logprobs, "
             "entropy) -> tuple[torch.Tensor, Metrics]")


@pytest.fixture(autouse=True)
def _registries_without_plugins(monkeypatch):
    """Each test adds its plug-ins to registries of its own (the process-wide ones are left as they were)."""
    for registry in (POLICY_LOSSES, ADVANTAGES, IS_CORRECTIONS, GROUP_FILTERS):
        monkeypatch.setattr(registry, "_plugins", {})


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """plugin(source) -> the module name of a file holding `source`, importable from a folder on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    count = iter(range(100))

    def write(source: str) -> str:
        name = f"plugin_{tmp_path.name.replace('-', '_')}_{next(count)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return name

    return write


def config(**sections) -> RLConfig:
    """An RLConfig with the exact-match reward (no optional extra needed) and `sections` set."""
    sections.setdefault("data", {}).setdefault("reward", "exact")
    return from_dict(RLConfig, sections)


def refusal(cfg: RLConfig) -> str:
    """load_plugins' one-line error for `cfg`."""
    with pytest.raises(ConfigError) as caught:
        load_plugins(cfg)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_config_names_match_the_registries():
    assert list(GROUP_FILTER_NAMES) == GROUP_FILTERS.names()
    assert sorted(ROLLOUT_FUNCTION_NAMES) == sorted(ROLLOUT_FUNCTIONS)
    assert get_rollout_function("generate") is generate  # the default, one engine.generate call


# ---- algorithm.loss -----------------------------------------------------------------------------------------


def test_a_loss_plugin_twice_gspo_gives_twice_the_loss_and_gradient(plugin):
    module = plugin("""
        from megatron_rl.algorithms.losses import gspo_loss

        def twice_gspo(logprobs, old_logprobs, advantages, response_mask, cfg, denom, **options):
            loss, metrics = gspo_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, **options)
            return 2 * loss, metrics
    """)
    cfg = config(algorithm={"loss": f"{module}:twice_gspo", "eps_low": 0.5, "eps_high": 0.5})
    assert list(load_plugins(cfg)) == ["algorithm.loss"]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.8]], dtype=torch.float64)
    d = torch.tensor([[0.1, -0.05, 0.0], [0.02, 0.04, -0.03]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    denom = compute_loss_denominators([mask])
    # GSPO by hand: s_i = exp(mean of d over i's tokens), inside [0.5, 1.5] so unclipped: l_i = -s_i A_i;
    # L = (1/2) sum_i l_i, dL/dlogprob_it = -A_i s_i / (2 |y_i|). The plug-in doubles both.
    s = [math.exp((0.1 - 0.05) / 2), math.exp((0.02 + 0.04 - 0.03) / 3)]
    by_hand = -(s[0] * 1.0 + s[1] * -0.5) / 2
    grad_by_hand = torch.tensor([[-1.0 * s[0] / 4, -1.0 * s[0] / 4, 0.0], [0.5 * s[1] / 6] * 3], dtype=torch.float64)
    for name, factor in (("gspo", 1.0), (cfg.algorithm.loss, 2.0)):
        logprobs = (old + d).requires_grad_()
        loss, metrics = get_policy_loss(name)(logprobs, old, advantages, mask, cfg.algorithm, denom,  # as actor.step calls it
                                              ref_logprobs=None, rollout_logprobs=None, entropy=None)
        loss.backward()
        assert float(loss) == pytest.approx(factor * by_hand, rel=1e-12), name
        torch.testing.assert_close(logprobs.grad, factor * grad_by_hand, rtol=1e-12, atol=0.0)
        assert float(metrics["sequences/sum"]) == 2.0


def test_a_loss_of_another_call_is_refused_in_one_line_by_the_start_up_check(plugin):
    from megatron_rl.preflight import check_plugins

    module = plugin("def fn(x):\n    return x\n")
    with pytest.raises(ConfigError) as caught:
        check_plugins(config(algorithm={"loss": f"{module}:fn"}))  # check_before_start's, on every rank
    assert str(caught.value) == f"algorithm.loss='{module}:fn': {LOSS_CALL} expected; got fn(x)"
    assert refusal(config(algorithm={"loss": f"{module}:fn"})) == str(caught.value)


# ---- algorithm.advantage ------------------------------------------------------------------------------------


def test_an_advantage_plugin_is_what_compute_advantages_returns(plugin):
    module = plugin("""
        import torch

        def gap_to_best(rewards, index, group_size, cfg):
            best = torch.full((int(index.max()) + 1,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amax")
            return rewards - best[index]
    """)
    cfg = config(algorithm={"advantage": f"{module}:gap_to_best"})
    load_plugins(cfg)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 0.25])
    groups = torch.tensor([5, 5, 5, 2, 2, 2])
    # the group's best: 1.0 for group 5, 0.25 for group 2
    expected = torch.tensor([0.0, -1.0, -0.5, -0.25, -0.25, 0.0])
    torch.testing.assert_close(compute_advantages(rewards, groups, cfg.algorithm, group_size=3), expected)


def test_an_advantage_of_another_call_or_shape_is_refused(plugin):
    module = plugin("""
        import torch

        def two(rewards, index):
            return rewards

        def per_group(rewards, index, group_size, cfg):
            return torch.zeros(int(index.max()) + 1)
    """)
    message = refusal(config(algorithm={"advantage": f"{module}:two"}))
    assert message == f"algorithm.advantage='{module}:two': fn(rewards, index, group_size, cfg) -> torch.Tensor expected; got two(rewards, index)"
    cfg = config(algorithm={"advantage": f"{module}:per_group"})
    load_plugins(cfg)
    with pytest.raises(ValueError, match=r"returned \(2,\): it must return one advantage per sample, a tensor of shape \(4,\)"):
        compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), cfg.algorithm, group_size=2)


# ---- algorithm.tis_mode -------------------------------------------------------------------------------------

CORRECTIONS = """
    import torch

    from megatron_rl.algorithms import ISCorrection, ISParams

    def capped(log_rho, params):
        ratio = log_rho.exp()
        return ratio.clamp(max=params.cap), torch.ones_like(log_rho, dtype=torch.bool), ratio > params.cap

    SEQUENCE_CAPPED = ISCorrection(name="sequence_capped", level="sequence", drops=False, defaults=ISParams(cap=1.2),
                                   weights=capped)

    def no_params(log_rho):
        return log_rho
"""


def test_an_importance_sampling_function_weighs_each_token_in_the_loss(plugin):
    module = plugin(CORRECTIONS)
    cfg = config(algorithm={"loss": "dapo", "tis_mode": f"{module}:capped", "tis_cap": 1.5})
    load_plugins(cfg)
    assert is_correction_params(cfg.algorithm).cap == 1.5  # the config's number, as given
    old = torch.tensor([[math.log(0.2), math.log(0.1), math.log(0.3)]], dtype=torch.float64)
    rollout = old - torch.tensor([[math.log(2.0), math.log(0.5), 0.0]], dtype=torch.float64)  # rho = 2, 0.5, 1
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights = importance_weights(cfg.algorithm, old, rollout, mask)
    torch.testing.assert_close(weights.weight, torch.tensor([[1.5, 0.5, 1.0]], dtype=torch.float64))  # min(rho, 1.5)
    assert weights.truncated.tolist() == [[True, False, False]]
    # dapo at pi_theta = pi_old: l_t = -A w_t, the token mean over 3 tokens with A = 1: -(1.5 + 0.5 + 1) / 3 = -1
    loss, _ = get_policy_loss("dapo")(old.clone().requires_grad_(), old, torch.tensor([1.0], dtype=torch.float64), mask,
                                      cfg.algorithm, compute_loss_denominators([mask]), ref_logprobs=None,
                                      rollout_logprobs=rollout, entropy=None)
    assert float(loss) == pytest.approx(-1.0, rel=1e-12)


def test_an_importance_sampling_correction_object_keeps_its_level_and_defaults(plugin):
    module = plugin(CORRECTIONS)
    cfg = config(algorithm={"loss": "dapo", "tis_mode": f"{module}:SEQUENCE_CAPPED"})
    load_plugins(cfg)
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = -torch.tensor([[math.log(2.0), math.log(2.0), 0.0]], dtype=torch.float64)
    # one ratio per sequence, the geometric mean 2^(2/3) = 1.587, capped at its default 1.2
    weights = importance_weights(cfg.algorithm, old, rollout, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(weights.weight, torch.tensor([[1.2]], dtype=torch.float64))
    message = refusal(config(algorithm={"tis_mode": f"{module}:no_params"}))
    assert message == (f"algorithm.tis_mode='{module}:no_params': fn(log_rho, params) -> "
                       "tuple[torch.Tensor, torch.Tensor, torch.Tensor] expected; got no_params(log_rho)")


# ---- algorithm.group_filter ---------------------------------------------------------------------------------

FILTERS = """
    import torch

    def has_a_right_answer(rewards, group_ids):
        _, index = torch.unique(group_ids, return_inverse=True)
        best = torch.zeros(int(index.max()) + 1).scatter_reduce(0, index, rewards, "amax", include_self=False)
        return (best == 1.0)[index]

    def first_sample_only(rewards, group_ids):
        return torch.arange(len(rewards)) % 2 == 0

    def mean_at_least_half(rewards, group_ids):
        _, index = torch.unique(group_ids, return_inverse=True)
        sums = torch.zeros(int(index.max()) + 1).index_add_(0, index, rewards)
        counts = torch.bincount(index).to(rewards.dtype)
        return (sums / counts >= 0.5)[index]

    def one_argument(rewards):
        return rewards > 0
"""


def test_a_group_filter_plugin_decides_which_groups_dynamic_sampling_keeps(plugin):
    module = plugin(FILTERS)
    cfg = config(algorithm={"dynamic_sampling": True, "group_filter": f"{module}:has_a_right_answer"})
    load_plugins(cfg)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    # groups with a reward of 1: 0 and 2 (the built-in reward_variance would keep 0 and 3 instead)
    assert kept_samples("reward_variance", rewards, group_ids).tolist() == [True, True, False, False, False, False, True, True]
    accumulator = DynamicSamplingAccumulator(2, 1, group_filter=cfg.algorithm.group_filter)  # as experience.py builds it
    accumulator.add(rewards, group_ids, samples=list("abcdefgh"))
    kept = accumulator.take()
    assert kept["samples"] == ["a", "b", "e", "f"] and kept["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    load_plugins(config(algorithm={"group_filter": f"{module}:first_sample_only"}))
    with pytest.raises(ValueError, match="kept some samples of a group and not others"):
        kept_samples(f"{module}:first_sample_only", rewards, group_ids)
    message = refusal(config(algorithm={"group_filter": f"{module}:one_argument"}))
    assert message == (f"algorithm.group_filter='{module}:one_argument': fn(rewards, group_ids) -> torch.Tensor expected; "
                       "got one_argument(rewards)")


# ---- data.reward --------------------------------------------------------------------------------------------


def test_a_reward_plugin_scores_the_responses(plugin):
    module = plugin("""
        def word_count(response, answer, *, prompt):
            return float(len(response.split()) == int(answer))

        def no_prompt(response, answer):
            return 0.0
    """)
    fn = load_plugins(config(data={"reward": f"{module}:word_count"}))["data.reward"]
    assert get_reward_fn(f"{module}:word_count") is fn
    assert compute_rewards(fn, ["a b", "a", "x y z"], [2, 2, 3], ["p"] * 3).rewards == [1.0, 0.0, 1.0]
    message = refusal(config(data={"reward": f"{module}:no_prompt"}))
    assert message == (f"data.reward='{module}:no_prompt': fn(response, answer, *, prompt) -> float expected; "
                       "got no_prompt(response, answer)")


# ---- rollout.agent ------------------------------------------------------------------------------------------


def test_an_agent_plugin_plays_its_episode_and_a_function_is_refused(plugin):
    from megatron_rl.data.dataset import Prompt
    from megatron_rl.rollout.agents import AgentContext, ModelTurn

    module = plugin("""
        from megatron_rl.rollout.agents import Environment, StepResult

        class Echo(Environment):
            def reset(self, prompt):
                self.target = str(prompt.answer)

            def step(self, turn):
                return StepResult(reward=float(turn.text.strip() == self.target), done=True)

        def make_echo(context):
            return Echo(context)
    """)
    agent_cls = load_plugins(config(rollout={"agent": f"{module}:Echo"}))["rollout.agent"]
    env = agent_cls(AgentContext(tokenizer=None, config=None))
    env.reset(Prompt(index=0, token_ids=[1], text="say 7", answer=7))
    assert env.step(ModelTurn(index=0, token_ids=[5], text=" 7 ", finish_reason="stop")).reward == 1.0
    assert env.step(ModelTurn(index=0, token_ids=[5], text="8", finish_reason="stop")).reward == 0.0
    message = refusal(config(rollout={"agent": f"{module}:make_echo"}))
    assert message == (f"rollout.agent='{module}:make_echo': a subclass of megatron_rl.rollout.agents.Environment "
                       "(or ToolsAgent) expected; got function make_echo")


# ---- rollout.function ---------------------------------------------------------------------------------------

SCRIPTED = """
    import torch

    from megatron_rl.data.batch import RolloutSample, Rollouts

    def first_sample_answers(engine, prompts, spec, tokenizer, cfg):
        '''Sample 0 of each prompt answers it, the others answer 0; the engine is not used.'''
        samples = []
        for i, prompt in enumerate(prompts):
            for j in range(spec.n):
                response = tokenizer.encode(str(prompt.answer) if j == 0 else "0") + [tokenizer.eos_id]
                samples.append(RolloutSample(
                    prompt_index=i, sample_index=j, prompt_token_ids=torch.tensor(prompt.token_ids),
                    response_token_ids=torch.tensor(response), rollout_logprobs=torch.zeros(len(response)),
                    finish_reason="stop", stop_reason=None, weight_version=0))
        return Rollouts(samples=samples, n_samples=spec.n, weight_version=0)

    def one_per_prompt(engine, prompts, spec, tokenizer, cfg):
        return first_sample_answers(engine, prompts, spec.__class__(n=1), tokenizer, cfg)

    def without_tokenizer(engine, prompts, spec):
        return None
"""


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    """(a sentencepiece tokenizer, a two-row prompt file) for the rollout function's tests."""
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.tiny import build_sentencepiece_model

    folder = tmp_path_factory.mktemp("arithmetic")
    rows = [{"prompt": "2 + 3 =", "answer": "5"}, {"prompt": "4 + 4 =", "answer": "8"}]
    (folder / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_tokenizer(build_sentencepiece_model(folder / "sp.model")), folder / "sums.jsonl"


def _rollout_config(module: str, **algorithm) -> RLConfig:
    return config(rollout={"function": f"{module}:first_sample_answers", "n_samples": 4},
                  train={"prompts_per_step": 2}, algorithm=algorithm)


def test_a_rollout_function_plugin_makes_the_steps_samples(plugin, arithmetic):
    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.experience import collect_experience

    tokenizer, path = arithmetic
    cfg = _rollout_config(plugin(SCRIPTED))
    load_plugins(cfg)
    dataset = PromptDataset(path, tokenizer, shuffle=False)
    experience = collect_experience(None, dataset, tokenizer, get_reward_fn("exact"), cfg, 0)  # the trainer's call
    # each group's rewards are [1, 0, 0, 0]: mean 1/4, sample std sqrt((3/4^2 + 3 (1/4)^2) / 3) = 1/2,
    # grpo advantages (r - 1/4) / (1/2 + 1e-6)
    assert experience.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] * 2
    torch.testing.assert_close(experience.advantages, torch.tensor([0.75, -0.25, -0.25, -0.25] * 2) / (0.5 + 1e-6))
    first = tokenizer.encode("2 + 3 =") + tokenizer.encode("5") + [tokenizer.eos_id]
    assert experience.rollouts.tokens[0, : len(first)].tolist() == first
    assert experience.metrics["reward/mean"] == 0.25


def test_a_rollout_function_plugin_feeds_the_asynchronous_stream(plugin, arithmetic):
    from megatron_rl.async_experience import AsyncExperienceStream
    from megatron_rl.data.dataset import PromptDataset

    tokenizer, path = arithmetic
    module = plugin(SCRIPTED)
    filters = plugin(FILTERS)
    cfg = config(rollout={"function": f"{module}:first_sample_answers", "n_samples": 4},
                 train={"prompts_per_step": 2, "max_staleness": 1},
                 algorithm={"tis_mode": "token", "dynamic_sampling": True, "group_filter": f"{filters}:has_a_right_answer"})
    load_plugins(cfg)
    stream = AsyncExperienceStream(None, PromptDataset(path, tokenizer, shuffle=False), tokenizer, get_reward_fn("exact"), cfg)
    try:
        experience = stream.take(0)
    finally:
        stream.close()
    assert experience.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] * 2
    assert experience.metrics["async/filtered_groups"] == 0.0  # every group has a right answer


def test_a_group_filter_that_keeps_nothing_stops_dynamic_sampling_naming_itself(plugin, arithmetic):
    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.experience import collect_experience

    tokenizer, path = arithmetic
    filters = plugin(FILTERS)
    cfg = _rollout_config(plugin(SCRIPTED), dynamic_sampling=True, max_num_gen_batches=1,
                          group_filter=f"{filters}:mean_at_least_half")
    load_plugins(cfg)
    with pytest.raises(DynamicSamplingExhausted, match=rf"passed algorithm.group_filter='{filters}:mean_at_least_half', "
                                                       "which dropped 2 of 2 generated groups"):
        collect_experience(None, PromptDataset(path, tokenizer, shuffle=False), tokenizer, exact_match, cfg, 0)


def test_a_rollout_function_of_another_call_or_count_is_refused(plugin, arithmetic):
    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.experience import generate_and_score
    from megatron_rl.rollout.sampling import SamplingSpec

    module = plugin(SCRIPTED)
    message = refusal(config(rollout={"function": f"{module}:without_tokenizer"}))
    assert message == (f"rollout.function='{module}:without_tokenizer': fn(engine, prompts, spec, tokenizer, cfg) -> "
                       "Rollouts expected; got without_tokenizer(engine, prompts, spec)")
    tokenizer, path = arithmetic
    cfg = config(rollout={"function": f"{module}:one_per_prompt", "n_samples": 4})
    load_plugins(cfg)
    prompts = PromptDataset(path, tokenizer, shuffle=False).next_batch(2)
    with pytest.raises(PluginError, match=rf"rollout.function='{module}:one_per_prompt' returned Rollouts of 2 samples, "
                                          r"n_samples=1 for 2 prompts: it must return Rollouts with n_samples=4 and 8"):
        generate_and_score(None, prompts, SamplingSpec.from_config(cfg.rollout), tokenizer, exact_match, cfg)


def test_a_rollout_function_excludes_agents_and_partial_rollouts():
    with pytest.raises(ConfigError, match="an agent generates its episodes turn by turn"):
        config(rollout={"function": "m:f", "agent": "lookup"})
    with pytest.raises(ConfigError, match="only the built-in generate is interrupted at a push"):
        config(rollout={"function": "m:f"}, train={"partial_rollouts": True, "max_staleness": 1},
               algorithm={"tis_mode": "token"})


# ---- every key: what is written, what imports ---------------------------------------------------------------

KEYS = [("algorithm", "loss"), ("algorithm", "advantage"), ("algorithm", "tis_mode"), ("algorithm", "group_filter"),
        ("data", "reward"), ("rollout", "agent"), ("rollout", "function")]


@pytest.mark.parametrize("section, key", KEYS)
def test_a_missing_module_or_attribute_names_the_key(section, key, plugin):
    module = plugin("VALUE = 1\n")
    message = refusal(config(**{section: {key: "no_such_package_xyz.mod:fn"}}))
    assert message.startswith(f"{section}.{key}='no_such_package_xyz.mod:fn': cannot import module 'no_such_package_xyz.mod' ")
    assert message.endswith("is it on PYTHONPATH?")
    message = refusal(config(**{section: {key: f"{module}:missing"}}))
    assert message.startswith(f"{section}.{key}='{module}:missing': module '{module}' has no attribute 'missing'; ")
    assert message.endswith(" expected")


@pytest.mark.parametrize("section, key", [k for k in KEYS if k[0] == "algorithm"] + [("rollout", "function")])
def test_a_value_neither_a_name_nor_an_import_path_is_refused_as_the_config_loads(section, key):
    with pytest.raises(ConfigError, match=rf"{section}.{key}='my_pkg.mod.fn' is not an? [a-z -]+; valid names: .*, "
                                          r"or an import path 'package.module:function'$"):
        from_dict(RLConfig, {section: {key: "my_pkg.mod.fn"}})
