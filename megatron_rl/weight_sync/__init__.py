"""Weight sync: trainer weights (HF-named buckets) -> the rollout engine.

    push_weights(engine_or_None, export_hf_weights(chunks, ctx, bucket_bytes=...), version)

buckets.py: bucketing and the wire format (safetensors bytes);
manifest.py: what the engine accepts and the whole-push check done before any
engine weight changes; push.py: push_weights and the engine-side collection;
broadcast.py: buckets broadcast from the pushing rank into every engine worker
over a group of their own (NCCL on GPU, gloo on CPU).
The engine side of loading lives in megatron_rl.rollout.worker_ext.
"""

from megatron_rl.weight_sync.buckets import Bucket, bucket_from_bytes, bucket_to_bytes, bucketize, tensor_bytes
from megatron_rl.weight_sync.manifest import PushValidator, WeightManifest, WeightPushError, manifest_from_checkpoint
from megatron_rl.weight_sync.push import PushStats, collect_push, push_weights

__all__ = [
    "Bucket",
    "PushStats",
    "PushValidator",
    "WeightManifest",
    "WeightPushError",
    "bucket_from_bytes",
    "bucket_to_bytes",
    "bucketize",
    "collect_push",
    "manifest_from_checkpoint",
    "push_weights",
    "tensor_bytes",
]
