"""Weight transports, one file each holding both ends of a push, looked up by the placement's transport.

    transport = transport_for(placement.transport)   # rollout.weight_transport as config.placement resolved it
    side = transport.trainer(pusher)                 # every trainer rank's part of a push (weight_sync.pusher)
    side = transport.owners(pusher, placement)       # the same with rollout.weight_senders=owners (None: not offered)
    transport.engine_sender(engine_end)              # what rank 0's engine sends each bucket with (weight_sync.push)
    transport.receiver                               # the worker's part, mixed into vLLM's worker (rollout.worker_ext)

| transport              | file         | trainer side                                  | worker side                 |
| ---------------------- | ------------ | --------------------------------------------- | --------------------------- |
| rpc                    | rpc.py       | the funnel; each bucket in the RPC            | push.PushReceiver alone     |
| broadcast              | broadcast.py | the funnel, one group; or every owner, a group each | mrl_broadcast_*, mrl_owner_* |
| ipc                    | ipc.py       | the funnel by memory handle; or every owner   | mrl_ipc_receive             |
| vllm_nccl_m2n, vllm_ipc | vllm.py     | vLLM's trainer-side weight-transfer engines   | vLLM's own engines          |

Every transport drives the one protocol and the one retry loop of weight_sync.push; the wire each one uses
(weight_sync.broadcast's groups and packing, weight_sync.ipc's shared buffers, weight_sync.parallel's rounds,
weight_sync.vllm_transfer over vLLM's engines) lies below. As vLLM registers its weight-transfer engines
(vllm.distributed.weight_transfer.factory), each module is imported only when its transport is asked for.
Adding a transport: a module here with a `TRANSPORT` (the Transport protocol below) and its line in TRANSPORTS;
rollout.weight_transport takes the names config.transport.Transport lists, and config.placement chooses among them.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

TRANSPORTS: dict[str, str] = {
    "rpc": "rpc",
    "broadcast": "broadcast",
    "ipc": "ipc",
    "vllm_nccl_m2n": "vllm",
    "vllm_ipc": "vllm",
}
"""Each transport (the placement's, config.transport.Transport) and the module here that holds both its ends."""


class TrainerSide(Protocol):
    """Every trainer rank's part of the run's pushes by one transport (made at the first push, kept for the run)."""

    def push(self, version: int) -> dict[str, float]:
        """One push as `version`, on every rank at once; this rank's metrics of it."""
        ...

    def close(self) -> None:
        """Let go of what the pushes keep (export plans, vLLM's engines); the next push makes them again."""
        ...


class Transport(Protocol):
    """Both ends of one way weights reach the engines."""

    receiver: type | None
    """The worker's part: methods rollout.worker_ext mixes into vLLM's worker (a weight_sync.push.PushReceiver);
    None where the protocol's own calls are all it takes."""

    def trainer(self, pusher: Any) -> TrainerSide:
        """The pushes through trainer rank 0 (rollout.weight_senders=rank0); pusher: weight_sync.pusher.WeightPusher."""
        ...

    def owners(self, pusher: Any, placement: Any) -> TrainerSide | None:
        """The pushes where every rank sends the weights it owns (rollout.weight_senders=owners) under the resolved
        `placement`; None: this transport has none."""
        ...

    def engine_sender(self, engine_end: Any) -> Callable[[], Any] | None:
        """What makes the sender of each bucket into every engine's workers (weight_sync.push.stream_push), from the
        hooks of rank 0's engine end (weight_sync.engine_side.WeightSyncedEngine, which asks); None: the bucket goes
        in the RPC (mrl_stage_weights)."""
        ...


def transport_for(name: str) -> Transport:
    """The transport called `name` (one of TRANSPORTS)."""
    if name not in TRANSPORTS:
        raise ValueError(f"no weight transport {name!r}; the transports are {sorted(TRANSPORTS)}")
    return importlib.import_module(f"{__name__}.{TRANSPORTS[name]}").TRANSPORT


def receivers() -> list[type]:
    """Every transport's worker part, one per module in TRANSPORTS' order (rollout.worker_ext mixes them in)."""
    found: list[type] = []
    for module in dict.fromkeys(TRANSPORTS.values()):
        receiver = importlib.import_module(f"{__name__}.{module}").TRANSPORT.receiver
        if receiver is not None and receiver not in found:
            found.append(receiver)
    return found
