"""Two vLLM engines hosted by the two trainer ranks (rollout.engines=2), every push transport.

Samples from either engine match the actor's logprobs after every push
(check_rows), so both got every push; vLLM's own access log shows each engine
served its share of the prompts.
"""

from __future__ import annotations

import pytest

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e.train_runs import check_rows, run_ok, train_command


@pytest.mark.parametrize("transport", ["broadcast", "ipc", "ipc_owners"])
def test_two_colocated_engines_hosted_by_the_trainer_ranks(transport, model_dir, tmp_path):
    # rollout.engines=2: each of the 2 ranks hosts a vLLM server; rank 0 sends the 4 prompts of a
    # step round-robin (2 each) and pushes every step's weights into both. Samples from either
    # engine match the actor's logprobs (checked in check_rows), so both got every push: by one
    # broadcast into both servers' workers (the CPU default), or by memory handles (the GPU default),
    # where rank 1 shares each bucket from its own memory with the server it hosts; small buckets, so
    # that each push is many buckets and their buffers are written again once the servers let go.
    # ipc_owners: rollout.weight_senders=owners, each rank's own buckets go from it to the other rank
    # (weight_sync.owner_ipc), and each rank logs the bytes it sourced
    senders = ("rollout.weight_senders=owners",) if transport == "ipc_owners" else ()
    run_ok(train_command("tiny-gspo-cpu2.yaml", model_dir, tmp_path, "train.steps=2", "rollout.engines=2",
                  f"rollout.weight_transport={transport.removesuffix('_owners')}", "rollout.weight_bucket_mb=0.25",
                  *senders, nproc=2), timeout=500)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    check_rows(rows, 2)
    if senders:
        # rank 0 sourced its own share and received rank 1's for its server's worker, by the owner-IPC path
        assert all(row["weight_sync/sent_bytes"] > 0 and row["weight_sync/received_bytes"] > 0 for row in rows), rows
    for engine in (0, 1):  # vLLM's own access log: 2 prompts x 2 steps on each engine
        log = (tmp_path / f"vllm-engine{engine}.log").read_text()
        assert log.count('"POST /v1/completions HTTP/1.1" 200') == 4, log[-3000:]

