"""A push as a stream: its whole manifest first, then buckets as the export produces them.

    stream = as_weight_stream(export_hf_weights(chunks, ctx, bucket_bytes=...))
    stream.entries                 # [(hf_name, shape, dtype)], known before any data is made
    for bucket in stream: ...      # buckets, one at a time

Because the names, shapes and dtypes of every tensor are known before the
first bucket exists, an engine checks the whole push against its own manifest
(check_announced) before the first byte moves, and then streams each bucket to
its workers and drops it: the pushing rank holds one bucket being sent (plus
the one the export is making), never the whole model. Each bucket is checked
against the announcement as it passes (AnnouncedPush): a bucket that differs
breaks the push midway, which the engine answers by going back to a complete
version.

`as_weight_stream` also takes a plain list or iterable of buckets (tests,
in-memory state dicts): it lists it first to describe it, which holds
references to tensors that already exist, not copies.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from megatron_rl.weight_sync.buckets import Bucket, tensor_bytes
from megatron_rl.weight_sync.manifest import PushValidator, WeightManifest, WeightPushError

Entry = tuple[str, tuple[int, ...], str]
"""(HF name, shape, torch dtype name such as 'bfloat16')."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entries_of(buckets: Iterable[Bucket]) -> list[Entry]:
    return [(name, tuple(int(d) for d in t.shape), dtype_name(t.dtype)) for bucket in buckets for name, t in bucket]


class PushBrokenError(RuntimeError):
    """A weight push broke midway; every engine that answers is back on a complete version. Push again."""

    def __init__(self, message: str, versions: list[int | None]):
        super().__init__(message)
        self.versions = versions
        """The version each engine serves now; None for one that did not answer (to be restarted)."""


class WeightStream:
    """Buckets of HF-named tensors with the push's manifest announced up front (see the module docstring)."""

    def __init__(self, entries: list[Entry], buckets: Iterable[Bucket]):
        self.entries = [(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in entries]
        self._buckets = buckets

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self._buckets)

    @property
    def num_bytes(self) -> int:
        total = 0
        for _, shape, dtype in self.entries:
            numel = math.prod(shape)
            total += numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        return total


def as_weight_stream(buckets: Iterable[Bucket] | WeightStream) -> WeightStream:
    """A WeightStream as is; an iterable with `entries` (models.export_hf_weights) wrapped; a list (or any
    other iterable) of buckets listed and described (references to its tensors, no copies)."""
    if isinstance(buckets, WeightStream):
        return buckets
    entries = getattr(buckets, "entries", None)
    if entries is not None:
        return WeightStream(entries, buckets)
    listed = [list(b) for b in buckets]
    return WeightStream(entries_of(listed), listed)


def check_announced(manifest: WeightManifest, entries: list[Entry]) -> None:
    """Refuse a push whose announced tensors do not fit the engine's model; nothing has moved yet.

    Checks: every name is a weight of the model (closest names suggested), its shape matches, no name
    twice, every required weight is there, and a floating-point weight comes as floating point (the
    engine casts between float dtypes; an integer tensor for a float weight is a mapping bug).
    """
    validator = PushValidator(manifest)
    for name, shape, dtype in entries:
        validator.check_bucket([(name, _Described(shape, dtype))])  # shape, name and kind of dtype
    validator.check_complete()


class AnnouncedPush:
    """Checks that each bucket of a stream is what the stream announced, in any order, each tensor once."""

    def __init__(self, entries: list[Entry]):
        self.expected = {name: (shape, dtype) for name, shape, dtype in entries}
        self.seen: set[str] = set()
        self.num_bytes = 0

    def check_bucket(self, bucket: Bucket) -> None:
        for name, tensor in bucket:
            got = (tuple(int(d) for d in tensor.shape), dtype_name(tensor.dtype))
            want = self.expected.get(name)
            if want is None or name in self.seen or got != want:
                reason = ("was not announced" if want is None else "came twice" if name in self.seen
                          else f"came as {list(got[0])} {got[1]}, announced as {list(want[0])} {want[1]}")
                raise WeightPushError(f"weight push broken midway: tensor {name!r} {reason}")
            self.seen.add(name)
            self.num_bytes += tensor_bytes(tensor)

    def check_complete(self) -> None:
        missing = [n for n in self.expected if n not in self.seen]
        if missing:
            raise WeightPushError(
                f"weight push broken midway: the stream ended without {len(missing)} announced tensors ({missing[:4]})"
            )


class LiveBytes:
    """Bytes of the tensors given to `track` that are still alive, and the peak of that.

    A measurement by allocation accounting (weak references: a tensor counts
    until it is freed), used to show how much of a push one process holds at once.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor_bytes(tensor)
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, nbytes)  # a view keeps its base alive (._base)
        return tensor

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


@dataclass
class _Described:
    """A tensor's shape and dtype without its data, for the manifest checks."""

    shape: tuple[int, ...]
    dtype_text: str

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_text)

    def element_size(self) -> int:
        return self.dtype.itemsize
