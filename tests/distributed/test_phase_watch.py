"""A collective that waits past parallel.timeout_s names the rank that did not answer and the phase it was last in;
a stop signal received by one rank is known to every rank at the step boundary.

Two real processes over gloo: rank 1 records step 3's generate phase and then does not join rank 0's all-reduce of
the train phase; rank 0's wait ends after the 2 s timeout with a CollectiveError that says so.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

from tests.distributed.harness import run_distributed

TIMEOUT_S = 2.0


def _silent_peer(rank: int, world_size: int) -> str:
    import torch
    import torch.distributed as dist

    from megatron_rl.errors import EXIT_RUNTIME_FAILURE, exit_code_for
    from megatron_rl.parallel.watch import CollectiveError, PhaseWatch, StopSignals

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))
    stop = StopSignals()
    stop.install()
    try:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is asked to stop ...
        agreed = stop.agreed(dist.group.WORLD)  # ... every rank learns it at the boundary
        assert agreed == signal.SIGUSR1, agreed
    finally:
        stop.restore()
    watch = PhaseWatch(rank, world_size, TIMEOUT_S)
    if rank == 1:
        with watch.phase(3, "generate"):
            time.sleep(3 * TIMEOUT_S)  # never joins rank 0's collective
        return ""
    try:
        with watch.phase(3, "train"):
            dist.all_reduce(torch.ones(1))
    except CollectiveError as error:
        assert exit_code_for(error) == EXIT_RUNTIME_FAILURE
        return str(error)
    raise AssertionError("the all-reduce without rank 1 returned")


def test_a_silent_rank_is_named_with_its_phase():
    message, _ = run_distributed(_silent_peer, 2, timeout=120)
    assert message.startswith("rank 0: a collective of step 3, phase train, waited past parallel.timeout_s=2 s"), message
    assert "rank 1 (last seen in step 3, phase generate) did not answer" in message, message
    assert "\n" not in message
