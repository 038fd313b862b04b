"""Weight sync: trainer weights (HF-named buckets) -> the rollout engine; every push path lives here.

    pusher = WeightPusher(cfg.rollout, ctx, actor.model, engine_or_None, placement=placement)  # weight_sync.pusher
    pusher.push(version)    # every trainer rank; the placement's transport (weight_sync.transports) sends it
    push_weights(engine_or_None, export_hf_weights(chunks, ctx, bucket_bytes=...), version)   # the funnel alone

pusher.py: WeightPusher, the trainer's one call for a push (imported from its module: it brings in models'
export), which looks the placement's transport up in transports/: one file per transport (rpc, broadcast, ipc,
vllm) holding both its ends, the trainer ranks' part of a push and the methods vLLM's worker gets
(rollout.worker_ext mixes them in); push.py: the push protocol's both ends (stream_push, PushTarget; PushReceiver in
the worker), push_weights (the funnel into one engine) and agree_and_retry, the one loop that agrees on a broken push
across the ranks and makes it again; engine_side.py: the engine's end of every push (WeightSyncedEngine,
WeightsLostError), which rollout's engines subclass; buckets.py: bucketing and the wire format (safetensors bytes);
manifest.py: what the engine accepts; stream.py: a push announced up front (names, shapes, dtypes) and checked
before any byte moves. The wire each transport uses: broadcast.py (groups with the engine workers, NCCL on GPU,
gloo on CPU, and bucket packing); parallel.py (every owner rank broadcasts its own buckets, models.export_owners);
delta.py (sparse deltas against what the engines hold, checked by checksum); ipc.py / owner_ipc.py /
ipc_reference.py (buckets by memory handle to engine workers on the trainer's own device, the trainer's own
tensors by reference), ipc_receive.py the worker's end; vllm_transfer.py / vllm_source.py (vLLM's own
weight-transfer engines over our shards); streaming_load.py: a push loaded into a worker's model as its buckets
arrive; engine_reload.py: vLLM's in-place reload under it (tied output layers given their tensor, a layer given
nothing an error; the CPU experts re-packed after it). This package imports nothing of rollout.
"""

from megatron_rl.weight_sync.buckets import Bucket, bucket_from_bytes, bucket_to_bytes, bucketize, tensor_bytes
from megatron_rl.weight_sync.manifest import PushValidator, WeightManifest, WeightPushError, manifest_from_checkpoint
from megatron_rl.weight_sync.push import PushStats, push_weights
from megatron_rl.weight_sync.stream import WeightStream, as_weight_stream, check_announced

__all__ = [
    "Bucket",
    "PushStats",
    "PushValidator",
    "WeightManifest",
    "WeightPushError",
    "bucket_from_bytes",
    "bucket_to_bytes",
    "bucketize",
    "manifest_from_checkpoint",
    "push_weights",
    "WeightStream",
    "as_weight_stream",
    "check_announced",
    "tensor_bytes",
]
