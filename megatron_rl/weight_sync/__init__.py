"""Weight sync: trainer weights (HF-named buckets) -> the rollout engine; every push path lives here.

    pusher = WeightPusher(cfg.rollout, ctx, actor.model, engine_or_None, placement=placement)  # weight_sync.pusher
    pusher.push(version)    # every trainer rank; picks the funnel, owner-parallel or vLLM's engines
    push_weights(engine_or_None, export_hf_weights(chunks, ctx, bucket_bytes=...), version)   # the funnel alone

pusher.py: WeightPusher, the trainer's one call for a push (imported from
its module: it brings in models' export and the actor's broadcast of an object); engine_side.py: the engine's end
of every push (WeightSyncedEngine, WeightsLostError), which rollout's engines
subclass; buckets.py: bucketing and the wire format (safetensors bytes);
manifest.py: what the engine accepts; stream.py: a push announced up front
(names, shapes, dtypes) and checked before any byte moves; push.py:
push_weights, the funnel on every trainer rank;
broadcast.py: buckets broadcast from the pushing rank into every engine worker
over a group of their own (NCCL on GPU, gloo on CPU); parallel.py: no funnel,
every owner rank broadcasts its own buckets (models.export_owners);
delta.py: sparse deltas against what the engines hold, checked by checksum;
ipc.py / owner_ipc.py / ipc_reference.py: buckets by memory handle to engine
workers on the trainer's own device (the trainer's own tensors, host or GPU, by
reference), ipc_receive.py the worker's end; vllm_transfer.py / vllm_source.py: vLLM's own weight-transfer
engines over our shards; protocol.py: the one push protocol every placement
drives (stream_push, PushTarget); streaming_load.py: a push loaded into a
worker's model as its buckets arrive; engine_reload.py: vLLM's in-place reload
under it (tied output layers given their tensor, a layer given nothing an
error). vLLM's worker extension that calls them is megatron_rl.rollout.worker_ext;
this package imports nothing of rollout.
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
