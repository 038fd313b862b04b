"""How long one weight push takes per RL step, per transport, before launch.

A push moves the model's wire bytes B (parameters x bytes per value: 2 in
bf16 on GPUs, 4 in fp32 on CPU) from the trainer ranks to every engine
worker. Each transport is limited by its busiest link, on the sending or the
receiving side; at link bandwidth `bw` (cluster.push_link_gb_per_s):

    t = max(bytes out of the busiest trainer rank, bytes into the busiest engine worker) / bw

    funnel          every bucket through trainer rank 0, broadcast to every worker:
                    out = B, in = B                          -> t = B / bw
    owner-parallel  every owner rank sends its own shards (S senders, one bucket of slack),
                    each bucket still broadcast whole to every worker (weight_sync.parallel):
                    out = B / S + bucket, in = B             -> t = max(B / S + bucket, B) / bw
    vllm nccl_m2n   each worker receives only its own shard (vLLM's weight_transfer, GPUs;
                    weight_sync.vllm_transfer: trainer rank r sends row block r mod s of every
                    tensor, s = the largest divisor of S up to 16, m2n's fan-in limit):
                    out = B / s + bucket, in = B / (engine TP x PP), per engine: with E engines
                    (servers) each gets its own communicator and export, one after another
                    (weight_sync.vllm_transfer.VllmTransfer.send) -> t = E x max(out, in) / bw
    vllm ipc        engines on the trainer's GPUs: every rank holds each tensor whole for a moment
                    (its owner broadcasts it), the worker reads it over device memory, no link:
                    out = B / S + bucket, in = B                 -> t = B / bw

S = the trainer ranks that hold a shard (every rank: replicated shards are spread
over their replicas); owner-parallel with rollout.weight_senders_max=N sends from
the N ranks config.rollout.sender_ranks picks (the other holders hand them their
shards first), so its S is N there. Owner-parallel frees trainer rank 0 (its link and memory
carry a share, not the model) but a broadcast of whole buckets still brings B
into every worker; only a transport that sends each worker its own shard cuts
the time below B / bw.

Sanity check against the numbers published for DeepSeek-V3 (671 B parameters,
bf16: B = 1.34 TB) at 50 GB/s (400 Gb/s InfiniBand):
funnel 1.34e12 / 50e9 = 27 s per step;
m2n from 256 trainer ranks (s = 16) into an engine of TP 8 x PP 4: max(1.34e12 / 16,
1.34e12 / 32) / 50e9 = 1.7 s per engine (the preset's 8 servers in turn: 13.5 s), the order of
NeMo RL's published 2.4-2.8 s reshard (which also converts and loads) and below
checkpoint-engine's 14-16 s for Kimi-K2 (1 T parameters in fp8, 16-256 GPUs).
The estimate counts bytes on links only: no loading, conversion, latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.rollout import sender_ranks
from megatron_rl.config.schema import RLConfig


@dataclass(kw_only=True, frozen=True)
class PushTime:
    """One transport's estimate (see the module docstring)."""

    transport: str
    """funnel, owner-parallel, vllm-nccl_m2n or vllm-ipc."""
    out_bytes: float
    """Bytes out of the busiest trainer rank (over every engine)."""
    in_bytes: float
    """Bytes into the busiest engine worker."""
    seconds: float
    """max(out_bytes, in_bytes) / link bandwidth (vllm-nccl_m2n: E x that of one engine, E pushes in turn)."""


def push_times(*, model_bytes: float, senders: int, bucket_bytes: float, engine_workers: int,
               link_bytes_per_s: float, engines: int = 1, owner_senders: int | None = None) -> list[PushTime]:
    """The four rows of the module docstring's formula; `engines`: E, the engines every push goes to;
    `owner_senders`: the ranks owner-parallel sends from (rollout.weight_senders_max; None: all `senders`)."""
    owner_senders = senders if owner_senders is None else owner_senders
    if min(senders, owner_senders, engine_workers, engines) < 1 or link_bytes_per_s <= 0:
        raise ValueError(f"senders={senders}, owner_senders={owner_senders}, engine_workers={engine_workers}, "
                         f"engines={engines} must be >= 1 and the link bandwidth > 0")
    bucket = min(bucket_bytes, model_bytes)
    share = model_bytes / senders + bucket
    owner_share = model_bytes / owner_senders + bucket
    m2n_slices = max(d for d in range(1, min(senders, 16) + 1) if senders % d == 0)  # vllm_transfer.m2n_slices
    m2n_out, m2n_in = model_bytes / m2n_slices + bucket, model_bytes / engine_workers  # one engine's push
    rows = [PushTime(transport=name, out_bytes=out, in_bytes=into, seconds=max(out, into) / link_bytes_per_s)
            for name, out, into in (("funnel", model_bytes, model_bytes), ("owner-parallel", owner_share, model_bytes))]
    rows.append(PushTime(transport="vllm-nccl_m2n", out_bytes=engines * m2n_out, in_bytes=m2n_in,
                         seconds=engines * max(m2n_out, m2n_in) / link_bytes_per_s))
    rows.append(PushTime(transport="vllm-ipc", out_bytes=share, in_bytes=model_bytes, seconds=max(share, model_bytes) / link_bytes_per_s))
    return rows


def preset_push_times(cfg: RLConfig, total_params: float, param_bytes: int, engines: int = 1) -> list[PushTime]:
    """The estimate for a preset: its model's wire bytes over its trainer world and its `engines` engines."""
    world = cfg.cluster.trainer_world_size
    capped = sender_ranks(world, cfg.rollout.weight_senders_max)
    return push_times(
        model_bytes=float(total_params) * param_bytes,
        senders=world,
        owner_senders=world if capped is None else len(capped),
        bucket_bytes=cfg.rollout.weight_bucket_mb * (1 << 20),
        engine_workers=cfg.rollout.tensor_parallel * cfg.rollout.pipeline_parallel,
        link_bytes_per_s=cfg.cluster.push_link_gb_per_s * 1e9,
        engines=max(1, engines),
    )
