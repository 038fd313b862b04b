"""Make megatron-core 0.16.1 run on a CPU-only torch build (gloo backend) and without Transformer Engine.

megatron-core hard-codes CUDA in a few dozen places: the RNG tracker uses the
CUDA generator, buffers are allocated on ``torch.cuda.current_device()``, the
alltoall dispatcher creates CUDA streams, optimizers check
``param.type() == 'torch.cuda.FloatTensor'``, and so on. Every site that fails
on a CPU build gets one patch, described by a :class:`PatchSite` (in the
compat_sites_* modules) that names the megatron-core module, the object, the
0.16.1 line numbers and the source expression the patch relies on. The sites
fall in numbered groups, which the compat_sites_* modules use as headings:

1. the RNG tracker's CUDA generator (tensor_parallel.random);
2. the alltoall token dispatcher's side stream and its device-to-host copies;
3. hard-coded ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``, streams;
4. ``te_general_gemm`` read where only Transformer Engine binds it (moe_utils: a NameError);
5. literal ``device="cuda"`` in tensor factories (schedules, optimizer, clip_grads, utils);
6. torch norms under sequence parallelism (their gradients must be all-reduced);
7. list all_gather / reduce_scatter of uneven sizes, which gloo refuses (mappings);
8. gradient clipping's ``grad.type() == 'torch.cuda.FloatTensor'`` check;
9. the distributed and fp16 optimizers' cuda tensor-type checks;
10. the static inference engine's CUDA events (an optional module);
11. resharding's CUDA streams in its gloo copy service (an optional module).

Patch kinds, narrowest first:

* ``function``/``method``: one megatron function or method replaced or wrapped.
* ``cuda-shim``: the module's global name ``torch`` is rebound to a copy of the
  torch module whose ``torch.cuda`` is a CPU stand-in (``current_device()`` ->
  ``cpu``, ``synchronize()`` -> no-op, ``Stream``/``Event`` -> no-op objects,
  RNG calls -> the CPU generator) and whose tensor factories map ``device="cuda"``
  to the CPU. Only code *in that module* sees it: no global mode, no cost for
  anything else (a ``TorchFunctionMode`` doing the same doubles forward time).
* ``tensor-cuda``/``tensor-type``: ``Tensor.cuda``/``Tensor.type`` wrapped so
  that only *callers inside the listed megatron modules* see CPU-friendly
  behaviour (``.cuda()`` is a no-op, ``.type()`` reports
  ``torch.cuda.*Tensor``); any other caller gets torch's own method. (On a
  CPU-only build ``.cuda()`` can only raise, so nothing that worked changes.)

:func:`apply_compat` applies, once each (idempotent), the sites whose
conditions hold on this platform (``PatchSite.when``, decided by one
:class:`~megatron_rl.parallel.availability.Availability`): on a CPU build all of
them; on a GPU without Transformer Engine only those about TE (and apex) being
absent, which megatron-core 0.16.1 needs there too; :func:`apply_cpu_compat`
is the same call, reporting whether the CPU sites are applied. :func:`check_patch_targets` verifies that every target still
exists and still contains the expression its patch relies on, raising
:class:`PatchTargetError` naming the site otherwise (run by
tests/unit/test_cpu_compat.py, so a megatron-core upgrade that moves a site
fails loudly instead of silently running unpatched code).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import sys
import threading
import time
import types
from typing import Any, Callable

import torch

from megatron_rl.parallel.availability import Availability, all_hold, condition_holds, detect
from megatron_rl.parallel.compat_sites import SITES, PatchSite

_PATCH_MARK = "__megatron_rl_cpu_compat__"


class PatchTargetError(RuntimeError):
    """A megatron-core object that the CPU compatibility layer patches is missing or changed."""



_TENSOR_CUDA_MODULES = frozenset(s.module for s in SITES if s.kind == "tensor-cuda")
_TENSOR_TYPE_MODULES = frozenset(s.module for s in SITES if s.kind == "tensor-type")


# ---------------------------------------------------------------------------------------------
# The torch.cuda stand-in seen by shimmed modules.


class _CpuStream:
    """A no-op stand-in for torch.cuda.Stream: every call runs on the CPU in program order."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "_CpuEvent":
        ev = event if event is not None else _CpuEvent()
        ev.record()
        return ev

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuEvent:
    """A stand-in for torch.cuda.Event timing with time.perf_counter."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return ((end._t or 0.0) - (self._t or 0.0)) * 1000.0


class _NoNvtx:
    @staticmethod
    def range_push(*a: Any, **k: Any) -> None:
        pass

    @staticmethod
    def range_pop(*a: Any, **k: Any) -> None:
        pass

    @staticmethod
    @contextlib.contextmanager
    def range(*a: Any, **k: Any):
        yield


class _CudaShim(types.ModuleType):
    """``torch.cuda`` as seen by a shimmed megatron module on a CPU-only build."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.__dict__.update(
            current_device=lambda: torch.device("cpu"),
            synchronize=lambda device=None: None,
            set_device=lambda device: None,
            Stream=lambda *a, **k: _CPU_STREAM,
            current_stream=lambda device=None: _CPU_STREAM,
            default_stream=lambda device=None: _CPU_STREAM,
            stream=lambda s=None: contextlib.nullcontext(),
            Event=_CpuEvent,
            nvtx=_NoNvtx,
            get_rng_state=lambda device="cuda": torch.get_rng_state(),
            set_rng_state=lambda state, device="cuda": torch.set_rng_state(state),
            manual_seed=lambda seed: torch.manual_seed(seed),
            manual_seed_all=lambda seed: torch.manual_seed(seed),
            empty_cache=lambda: None,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "eye", "linspace",
)  # fmt: skip


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal
    return device


def _factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # a CPU-only build has no pinned-memory allocator: it can only raise
        return fn(*args, **kwargs)

    return wrapper


def _make_torch_shim() -> types.ModuleType:
    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim.__dict__["cuda"] = _CudaShim()
    for name in _FACTORIES:
        shim.__dict__[name] = _factory(getattr(torch, name))
    shim.__dict__["__getattr__"] = lambda name: getattr(torch, name)  # lazily-loaded torch attributes
    shim.__dict__[_PATCH_MARK] = True
    return shim


# ---------------------------------------------------------------------------------------------
# Replacements.


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def _cpu_tracker_fork(self: Any, name: str = "model-parallel-rng"):
    """CudaRNGStatesTracker.fork on the CPU generator (same bookkeeping as 0.16.1 random.py:242)."""
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not the same as the desired state name {name}.")
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def _cpu_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu, also converting CPU tensors to numpy when asked."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


def _wrap_norm_new(orig_new: Callable) -> Callable:
    def __new__(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if sequence_parallel:
            config = copy.copy(config)  # shallow: no __post_init__ re-validation
            config.sequence_parallel = False
        norm = orig_new(cls, config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    return __new__


def _wrap_gather(orig: Callable) -> Callable:
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        inp = input_.contiguous()
        if inp.shape[0] < longest:
            pad = inp.new_zeros((longest - inp.shape[0],) + tuple(inp.shape[1:]))
            inp = torch.cat([inp, pad], dim=0)
        gathered = inp.new_empty((longest * len(sizes),) + tuple(inp.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, inp, group=group)
        return torch.cat([gathered[i * longest : i * longest + s] for i, s in enumerate(sizes)], dim=0)

    return _gather_along_first_dim


def _wrap_reduce_scatter(orig: Callable) -> Callable:
    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group is None or group.size() == 1:
            return orig(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        rank = group.rank()
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[:rank])
        return total[start : start + sizes[rank]].clone()

    return _reduce_scatter_along_first_dim


_ORIG_TENSOR_CUDA = torch.Tensor.cuda
_ORIG_TENSOR_TYPE = torch.Tensor.type


def _caller_in(modules: frozenset[str]) -> bool:
    """Whether the caller of the Tensor method (two frames up) is one of ``modules``."""
    return sys._getframe(2).f_globals.get("__name__") in modules


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Tensor.cuda: a no-op when called from a listed megatron module on a CPU-only build."""
    if _caller_in(_TENSOR_CUDA_MODULES):
        return self
    return _ORIG_TENSOR_CUDA(self, *args, **kwargs)


def _tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Tensor.type: reports 'torch.cuda.FloatTensor' etc. for CPU tensors to listed megatron modules."""
    result = _ORIG_TENSOR_TYPE(self, *args, **kwargs)
    if not args and not kwargs and isinstance(result, str) and result.startswith("torch.") and not self.is_cuda:
        if _caller_in(_TENSOR_TYPE_MODULES):
            return "torch.cuda." + result[len("torch.") :]
    return result


setattr(_tensor_cuda, _PATCH_MARK, True)
setattr(_tensor_type, _PATCH_MARK, True)

# ---------------------------------------------------------------------------------------------
# Resolution, checking and application.

_LOCK = threading.Lock()
_APPLIED = False
_APPLIED_SITES: set[str] = set()
_ORIGINALS: dict[tuple[str, str], Any] = {}


def _import(site: PatchSite) -> types.ModuleType | None:
    try:
        return importlib.import_module(site.module)
    except Exception as exc:  # noqa: BLE001 - optional extras fail in many ways
        if site.optional:
            return None
        raise PatchTargetError(f"{site.describe()}: cannot import {site.module}: {exc!r}") from exc


def _resolve(module: types.ModuleType, target: str) -> tuple[Any, str, Any]:
    """Return (owner, attribute name, current value) for a dotted target."""
    owner: Any = module
    parts = target.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    if parts[-1] not in vars(owner) and not hasattr(owner, parts[-1]):
        raise AttributeError(parts[-1])
    return owner, parts[-1], getattr(owner, parts[-1])


def _source_of(site: PatchSite, module: types.ModuleType) -> str:
    original = _ORIGINALS.get((site.module, site.target))
    if site.kind == "cuda-shim" or site.kind == "attribute" or not site.target:
        return inspect.getsource(module)
    obj = original if original is not None else _resolve(module, site.target)[2]
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    try:
        return inspect.getsource(obj)
    except (TypeError, OSError):
        return inspect.getsource(module)


def check_patch_targets(sites: tuple[PatchSite, ...] | list[PatchSite] | None = None) -> list[str]:
    """Verify every patched megatron-core target exists and still looks as the patch expects.

    Raises PatchTargetError naming the site (module:object, 0.16.1 line) when an
    upgrade removed, renamed or rewrote it. Returns the descriptions of the
    sites checked (optional modules that are absent are skipped). Works whether
    or not the patches are applied: applied patches are checked against the
    originals they replaced.
    """
    checked = []
    for site in SITES if sites is None else sites:
        module = _import(site)
        if module is None:
            continue
        if site.target and site.kind != "attribute":
            try:
                _resolve(module, site.target)
            except AttributeError as exc:
                raise PatchTargetError(
                    f"{site.describe()}: {site.target!r} no longer exists in {site.module} "
                    f"(megatron-core {_megatron_version()}); the CPU patch '{site.name}' must be updated"
                ) from exc
        if site.kind == "cuda-shim" and "torch" not in vars(module):
            raise PatchTargetError(f"{site.describe()}: module no longer binds the global name 'torch'")
        source = _source_of(site, module)
        for fragment in site.expects:
            if fragment not in source:
                raise PatchTargetError(
                    f"{site.describe()}: expected source {fragment!r} not found in "
                    f"{site.module}{':' + site.target if site.target else ''} "
                    f"(megatron-core {_megatron_version()}); the site moved or changed: review patch '{site.name}'"
                )
        checked.append(site.describe())
    return checked


def _megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__

        return __version__
    except Exception:  # noqa: BLE001
        return "unknown"


def cuda_absent() -> bool:
    """True when this process must run megatron-core on the CPU (the 'cuda-absent' condition)."""
    return not detect().cuda


def sites_for(avail: Availability) -> list[PatchSite]:
    """The sites whose conditions (PatchSite.when) all hold on `avail`: what apply_compat patches there."""
    return [site for site in SITES if all_hold(site.when, avail)]


def is_applied() -> bool:
    """Whether the CUDA-absent (CPU) sites are applied in this process."""
    return _APPLIED


def _replace(site: PatchSite, owner: Any, attr: str, new: Any) -> None:
    """setattr(owner, attr, new), remembering the original for check_patch_targets."""
    _ORIGINALS.setdefault((site.module, site.target), getattr(owner, attr, None))
    try:
        setattr(new, _PATCH_MARK, True)
    except (AttributeError, TypeError):
        pass
    setattr(owner, attr, new)


def apply_compat(avail: Availability | None = None) -> list[str]:
    """Apply, once each, the sites whose conditions hold on `avail` (default: this process's detect()).

    On a CPU build that is every site; on a GPU without Transformer Engine the
    te-absent (and apex-absent) ones; with TE and apex, none. Checks the targets
    of those sites first (check_patch_targets), so a moved site fails here,
    before anything is half-patched. Returns the names of the sites applied in
    this process so far.
    """
    global _APPLIED
    avail = detect() if avail is None else avail
    sites = [s for s in sites_for(avail) if s.name not in _APPLIED_SITES]
    with _LOCK:
        if sites:
            check_patch_targets(sites)
        shim: types.ModuleType | None = None
        shimmed: set[str] = set()
        for site in sites:
            module = _import(site)
            if module is None:
                continue
            if site.kind == "cuda-shim":
                if site.module not in shimmed and not getattr(module.torch, _PATCH_MARK, False):
                    shim = shim or _make_torch_shim()
                    _ORIGINALS.setdefault((site.module, ""), module.torch)
                    module.torch = shim
                shimmed.add(site.module)
            elif site.name in _REPLACERS:
                _REPLACERS[site.name](site, module)
            if site.kind == "tensor-cuda" and not getattr(torch.Tensor.cuda, _PATCH_MARK, False):
                torch.Tensor.cuda = _tensor_cuda
            if site.kind == "tensor-type" and not getattr(torch.Tensor.type, _PATCH_MARK, False):
                torch.Tensor.type = _tensor_type
            _APPLIED_SITES.add(site.name)
        if condition_holds("cuda-absent", avail):
            _APPLIED = True
        return [s.name for s in SITES if s.name in _APPLIED_SITES]


def apply_cpu_compat(force: bool = False) -> bool:
    """apply_compat() on this platform; True when the CPU (CUDA-absent) sites are applied.

    force=True applies them as if CUDA were absent (the other conditions as detected).
    """
    avail = detect()
    if force:
        avail = dataclasses.replace(avail, cuda=False)
    apply_compat(avail)
    return _APPLIED


def _patch_attr(site: PatchSite, module: types.ModuleType, new_from_old: Callable[[Any], Any]) -> None:
    owner, attr, old = _resolve(module, site.target)
    if getattr(old, _PATCH_MARK, False):
        return
    if isinstance(owner, type):
        old = vars(owner).get(attr, old)
        if isinstance(old, staticmethod):
            old = old.__func__
    _replace(site, owner, attr, new_from_old(old))


def _set_none_if_missing(site: PatchSite, module: types.ModuleType) -> None:
    if site.target not in vars(module):
        _ORIGINALS.setdefault((site.module, site.target), None)
        setattr(module, site.target, None)


def _set_attribute(site: PatchSite, module: types.ModuleType, value: Any) -> None:
    _ORIGINALS.setdefault((site.module, site.target), getattr(module, site.target, None))
    setattr(module, site.target, value)


def _norm_patch(site: PatchSite, module: types.ModuleType) -> None:
    cls = module.WrappedTorchNorm
    old = vars(cls)["__new__"]
    old = old.__func__ if isinstance(old, staticmethod) else old
    if getattr(old, _PATCH_MARK, False):
        return
    _ORIGINALS.setdefault((site.module, site.target), old)
    new = _wrap_norm_new(old)
    setattr(new, _PATCH_MARK, True)
    cls.__new__ = new


def _keep_adam_step(old: Callable) -> Callable:
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return old(self, model_param, tensors)

    return set_main_param_and_optimizer_states


def _bind_grouped_gemm(site: PatchSite, module: types.ModuleType) -> None:
    """grouped_gemm_util.grouped_gemm / .ops -> the torch fallback, when the CUDA package is absent."""
    if getattr(module, "grouped_gemm", None) is not None:
        return
    from megatron_rl.parallel import grouped_gemm_torch

    _set_attribute(site, module, grouped_gemm_torch.package)
    module.ops = grouped_gemm_torch.ops


def _grouped_mlp_any_dtype(old: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        if self.config.bf16:
            return old(self, *args, **kwargs)
        config = self.config
        self.config = copy.copy(config)  # shallow: no __post_init__ re-validation
        self.config.bf16 = True
        try:
            return old(self, *args, **kwargs)
        finally:
            self.config = config

    return forward


_REPLACERS: dict[str, Callable[[PatchSite, types.ModuleType], None]] = {
    "rng-get-state": lambda s, m: _patch_attr(s, m, lambda old: _cpu_get_rng_state),
    "rng-set-state": lambda s, m: _patch_attr(s, m, lambda old: _cpu_set_rng_state),
    # tracker.add works unchanged through the random module's cuda shim (rng-manual-seed):
    # torch.cuda.get_rng_state/manual_seed there are the CPU generator's.
    "rng-tracker-fork": lambda s, m: _patch_attr(s, m, lambda old: _cpu_tracker_fork),
    "dispatcher-dtoh": lambda s, m: _patch_attr(s, m, lambda old: _cpu_move_tensor_to_cpu),
    "te-general-gemm": _set_none_if_missing,
    "mla-te-stubs": lambda s, m: _set_attribute(s, m, False),
    "norm-sequence-parallel": _norm_patch,
    "uneven-all-gather": lambda s, m: _patch_attr(s, m, _wrap_gather),
    "uneven-reduce-scatter": lambda s, m: _patch_attr(s, m, _wrap_reduce_scatter),
    "distopt-torch-adam-step": lambda s, m: _patch_attr(s, m, _keep_adam_step),
    "grouped-gemm-fallback": _bind_grouped_gemm,
    "grouped-mlp-bf16": lambda s, m: _patch_attr(s, m, _grouped_mlp_any_dtype),
}


def patched_sites() -> list[str]:
    """Descriptions of the sites patched in this process (empty when none applied)."""
    return [s.describe() for s in SITES if s.name in _APPLIED_SITES]
