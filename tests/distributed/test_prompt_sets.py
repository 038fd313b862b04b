"""The trainer's tokenizer and prompt sets are read on rank 0 alone (megatron_rl.trainer.read_prompt_sets, the call Trainer makes),
on real processes over gloo: the other ranks read no row, and a bad row stops every rank with rank 0's error."""

from __future__ import annotations

import json

import pytest

from tests.distributed.harness import run_distributed

ROWS = [{"prompt": f"word {i}", "answer": "abcdefgh"[i % 8]} for i in range(11)]


class _LocalError(Exception):
    """Raised with a second required argument: pickle cannot build it again (its args are only the message)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _worker(rank: int, world_size: int, tokenizer: str, good: str, bad: str) -> dict:
    import megatron_rl.data.dataset as dataset_module
    from megatron_rl.actor.distribute import on_rank0
    from megatron_rl.config import ParallelConfig, RLConfig, load_config
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.trainer import read_prompt_sets

    reads = []
    real_read_rows = dataset_module.read_rows

    def counting_read_rows(path):  # the real reader, counted
        reads.append(str(path))
        return real_read_rows(path)

    dataset_module.read_rows = counting_read_rows
    ctx = init_parallel(ParallelConfig(timeout_s=60))
    out = {}
    try:
        cfg = load_config(RLConfig, None, [f"data.path={good}", f"data.tokenizer={tokenizer}",
                                           "data.eval_sets={held: {path: 'synthetic:first_letter8:16:7', k: 2}}"])
        tok, dataset, evaluator = read_prompt_sets(cfg, ctx)
        out["good"] = {"prompts": None if dataset is None else len(dataset), "evaluator": evaluator is not None,
                       "reads": list(reads), "tokenizer": None if tok is None else tok.encode("word 3")}
        reads.clear()
        try:
            read_prompt_sets(load_config(RLConfig, None, [f"data.path={bad}", f"data.tokenizer={tokenizer}"]), ctx)
            out["bad"] = "no error"
        except dataset_module.DatasetError as error:
            out["bad"] = str(error)
        out["bad_reads"] = list(reads)

        def raise_local():
            raise _LocalError("the reader's own error", 7)

        try:
            on_rank0(raise_local, ctx)
        except Exception as error:  # noqa: BLE001 - which type each rank gets is the point
            out["unpicklable"] = (type(error).__name__, str(error))
    finally:
        destroy_parallel(ctx)
        dataset_module.read_rows = real_read_rows
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from megatron_rl.models.tiny import build_sentencepiece_model

    root = tmp_path_factory.mktemp("prompt_sets")
    good, bad = root / "good.jsonl", root / "bad.jsonl"
    good.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    bad.write_text("".join(json.dumps(row) + "\n" for row in [ROWS[0], {"prompt": "no answer here"}, ROWS[2]]))
    return str(build_sentencepiece_model(root / "sp.model")), str(good), str(bad)


def test_prompt_sets_are_read_on_rank0_alone_and_a_bad_row_stops_every_rank(files):
    from megatron_rl.data.tokenizer import load_tokenizer

    tokenizer, good, bad = files
    rank0, rank1 = run_distributed(_worker, 2, tokenizer, good, bad, timeout=120)
    # rank 0: all 11 rows, the eval set read too (its synthetic rows through the same reader); rank 1: nothing read
    assert rank0["good"]["prompts"] == len(ROWS) and rank0["good"]["evaluator"]
    assert rank0["good"]["tokenizer"] == load_tokenizer(tokenizer).encode("word 3")  # the tokenizer rank 0 loaded
    assert set(rank0["good"]["reads"]) == {good, "synthetic:first_letter8:16:7"}
    assert rank1["good"] == {"prompts": None, "evaluator": False, "reads": [], "tokenizer": None}
    # row 1 lacks the answer: rank 0's error, word for word, on both ranks; rank 1 still read nothing
    assert f"{bad} row 1: missing field 'answer'" in rank0["bad"] and rank1["bad"] == rank0["bad"]
    assert rank0["bad_reads"] == [bad] and rank1["bad_reads"] == []
    # an exception pickle cannot rebuild reaches the other ranks as its line; rank 0 raises its own
    assert rank0["unpicklable"] == ("_LocalError", "the reader's own error")
    assert rank1["unpicklable"] == ("RuntimeError", "_LocalError: the reader's own error")
