"""What the rest of the package uses of a rollout engine, declared: `RolloutEngine` and two capabilities.

    engine = make_engine(model_dir, cfg.rollout)          # a RolloutEngine (rollout.make_engine)
    rollouts = engine.generate(prompt_ids, SamplingSpec(n=4, seed=step))
    WeightPusher(cfg.rollout, ctx, chunks, engine).push(step + 1)   # the push side: weight_sync.engine_side.WeightReceiver

- `RolloutEngine`: every member the trainer, the experience sources, evaluation, the agents and the push use
  on rank 0's engine; every engine class has all of them (VLLMEngine in this process or its own, VLLMServerEngine
  over servers, remote or colocated). The push's part is weight_sync.engine_side.WeightReceiver (weight_sync
  imports nothing of rollout), which it extends.
- `SteppedEngine`: an engine in this process whose requests are added between its steps (VLLMEngine): episodes'
  turns run in one step session, and partial rollouts stop after the step in progress when a push waits.
- `ServerPoolEngine`: an engine over HTTP servers (VLLMServerEngine): episodes' turns are one request each,
  sent to the servers by the caller.

Callers ask for a capability with isinstance on these protocols (runtime-checkable: every member present), never
on an engine class. tests/unit/test_engine_protocol.py checks every engine class against them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.interrupt import StepSession
from megatron_rl.rollout.partial import SegmentEngine, SegmentOutput, SegmentRequest
from megatron_rl.rollout.routing import RequestCapture
from megatron_rl.rollout.sampling import SamplingSpec
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.engine_side import WeightReceiver


@runtime_checkable
class RolloutEngine(WeightReceiver, Protocol):
    """Rank 0's rollout engine as the package uses it (module docstring); the push's members are WeightReceiver's."""

    config: RolloutConfig
    """The rollout settings the engine runs with (after the placement resolved them)."""

    weight_version: int
    """Version of the weights the engine serves (the last push's; 0 = the model directory's)."""

    reexport_fn: Callable[[], Iterable[Bucket]] | None
    """Makes the trainer's weights again for an engine restarted on its model directory; None: WeightsLostError."""

    restarts: int
    """Engine restarts since it started (a failed batch or push, a dead engine process or server)."""

    max_model_len: int
    """Longest sequence (prompt + response tokens) the engine serves."""

    vocab_size: int
    """Token ids the engine's model takes (0 .. vocab_size - 1)."""

    model_info: dict[str, Any]
    """The worker's description of the served model (num_moe_layers, top_k, workers, ...; rollout.worker_ext)."""

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> Rollouts:
        """n samples per prompt, prompt-major; all of them or an exception, never a partial batch."""
        ...

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Generation outside generate() (episodes' turns): the engine held awake, on the trainer's weights."""
        ...

    def restart_after(self, error: BaseException) -> bool:
        """After `error` while serving(): restart the engine and recover its weights (True) if it was an engine failure."""
        ...

    def sleep(self) -> bool:
        """Sleep at rollout.sleep_level while the trainer trains; True when that releases the engine's memory."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what sleeps of `tags` ("weights", "kv_cache"; None = all)."""
        ...

    def start_route_capture(self) -> None:
        """Record the routed experts of every request from now on (R3 over the turns of episodes)."""
        ...

    def collect_route_capture(self) -> list[RequestCapture]:
        """The routes of every request computed since start_route_capture; recording stops."""
        ...

    def shutdown(self) -> None:
        """Stop the engine (and the servers it started) and free its memory."""
        ...


@runtime_checkable
class SteppedEngine(RolloutEngine, SegmentEngine, Protocol):
    """An engine in this process whose requests are added between its steps (module docstring); generate_segment is
    SegmentEngine's (rollout.partial)."""

    @contextmanager
    def step_session(self, spec: SamplingSpec) -> Iterator[StepSession]:
        """Episodes' turns added between engine steps while the session is open (a push waits for it to close)."""
        ...


@runtime_checkable
class ServerPoolEngine(RolloutEngine, Protocol):
    """An engine over HTTP servers: the caller sends episodes' turns to them one request each (module docstring)."""

    urls: list[str]
    """Every server's base URL, in server order."""

    auth_headers: dict[str, str]
    """Headers every request to the servers carries (the run's token; rollout.server_auth)."""

    max_num_seqs: list[int]
    """Each server's scheduler limit on sequences at once, in server order."""

    def healthy(self, server: int) -> bool:
        """Whether server `server` answers /health."""
        ...

    def complete_turn(self, server: int, request: SegmentRequest, spec: SamplingSpec, client: Any = None) -> SegmentOutput:
        """One turn of an episode on server `server` (`client`: the caller's HTTP client, else the engine's)."""
        ...


def protocol_members(protocol: type) -> list[str]:
    """The public members a protocol declares, its own and those of the protocols it extends, sorted."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        names.update(n for n in (*vars(base), *vars(base).get("__annotations__", {})) if not n.startswith("_"))
    return sorted(names)


def check_engine(engine: Any) -> RolloutEngine:
    """`engine` itself when it has every RolloutEngine member; else TypeError naming the missing ones."""
    missing = [name for name in protocol_members(RolloutEngine) if not hasattr(engine, name)]
    if missing:
        raise TypeError(
            f"{type(engine).__name__} is not a rollout engine: it lacks {', '.join(missing)} (declared by "
            "megatron_rl.rollout.RolloutEngine); pass a VLLMEngine or VLLMServerEngine, or an object with those members"
        )
    return engine


__all__ = ["RolloutEngine", "ServerPoolEngine", "SteppedEngine", "check_engine", "protocol_members"]
