"""rpc: each bucket rides in the call that stages it, `mrl_stage_weights(bucket)` on every engine.

Trainer side: the funnel (weight_sync.pusher.FunnelPush): every rank joins the export, rank 0 streams it into its
engine through weight_sync.push.stream_push, which sends each bucket as its target encodes it
(PushTarget.encode: tensors by reference to an in-process engine, safetensors bytes over vLLM's RPC to an engine
process, base64 safetensors text in POST /collective_rpc to a server).
Worker side: weight_sync.push.PushReceiver's `mrl_stage_weights` decodes and stages it; nothing of its own.
No owner-parallel form: every bucket goes through rank 0's calls.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.weight_sync.pusher import FunnelPush


class RpcTransport:
    """Buckets in the RPC (see the module docstring)."""

    receiver = None

    def trainer(self, pusher: Any) -> FunnelPush:
        return FunnelPush(pusher)

    def owners(self, pusher: Any, placement: Any) -> None:
        return None

    def engine_sender(self, engine_end: Any) -> None:
        return None


TRANSPORT = RpcTransport()
