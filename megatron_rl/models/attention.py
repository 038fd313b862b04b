"""Exact core attention for megatron-core's local layer spec: packed sequences (THD) and context parallelism.

megatron-core's local ``DotProductAttention`` refuses ``PackedSeqParams`` and a
context-parallel size above 1 (only Transformer Engine's attention takes them).
:class:`LocalCoreAttention` has DotProductAttention's constructor and forward
signature and takes both, so the packed / CP training path runs on CPU (and on
a GPU without Transformer Engine, through torch's fused scaled_dot_product_attention).

The math, for a query token i and a key token j (softmax scale s, head dim d):

    out_i = sum_j softmax_j(s * q_i . k_j + M_ij) v_j,   M_ij = 0 if allowed(i, j) else -inf

* unpacked [s, b, h, d]: allowed(i, j) = j <= i (causal), or megatron's attention_mask
  when one is given (True = masked out, as in megatron's ``attention_mask_func``);
* packed THD [t, h, d] with ``cu_seqlens_q_padded`` = [0, L_0, L_0 + L_1, ...]: the mask is
  block-diagonal causal, allowed(i, j) = seq(i) == seq(j) and pos(j) <= pos(i), where pos is
  the position inside the (padded) sequence. Padding sits at the end of each sequence
  (megatron/TE's THD convention: ``cu_seqlens`` are the real lengths, ``cu_seqlens_padded``
  the laid-out ones), so no real token attends to a padding token: padding is inert;
* context parallelism (megatron/TE's load-balanced layout, ``get_batch_on_this_cp_rank`` and
  TE's ``thd_get_partitioned_indices``): every sequence of padded length L is cut into
  2 x CP chunks of L / (2 x CP) tokens and CP rank r holds chunks r and 2 x CP - 1 - r, in
  that order. Keys and values are all-gathered over the CP group (megatron's
  ``gather_from_sequence_parallel_region``: all-gather forward, reduce-scatter of their
  gradients backward), put back in sequence order, and each local query i attends to
  pos(j) <= pos(i) with pos(i) its global position (:func:`cp_chunk_indices`).
  ``cu_seqlens`` in ``PackedSeqParams`` are those of the whole (global) sequences; a rank holds
  L / CP tokens of each.

Grouped-query attention (fewer key/value heads) uses torch's ``enable_gqa``: query head n
reads key/value group n // (heads / groups), as megatron's ``repeat_interleave`` does. The
varlen kernel takes it only from torch 2.13 on; before, heads are expanded for the call
(models.varlen, chosen from the installed function's signature).

Memory: the CP exchange is an all-gather (megatron's ``cp_comm_type="all_gather"``, not TE's
ring of point-to-point steps), so each rank holds the keys and values of the whole sequences
of its microbatch, 2 x T x groups x head_dim per layer, while everything else it holds is
T / CP; with GQA that is a small part of a layer's activations.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron_rl.parallel.devices import host_to_device


def cp_chunk_indices(seq_len_padded: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of one sequence that context-parallel rank `cp_rank` holds, in its local order.

    megatron/TE's load-balanced causal layout: the sequence (length padded to a multiple of
    2 x cp_size) is cut into 2 x cp_size equal chunks; rank r holds chunk r then chunk
    2 x cp_size - 1 - r. E.g. length 8, CP 2: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5].
    Returns int64 [seq_len_padded // cp_size].
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} with cp_size={cp_size}: need cp_size >= 1 and 0 <= cp_rank < cp_size")
    if cp_size == 1:
        return torch.arange(seq_len_padded)
    if seq_len_padded % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len_padded} is not a multiple of 2 x CP = {2 * cp_size}: pad each sequence to a "
            f"multiple of {2 * cp_size} (packed_seq_params(lengths, multiple={2 * cp_size}))"
        )
    chunk = seq_len_padded // (2 * cp_size)
    return cp_global_positions(torch.arange(2 * chunk), torch.tensor(chunk), cp_size, cp_rank)


def cp_global_positions(local: torch.Tensor, chunk: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The position in its sequence of local index `local` of CP rank `cp_rank` (elementwise; `chunk`: the
    sequence's chunk length, length / (2 x cp_size), per element): chunk cp_rank, then chunk 2 x cp_size - 1 - cp_rank."""
    return torch.where(local < chunk, cp_rank * chunk + local, (2 * cp_size - 1 - cp_rank) * chunk + local - chunk)


def packed_seq_params(
    lengths: Sequence[int] | torch.Tensor, *, multiple: int = 1, device: torch.device | str | None = None
) -> PackedSeqParams:
    """megatron-core PackedSeqParams (THD) for sequences of `lengths` tokens laid out back to back.

    Each sequence is padded at its end to a multiple of `multiple` (2 x CP with context
    parallelism, times TP with sequence parallelism as NeMo and verl pad; 1 = no padding).
    cu_seqlens_q/kv hold the real lengths' offsets, cu_seqlens_*_padded the laid-out ones
    (int32, on `device`); max_seqlen_q/kv is the longest padded length (RoPE tables and
    TE's kernels are sized by it). E.g. lengths [3, 5], multiple 4: cu_seqlens [0, 3, 8],
    cu_seqlens_padded [0, 4, 12], max_seqlen 8.
    """
    lengths = [int(n) for n in (lengths.tolist() if torch.is_tensor(lengths) else lengths)]
    if not lengths:
        raise ValueError("packed_seq_params: no sequences (lengths is empty)")
    if multiple < 1:
        raise ValueError(f"packed_seq_params: multiple={multiple} must be >= 1")
    bad = [n for n in lengths if n < 1]
    if bad:
        raise ValueError(f"packed_seq_params: sequence lengths {bad} are not positive: drop empty sequences before packing")
    padded = [-(-n // multiple) * multiple for n in lengths]
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    cu_seqlens_padded = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )


def _layout_offsets(params: PackedSeqParams) -> list[int]:
    """Token offsets of the sequences as laid out (padded when given), checked q == kv (self-attention); read once per
    microbatch and kept on `params` for every layer (and the recomputation in backward)."""
    cached = getattr(params, "layout_offsets", None)
    if cached is not None:
        return cached
    params.layout_offsets = _read_layout_offsets(params)
    return params.layout_offsets


def _read_layout_offsets(params: PackedSeqParams) -> list[int]:
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    if cu_q is None:
        raise ValueError("PackedSeqParams(qkv_format='thd') without cu_seqlens_q: build it with packed_seq_params(lengths)")
    offsets = [int(x) for x in cu_q.tolist()]  # host copy: a handful of integers per microbatch
    if cu_kv is not None and cu_kv is not cu_q and [int(x) for x in cu_kv.tolist()] != offsets:
        raise ValueError("PackedSeqParams: cu_seqlens_kv differs from cu_seqlens_q; self-attention needs the same layout")
    return offsets


def device_offsets(params: PackedSeqParams | None, offsets: list[int], device: torch.device) -> torch.Tensor:
    """The laid-out offsets as int32 on `device`, copied once per microbatch: kept on its PackedSeqParams for every
    layer's call and the recomputation in backward (`parallel.context.host_to_device`: no stream synchronisation)."""
    cached = getattr(params, "device_cu_seqlens", None)
    if cached is not None and cached.device == device and cached.numel() == len(offsets):
        return cached
    out = host_to_device(torch.tensor(offsets, dtype=torch.int32), device)
    if params is not None:
        params.device_cu_seqlens = out
    return out


@functools.lru_cache(maxsize=16)
def _device_cp_order(offsets: tuple[int, ...], cp_size: int, device: str) -> torch.Tensor:
    """`_cp_global_order` on `device`, made once per microbatch layout (every layer and the recomputation in backward
    read it: no host-to-device copy per layer)."""
    return host_to_device(_cp_global_order(list(offsets), cp_size), device)


@functools.lru_cache(maxsize=64)
def _device_chunk_positions(seq_len_padded: int, cp_size: int, cp_rank: int, device: str) -> torch.Tensor:
    """`cp_chunk_indices` on `device`, made once per sequence length (a few KB each)."""
    return host_to_device(cp_chunk_indices(seq_len_padded, cp_size, cp_rank), device)


def _cp_global_order(offsets: list[int], cp_size: int) -> torch.Tensor:
    """Index into the CP-gathered tokens that puts them in global packed order.

    The gather concatenates the ranks' local packs (rank r' first at r' x local_total); within
    a rank, sequence k sits at offsets[k] / CP and holds chunks r' then 2CP - 1 - r'. Returns
    int64 [offsets[-1]]: entry g is where global token g (sequence k, position p) is found.
    """
    local_total = offsets[-1] // cp_size
    pieces = []
    for start, end in pairwise(offsets):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"packed sequence of padded length {length} is not a multiple of 2 x CP = {2 * cp_size}: "
                f"pad each sequence to a multiple of {2 * cp_size} (packed_seq_params(lengths, multiple={2 * cp_size}))"
            )
        chunk = length // (2 * cp_size)
        local_start = start // cp_size
        for j in range(2 * cp_size):
            rank, half = (j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1)
            first = rank * local_total + local_start + half * chunk
            pieces.append(torch.arange(first, first + chunk))
    return torch.cat(pieces)


class LocalCoreAttention(MegatronModule):
    """Core attention for the local spec: causal, packed (block-diagonal causal) and context-parallel.

    Drop-in for megatron's DotProductAttention (same constructor and forward signature).
    Forward steps: 1. (CP > 1) all-gather keys/values over the CP group and put them in
    sequence order; 2. per sequence (THD) or per batch (SBHD), scaled_dot_product_attention
    with the causal mask in global positions; 3. heads flattened: [s, b, np x hn] (SBHD) or
    [t, np x hn] (THD; megatron's Attention reshapes it to [t, 1, h]).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        # DotProductAttention with apply_query_key_layer_scaling divides the scale by the layer number
        # before the matmul and multiplies it back in its fp32 softmax: the net scale is this one.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"softmax_type={config.softmax_type!r} with the local attention: only 'vanilla' softmax is implemented here; "
                "use the Transformer Engine spec (model.transformer_impl=transformer_engine)"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(
                f"window_size={config.window_size} with the local attention: sliding-window attention is not implemented "
                "here; use the Transformer Engine spec (model.transformer_impl=transformer_engine)"
            )

    packed_kernel: str = "per_sequence"
    """Packed (THD) attention: "per_sequence" (one exact SDPA per sequence) or "varlen" (torch's flash varlen
    kernel over the whole microbatch; CUDA, bf16/fp16, CP 1). Set once at build (models.kernels)."""

    varlen_binding = None
    """How the varlen kernel takes its arguments (models.varlen.VarlenBinding; set at build from the installed
    torch's signature, read from it on first use when unset)."""

    @staticmethod
    def varlen_kernel(*args, **kwargs):
        """torch.nn.attention.varlen.varlen_attn (imported on first use: it exists in torch >= 2.9)."""
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(*args, **kwargs)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """query [s, b, np, hn] / key, value [s, b, ng, hn] (or [t, ., .] packed) -> [s, b, np x hn] (or [t, np x hn])."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias with the local attention: use the Transformer Engine spec")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed and attention_mask is not None:
            raise ValueError("packed (THD) sequences take no attention_mask: the mask is given by cu_seqlens")
        if attention_mask is not None and self.cp_size > 1:
            raise ValueError("an explicit attention_mask with context parallelism: pass attention_mask=None (causal)")
        offsets = self._packed_offsets(query, packed_seq_params) if packed else [0, query.shape[0] * self.cp_size]
        if self.cp_size > 1:
            order = _device_cp_order(tuple(offsets), self.cp_size, str(key.device))  # checks the layout before communicating
            key, value = self._gather_over_cp(key, value)
            key, value = key.index_select(0, order), value.index_select(0, order)  # now in sequence order
        if packed:
            return self._packed(query, key, value, offsets, causal, packed_seq_params)
        return self._unpacked(query, key, value, attention_mask, causal)

    def _packed_offsets(self, query: torch.Tensor, params: PackedSeqParams) -> list[int]:
        offsets = _layout_offsets(params)
        if offsets[-1] != query.shape[0] * self.cp_size:
            raise ValueError(
                f"packed query has {query.shape[0]} tokens but cu_seqlens cover {offsets[-1]} tokens over CP={self.cp_size} "
                f"(expected {offsets[-1] // self.cp_size} per rank): cu_seqlens must describe the whole packed sequences"
            )
        return offsets

    def _gather_over_cp(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every CP rank, rank-major along dim 0 (one all-gather; reduce-scatter backward)."""
        stacked = torch.stack([key, value], dim=-1)
        gathered = gather_from_sequence_parallel_region(stacked, tensor_parallel_output_grad=True, group=self.cp_group)
        return gathered[..., 0], gathered[..., 1]

    def _sdpa(self, query, key, value, *, mask=None, causal=False) -> torch.Tensor:
        """[.., np, s, hn] x [.., ng, S, hn] -> [.., np, s, hn] with torch's fused attention."""
        dropout_p = self.dropout_p if self.training else 0.0
        rng = contextlib.nullcontext()
        if dropout_p > 0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            rng = tensor_parallel.get_cuda_rng_tracker().fork()  # as DotProductAttention: TP ranks drop differently
        with rng:
            return F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal and mask is None,
                scale=self.softmax_scale,
                enable_gqa=query.size(-3) != key.size(-3),
            )

    def _unpacked(self, query, key, value, attention_mask, causal: bool) -> torch.Tensor:
        """SBHD: one batch of equal-length rows (with CP: each row one sequence, keys already in sequence order)."""
        seq_len, batch = query.shape[0], query.shape[1]
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.to(torch.bool)  # megatron: True = masked out; torch: True = attend
        elif self.cp_size > 1 and causal:
            mask = self._cp_causal_mask(seq_len * self.cp_size, query.device)
        # As megatron's softmax: one query (decoding against cached keys) sees every key.
        causal = causal and seq_len > 1
        # [s, b, n, hn] -> [b, n, s, hn]
        out = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), mask=mask, causal=causal)
        return out.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

    def _packed(self, query, key, value, offsets: list[int], causal: bool, params: PackedSeqParams | None = None) -> torch.Tensor:
        """THD: block-diagonal (causal) attention, one scaled_dot_product_attention per sequence (or one varlen call)."""
        cp_size = self.cp_size
        if self.packed_kernel == "varlen" and cp_size == 1 and causal and not (self.training and self.dropout_p > 0):
            return self._packed_varlen(query, key, value, offsets, params)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # [n, t, hn]
        outputs = []
        for start, end in pairwise(offsets):
            if end == start:
                continue
            local = slice(start // cp_size, end // cp_size)
            mask = self._cp_causal_mask(end - start, query.device) if cp_size > 1 and causal else None
            outputs.append(self._sdpa(query[:, local], key[:, start:end], value[:, start:end], mask=mask, causal=causal))
        out = torch.cat(outputs, dim=1)  # [np, t, hn]
        return out.transpose(0, 1).reshape(out.shape[1], -1)

    def _packed_varlen(self, query, key, value, offsets: list[int], params: PackedSeqParams | None = None) -> torch.Tensor:
        """THD in one call of a varlen kernel: [t, np, hn] x [t, ng, hn] -> [t, np x hn].

        cu_seqlens are the laid-out (padded) offsets: each sequence's padding sits at its end and is
        causal-masked away from its real tokens, as in the per-sequence path. window_size (-1, 0) is causal.
        """
        binding = self.varlen_binding
        if binding is None:
            from megatron_rl.models.varlen import varlen_binding

            binding, why = varlen_binding()
            if binding is None:
                raise RuntimeError(f"packed attention was built for the varlen kernel, which cannot serve here: {why}")
            self.varlen_binding = binding  # read once (a module built outside models.build)
        cu_seqlens = device_offsets(params, offsets, query.device)
        longest = max(end - start for start, end in pairwise(offsets))
        out = binding.call(self.varlen_kernel, query, key, value, cu_seqlens, longest, self.softmax_scale)
        return out.reshape(out.shape[0], -1)

    def _cp_causal_mask(self, seq_len_padded: int, device: torch.device) -> torch.Tensor:
        """[L / CP, L] bool, True = attend: key position j <= the global position of each local query."""
        positions = _device_chunk_positions(seq_len_padded, self.cp_size, self.cp_group.rank(), str(device))
        return torch.arange(seq_len_padded, device=device)[None, :] <= positions[:, None]


class PackedSelfAttention(SelfAttention):
    """megatron's SelfAttention whose RoPE of a packed (THD) microbatch is models.rope's: one table per microbatch,
    one rotation of the query and one of the key per layer, applied where megatron applies it (after the q / k
    norms, before the core attention). Elsewhere (unpacked rows, context parallelism, interleaved or fused
    RoPE, inference) megatron's own path runs."""

    _rope_table = None
    compiled_rope = False
    """Rotate with models.rope's torch.compile'd pair rotation (model.compile_regions; set at build)."""

    def _packed_rope(self, rotary_pos_emb, packed_seq_params, inference_context):
        """The packed table for this call, or None where megatron's RoPE runs (class docstring)."""
        config = self.config
        if (rotary_pos_emb is None or packed_seq_params is None or packed_seq_params.qkv_format != "thd"
                or inference_context is not None or config.apply_rope_fusion or config.rotary_interleaved
                or config.multi_latent_attention or self.pg_collection.cp.size() > 1):
            return None
        if isinstance(rotary_pos_emb, tuple):
            if rotary_pos_emb[0] is not rotary_pos_emb[1]:
                return None
            rotary_pos_emb = rotary_pos_emb[0]
        if config.no_rope_freq and config.no_rope_freq[self.layer_number - 1]:
            return None
        from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

        from megatron_rl.models.rope import packed_table

        mscale = float(_yarn_get_concentration_factor_from_config(config))
        return packed_table(packed_seq_params, _layout_offsets(packed_seq_params), rotary_pos_emb,
                            config.params_dtype, mscale)

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        table = None
        if not args:
            table = self._packed_rope(kwargs.get("rotary_pos_emb"), kwargs.get("packed_seq_params"),
                                      kwargs.get("inference_context"))
        if table is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._rope_table = table
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rope_table = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope_table is None:
            return qkv
        from megatron_rl.models.rope import rotate, rotate_pair_compiled

        query, key, *rest = qkv
        if self.compiled_rope and self._rope_table[0].shape[-1] == query.shape[-1]:
            return (*rotate_pair_compiled()(query, key, *self._rope_table), *rest)
        return (rotate(query, self._rope_table), rotate(key, self._rope_table), *rest)


def with_local_core_attention(block_spec):
    """A copy of a local-spec decoder block spec whose layers use LocalCoreAttention as core attention.

    Only layers built with megatron's DotProductAttention are changed (the Transformer
    Engine spec keeps TE's attention, which takes THD and CP itself).
    """
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def swap(layer_spec):
        attention = getattr(layer_spec.submodules, "self_attention", None)
        inner = getattr(attention, "submodules", None)
        if getattr(inner, "core_attention", None) is not DotProductAttention:
            return layer_spec
        module = PackedSelfAttention if attention.module is SelfAttention else attention.module
        attention = dataclasses.replace(attention, module=module,
                                        submodules=dataclasses.replace(inner, core_attention=LocalCoreAttention))
        return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention))

    return dataclasses.replace(block_spec, layer_specs=[swap(spec) for spec in block_spec.layer_specs])
