"""What a run on a cluster watches for: a request to stop (pre-emption, a time limit) and a rank that stopped answering.

StopSignals: SIGTERM (torchrun's or Slurm's way to end a job) and SIGUSR1 (Slurm's `--signal=USR1@<s>`, sent before
the time limit) only set a flag; the trainer asks every rank at each step boundary (`agreed`), saves and stops. A
signal never interrupts a step, a collective or a save halfway.

PhaseWatch: each rank records the step and phase it is in (generate, train, push, save) in the job's key-value
store (the one torch.distributed rendezvoused on; under torchrun it lives in the launcher, so it outlives a dead
rank). When a collective fails (a peer closed its connection) or waits past parallel.timeout_s, the rank reads
every rank's record and names those that are not where it is: the ranks that did not answer.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PHASE_KEY = "megatron_rl/phase/{rank}"


class StopSignals:
    """SIGTERM / SIGUSR1 received by this process, to be acted on at the next step boundary."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        """Catch the stop signals (main thread only: Python delivers signals there; elsewhere a no-op). Called again
        after something else (an engine's start) may have set its own handlers; a signal already received is kept."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def _handle(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, group) -> signal.Signals | None:
        """The signal any rank of `group` (gloo) received, or None; every rank learns the same (a collective)."""
        number = self.received.value if self.received is not None else 0
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            value = torch.tensor([number], dtype=torch.int32)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            number = int(value.item())
        return signal.Signals(number) if number else None


class CollectiveError(RuntimeError):
    """A collective failed or timed out because other ranks did not answer; the message names them and the phase."""


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out", "Timeout",
              "NCCL communicator was aborted", "Socket Timeout", "ProcessGroupNCCL", "Gloo connectFullMesh failed")


def _is_collective_failure(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())) and not isinstance(error, getattr(dist, "DistStoreError", ())):
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in _PEER_LOST)


class PhaseWatch:
    """This rank's step and phase in the job's store, and the names of the ranks a failed collective waited for."""

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.step, self.name = 0, "start"
        self._store = None
        if world_size > 1 and dist.is_initialized():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, AttributeError, ValueError):  # an init without a store: phases are not shared
                self._store = None

    def _record(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):  # a store that is gone must not fail the step itself
                self._store.set(PHASE_KEY.format(rank=self.rank), f"{self.step} {self.name}")

    @contextlib.contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """Run one phase of a step; a collective that fails in it becomes a CollectiveError naming the silent ranks."""
        self.step, self.name = step, name
        self._record()
        try:
            yield
        except Exception as error:
            from megatron_rl.errors import exit_code_for

            # the project's own errors keep their message and exit code, whatever text they quote
            if isinstance(error, CollectiveError) or exit_code_for(error) is not None or not _is_collective_failure(error):
                raise
            raise CollectiveError(self.describe(error)) from error

    def others(self) -> dict[int, str]:
        """Each other rank's last recorded 'step phase' ('?' when it recorded none or the store is gone)."""
        ranks = [rank for rank in range(self.world_size) if rank != self.rank]
        seen = dict.fromkeys(ranks, "?")
        if self._store is None:
            return seen
        for rank in ranks:  # one round trip for a rank that recorded (check is one more for one that did not)
            key = PHASE_KEY.format(rank=rank)
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    seen[rank] = self._store.get(key).decode()
        return seen

    def describe(self, error: BaseException) -> str:
        here = f"{self.step} {self.name}"
        silent = {rank: where for rank, where in self.others().items() if where != here}
        timed_out = any(mark in str(error).lower() for mark in ("timed out", "timeout"))
        how = f"waited past parallel.timeout_s={self.timeout_s:g} s" if timed_out else "lost its connection"
        if silent:
            who = "; ".join(f"rank {r} (never seen)" if w == "?" else f"rank {r} (last seen in step {w.replace(' ', ', phase ')})"
                            for r, w in sorted(silent.items())) + " did not answer"
        else:
            who = "every other rank was last seen in this phase: one of them died or hangs in it"
        return (f"rank {self.rank}: a collective of step {self.step}, phase {self.name}, {how}: {who} (each rank's "
                "error: <logging.dir>/logs/error[.rankN].log); with cluster.max_restarts > 0 torchrun restarts the job "
                "from the newest checkpoint")
