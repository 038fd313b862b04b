"""init_parallel on real processes (gloo): groups and ranks of each layout against expectations
computed here independently of megatron, plus the failure paths (bad layout, a failing rank)."""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.config import ConfigError, ParallelConfig
from tests.distributed.harness import DistributedTestError, run_distributed

LAYOUTS_2 = {
    "TP2": dict(tensor_parallel=2),
    "PP2": dict(pipeline_parallel=2),
    "EP2": dict(expert_parallel=2),
    "DP2": dict(),
}
LAYOUTS_4 = {
    "TP2xEP2": dict(tensor_parallel=2, expert_parallel=2),
    "PP2xTP2": dict(pipeline_parallel=2, tensor_parallel=2),
    "PP2xEP2": dict(pipeline_parallel=2, expert_parallel=2),
    "TP2xPP2xEP2": dict(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2, expert_tensor_parallel=1),
}


def expected_layout(rank: int, world: int, tp=1, pp=1, ep=1, cp=1, etp=1) -> dict:
    """megatron's default order tp-cp-ep-dp-pp, written out by hand.

    Dense:   rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))
    Experts: rank = etp_r + etp * (ep_r + ep * (edp_r + edp * pp_r))
    """
    dp = world // (tp * pp * cp)
    edp = world // (etp * ep * pp)
    tp_r, cp_r, dp_r, pp_r = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
    etp_r, ep_r, edp_r = rank % etp, (rank // etp) % ep, (rank // (etp * ep)) % edp
    assert pp_r == rank // (etp * ep * edp)

    def dense(t, c, d, p):
        return t + tp * (c + cp * (d + dp * p))

    def expert(t, e, d, p):
        return t + etp * (e + ep * (d + edp * p))

    return {
        "sizes": dict(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expert_tp=etp, expert_dp=edp),
        "ranks": dict(tp=tp_r, pp=pp_r, cp=cp_r, dp=dp_r, ep=ep_r, expert_tp=etp_r, expert_dp=edp_r),
        "groups": {
            "tp": [dense(t, cp_r, dp_r, pp_r) for t in range(tp)],
            "pp": [dense(tp_r, cp_r, dp_r, p) for p in range(pp)],
            "dp": [dense(tp_r, cp_r, d, pp_r) for d in range(dp)],
            "cp": [dense(tp_r, c, dp_r, pp_r) for c in range(cp)],
            "dp_cp": sorted(dense(tp_r, c, d, pp_r) for d in range(dp) for c in range(cp)),
            "model_parallel": sorted(dense(t, cp_r, dp_r, p) for t in range(tp) for p in range(pp)),
            "ep": [expert(etp_r, e, edp_r, pp_r) for e in range(ep)],
            "expert_tp": [expert(t, ep_r, edp_r, pp_r) for t in range(etp)],
            "expert_tp_ep": sorted(expert(t, e, edp_r, pp_r) for t in range(etp) for e in range(ep)),
            "expert_dp": [expert(etp_r, ep_r, d, pp_r) for d in range(edp)],
        },
        "first": pp_r == 0,
        "last": pp_r == pp - 1,
    }


def _describe(ctx) -> dict:
    import torch
    import torch.distributed as dist

    groups = {}
    for name in ("tp", "pp", "dp", "cp", "dp_cp", "model_parallel", "ep", "expert_tp", "expert_tp_ep", "expert_dp"):
        group = getattr(ctx, f"{name}_group")
        ranks = sorted(dist.get_process_group_ranks(group))
        # The group really connects those ranks: the sum of global ranks over it.
        value = torch.tensor([float(ctx.rank)])
        dist.all_reduce(value, group=group)
        assert int(value.item()) == sum(ranks), (name, ranks, value)
        groups[name] = ranks
    return {
        "sizes": dict(tp=ctx.tp_size, pp=ctx.pp_size, cp=ctx.cp_size, dp=ctx.dp_size, ep=ctx.ep_size,
                      expert_tp=ctx.expert_tp_size, expert_dp=ctx.expert_dp_size),  # fmt: skip
        "ranks": dict(tp=ctx.tp_rank, pp=ctx.pp_rank, cp=ctx.cp_rank, dp=ctx.dp_rank, ep=ctx.ep_rank,
                      expert_tp=ctx.expert_tp_rank, expert_dp=ctx.expert_dp_rank),  # fmt: skip
        "groups": groups,
        "first": ctx.is_pipeline_first_stage(),
        "last": ctx.is_pipeline_last_stage(),
        "pp_ranks": list(ctx.pp_ranks),
        "world": (ctx.world_size, ctx.rank, ctx.local_rank, str(ctx.device), ctx.backend),
    }


def _layouts_worker(rank: int, world_size: int, layouts: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_rl.parallel import destroy_parallel, init_parallel

    out = {}
    # An impossible layout fails on every rank before any process group exists.
    try:
        init_parallel(ParallelConfig(tensor_parallel=world_size * 2))
        raise AssertionError("an impossible layout was accepted")
    except ConfigError as exc:
        out["bad_layout_error"] = str(exc)
    out["pg_after_bad_layout"] = dist.is_initialized()

    for name, layout in layouts.items():
        ctx = init_parallel(ParallelConfig(timeout_s=60, **layout))
        out[name] = _describe(ctx)
        # megatron's own globals agree with the context
        assert mpu.get_tensor_model_parallel_group() is ctx.tp_group
        assert mpu.get_expert_model_parallel_world_size() == ctx.ep_size
        destroy_parallel(ctx, keep_world=True)  # re-initialise in the same processes
        assert not mpu.model_parallel_is_initialized()
    dist.destroy_process_group()
    return out


def _check(results: list[dict], world: int, layouts: dict) -> None:
    for rank, out in enumerate(results):
        assert out["pg_after_bad_layout"] is False
        assert "not divisible" in out["bad_layout_error"] and str(world) in out["bad_layout_error"]
        for name, layout in layouts.items():
            tp, ep = layout.get("tensor_parallel", 1), layout.get("expert_parallel", 1)
            # expert TP defaults to TP when EP is 1 (experts replicated like dense layers), else 1
            kw = dict(tp=tp, pp=layout.get("pipeline_parallel", 1), ep=ep, etp=layout.get("expert_tensor_parallel", tp if ep == 1 else 1))
            want, got = expected_layout(rank, world, **kw), out[name]
            for key in ("sizes", "ranks", "groups", "first", "last"):
                assert got[key] == want[key], f"{name} rank {rank} {key}: got {got[key]}, expected {want[key]}"
            assert got["pp_ranks"] == want["groups"]["pp"]
            assert got["world"] == (world, rank, rank, "cpu", "gloo") or got["world"][4] == "nccl"


def test_layouts_on_2_ranks():
    _check(run_distributed(_layouts_worker, 2, LAYOUTS_2, timeout=120), 2, LAYOUTS_2)


def test_layouts_on_4_ranks():
    _check(run_distributed(_layouts_worker, 4, LAYOUTS_4, timeout=120), 4, LAYOUTS_4)


def test_expected_layout_matches_hand_written_cases():
    """The independent expectation itself, on cases worked out by hand."""
    e = expected_layout(3, 4, tp=2, pp=2, ep=2)  # TP2xPP2xEP2, rank 3: tp 1, dp 0, pp 1
    assert e["groups"]["tp"] == [2, 3] and e["groups"]["pp"] == [1, 3] and e["groups"]["dp"] == [3]
    assert e["groups"]["ep"] == [2, 3] and e["groups"]["expert_dp"] == [3]
    e = expected_layout(1, 4, tp=2, ep=2)  # TP2xEP2: dp 2, experts etp1 x ep2 x edp2
    assert e["groups"]["dp"] == [1, 3] and e["groups"]["ep"] == [0, 1] and e["groups"]["expert_dp"] == [1, 3]


def test_impossible_layout_raises_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    from megatron_rl.parallel import init_parallel

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"TP x PP x CP = 3 x 1 x 1"):
        init_parallel(ParallelConfig(tensor_parallel=3))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match=r"expert TP x EP x PP = 1 x 4 x 2 = 8"):
        init_parallel(ParallelConfig(expert_parallel=4, pipeline_parallel=2))
    assert not dist.is_initialized()


def _single_process_worker(rank: int, world_size: int) -> tuple:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    import torch.distributed as dist

    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.ports import free_port

    ctx = init_parallel(ParallelConfig())
    out = (ctx.world_size, ctx.rank, ctx.tp_size, ctx.dp_size, ctx.is_pipeline_first_stage(), ctx.is_pipeline_last_stage())
    destroy_parallel(ctx)
    out += (dist.is_initialized(),)
    # A world started by someone else is used as is, and left up by destroy_parallel.
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % free_port(), world_size=1, rank=0)
    ctx = init_parallel(ParallelConfig())
    destroy_parallel(ctx)
    out += (ctx.owns_world, dist.is_initialized())
    dist.destroy_process_group()
    return out


def test_single_process_world_of_one():
    assert run_distributed(_single_process_worker, 1, timeout=60) == [(1, 0, 1, 1, True, True, False, False, True)]


def _failing_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from megatron_rl.parallel import init_parallel

    init_parallel(ParallelConfig(tensor_parallel=2, timeout_s=30))
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait here for ever without the harness/timeouts


def test_failing_rank_fails_fast_naming_the_rank():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed[\s\S]*deliberate failure on rank 1"):
        run_distributed(_failing_worker, 2, timeout=60)
    assert time.monotonic() - start < 20


def _hanging_worker(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def _silent_death_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(600)


def test_harness_timeout_kills_and_names_ranks():
    # rank 1 returns at once and rank 0 never does: the timeout names rank 0 alone, and kills it. The timeout counts
    # from the ranks' start, so on a loaded machine rank 1 may not have returned within 2 s (it is then named as
    # still running too, rightly): a longer timeout is tried before failing.
    for timeout in (2, 10, 30):
        start = time.monotonic()
        with pytest.raises(DistributedTestError, match=rf"timed out after {timeout}s; ranks still running: ") as raised:
            run_distributed(_hanging_worker, 2, timeout=timeout)
        assert time.monotonic() - start < timeout + 30  # killed at the timeout, not left to sleep its 600 s
        if "ranks still running: [0, 1]" not in str(raised.value):
            break
    assert "ranks still running: [0] (all ranks killed)" in str(raised.value), raised.value


def test_harness_rank_dying_without_python_error():
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 exited with code 3 without a result"):
        run_distributed(_silent_death_worker, 2, timeout=30)
