"""Datasets, tokenizers and rewards on hand-made inputs."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, RLConfig, load_config
from megatron_rl.data.dataset import DatasetError, PromptDataset, read_rows
from megatron_rl.data.tasks import parse_synthetic, synthetic_rows
from megatron_rl.data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer
from megatron_rl.models.tiny import build_sentencepiece_model, write_hf_tokenizer_dir
from megatron_rl.rollout.rewards import RewardError, compute_rewards, exact_match, get_reward_fn, math_answer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    sp_model = build_sentencepiece_model(root / "sp.model")
    hf_dir = write_hf_tokenizer_dir(sp_model, root / "hf")
    return sp_model, hf_dir


def test_hf_and_sentencepiece_tokenizers_agree(tokenizer_files):
    import sentencepiece as spm

    sp_model, hf_dir = tokenizer_files
    reference = spm.SentencePieceProcessor(model_file=str(sp_model))
    hf, sp = load_tokenizer(hf_dir), load_tokenizer(sp_model)
    assert isinstance(hf, HFTokenizer) and isinstance(sp, SentencePieceTokenizer)
    for text in ["first letter of k q z is", "12 + 345 = 357", "Hello, World! {x: [1, 2]}"]:
        ids = reference.encode(text)
        assert hf.encode(text) == ids
        assert sp.encode(text) == ids
        assert hf.decode(ids) == reference.decode(ids)
    assert hf.eos_id == sp.eos_id == reference.eos_id() == 2
    assert hf.vocab_size == sp.vocab_size == reference.get_piece_size()


def test_tokenizer_path_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.extra("data", "pyarrow")
def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "1 + 1 =", "gold": "2"}, {"question": "2 + 2 =", "gold": "4"}]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_rows(tmp_path / "d.jsonl") == rows == read_rows(tmp_path / "d.parquet")


def test_malformed_rows_are_named(tmp_path, tokenizer_files):
    tok = load_tokenizer(tokenizer_files[1])
    cases = [
        ([{"prompt": "a", "answer": "b"}, {"answer": "c"}], r"row 1: missing field 'prompt'"),
        ([{"prompt": 3, "answer": "b"}], r"row 0: field 'prompt' must be a string"),
        ([{"prompt": "  ", "answer": "b"}], r"row 0: field 'prompt' is empty"),
        ([{"prompt": "a"}], r"row 0: missing field 'answer'"),
        ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}], r"row 1: field 'answer' is empty \(None\)"),
        ([{"prompt": "a", "answer": " "}], r"row 0: field 'answer' is empty \(' '\)"),
        ([{"prompt": [{"role": "user"}], "answer": "x"}], r"row 0: field 'prompt' as chat messages"),
    ]
    for i, (rows, message) in enumerate(cases):
        with pytest.raises(DatasetError, match=message):
            PromptDataset(_write_jsonl(tmp_path / f"bad{i}.jsonl", rows), tok)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl:2: not valid JSON"):
        PromptDataset(tmp_path / "broken.jsonl", tok)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match="holds no rows"):
        PromptDataset(tmp_path / "empty.jsonl", tok)


def test_long_prompts_dropped_with_count_or_rejected(tmp_path, tokenizer_files):
    tok = load_tokenizer(tokenizer_files[1])
    rows = [{"prompt": "a b", "answer": "x"}, {"prompt": " ".join("abcdefghij" * 3), "answer": "y"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    ds = PromptDataset(path, tok, max_prompt_tokens=8)
    assert (len(ds), ds.num_dropped_long) == (1, 1)
    with pytest.raises(DatasetError, match=r"row 1: prompt has \d+ tokens > rollout.max_prompt_tokens=8"):
        PromptDataset(path, tok, max_prompt_tokens=8, long_prompts="error")


def test_order_is_a_seeded_permutation_per_epoch_and_resumes(tokenizer_files):
    tok = load_tokenizer(tokenizer_files[1])
    ds = PromptDataset("synthetic:first_letter:10:3", tok, seed=5)
    first_epoch = [p.index for p in ds.next_batch(10)]
    assert sorted(first_epoch) == list(range(10))
    ds.next_batch(3)
    state = ds.state_dict()
    expected = [p.index for p in ds.next_batch(12)]
    again = PromptDataset("synthetic:first_letter:10:3", tok, seed=5)
    again.load_state_dict(state)
    assert [p.index for p in again.next_batch(12)] == expected
    assert expected[:7] != first_epoch[3:]  # the second epoch is reshuffled, not repeated


def test_synthetic_task_rows_are_correct():
    for row in synthetic_rows("synthetic:first_letter:50:1"):
        letters = row["prompt"].split(" of ")[1].removesuffix(" is").split()
        assert row["answer"] == letters[0]
    for row in synthetic_rows("synthetic:add:50:1"):
        a, b = row["prompt"].removesuffix(" =").split(" + ")
        assert int(row["answer"]) == int(a) + int(b)
    with pytest.raises(ConfigError, match="unknown synthetic task 'nope'"):
        synthetic_rows("synthetic:nope")


def test_synthetic_spec_parts_and_defaults():
    assert parse_synthetic("synthetic:first_letter8:512:7") == ("first_letter8", 512, 7)
    assert parse_synthetic("synthetic:add") == ("add", 1024, 0)
    assert parse_synthetic("synthetic:lookup8:3") == ("lookup8", 3, 0)


KNOWN = "known tasks: add, first_letter, first_letter8, last_letter, lookup8"
FORM = "synthetic:<task>[:<num_prompts>[:<seed>]]"


@pytest.mark.parametrize(("spec", "message"), [
    ("synthetic:nosuchtask", f"data.path='synthetic:nosuchtask': unknown synthetic task 'nosuchtask'; {KNOWN} (write {FORM}"),
    ("synthetic:", f"data.path='synthetic:': unknown synthetic task ''; {KNOWN}"),
    ("synthetic:first_letter8:abc", f"data.path='synthetic:first_letter8:abc': expected {FORM} with num_prompts >= 1"),
    ("synthetic:add:0", f"data.path='synthetic:add:0': expected {FORM} with num_prompts >= 1 and seed >= 0"),
    ("synthetic:add:4:-1", "data.path='synthetic:add:4:-1': expected"),
    ("synthetic:add:4:1:9", "data.path='synthetic:add:4:1:9': expected"),
])
def test_bad_synthetic_specs_are_refused_when_the_config_is_read(spec, message):
    """The config check (what `plan` runs) refuses what reading the data would: a ConfigError, exit 2 in the CLI."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_synthetic(spec)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(RLConfig, REPO / "configs" / "tiny-gspo.yaml", [f"data.path='{spec}'"])
    where = message.replace("data.path=", "data.eval_sets.held.path=", 1)
    with pytest.raises(ConfigError, match=re.escape(where)):
        load_config(RLConfig, REPO / "configs" / "tiny-gspo.yaml", [f"data.eval_sets={{held: '{spec}'}}"])


def test_plan_refuses_an_unknown_synthetic_task_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "plan", "--config", "configs/tiny-gspo.yaml", "data.path=synthetic:nosuchtask"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"megatron-rl plan: data.path='synthetic:nosuchtask': unknown synthetic task 'nosuchtask'; {KNOWN} "
        f"(write {FORM}, e.g. synthetic:first_letter8:512)"
    ]


@pytest.mark.extra("data", "math_verify")
def test_rewards_registry_and_math():
    assert exact_match(" k ", "k") == 1.0 and exact_match("kk", "k") == 0.0
    assert math_answer("so the result is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("\\boxed{3}", "4") == 0.0
    assert get_reward_fn("math") is math_answer
    assert get_reward_fn("tests.unit.test_data:_flaky") is _flaky
    with pytest.raises(RewardError, match=r"unknown reward 'mth'.*'exact', 'math'"):
        get_reward_fn("mth")
    with pytest.raises(RewardError, match="cannot import module"):
        get_reward_fn("no_such_module_xyz:f")


def _flaky(response, answer, *, prompt=""):
    if response == "raise":
        raise KeyError("boom")
    if response == "nan":
        return math.nan
    return 1.0


def test_reward_failures_are_counted_and_reported():
    result = compute_rewards(_flaky, ["ok", "raise", "nan", "ok"], [0, 0, 0, 0], ["p0", "p1", "p2", "p3"], failure_reward=-1.0)
    assert result.rewards == [1.0, -1.0, -1.0, 1.0]
    assert result.num_errors == 2
    assert "sample 1" in result.errors[0] and "KeyError" in result.errors[0]
    assert "sample 2" in result.errors[1] and "nan" in result.errors[1]
    with pytest.raises(RewardError, match=r"tests.unit.test_data:_flaky \(data.reward\) failed on all 2 samples"):
        compute_rewards(_flaky, ["raise", "nan"], [0, 0], ["a", "b"])
