"""Our HF-named shards as a vLLM `WeightSource` (vllm.distributed.weight_transfer.base), for vLLM's trainer engines.

vLLM 0.32's trainer-side transfer engines (`TrainerWeightTransferEngine`:
nccl, nccl_m2n, ipc, ...) take the trainer's weights as a `WeightSource`:
`metadata()` (every HF name, wire dtype and full shape, the whole model on every
rank), `held_names()` (what this rank serves), `groups()` (vLLM's
`layerwise_groups` over the metadata, kept where this rank holds a name) and
iteration in metadata order, a real tensor for each held name and None for the
rest. `MegatronSource` answers it from the owner plan of models.export_owners:
a rank holds the HF tensors of the parameters it owns (replicas spread the
load; at least one rank per PP stage and EP rank), and a layer group is made on
every rank at once (the owners' TP peers hand them their shards: a collective,
so `iter_groups` walks every group of the model on every rank and yields the
ones this rank holds).

The transfer itself (vLLM's engines over NCCL / CUDA IPC) needs GPUs and is not
exercised on CPU; this adapter's contract is (tests/distributed/test_weight_owner_push.py).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.models.build import model_info
from megatron_rl.models.export import _replica_shards, hf_entries
from megatron_rl.models.export_owners import _gather_params, assign_owners
from megatron_rl.models.mapping import mapping_for


def _vllm_base():
    from vllm.distributed.weight_transfer import base

    return base


def make_megatron_source(model_chunks: list, ctx, *, wire_dtype: torch.dtype | None = None):
    """A `MegatronSource` (the class is made on first use: vLLM is imported only here)."""
    base = _vllm_base()

    class MegatronSource(base.WeightSource):
        """See the module docstring."""

        def __init__(self) -> None:
            info = model_info(model_chunks)
            self._arch, self._padded = info.arch, info.padded_vocab_size
            self._held = _replica_shards(model_chunks, ctx, self._arch, self._padded)
            self._params = _gather_params(self._held, ctx)
            assign_owners(self._params, ctx.world_size)
            self._of_name: dict[str, object] = {}
            entries = []
            for param in self._params:
                for name, shape, dtype in hf_entries([param], self._arch, self._padded):
                    self._of_name[name] = param
                    entries.append((name, shape, dtype))
            order = [n for group in base.layerwise_groups([n for n, _, _ in entries]) for n in group]
            by_name = {n: (s, d) for n, s, d in entries}
            self._meta = [base.ParamMeta(n, wire_dtype or getattr(torch, by_name[n][1]), tuple(by_name[n][0]))
                          for n in order]
            self._mine = {n for n, p in self._of_name.items() if p.owner == ctx.rank}

        def metadata(self):
            return list(self._meta)

        def held_names(self):
            return set(self._mine)

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
            for names, tensors in self.iter_groups():
                yield from zip(names, tensors)

        @torch.no_grad()
        def iter_groups(self):
            held_groups = {tuple(g) for g in self.groups()}
            for group in base.layerwise_groups([m.name for m in self._meta]):
                made = self.make_group(group)
                if tuple(group) in held_groups:
                    yield list(group), [made.get(n) for n in group]

        def owner_of(self, name: str) -> int:
            """The trainer rank that makes (and serves) HF tensor `name`."""
            return int(self._of_name[name].owner)

        def make_group(self, group: list[str]) -> dict[str, torch.Tensor]:
            """Every rank: the owners of the group's parameters get their TP peers' shards; HF tensors of those owned here."""
            params, seen = [], set()
            for name in group:
                param = self._of_name[name]
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
            shards, requests, keep = {}, [], []
            for param in params:
                for index, src in sorted(param.sources.items()):
                    if src == param.owner == ctx.rank:
                        shards[(param.name, index)] = self._held[(param.name, index)][0].detach().clone()
                    elif src == ctx.rank and src != param.owner:
                        keep.append(self._held[(param.name, index)][0].detach().contiguous())
                        requests.append(dist.isend(keep[-1], param.owner))
                    elif param.owner == ctx.rank and src != ctx.rank:
                        buffer = torch.empty(param.shape, dtype=getattr(torch, param.dtype), device=ctx.device)
                        shards[(param.name, index)] = buffer
                        requests.append(dist.irecv(buffer, src))
            for request in requests:
                request.wait()
            out: dict[str, torch.Tensor] = {}
            for param in params:
                if param.owner == ctx.rank:
                    pieces = [shards.pop((param.name, i)) for i in range(param.count)]
                    for name, tensor in mapping_for(self._arch, param.name, self._padded).export(pieces):
                        out[name] = tensor.to(wire_dtype) if wire_dtype is not None else tensor
            return out

    return MegatronSource()
