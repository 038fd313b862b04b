"""vllm_nccl_m2n and vllm_ipc: vLLM's own weight-transfer engines (vllm.distributed.weight_transfer) over our shards.

Trainer side (`VllmPush`): vLLM's trainer engines (weight_sync.vllm_transfer.start_for_run: nccl_m2n, every rank
sends its own slice of each tensor to remote servers; ipc, CUDA IPC handles to engines on the trainer's GPUs), made
at the first push, checked against the engines' manifest before any tensor moves (vLLM's own routes check no names,
shapes or dtypes), and made again after a broken push; rank 0 drives the engines' control plane through each
engine's weight-sync client, between its engine's checks (WeightSyncedEngine.vllm_push).
Worker side: vLLM's own engines load the weights (the engines start with their weight-transfer config,
vllm_transfer.engine_args / server_args); `VllmReceiver.mrl_set_version` records the version they loaded.
No owner-parallel form: vLLM's engines already send from every rank.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from megatron_rl.actor.distribute import broadcast_object
from megatron_rl.weight_sync.broadcast import default_host
from megatron_rl.weight_sync.manifest import WeightPushError
from megatron_rl.weight_sync.push import PushReceiver, agree_and_retry, any_rank
from megatron_rl.weight_sync.stream import PushBrokenError, check_announced
from megatron_rl.weight_sync.transports.rpc import RpcTransport
from megatron_rl.weight_sync.vllm_transfer import VllmTransfer, start_for_run


class VllmPush:
    """Every rank sends through vLLM's trainer engines (see the module docstring): a broken push drops them on every
    rank (the engine then says its weights are lost, WeightsLostError, and the trainer pushes again)."""

    def __init__(self, pusher: Any):
        self.pusher = pusher
        self._transfer: VllmTransfer | None = None  # vLLM's trainer engines, made at the first push

    def push(self, version: int) -> dict[str, float]:
        pusher = self.pusher
        rollout, ctx = pusher.placement.rollout_config(pusher.rollout), pusher.ctx
        if self._transfer is None:
            urls = rollout.server_urls or pusher.engine_urls
            host = rollout.weight_broadcast_host or default_host([urlparse(u).hostname or "" for u in urls])
            clients = pusher.engine.weight_sync_clients() if pusher.engine is not None else None
            self._transfer = start_for_run(rollout.weight_transport, rollout, ctx, pusher.model_chunks,
                                           engines=pusher.placement.engines, clients=clients, host=host,
                                           share=lambda obj: broadcast_object(obj, ctx))
            self._check(version)
        send = self._transfer.send

        def attempt() -> None:
            if pusher.engine is not None:
                pusher.engine.vllm_push(send, version)
            else:
                send(version)

        def elsewhere(attempts: int) -> BaseException:
            return PushBrokenError(f"weight push v{version} by {rollout.weight_transport} broke on another rank", [])

        # no second attempt: vLLM's engines are made again at the next push
        agree_and_retry(attempt, version, group=ctx.world_group, max_attempts=1, elsewhere=elsewhere, on_broken=self.close)
        return {}

    def _check(self, version: int) -> None:
        """Every rank: refuse a push whose tensors do not fit the engines' manifest (checked on rank 0, which holds
        it), before any tensor moves."""
        pusher = self.pusher
        refused: WeightPushError | None = None
        if pusher.engine is not None:
            try:
                check_announced(pusher.engine.manifest, self._transfer.entries)
            except WeightPushError as error:
                refused = error
        if any_rank(refused is not None, pusher.ctx.world_group):
            self.close()
            raise refused or WeightPushError(f"weight push v{version} refused by the engines' manifest (see rank 0)")

    def close(self) -> None:
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None


class VllmReceiver(PushReceiver):
    """The worker's part beside vLLM's own engines (see the module docstring)."""

    def mrl_set_version(self, version: int | str) -> None:
        """Record the version that vLLM's own weight-transfer engine just loaded (weight_sync.vllm_transfer)."""
        self.__dict__["_mrl_version"] = int(version)


class VllmTransport(RpcTransport):
    """vLLM's weight-transfer engines (see the module docstring) carry the trainer's pushes; the rest is rpc's: no
    owner-parallel form (vLLM's engines already send from every rank), and a re-export after an engine restart
    (reexport_fn) goes in the RPC."""

    receiver = VllmReceiver

    def trainer(self, pusher: Any) -> VllmPush:
        return VllmPush(pusher)


TRANSPORT = VllmTransport()
