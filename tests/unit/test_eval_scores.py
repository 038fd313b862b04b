"""Evaluation scores against hand computations and brute force: pass@k, maj@k with ties, lengths, per source;
the eval-set config and the checks that run before any generation."""

import itertools
import json

import numpy
import pytest

from megatron_rl.config import RLConfig, load_config
from megatron_rl.config.core import ConfigError
from megatron_rl.config.evaluation import parse_eval_sets
from megatron_rl.data.dataset import DatasetError
from megatron_rl.evaluation.answers import EvalSetError, answer_rule
from megatron_rl.evaluation.runner import load_eval_set
from megatron_rl.evaluation.scores import PromptResult, aggregate, by_source, majority_vote, pass_at_k, percentile
from megatron_rl.models.tiny import build_sentencepiece_model, write_hf_tokenizer_dir
from megatron_rl.rollout.rewards import exact_match


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert pass_at_k(8, 1, 4) == pytest.approx(1 - 35 / 70)  # 1 - C(7,4)/C(8,4)
    for n in (1, 4, 7):
        assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, 0, n) == 0.0  # c = 0: never
        assert pass_at_k(n, n, 1) == 1.0 and pass_at_k(n, n, n) == 1.0  # c = n: always
        assert pass_at_k(n, 1, n) == 1.0  # n = k: one correct sample is among the k drawn
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_pass_at_k_equals_brute_force_enumeration():
    # pass@k = the fraction of the C(n, k) subsets of k samples that hold at least one correct sample
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                expected = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_majority_vote_ties_go_to_the_earliest_first_sample():
    same = str.__eq__
    assert majority_vote(["b", "a", "a", "b", "c"], same) == 0  # b and a both 2 votes; b's first sample (0) comes first
    assert majority_vote(["c", "a", "b", "a", "b"], same) == 1  # a (1, 3) and b (2, 4) tie; a first appears at 1
    assert majority_vote(["c", "a", "b", "b"], same) == 2  # b has 2 votes
    assert majority_vote(["", "x", ""], same) == 1  # empty answers do not vote
    assert majority_vote(["", ""], same) == -1
    assert majority_vote(["X", "y", "x"], lambda a, b: a.lower() == b.lower()) == 0  # the equivalence groups X and x


@pytest.mark.extra("data", "math_verify")
def test_math_answers_vote_by_math_verify_equivalence():
    from megatron_rl.rollout.rewards import math_answer

    rule = answer_rule("math", math_answer)
    finals = [rule.final(r) for r in ["so \\boxed{3}", "\\boxed{0.5}", "we get \\boxed{\\frac{1}{2}}", "\\boxed{3}", "\\boxed{1/2}"]]
    assert finals[0] == "$3$" and finals[2] == "$\\frac{1}{2}$"
    # 1/2 has three votes (0.5, \frac{1}{2}, 1/2), 3 has two: the winner is the first 1/2, sample 1
    assert majority_vote(finals, rule.same) == 1


def _result(rewards, lengths, finals, source="", truncated=None, errors=0):
    same = str.__eq__
    return PromptResult(
        index=0, data_source=source, answer="a", rewards=rewards, correct=[r >= 1.0 for r in rewards], lengths=lengths,
        truncated=truncated or [False] * len(rewards), final_answers=finals, majority=majority_vote(finals, same), reward_errors=errors,
    )


def test_aggregate_by_hand():
    results = [
        _result([1, 0, 0, 1], [1, 2, 3, 4], ["a", "b", "b", "a"], truncated=[False, False, False, True]),  # tie a/b: a first, correct
        _result([0, 0, 0, 0], [5, 6, 7, 8], ["c", "c", "d", ""], errors=1),
    ]
    m = aggregate(results, [1, 2, 4])
    assert m["mean@4"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["pass@1"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # 1 - C(2,2)/C(4,2) for the first prompt
    assert m["pass@4"] == pytest.approx(0.5)
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["length_mean"] == pytest.approx(4.5)
    assert m["length_p50"] == pytest.approx(4.5)
    assert m["length_p95"] == pytest.approx(7 + 0.65)  # position 0.95 x 7 = 6.65 between 7 and 8
    assert m["length_max"] == 8 and m["truncated_fraction"] == pytest.approx(1 / 8) and m["reward_errors"] == 1
    assert m["num_prompts"] == 2 and m["samples_per_prompt"] == 4
    assert percentile([3, 1, 9, 4, 4], 95) == pytest.approx(float(numpy.percentile([3, 1, 9, 4, 4], 95)))


def test_per_source_breakdown_equals_each_source_alone():
    mixed = [
        _result([1, 1], [2, 2], ["a", "a"], source="aime"),
        _result([0, 1], [3, 5], ["b", "a"], source="math"),
        _result([0, 0], [4, 4], ["b", "b"], source="aime"),
        _result([1, 0], [1, 9], ["a", "c"], source="math"),
    ]
    sources = by_source(mixed, [1, 2])
    assert set(sources) == {"aime", "math"}
    # aime alone: accuracies 1, 0 -> mean@2 0.5, pass@2 0.5, maj@2 0.5, lengths 2 2 4 4
    aime = sources["aime"]
    assert (aime["mean@2"], aime["pass@2"], aime["maj@2"], aime["length_mean"], aime["num_prompts"]) == (0.5, 0.5, 0.5, 3.0, 2.0)
    # math alone: accuracies 1/2, 1/2 -> mean@2 0.5, pass@2 1; maj: prompt 1 a/b tie -> "b" (wrong), prompt 2 "a" (right)
    math_ = sources["math"]
    assert (math_["mean@2"], math_["pass@2"], math_["maj@2"], math_["length_max"]) == (0.5, 1.0, 0.5, 9.0)
    for source, metrics in sources.items():
        assert metrics == aggregate([r for r in mixed if r.data_source == source], [1, 2])
    assert by_source([_result([1], [1], ["a"])], [1]) == {}  # no data_source column: no breakdown


def test_eval_set_config():
    sets = parse_eval_sets({"aime24": {"path": "a.jsonl", "k": 8}, "math500": "b.jsonl", "six": {"path": "c.jsonl", "k": 6}})
    assert sets["aime24"].pass_ks() == [1, 2, 4, 8] and sets["six"].pass_ks() == [1, 2, 4, 6]
    assert sets["math500"].k == 1 and sets["math500"].pass_ks() == [1]
    assert (sets["math500"].temperature, sets["math500"].top_p) == (0.6, 0.95)
    for bad, message in [
        ({"x": {"path": "a.jsonl", "k": 0}}, r"data.eval_sets.x.k=0"),
        ({"x": {"path": "a.jsonl", "k": 4, "pass_at": [1, 8]}}, r"pass@8 needs at least 8 samples .* data.eval_sets.x.k=4"),
        ({"x y": "a.jsonl"}, "set name 'x y'"),
        ({"x": {"path": "a.jsonl", "kk": 1}}, "unknown config key 'data.eval_sets.x.kk'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_eval_sets(bad)
    with pytest.raises(ConfigError, match="replaced by data.eval_sets"):
        load_config(RLConfig, None, ["data.eval_path=x.jsonl"])
    cfg = load_config(RLConfig, None, ["data.eval_sets={aime: {path: a.jsonl, k: 4}}"])
    assert cfg.data.eval_sets["aime"].k == 4



def test_eval_set_paths_in_a_preset_resolve_against_the_preset(tmp_path):
    (tmp_path / "sub").mkdir()
    preset = tmp_path / "sub" / "p.yaml"
    preset.write_text("data:\n  eval_sets:\n    a: ./a.jsonl\n    b: {path: ../b.jsonl, k: 2}\n    c: synthetic:add:4\n")
    sets = load_config(RLConfig, preset).data.eval_sets
    assert (sets["a"].path, sets["b"].path, sets["c"].path) == (str(tmp_path / "sub" / "a.jsonl"), str(tmp_path / "b.jsonl"), "synthetic:add:4")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_rl.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("tok")
    return load_tokenizer(write_hf_tokenizer_dir(build_sentencepiece_model(root / "sp.model"), root / "hf"))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def picky_reward(response, answer, *, prompt=""):
    """A user reward that cannot score answers that are not digits."""
    return float(int(response) == int(answer))


def _load(tmp_path, tokenizer, rows, reward="exact", **set_config):
    path = _jsonl(tmp_path / "set.jsonl", rows)
    cfg = load_config(RLConfig, None, [f"data.reward={reward}", "rollout.max_prompt_tokens=16"])
    return load_eval_set("s", parse_eval_sets({"s": {"path": path, **set_config}})["s"], cfg, tokenizer)


@pytest.mark.extra("data", "math_verify")
def test_a_reference_math_verify_cannot_parse_is_named(tokenizer, tmp_path):
    with pytest.raises(EvalSetError, match=r"row 1: the reward 'math' gives the reference answer '\\\\frac\{' itself 0.0"):
        _load(tmp_path, tokenizer, [{"prompt": "a b", "answer": "\\frac{1}{2}"}, {"prompt": "c d", "answer": "\\frac{"}], reward="math")


def test_bad_eval_sets_are_named_before_any_generation(tokenizer, tmp_path):
    def load(rows, reward="exact", **set_config):
        return _load(tmp_path, tokenizer, rows, reward, **set_config)

    with pytest.raises(DatasetError, match=r"row 1: missing field 'answer'"):
        load([{"prompt": "a b", "answer": "a"}, {"prompt": "c d"}])
    with pytest.raises(DatasetError, match=r"row 0: field 'answer' is empty"):  # refused as the set is read
        load([{"prompt": "a b", "answer": " "}])
    with pytest.raises(EvalSetError, match=r"row 1: the reward 'tests.unit.test_eval_scores:picky_reward' cannot score .*'x'"):
        load([{"prompt": "a b", "answer": "3"}, {"prompt": "c d", "answer": "x"}], reward="tests.unit.test_eval_scores:picky_reward")
    with pytest.raises(DatasetError, match=r"row 0: prompt has \d+ tokens > rollout.max_prompt_tokens=16"):
        load([{"prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z", "answer": "a"}])
    good = load([{"prompt": "a b", "answer": "a", "data_source": "x"}, {"prompt": "c d", "answer": "c"}], k=4)
    assert good.sources == ["x", ""] and good.spec.n == 4 and good.spec.temperature == 0.6 and good.reward_fn is exact_match
