"""Counting what one step dispatches, by phase: aten ops, the kernels among them, host syncs and bytes.

A `torch.utils._python_dispatch.TorchDispatchMode` sees every aten op after autograd (forward
and backward) and attributes it to a phase:

* forward: the innermost labelled region open when it dispatches (`region(phase)` / `enter`,
  opened by module hooks or wrappers);
* backward: the phase of the forward region that created the autograd node being run
  (`torch._C._current_autograd_node()` and its sequence number, recorded at every region
  boundary), so backward ops land where their forward ran; a recomputation in backward runs its
  labelled modules again and marks its nodes too.

Per op:

* ``ops``: every op; ``kernels``: those that launch device work on a GPU: not a view, not a
  launch-free op (a wrapped host scalar, dtype arithmetic, an uninitialised allocation); a custom
  op that stands for a CUDA kernel run on the CPU (models' flash varlen attention, see
  bench/op_count_emulation.py) counts the kernels its CUDA implementation launches;
* ``host_syncs``: ops that make the host wait for a CUDA device: a scalar read (``.item()``,
  ``int()``, ``bool()``: ``_local_scalar_dense``), an output sized by the data (``nonzero``,
  ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``,
  indexing with a boolean mask), a comparison read on the host (``equal``, ``is_nonzero``). A
  ``.tolist()`` / ``.cpu()`` of a tensor dispatches nothing on a CPU tensor: on CPU those are
  not seen (tests/gpu runs the same layer under ``torch.cuda.set_sync_debug_mode``);
* ``bytes``: the bytes of its tensor arguments and outputs (each tensor's distinct elements
  times the element size: an expanded view counts its storage once; a tensor passed only as a template of
  shape and dtype, as to ``new_zeros``, is not read), for kernels only;
  ``index_bytes`` the part of them in integer and boolean tensors (indices, counts, masks).
"""

from __future__ import annotations

import bisect
import contextlib
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NOT_KERNELS = {"scalar_tensor", "promote_types", "result_type", "empty", "empty_like", "empty_strided", "new_empty",
               "new_empty_strided", "empty_permuted", "lift_fresh"}
"""Ops that launch no device work: a wrapped host scalar, dtype arithmetic, uninitialised allocations."""
VIEW_OPS = {"detach", "alias", "lift_fresh", "_unsafe_view", "view", "reshape", "expand", "t", "transpose",
            "permute", "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "unbind",
            "as_strided", "chunk", "narrow", "view_as", "_reshape_alias", "unfold", "diagonal", "movedim",
            "flatten", "unflatten", "expand_as", "set_", "resize_"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "bincount", "equal", "is_nonzero"}
"""Ops whose CUDA implementation makes the host wait for the device (a scalar read or a data-sized output)."""
TEMPLATE_OPS = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like",
                "rand_like", "randn_like"}
"""Ops that take a tensor only for its shape, dtype and device: their bytes are the output's."""
CUSTOM_OP_KERNELS = {"torch_attn::_varlen_attn": 2, "torch_attn::_varlen_attn_backward": 1}
"""Kernels a CUDA build launches for these custom ops (torch.nn.attention.varlen: the flash forward and its
rng-state zeros; the flash backward)."""


def is_host_sync(name: str, overload: str, args, kwargs) -> bool:
    """Whether an op (`name` without the aten:: prefix) waits for the device on CUDA (see SYNC_OPS)."""
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave":  # a tensor of repeats sizes the output unless output_size is given
        return overload != "self_int" and (kwargs or {}).get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's distinct elements (dims of stride 0, expanded ones, count once)."""
    distinct = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            distinct *= size
    return distinct * tensor.element_size() if tensor.numel() else 0


class OpCounter(TorchDispatchMode):
    """Counts aten ops by phase (module docstring); `region(phase)` opens a labelled region."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        super().__init__()
        self.phases = phases
        self.stack: list[str] = []
        self.boundaries: list[int] = []  # autograd sequence numbers where a phase began
        self.boundary_phase: list[str] = []
        self.paused = False
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.names: dict[str, Counter] = defaultdict(Counter)
        self.syncs: dict[str, Counter] = defaultdict(Counter)

    # -- phase bookkeeping ------------------------------------------------------------------------

    def _next_sequence_nr(self) -> int:
        self.paused = True
        try:
            with torch.enable_grad():
                probe = torch.zeros((), requires_grad=True).mul(1.0)
            return probe.grad_fn._sequence_nr()
        finally:
            self.paused = False

    def _mark(self) -> None:
        """Nodes created from here on belong to the current innermost phase."""
        if torch._C._current_autograd_node() is not None and not self.stack:
            return
        self.boundaries.append(self._next_sequence_nr())
        self.boundary_phase.append(self.stack[-1] if self.stack else "other")

    def enter(self, phase: str) -> None:
        self.stack.append(phase)
        self._mark()

    def exit(self) -> None:
        if self.stack:
            self.stack.pop()
        self._mark()

    @contextlib.contextmanager
    def region(self, phase: str):
        self.enter(phase)
        try:
            yield
        finally:
            self.exit()

    def _phase_now(self) -> str:
        if self.stack:  # forward (or a recomputation in backward)
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is None or not self.boundaries or node.name().endswith("AccumulateGrad"):
            return "other"  # a parameter's gradient accumulation (DDP's main_grad hooks) is no layer phase
        index = bisect.bisect_right(self.boundaries, node._sequence_nr()) - 1
        return self.boundary_phase[index] if index >= 0 else "other"

    # -- counting ---------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            phase = self._phase_now()
            schema = func._schema.name
            name = schema.removeprefix("aten::")
            kernels = CUSTOM_OP_KERNELS.get(schema, 0 if name in VIEW_OPS or name in NOT_KERNELS or func.is_view else 1)
            counts = self.counts[phase]
            counts["ops"] += 1
            counts["kernels"] += kernels
            if is_host_sync(name, func._overloadname, args, kwargs):
                counts["host_syncs"] += 1
                self.syncs[phase][name] += 1
            if kernels:
                self.names[phase][name] += 1
                read = () if name in TEMPLATE_OPS else (args, kwargs)  # a template's data is not read
                tensors = [t for t in tree_leaves((read, out)) if isinstance(t, torch.Tensor)]
                counts["bytes"] += sum(tensor_bytes(t) for t in tensors)
                counts["index_bytes"] += sum(tensor_bytes(t) for t in tensors if not t.is_floating_point())
        return out

    def take(self) -> tuple[dict, dict]:
        """({phase: {ops, kernels, host_syncs, bytes, index_bytes}}, {phase: the most frequent kernels, {"syncs": ...}}); resets."""
        keys = ("ops", "kernels", "host_syncs", "bytes", "index_bytes")
        counts = {phase: {key: self.counts[phase][key] for key in keys} for phase in self.phases}
        names = {phase: dict(self.names[phase].most_common(12)) for phase in self.phases if phase in self.names}
        syncs = {phase: dict(self.syncs[phase]) for phase in self.phases if phase in self.syncs}
        self.counts.clear()
        self.names.clear()
        self.syncs.clear()
        return counts, {"kernels": names, "host_syncs": syncs}
