"""The one place that initialises torch.distributed and megatron-core's model-parallel state.

``init_parallel`` validates the layout (before any process group exists),
starts torch.distributed from the torchrun/env:// variables (or a world of one
on a free localhost port), applies the compatibility layer's sites whose
conditions hold (all of them on a CPU build, the Transformer-Engine-absent ones
on a GPU without TE), initialises megatron's parallel state and RNG tracker, and returns a
:class:`ParallelContext`. Everything else in megatron_rl receives that object
explicitly; megatron-core itself still reads its own globals.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.core import ConfigError
from megatron_rl.config.layout import ModelShape, check_layout
from megatron_rl.config.schema import ParallelConfig

ProcessGroup = Any  # torch.distributed.ProcessGroup (kept loose for type checkers)


@dataclass(kw_only=True, frozen=True, eq=False)
class ParallelContext:
    """Ranks, sizes and process groups of this process, as set up by :func:`init_parallel`.

    Sizes/ranks follow megatron-core's definitions: dp excludes CP (dp_cp = DP x CP
    is the gradient-reduction group), expert groups are carved from the same
    ranks as TP x CP x DP (ETP x EP x expert-DP = TP x CP x DP).
    """

    config: ParallelConfig
    """The layout this context was built from."""
    world_size: int
    """Processes in the job."""
    rank: int
    """Global rank of this process."""
    local_rank: int
    """Rank on this node (GPU index under nccl)."""
    device: torch.device
    """Where this rank's tensors live (cuda:local_rank or cpu)."""
    backend: str
    """torch.distributed backend: nccl or gloo."""
    seed: int
    """Base seed given to megatron's RNG tracker."""
    sequence_parallel: bool
    """Whether activations are sharded along the sequence between TP ranks."""

    tp_size: int
    """Tensor-parallel size."""
    tp_rank: int
    """Rank in the tensor-parallel group."""
    pp_size: int
    """Pipeline-parallel size."""
    pp_rank: int
    """Pipeline stage of this rank."""
    cp_size: int
    """Context-parallel size."""
    cp_rank: int
    """Rank in the context-parallel group."""
    dp_size: int
    """Data-parallel size (without CP)."""
    dp_rank: int
    """Rank in the data-parallel group (without CP)."""
    ep_size: int
    """Expert-parallel size."""
    ep_rank: int
    """Rank in the expert-parallel group."""
    expert_tp_size: int
    """Tensor-parallel size inside each expert."""
    expert_tp_rank: int
    """Rank in the expert tensor-parallel group."""
    expert_dp_size: int
    """Data-parallel size of the expert weights."""
    expert_dp_rank: int
    """Rank in the expert data-parallel group."""

    world_group: ProcessGroup = field(repr=False)
    """The default (world) group."""
    host_group: ProcessGroup = field(repr=False)
    """The world on gloo (CPU tensors, pickled objects): the step's batch is sent over it, so ranks
    waiting for their share during a long generation sit in no NCCL collective (no watchdog)."""
    tp_group: ProcessGroup = field(repr=False)
    """Tensor-parallel group."""
    pp_group: ProcessGroup = field(repr=False)
    """Pipeline group (the stages holding one model copy's layers)."""
    dp_group: ProcessGroup = field(repr=False)
    """Data-parallel group (without CP)."""
    dp_cp_group: ProcessGroup = field(repr=False)
    """Data x context-parallel group: dense-gradient reduction."""
    cp_group: ProcessGroup = field(repr=False)
    """Context-parallel group."""
    ep_group: ProcessGroup = field(repr=False)
    """Expert-parallel group (token all-to-all)."""
    expert_tp_group: ProcessGroup = field(repr=False)
    """Tensor-parallel group inside experts."""
    expert_tp_ep_group: ProcessGroup = field(repr=False)
    """Expert TP x EP group (the MoE token dispatch group)."""
    expert_dp_group: ProcessGroup = field(repr=False)
    """Expert data-parallel group: expert-gradient reduction."""
    model_parallel_group: ProcessGroup = field(repr=False)
    """TP x PP group: the ranks holding one copy of the dense weights."""
    embedding_group: ProcessGroup | None = field(repr=False)
    """First and last pipeline stage (tied-embedding gradient sync); None off those stages when PP=1."""

    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline group, first stage first."""
    tp_ranks: tuple[int, ...]
    """Global ranks of this rank's tensor-parallel group."""
    dp_ranks: tuple[int, ...]
    """Global ranks of this rank's data-parallel group."""
    ep_ranks: tuple[int, ...]
    """Global ranks of this rank's expert-parallel group."""
    dp_leaders: tuple[int, ...] = (0,)
    """Global rank of each DP rank's leader (its rank with tp = pp = cp = 0), indexed by dp_rank: rank 0 sends a
    DP rank's rows of the step to its leader only (actor.distribute)."""
    share_group: ProcessGroup | None = field(default=None, repr=False)
    """gloo group of the ranks holding this rank's rows of the step (its TP x PP x CP peers: the same dp_rank),
    where its leader broadcasts them; None when the rank is its DP rank's only one."""
    owns_world: bool = field(default=True, repr=False)
    """init_parallel created the default process group (destroy_parallel tears it down)."""

    def is_pipeline_first_stage(self) -> bool:
        """This rank holds the first pipeline stage (embeddings)."""
        return self.pp_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        """This rank holds the last pipeline stage (output layer, loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last stage in this rank's pipeline (where losses live)."""
        return self.pp_ranks[-1]

    def pg_collection(self) -> Any:
        """megatron-core's ProcessGroupCollection for these groups (for model constructors that take one)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer (set by torchrun)") from exc


def _launch_env() -> tuple[int, int, int, bool]:
    """(world_size, rank, local_rank, launched_by_torchrun)."""
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if world is None and rank is None:
        return 1, 0, 0, False
    if world is None or rank is None:
        raise ConfigError("set both RANK and WORLD_SIZE (torchrun does) or neither (a single process)")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(var):
            raise ConfigError(f"{var} is not set: launch with torchrun or set MASTER_ADDR/MASTER_PORT with RANK/WORLD_SIZE")
    local = _env_int("LOCAL_RANK")
    return world, rank, rank if local is None else local, True


def _pick_backend(cfg: ParallelConfig) -> str:
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.backend=nccl but CUDA is not available: use parallel.backend=gloo (or auto)")
    return cfg.backend


def seed_all(seed: int) -> None:
    """Seed python, numpy, torch and megatron's RNG tracker (model_parallel_cuda_manual_seed).

    On a CPU-only build the tracker's named states live on the CPU generator
    (see cpu_compat); the default CPU generator is seeded with ``seed`` on every
    rank, so use_cpu_initialization draws identical full weights across TP.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


_worlds_started = 0
"""Worlds this process has started under torchrun's shared store (each rank starts the same sequence)."""


def _attempt_store(timeout: timedelta):
    """Under torchrun's c10d rendezvous the ranks share the launcher's key-value store, which outlives a restart and a
    world's end: the keys of the attempt before, or of this launch's world before (a second run in the same processes,
    after destroy_parallel), gloo's peer addresses among them, would still be there. torch numbers a new world's groups
    from 0 again, so its groups would read the old keys, connect to peers that are gone and wait forever. Each world of
    each attempt gets keys of its own (None: not under torchrun's shared store, env:// as usual)."""
    global _worlds_started
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    _worlds_started += 1
    return dist.PrefixStore(f"megatron_rl/attempt_{attempt}/world_{_worlds_started}/", agent)


def init_parallel(
    cfg: ParallelConfig,
    *,
    shape: ModelShape | None = None,
    num_microbatches: int | None = None,
    seed: int = 1234,
) -> ParallelContext:
    """Start torch.distributed + megatron parallel state for ``cfg`` and return the context.

    The layout is checked (check_layout) before any process group is created,
    so an impossible layout raises ConfigError on every rank instead of hanging.
    Collectives time out after ``cfg.timeout_s`` so a rank that dies makes the
    others fail. Call :func:`destroy_parallel` to tear down (or to re-initialise
    with another layout in the same processes).
    """
    from megatron_rl.parallel.availability import require_supported_torch

    require_supported_torch()
    cfg.validate()
    world_size, rank, local_rank, launched = _launch_env()
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    check_layout(cfg, world_size, shape, num_microbatches)
    backend = _pick_backend(cfg)

    from megatron.core import parallel_state as mpu  # after the checks: importing it takes seconds

    from megatron_rl.parallel.cpu_compat import apply_compat

    apply_compat()  # the sites whose conditions hold here: CUDA absent, Transformer Engine absent, ...
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    if mpu.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is already initialised: call destroy_parallel(ctx) first")

    timeout = timedelta(seconds=cfg.timeout_s)
    owns_world = not dist.is_initialized()
    if owns_world:
        if launched:
            store = _attempt_store(timeout)
            init = {"store": store} if store is not None else {"init_method": "env://"}
            dist.init_process_group(backend=backend, world_size=world_size, rank=rank, timeout=timeout, **init)
        else:
            # One process: its rendezvous store lives in this process (no port, none to lose to another process).
            dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1, rank=0, timeout=timeout)
    elif dist.get_backend() != backend:
        raise ConfigError(f"torch.distributed is already initialised with backend {dist.get_backend()}, but parallel.backend wants {backend}")

    try:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel,
            pipeline_model_parallel_size=cfg.pipeline_parallel,
            context_parallel_size=cfg.context_parallel,
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel,
            distributed_timeout_minutes=max(1, math.ceil(cfg.timeout_s / 60)),
            # Kept on (megatron's default) even under gloo, where they duplicate the main groups:
            # get_megatron_optimizer and the distributed optimizer's checkpointing ask for them.
            create_gloo_process_groups=True,
        )
        seed_all(seed)
        ctx = _context_from_mpu(cfg, backend=backend, device=device, local_rank=local_rank, seed=seed, owns_world=owns_world)
    except BaseException:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()
        raise
    return ctx


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _context_from_mpu(
    cfg: ParallelConfig, *, backend: str, device: torch.device, local_rank: int, seed: int, owns_world: bool
) -> ParallelContext:
    from megatron.core import parallel_state as mpu

    pp_group = mpu.get_pipeline_model_parallel_group()
    try:
        embedding_group = mpu.get_embedding_group(check_initialized=False)
    except Exception:  # noqa: BLE001 - not a member of any embedding group
        embedding_group = None
    tp_group = mpu.get_tensor_model_parallel_group()
    dp_group = mpu.get_data_parallel_group()
    ep_group = mpu.get_expert_model_parallel_group()
    host_timeout = timedelta(seconds=cfg.timeout_s) if backend == "gloo" else None  # as the world's (gloo) or torch's
    host_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=host_timeout)
    coords = (mpu.get_data_parallel_rank(), mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
              mpu.get_context_parallel_rank())
    dp_leaders, share_group = _share_groups(coords, host_group, host_timeout)
    return ParallelContext(
        config=cfg,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        device=device,
        backend=backend,
        seed=seed,
        sequence_parallel=cfg.use_sequence_parallel(),
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        dp_rank=mpu.get_data_parallel_rank(),
        ep_size=mpu.get_expert_model_parallel_world_size(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        expert_tp_size=mpu.get_expert_tensor_parallel_world_size(),
        expert_tp_rank=mpu.get_expert_tensor_parallel_rank(),
        expert_dp_size=mpu.get_expert_data_parallel_world_size(),
        expert_dp_rank=mpu.get_expert_data_parallel_rank(),
        world_group=dist.group.WORLD,
        host_group=host_group,
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
        cp_group=mpu.get_context_parallel_group(),
        ep_group=ep_group,
        expert_tp_group=mpu.get_expert_tensor_parallel_group(),
        expert_tp_ep_group=mpu.get_expert_tensor_and_model_parallel_group(),
        expert_dp_group=mpu.get_expert_data_parallel_group(),
        model_parallel_group=mpu.get_model_parallel_group(),
        embedding_group=embedding_group,
        pp_ranks=_ranks(pp_group),
        tp_ranks=_ranks(tp_group),
        dp_ranks=_ranks(dp_group),
        ep_ranks=_ranks(ep_group),
        dp_leaders=dp_leaders,
        share_group=share_group,
        owns_world=owns_world,
    )


def _share_groups(coords: tuple[int, int, int, int], host_group: ProcessGroup, timeout: timedelta | None
                  ) -> tuple[tuple[int, ...], ProcessGroup | None]:
    """(dp_leaders, share_group) from every rank's (dp, tp, pp, cp) ranks (one all-gather of 4 ints).

    A DP rank's rows go to all its TP x PP x CP peers. Rank 0 sends each DP rank's rows once, to its leader
    (tp = pp = cp = 0), which broadcasts them in the peers' gloo group: rank 0 sends and holds one copy of the
    step, not one per rank (W / D copies).
    """
    world = dist.get_world_size()
    if world == 1:
        return (0,), None
    gathered = [torch.zeros(4, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(coords, dtype=torch.int64), group=host_group)
    table = [tuple(int(v) for v in row) for row in gathered]
    dp_size = 1 + max(row[0] for row in table)
    leaders = {row[0]: rank for rank, row in enumerate(table) if row[1:] == (0, 0, 0)}
    if sorted(leaders) != list(range(dp_size)):
        raise RuntimeError(f"data-parallel ranks without a tp = pp = cp = 0 rank among {table}")
    members = [[rank for rank, row in enumerate(table) if row[0] == d] for d in range(dp_size)]
    dp_leaders = tuple(leaders[d] for d in range(dp_size))
    if len(members[coords[0]]) == 1:  # every DP rank alone (the same size everywhere): no peers to broadcast to
        return dp_leaders, None
    share_group, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout, backend="gloo")
    return dp_leaders, share_group


def destroy_parallel(ctx: ParallelContext | None = None, *, keep_world: bool = False) -> None:
    """Tear down megatron's parallel state and (unless keep_world) the default process group.

    keep_world=True keeps torch.distributed up so that init_parallel can set up
    another layout in the same processes (cheap; used by the layout tests).
    Safe to call twice.
    """
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if ctx is not None and keep_world and dist.is_initialized():  # the groups init_parallel made beyond megatron's
        for group in (ctx.share_group, None if ctx.host_group is dist.group.WORLD else ctx.host_group):
            if group is not None:
                dist.destroy_process_group(group)
    owns = True if ctx is None else ctx.owns_world
    if not keep_world and owns and dist.is_initialized():
        # No barrier: a failed peer must not make teardown hang.
        dist.destroy_process_group()
