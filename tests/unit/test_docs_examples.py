"""The examples of the data, rewards and extending pages (docs/examples/) run, and give the numbers worked out
here by hand. The plug-ins (a loss, an advantage estimator, an importance-sampling correction, a group filter, a
rollout function) are loaded by their import path as a run loads them (megatron_rl.plugins). A module that
registers a model family runs in a process of its own, as a user's run would import it: this process's registry
stays the package's own."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = 24 clips.\nIn all 48+24 = 72 clips.\n#### 72"},
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
]


def run_example(body: str) -> dict:
    """Run `body` in a fresh interpreter with docs/examples importable; it prints one JSON object last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.tiny import build_sentencepiece_model

    return load_tokenizer(build_sentencepiece_model(tmp_path_factory.mktemp("tok") / "sp.model"))


# ---- data ---------------------------------------------------------------------------------------------------


@pytest.mark.extra("data", "pyarrow")
def test_prompt_files_converted_from_jsonl_parquet_and_a_datasets_folder_load(tmp_path, sp_tokenizer, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    from megatron_rl.data.dataset import PromptDataset

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import convert_prompts

    (tmp_path / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), tmp_path / "src.parquet")
    Dataset.from_list(GSM8K_ROWS).save_to_disk(str(tmp_path / "saved"))
    convert_prompts.main(str(tmp_path / "src.jsonl"), str(tmp_path / "a.jsonl"))
    convert_prompts.main(str(tmp_path / "src.parquet"), str(tmp_path / "b.parquet"))
    convert_prompts.main(str(tmp_path / "saved"), str(tmp_path / "c.parquet"))
    for name in ("a.jsonl", "b.parquet", "c.parquet"):
        dataset = PromptDataset(tmp_path / name, sp_tokenizer, shuffle=False)
        assert [p.text for p in dataset.prompts] == [r["question"] for r in GSM8K_ROWS], name
        assert [p.answer for p in dataset.prompts] == ["72", "7"], name  # what follows '####', by hand
        assert [p.row["data_source"] for p in dataset.prompts] == ["gsm8k", "gsm8k"], name
        assert dataset.prompts[1].token_ids == sp_tokenizer.encode("What is 3 + 4?")


def test_a_multi_turn_messages_row_is_rendered_by_the_tokenizers_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.tiny import build_sentencepiece_model, write_hf_tokenizer_dir

    hf_dir = write_hf_tokenizer_dir(build_sentencepiece_model(tmp_path / "sp.model"), tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    hf.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    hf.save_pretrained(str(hf_dir))
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and times 3?"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages, "answer": "12"}) + "\n")
    tokenizer = load_tokenizer(hf_dir)
    dataset = PromptDataset(tmp_path / "chat.jsonl", tokenizer, prompt_key="messages")
    by_hand = "[system] Answer with a number.\n[user] 2 + 2?\n[assistant] 4\n[user] and times 3?\n[assistant] "
    assert dataset.prompts[0].token_ids == tokenizer.encode(by_hand)
    assert dataset.prompts[0].answer == "12"


# ---- rewards ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, reward", [
    ("So 48 + 24 = 72.\nAnswer: 72", 1.0),
    ("Answer: 72.0", 1.0),
    ("so the answer is 72", 0.0),
    ("Answer: 70", 0.1),
    ("Answer: seventy-two", 0.1),
])
def test_the_custom_reward_by_import_path_gives_the_pages_worked_example(response, reward, monkeypatch):
    from megatron_rl.rollout.rewards import compute_rewards, get_reward_fn

    monkeypatch.syspath_prepend(str(EXAMPLES))
    fn = get_reward_fn("reward_example:graded_answer")
    assert compute_rewards(fn, [response], ["72"], ["a prompt"]).rewards == [reward]


# ---- extending ----------------------------------------------------------------------------------------------


def test_the_mistral_family_builds_a_model_whose_logits_are_transformers(tmp_path):
    out = run_example(f"""
        import json, warnings, torch
        from transformers import MistralConfig, MistralForCausalLM
        import mistral_family  # registers model_type "mistral"
        from megatron_rl.config import ModelConfig, ParallelConfig
        from megatron_rl.models import UnsupportedModelError, build_model
        from megatron_rl.parallel import init_parallel

        config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               sliding_window=None, initializer_range=0.1)
        torch.manual_seed(0)
        reference = MistralForCausalLM(config).eval()
        reference.save_pretrained({str(tmp_path / 'mistral')!r})
        ctx = init_parallel(ParallelConfig())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (model,) = build_model(ModelConfig(path={str(tmp_path / 'mistral')!r}, dtype="float32"), ctx)
        model.eval()
        tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(24).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            err = (model(tokens, positions, attention_mask=None)[..., :256] - reference(tokens).logits).abs().max().item()
        windowed = json.loads(open({str(tmp_path / 'mistral' / 'config.json')!r}).read())
        windowed["sliding_window"] = 32
        import pathlib
        pathlib.Path({str(tmp_path / 'windowed')!r}).mkdir()
        pathlib.Path({str(tmp_path / 'windowed' / 'config.json')!r}).write_text(json.dumps(windowed))
        try:
            build_model(ModelConfig(path={str(tmp_path / 'windowed')!r}, load_weights=False), ctx)
            refused = ""
        except UnsupportedModelError as e:
            refused = str(e)
        print(json.dumps({{"err": err, "refused": refused}}))
    """)
    assert out["err"] < 1e-4, out
    assert "sliding_window=32 is not supported" in out["refused"], out


@pytest.fixture
def plugins(monkeypatch):
    """load(**sections): load_plugins on a config of `sections` with docs/examples importable, as a run with that
    folder on PYTHONPATH does; the plug-ins go to registries of this test's own."""
    from megatron_rl.algorithms import ADVANTAGES, GROUP_FILTERS, IS_CORRECTIONS, POLICY_LOSSES
    from megatron_rl.config import RLConfig, from_dict
    from megatron_rl.plugins import load_plugins

    monkeypatch.syspath_prepend(str(EXAMPLES))
    for registry in (POLICY_LOSSES, ADVANTAGES, IS_CORRECTIONS, GROUP_FILTERS):
        monkeypatch.setattr(registry, "_plugins", {})

    def load(**sections):
        cfg = from_dict(RLConfig, {"data": {"reward": "exact"}, **sections})
        load_plugins(cfg)
        return cfg

    return load


def test_the_cispo_loss_and_its_gradient_are_the_formulas(plugins):
    import torch

    from megatron_rl.algorithms import compute_loss_denominators, get_policy_loss

    # Two sequences of 3 tokens (the last token of the second is padding); eps_high 0.28, no lower bound.
    logprobs = [[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]]
    old = [[-1.5, -0.5, -1.0], [-0.1, -1.4, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    advantages = [1.0, -0.5]
    cfg = plugins(algorithm={"loss": "cispo_loss:cispo_loss"})
    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    denom = compute_loss_denominators([torch.tensor(mask, dtype=torch.bool)])
    loss, _ = get_policy_loss(cfg.algorithm.loss)(lp, torch.tensor(old, dtype=torch.float64),
                                                  torch.tensor(advantages, dtype=torch.float64),
                                                  torch.tensor(mask, dtype=torch.bool), cfg.algorithm, denom,
                                                  ref_logprobs=None, rollout_logprobs=None, entropy=None)
    loss.backward()
    # by hand: weight_t = min(exp(lp - old), 1.28) (no lower bound), loss = -sum w A lp / 5, d loss / d lp = -w A / 5
    weights = [[min(math.exp(a - o), 1.28) for a, o in zip(lr, orow)] for lr, orow in zip(logprobs, old)]
    expected = -sum(weights[i][t] * advantages[i] * logprobs[i][t] * mask[i][t] for i in range(2) for t in range(3)) / 5
    grad = [[-weights[i][t] * advantages[i] * mask[i][t] / 5 for t in range(3)] for i in range(2)]
    assert denom.global_num_tokens == 5
    assert float(loss) == pytest.approx(expected, abs=1e-12)
    assert lp.grad.tolist() == [pytest.approx(row, abs=1e-12) for row in grad]
    assert weights[0][0] == 1.28  # exp(0.5) = 1.65 is cut at 1 + eps_high, yet that token keeps its gradient


def test_the_reinforce_pp_baseline_advantages_are_the_formula(plugins):
    import torch

    from megatron_rl.algorithms import compute_advantages

    rewards, groups = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], [7, 7, 7, 7, 3, 3, 3, 3]
    cfg = plugins(algorithm={"advantage": "reinforce_pp_advantage:reinforce_pp_baseline"})
    out = compute_advantages(torch.tensor(rewards), torch.tensor(groups), cfg.algorithm, group_size=4).tolist()
    means = {7: 0.75, 3: 0.25}  # each group's mean reward, by hand
    centred = [r - means[g] for r, g in zip(rewards, groups)]
    expected = [c / (statistics.stdev(centred) + 1e-6) for c in centred]
    assert out == pytest.approx(expected, abs=1e-6)


def test_the_two_sided_correction_truncates_both_ways_and_drops_nothing(plugins):
    import torch

    from megatron_rl.algorithms import importance_weights

    cfg = plugins(algorithm={"tis_mode": "two_sided_correction:TWO_SIDED"})
    rollout = torch.zeros(1, 4, dtype=torch.float64)
    old = torch.tensor([[math.log(3.0), math.log(1.5), math.log(0.25), math.log(0.8)]], dtype=torch.float64)
    w = importance_weights(cfg.algorithm, old, rollout, torch.tensor([[True, True, True, False]]))
    # rho = 3, 1.5, 0.25 on the valid tokens, cut to [1/2, 2]: 2, 1.5, 0.5; the invalid token's log ratio is 0
    assert w.weight.tolist() == [pytest.approx([2.0, 1.5, 0.5, 1.0])]
    assert w.keep.tolist() == [[True, True, True, False]]
    assert w.truncated.tolist() == [[True, False, True, False]]


def test_the_difficulty_filter_keeps_the_groups_of_its_table(plugins):
    import torch

    from megatron_rl.algorithms import DynamicSamplingAccumulator

    cfg = plugins(algorithm={"dynamic_sampling": True, "group_filter": "difficulty_filter:mid_difficulty"})
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    groups = torch.arange(4).repeat_interleave(4)
    accumulator = DynamicSamplingAccumulator(2, 1, group_filter=cfg.algorithm.group_filter)
    accumulator.add(rewards, groups, rows=list(range(16)))
    # the page's table: means 0.25, 1.0, 0.75, 0.0; the first and the third group are kept
    assert accumulator.take()["rows"] == [0, 1, 2, 3, 8, 9, 10, 11]


def test_the_instruction_rollout_function_takes_the_trainers_call(plugins):
    """Loaded and checked as a run loads it; generating through it needs an engine (the e2e tests)."""
    from megatron_rl.rollout.function import get_rollout_function

    cfg = plugins(rollout={"function": "instruction_rollout:with_instruction"})
    import instruction_rollout

    assert get_rollout_function(cfg.rollout.function) is instruction_rollout.with_instruction


def test_the_guess_environment_by_import_path_answers_each_turn(monkeypatch):
    from megatron_rl.data.dataset import Prompt
    from megatron_rl.rollout.agents import AgentContext, ModelTurn, load_agent

    monkeypatch.syspath_prepend(str(EXAMPLES))
    env = load_agent("guess_environment:Guess")(AgentContext(tokenizer=None, config=None))
    assert env.reset(Prompt(index=0, token_ids=[5], text="guess my number", answer="7")) is None
    said = []
    for i, text in enumerate(["3", "nine", "9", " 7"]):
        result = env.step(ModelTurn(index=i, token_ids=[], text=text, finish_reason="stop"))
        said.append((result.observation, result.reward, result.done))
    assert said == [("higher", 0.0, False), ("a number, please", 0.0, False), ("lower", 0.0, False), (None, 1.0, True)]


def test_the_examples_fit_the_width_of_a_pages_code_block():
    """The pages include each example whole; a line longer than a code block shows (76 characters at the
    site's width) is cut off on the page."""
    long = [f"{path.name}:{n}" for path in sorted(EXAMPLES.glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), start=1) if len(line) > 76]
    assert not long, f"lines over 76 characters: {long}"
