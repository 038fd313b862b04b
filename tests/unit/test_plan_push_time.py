"""The planner's weight-push time: the formula on a hand-worked case, the published DeepSeek-V3 number, the CLI."""

import io
from pathlib import Path

import pytest

from megatron_rl.plan.push_time import push_times
from megatron_rl.plan.report import plan_preset, render

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_push_times_hand_computed():
    # B = 1 GB over 4 senders with 10 MB buckets into engines of 2 workers, 1 GB/s links:
    # funnel: 1 GB out of rank 0 and into every worker -> 1 s
    # owner-parallel: 0.25 GB + 0.01 GB out of each rank, 1 GB into every worker -> 1 s
    # nccl_m2n: 0.26 GB out (4 senders: every rank one row block), 0.5 GB into each worker -> 0.5 s
    # vllm-ipc: 0.26 GB out, 1 GB into every rank (each tensor whole on every GPU) -> 1 s
    rows = {r.transport: r for r in push_times(model_bytes=1e9, senders=4, bucket_bytes=1e7, engine_workers=2,
                                               link_bytes_per_s=1e9)}
    assert rows["funnel"].out_bytes == 1e9 and rows["funnel"].seconds == pytest.approx(1.0)
    assert rows["owner-parallel"].out_bytes == pytest.approx(2.6e8) and rows["owner-parallel"].seconds == pytest.approx(1.0)
    assert rows["vllm-nccl_m2n"].in_bytes == pytest.approx(5e8) and rows["vllm-nccl_m2n"].seconds == pytest.approx(0.5)
    assert rows["vllm-nccl_m2n"].out_bytes == pytest.approx(2.6e8)
    assert rows["vllm-ipc"].in_bytes == 1e9 and rows["vllm-ipc"].seconds == pytest.approx(1.0)
    # 32 senders: m2n sends from 16 row blocks (its fan-in limit), 1/16 GB + 10 MB out of each rank
    m2n = {r.transport: r for r in push_times(model_bytes=1e9, senders=32, bucket_bytes=1e7, engine_workers=64,
                                              link_bytes_per_s=1e9)}["vllm-nccl_m2n"]
    assert m2n.out_bytes == pytest.approx(1e9 / 16 + 1e7) and m2n.seconds == pytest.approx(1e9 / 16 / 1e9 + 1e-2)
    # 3 engines (servers): m2n pushes each its own export in turn, 3 x (0.26 GB out, 0.5 GB in) -> 1.5 s; the
    # broadcasts go into every engine's workers at once: unchanged
    three = {r.transport: r for r in push_times(model_bytes=1e9, senders=4, bucket_bytes=1e7, engine_workers=2,
                                                link_bytes_per_s=1e9, engines=3)}
    assert three["vllm-nccl_m2n"].out_bytes == pytest.approx(3 * 2.6e8) and three["vllm-nccl_m2n"].in_bytes == pytest.approx(5e8)
    assert three["vllm-nccl_m2n"].seconds == pytest.approx(1.5)
    assert three["funnel"] == rows["funnel"] and three["owner-parallel"] == rows["owner-parallel"]
    # owner-parallel from 2 of the 4 ranks (rollout.weight_senders_max=2): 0.5 GB + 10 MB out of each sender; the
    # other rows do not use the cap (m2n and vLLM's ipc send from every rank)
    capped = {r.transport: r for r in push_times(model_bytes=1e9, senders=4, bucket_bytes=1e7, engine_workers=2,
                                                 link_bytes_per_s=1e9, owner_senders=2)}
    assert capped["owner-parallel"].out_bytes == pytest.approx(5.1e8) and capped["owner-parallel"].seconds == pytest.approx(1.0)
    assert {k: v for k, v in capped.items() if k != "owner-parallel"} == {k: v for k, v in rows.items() if k != "owner-parallel"}
    # a bucket larger than the model is the model
    (funnel, owner, _, _) = push_times(model_bytes=1e6, senders=1, bucket_bytes=1e9, engine_workers=1, link_bytes_per_s=1e6)
    assert owner.out_bytes == pytest.approx(2e6)
    with pytest.raises(ValueError, match="senders=0"):
        push_times(model_bytes=1e6, senders=0, bucket_bytes=1, engine_workers=1, link_bytes_per_s=1)
    with pytest.raises(ValueError, match="owner_senders=0"):
        push_times(model_bytes=1e6, senders=2, bucket_bytes=1, engine_workers=1, link_bytes_per_s=1, owner_senders=0)
    with pytest.raises(ValueError, match="engines=0"):
        push_times(model_bytes=1e6, senders=1, bucket_bytes=1, engine_workers=1, link_bytes_per_s=1, engines=0)


def test_deepseek_v3_preset_matches_the_published_funnel_time_and_the_cli_prints_it():
    result = plan_preset(str(CONFIGS / "deepseek-v3-gspo-64x8h100.yaml"))
    rows = {r.transport: r for r in result.push}
    # 671e9 parameters in bf16 = 1.34 TB at 50 GB/s: about 27 s through one rank
    assert rows["funnel"].seconds == pytest.approx(671e9 * 2 / 50e9, rel=0.03)
    # 256 trainer ranks send 1/256 each; m2n sends 16 row blocks (1/16 out of a rank), engines of TP 8 x PP 4
    # take 1/32 each: 1.34e12 / 16 / 50e9 = 1.7 s per engine, the order of NeMo RL's published 2.4-2.8 s; the
    # preset's 8 servers (its 256 rollout GPUs / 32) each get their own export, one after another: 8 x 1.7 s
    assert rows["owner-parallel"].out_bytes == pytest.approx(671e9 * 2 / 256 + 512 * 2**20, rel=0.03)
    assert result.engines == 256 // 32
    assert rows["vllm-nccl_m2n"].seconds == pytest.approx(result.engines * 671e9 * 2 / 16 / 50e9, rel=0.03)
    assert rows["vllm-ipc"].seconds == pytest.approx(671e9 * 2 / 50e9, rel=0.03)
    from rich.console import Console

    out = io.StringIO()
    render(result, Console(file=out, width=200))
    assert "Weight push per step at 50 GB/s" in out.getvalue() and "vllm-nccl_m2n" in out.getvalue()


def test_a_sender_cap_sends_each_senders_share_in_the_preset_plan():
    """rollout.weight_senders_max=32 on DeepSeek-V3's 256 trainer ranks: every 8th rank sends 1/32 of 1.34 TB."""
    full = {r.transport: r for r in plan_preset(str(CONFIGS / "deepseek-v3-gspo-64x8h100.yaml")).push}
    capped = {r.transport: r for r in plan_preset(str(CONFIGS / "deepseek-v3-gspo-64x8h100.yaml"),
                                                  ["rollout.weight_senders=owners", "rollout.weight_senders_max=32"]).push}
    bucket = 512 * 2**20
    assert capped["owner-parallel"].out_bytes == pytest.approx(671e9 * 2 / 32 + bucket, rel=0.03)
    assert capped["owner-parallel"].out_bytes / (full["owner-parallel"].out_bytes - bucket) > 7
    assert capped["vllm-nccl_m2n"] == full["vllm-nccl_m2n"] and capped["funnel"] == full["funnel"]
