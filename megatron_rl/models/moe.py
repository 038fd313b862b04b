"""The MoE layer's sorted path: top-k routing kept as [tokens, k], one gather each way, no host sync.

megatron-core's router returns dense [tokens, experts] probabilities and a boolean routing
map; its token dispatchers turn them back into per-expert rows with ``masked_select`` (an
output sized by the data: the host waits for the device), copy the per-expert token counts
to the host for the grouped GEMM (another wait), and un-permute with a scatter after several
intermediate copies. Where the experts of a layer all live on this rank (expert parallel x
expert tensor parallel = 1), this path does the same work with:

1. route (`SortedTopKRouter`): gating GEMM, score function, top-k, exactly megatron's
   ``topk_routing_with_score_function`` (softmax before or after the top-k, sigmoid with the
   expert bias, group-limited top-k, scaling, RouterReplay's record / replay) without
   building the dense maps: it returns (probs [T, k], expert ids [T, k]);
2. dispatch (`SortedTokenDispatcher`): one stable sort of the T x k expert ids gives the
   rows in expert order (token-ascending within an expert: megatron's order, so the experts
   see the same batches); token = sorted position // k; each expert's end offset in one
   ``searchsorted`` (int32, what torch._grouped_mm takes: parallel.grouped_gemm_torch reads
   it on the device, no host copy); the hidden states and probabilities gathered once;
3. experts: megatron's GroupedMLP / SequentialMLP, unchanged;
4. combine: each row added back into its token's output (``index_add_``; on CUDA with
   atomics, as megatron's own ``unpermute`` scatter-adds: a token's k contributions sum in an
   unspecified order, exact for k = 2).

Backward: the combine's gradient is one gather of the output gradient, the dispatch's one
``index_add_`` into the input gradient; the probabilities' permutation is inverted by one
``index_copy_``.

`sorted_dispatch_refusal` says where the path does not apply (megatron's dispatcher then
runs); `with_sorted_moe` puts the router into a local layer spec (megatron's MoESubmodules.router)
and `use_sorted_dispatch` gives the built layers the dispatcher.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import group_limited_topk
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


def sorted_dispatch_refusal(config) -> str | None:
    """Why the sorted path cannot serve a TransformerConfig's MoE layers (None: it can)."""
    checks = (
        (config.expert_model_parallel_size * (config.expert_tensor_parallel_size or 1) == 1,
         "experts spread over ranks (expert parallel or expert tensor parallel > 1) need megatron's all-to-all"),
        (config.moe_expert_capacity_factor is None, "token dropping (moe_expert_capacity_factor)"),
        (config.moe_router_load_balancing_type != "sinkhorn", "sinkhorn routing"),
        (not config.moe_router_fusion and not config.moe_permute_fusion, "Transformer Engine's fused router / permute"),
        (not getattr(config, "moe_router_padding_for_quantization", False), "routing padded for quantization"),
        (not getattr(config, "moe_latent_size", None), "latent MoE projections"),
        (not config.moe_shared_expert_overlap, "shared experts overlapped with the dispatch"),
    )
    return next((why for ok, why in checks if not ok), None)


class SortedTopKRouter(TopKRouter):
    """megatron's TopKRouter returning (probs [T, k], expert ids [T, k]) instead of dense [T, E] maps (step 1 of
    the module docstring); aux losses, z-loss, the expert-bias token count and RouterReplay as megatron's."""

    def _choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) of the top-k of `scores` [T, E], group-limited where configured, through RouterReplay."""
        groups, group_topk = self.config.moe_router_num_groups, self.config.moe_router_group_topk

        def compute(values, topk, num_groups=None, group_topk=None):
            if group_topk:
                return group_limited_topk(scores=values, topk=topk, num_tokens=values.shape[0],
                                          num_experts=values.shape[1], num_groups=num_groups, group_topk=group_topk)
            return torch.topk(values, k=topk, dim=1)

        if self.router_replay is None:
            return compute(scores, self.topk, groups, group_topk)
        return self.router_replay.get_replay_topk(scores, self.topk, groups, group_topk, compute)

    def sorted_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [T, k], ids [T, k]): megatron's topk_routing_with_score_function, op for op, without its dense maps."""
        if self.score_function == "softmax":
            if self.config.moe_router_pre_softmax:  # softmax over all experts, then top-k (no renormalisation)
                probs, ids = self._choose(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
            else:  # top-k of the logits, then softmax over the k: softmax -> top-k -> renormalise
                values, ids = self._choose(logits)
                probs = torch.softmax(values, dim=-1, dtype=torch.float32).type_as(logits)
        else:  # sigmoid scores; the expert bias (aux-loss-free balancing) only chooses
            scores = torch.sigmoid(logits.float()).type_as(logits)
            if self.expert_bias is not None:
                _, ids = self._choose(scores + self.expert_bias)
                scores = torch.gather(scores, dim=1, index=ids).type_as(logits)
            else:
                scores, ids = self._choose(scores)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if self.topk > 1 else scores
        if self.config.moe_router_topk_scaling_factor:
            probs = probs * self.config.moe_router_topk_scaling_factor
        return probs, ids

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron's TopKRouter.routing with sparse outputs: (probs [T, k], ids [T, k])."""
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, ids = self.sorted_topk(logits)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routing_map, scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=False, padding_mask=padding_mask)
            with_padding = padding_mask is not None
            probs = self._apply_aux_loss(probs, scores, routing_map, with_padding_mask=with_padding)
            probs = self._apply_seq_aux_loss(probs, scores, routing_map, seq_length, bsz, with_padding_mask=with_padding)
            probs = self._apply_global_aux_loss(probs, scores, routing_map, with_padding_mask=with_padding)
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():  # megatron's _apply_expert_bias: the tokens sent to each expert, padding left out
                counted = torch.ones_like(ids, dtype=self.local_tokens_per_expert.dtype)
                if padding_mask is not None:
                    counted = counted * (~padding_mask)[:, None]
                self.local_tokens_per_expert.scatter_add_(0, ids.reshape(-1), counted.reshape(-1))
        return probs, ids


class _PermuteRows(torch.autograd.Function):
    """x[order] for a permutation `order` of x's rows; backward: the gradient put back with one index_copy_."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.new_empty(grad.shape).index_copy_(0, order, grad), None


class SortedTokenDispatcher(MoETokenDispatcher):
    """Steps 2 and 4 of the module docstring, for experts all on this rank."""

    def __init__(self, num_local_experts: int, config, pg_collection) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size * self.ep_size != 1:
            raise ValueError(f"the sorted MoE dispatch serves experts on one rank; this layer has expert parallel "
                             f"{self.ep_size} x expert tensor parallel {self.tp_size}: use megatron's token dispatcher")
        self.num_experts = num_local_experts
        self.topk = config.moe_router_topk
        self._bounds: dict[torch.device, torch.Tensor] = {}

    def _expert_bounds(self, device: torch.device) -> torch.Tensor:
        """[0, 1, ..., E] on `device`, made once: searchsorted's queries for each expert's first row."""
        if device not in self._bounds:
            self._bounds[device] = torch.arange(self.num_experts + 1, device=device)
        return self._bounds[device]

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """hidden [.., H], expert ids [T, k] (the router's second output), probs [T, k] -> rows and probs in expert order."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        experts, order = torch.sort(routing_map.reshape(-1), stable=True)
        starts = torch.searchsorted(experts, self._expert_bounds(experts.device), out_int32=True)  # [E + 1]
        self.tokens_per_expert = starts[1:] - starts[:-1]
        self.tokens_per_expert.grouped_mm_offsets = starts[1:]  # each expert's end row (torch._grouped_mm's offs)
        self.token_of_row = torch.div(order, self.topk, rounding_mode="floor")
        return hidden.index_select(0, self.token_of_row), _PermuteRows.apply(probs.reshape(-1), order)

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        """Expert rows [T x k, H] -> [.., H]: each row added into its token's output."""
        tokens = self.hidden_shape.numel() // self.hidden_shape[-1]
        out = hidden_states.new_zeros(tokens, hidden_states.shape[-1]).index_add_(0, self.token_of_row, hidden_states)
        self.token_of_row = None
        return out.view(self.hidden_shape)


def use_sorted_dispatch(model) -> int:
    """Give every MoE layer of a built model whose router is a SortedTopKRouter the sorted dispatcher (in place of the
    one megatron built from moe_token_dispatcher_type, with its process groups); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and isinstance(m.router, SortedTopKRouter)]
    for layer in layers:
        built = layer.token_dispatcher
        groups = types.SimpleNamespace(ep=built.ep_group, expt_tp=built.tp_group, tp_ep=built.tp_ep_group)
        layer.token_dispatcher = SortedTokenDispatcher(layer.num_local_experts, layer.config, groups)
    return len(layers)


def with_sorted_moe(block_spec):
    """A copy of a local-spec decoder block spec whose MoE layers route with SortedTopKRouter; the built model then
    needs `use_sorted_dispatch` (megatron's dispatchers take dense routing maps, and refuse the router's ids)."""

    def swap(layer_spec):
        mlp = getattr(layer_spec.submodules, "mlp", None)
        if getattr(mlp, "module", None) is not MoELayer:
            return layer_spec
        moe = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=SortedTopKRouter))
        return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=moe))

    return dataclasses.replace(block_spec, layer_specs=[swap(spec) for spec in block_spec.layer_specs])


__all__ = ["SortedTokenDispatcher", "SortedTopKRouter", "sorted_dispatch_refusal", "use_sorted_dispatch", "with_sorted_moe"]
