"""Weight transports: their names, what the platform offers them, and the rules one rollout section decides alone.

The lowest layer of the placement rules: it reads no other section and no
other project module, so the schema (RolloutConfig.validate), the placement
rules (config.placement) and parallel.availability all import it and none of
them imports the others back.

    facts = transport_facts()                       # CUDA, NCCL, vLLM's engines, nccl.m2n, detected here
    facts.missing_for("vllm_ipc")                   # [] where vLLM's ipc engine can run
    check_rollout_transport("vllm", "ipc", False)   # ConfigError: ipc needs the engine in another process

torch and vLLM are imported only inside `transport_facts` (the rules need
neither; without torch the platform has no CUDA).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.core import ConfigError

Transport = Literal["rpc", "broadcast", "ipc", "vllm_nccl_m2n", "vllm_ipc"]
VLLM_ENGINE_OF = {"vllm_nccl_m2n": "nccl_m2n", "vllm_ipc": "ipc"}
"""Each vllm_* transport and the vLLM weight-transfer engine (its registry key) it drives."""


@dataclass(frozen=True, kw_only=True)
class TransportFacts:
    """What the platform offers the weight push (`transport_facts` detects it)."""

    cuda: bool
    """torch sees a CUDA device."""
    nccl: bool = False
    """torch.distributed has NCCL."""
    vllm_engines: frozenset[str] | None = field(default_factory=frozenset)
    """vLLM's registered trainer-side weight-transfer engines (WeightTransferTrainerFactory), empty without vLLM;
    None where they were not looked up because there is no CUDA, which every one of them needs."""
    m2n_runtime: bool = False
    """nccl.m2n (NVIDIA nccl-extensions) imports: vLLM's nccl_m2n engine needs it."""

    def missing_for(self, transport: str) -> list[str]:
        """What this platform lacks for a vllm_* transport (empty: it can run)."""
        engine = VLLM_ENGINE_OF[transport]
        missing = [] if self.cuda else ["no CUDA device"]
        if self.vllm_engines is not None and engine not in self.vllm_engines:
            missing.append(f"vLLM has no '{engine}' trainer engine registered (a vLLM build with "
                           "vllm.distributed.weight_transfer is needed)")
        if engine == "nccl_m2n" and not self.nccl:
            missing.append("torch.distributed has no NCCL (gloo only)")
        if engine == "nccl_m2n" and not self.m2n_runtime:
            missing.append("nccl.m2n does not import (pip install NVIDIA nccl-extensions)")
        return missing


def module_imports(module: str) -> bool:
    """Whether `module` imports in this process (missing, or built against another torch / CUDA: False)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - missing, or built against another torch/CUDA: unusable either way
        return False
    return True


@functools.lru_cache(maxsize=None)
def package_imports(module: str) -> bool:
    """`module_imports`, asked once per process (a package does not appear or vanish while a run goes on)."""
    return module_imports(module)


def transport_facts() -> TransportFacts:
    """What the weight push can use here: CUDA, NCCL, vLLM's registered trainer-side weight-transfer engines and
    the nccl.m2n runtime; without torch, no CUDA. With CUDA it imports vLLM's factory (not its engines) when vLLM is
    there. Without CUDA no vLLM engine can run, and the factory is not imported: it takes 2.5 s of every trainer
    rank's start on a 2-core CPU (most ranks import nothing else of vLLM)."""
    try:
        import torch
    except ImportError:
        return TransportFacts(cuda=False, vllm_engines=None)
    cuda = torch.cuda.is_available()
    return TransportFacts(cuda=cuda, nccl=cuda and torch.distributed.is_nccl_available(),
                          vllm_engines=_vllm_trainer_engines() if cuda else None,
                          m2n_runtime=cuda and package_imports("nccl.m2n"))


@functools.lru_cache(maxsize=None)
def _vllm_trainer_engines() -> frozenset[str]:
    """The names vLLM's WeightTransferTrainerFactory registers (empty without vLLM, or a vLLM without the API)."""
    if importlib.util.find_spec("vllm") is None:
        return frozenset()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except Exception:  # noqa: BLE001 - an older vLLM, or one built for another torch: no engines to use
        return frozenset()
    return frozenset(WeightTransferTrainerFactory._registry)


def check_transport_reaches_engine(transport: str, multiprocessing: bool) -> None:
    """A broadcast or memory handles need the engine in a process of its own: in the trainer's it gets tensors by
    reference."""
    if transport in ("broadcast", "ipc", "vllm_ipc") and not multiprocessing:
        raise ConfigError(
            f"rollout.weight_transport={transport} needs the engine in another process, but rollout.multiprocessing="
            "false keeps it in the trainer's (where it gets tensors by reference): set rollout.multiprocessing=true "
            "or rollout.weight_transport=rpc"
        )


def server_transport(weight_transport: str) -> Literal["rpc", "broadcast"]:
    """Remote servers take weights by broadcast unless rollout.weight_transport=rpc (our own transports: vLLM's are
    config.placement.choose_transport's)."""
    if weight_transport in ("ipc", "vllm_ipc"):
        raise ConfigError(
            f"rollout.weight_transport={weight_transport} hands memory handles to engines on the trainer's own "
            "devices (rollout.engine=vllm: an engine process, or colocated servers); remote servers take weights by "
            "broadcast or rpc: set rollout.weight_transport=auto"
        )
    return "rpc" if weight_transport == "rpc" else "broadcast"


def check_rollout_transport(engine: str, weight_transport: str, multiprocessing: bool | None) -> None:
    """The placement rules the rollout section decides by itself (RolloutConfig.validate runs them at load time;
    the rest needs the trainer's world size and cluster: config.placement.resolve_placement)."""
    if engine == "vllm" and multiprocessing is not None:
        check_transport_reaches_engine(weight_transport, bool(multiprocessing))
    if engine == "vllm_server":
        server_transport(weight_transport)  # refuses ipc: memory handles reach engines on the trainer's own devices only
