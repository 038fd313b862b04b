"""The actor: a megatron-core policy on any TP/PP/EP/DP layout, its optimizer, and one RL training step.

    actor = Actor.from_config(cfg, ctx)               # model (+ frozen reference when beta > 0), optimizer, LR schedule
    batch = actor.distribute(train_batch_from_rollouts(padded, advantages) if rank == 0 else None)
    batch, metrics = actor.prepare_batch(batch)       # old logprobs (+ R2 routes, + reference logprobs), but the
                                                      # first mini-batch's: its training forward's own
    metrics |= actor.train_step(batch)                # mini-batches x microbatches -> optimizer steps
    for bucket in actor.export_hf_weights(512 << 20): # weight sync, HF names
        ...

train_step, per mini-batch (one optimizer step):
  1. plan: this rank's microbatches (actor.microbatches), the same count M on every DP rank,
     made by plan.rank_microbatches for a share and a whole batch alike (a share keeps
     every field of the plan: packing, CP chunking, widths; checked field by field);
  2. the step's global token / sequence counts: ONE all-reduce over DP x CP
     (algorithms.compute_loss_denominators), before the first microbatch,
     without the tokens an importance-sampling correction drops;
  3. megatron's forward_backward_func over the M microbatches (actor.schedule): forward (with
     routing replay set per microbatch), vocab-parallel logprobs, the loss from
     the algorithms registry times M x D (see actor.step for why), backward;
     finalize_model_grads reduces gradients over DP;
  4. LR schedule step, optimizer step (gradient clipping inside), metrics.

The old policy (train.old_logprobs, config.schema.old_logprobs_source): the first mini-batch's optimizer
step runs at the old policy's weights, so its training forward's own logprobs, detached, are its old
logprobs (the ratio exactly 1, the gradient the same) and prepare_batch's forward covers only the other
mini-batches' rows: with one mini-batch, one forward of three per step is not run. Their finiteness is
checked after the backward and before the optimizer steps.

Data: rank 0 holds the step's batch; `actor.distribute` gives every rank only
its DP rank's rows (actor.distribute), and logprobs come back as that share's
[B/D, T] tensors (summed over its TP x PP group only); R2 routes stay on the
rank whose routers computed them (routing.RankRoutes); metrics are
small reductions, identical on every rank. A whole batch given to every rank
also works (each rank trains its rows; results are assembled over DP).
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch

from megatron_rl.actor.batch import BatchError, PackedRoutes, TrainBatch, check_finite, validate_batch
from megatron_rl.actor.distribute import scatter_shares
from megatron_rl.actor.packing import layout_metrics
from megatron_rl.actor.optim import build_optimizer, build_scheduler, ddp_config, load_sharded_state, sharded_state
from megatron_rl.actor.microbatches import Microbatch, PlanMismatch, plan_step, rank_microbatches
from megatron_rl.actor.routing import RankRoutes, RouteRecorder, RoutingControl
from megatron_rl.actor.schedule import forward_logprobs, run_schedule
from megatron_rl.actor.step import (
    LogprobSettings,
    loss_scale,
    microbatch_inputs,
    policy_loss,
    reduce_step_metrics,
    refuse_nonfinite_own_logprobs,
)
from megatron_rl.algorithms import (
    compute_loss_denominators,
    get_is_correction,
    get_policy_loss,
    merge_metrics,
    rejection_response_mask,
)
from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.core import ConfigError
from megatron_rl.config.schema import ModelConfig, OptimizerConfig, TrainConfig, old_logprobs_source
from megatron_rl.heap import collect_after_close
from megatron_rl.models import build_model, export_hf_weights, load_hf_config, parse_hf_config, resolve_dtype
from megatron_rl.models.info import model_info
from megatron_rl.models.build import announce


class LogprobsWithRoutes(NamedTuple):
    """`Actor.compute_logprobs(..., record_routes=True)`."""

    logprobs: torch.Tensor
    """[B, T] float32, token-aligned (0 at position 0 and on padding)."""
    routed_experts: "torch.Tensor | RankRoutes"
    """R2: `RankRoutes`, the experts this rank's routers used (its layers and tokens; the whole
    [B, T, L, K] int16 tensor with `.gather(actor.route_groups(batch))`); under R3 the engine's
    routes that the forward replayed, as the batch held them (a share's: this rank's `RankRoutes`)."""
    metrics: dict[str, float]
    """routing/engine_vs_trainer/... when the batch carries engine routes."""


class Actor:
    """Policy model, optimizer and LR schedule on this rank; see the module docstring."""

    def __init__(
        self,
        ctx,
        *,
        model: ModelConfig,
        optimizer: OptimizerConfig,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        temperature: float = 1.0,
        total_optimizer_steps: int | None = None,
        max_response_tokens: int = 0,
        hf_config: dict | None = None,
        load_weights: bool = True,
    ) -> None:
        """load_weights=False: the policy keeps its seeded initial weights instead of reading model.path's (a resume
        overwrites every one of them); the reference model (algorithm.beta > 0) reads them either way."""
        if ctx.cp_size > 1 and not train.pack_sequences:
            raise ConfigError(
                f"parallel.context_parallel={ctx.cp_size} splits packed sequences over CP ranks: set train.pack_sequences=true"
            )
        if ctx.cp_size > 1 and algorithm.tis_mode != "none" and get_is_correction(algorithm.tis_mode).level == "sequence":
            raise ConfigError(
                f"algorithm.tis_mode={algorithm.tis_mode} weighs whole sequences, which parallel.context_parallel="
                f"{ctx.cp_size} splits over ranks: use a token-level tis_mode, or context_parallel=1"
            )
        if temperature <= 0:
            raise ConfigError(f"temperature={temperature}: must be > 0 (rollout.temperature)")
        train.validate()
        algorithm.validate()
        self.old_logprobs_from, self.old_logprobs_why = old_logprobs_source(train, algorithm)
        """"training_forward", "forward" or "rollout" (config.schema.old_logprobs_source), and why."""
        announce(f"old-policy logprobs: {self.old_logprobs_why}")
        self.ctx, self.model_cfg, self.train_cfg, self.algorithm = ctx, model, train, algorithm
        self.hf_config = hf_config if hf_config is not None else load_hf_config(model.path)
        self.arch = parse_hf_config(self.hf_config)
        self.dtype = resolve_dtype(model)
        self.loss_fn = get_policy_loss(algorithm.loss)
        self.max_response_tokens = max_response_tokens or algorithm.max_response_tokens
        if algorithm.routing_replay != "none" and not self.arch.num_experts:
            raise ConfigError(f"algorithm.routing_replay={algorithm.routing_replay} needs an MoE model; {model.path} is dense: set it to none")

        overrides: dict = {}
        self._uniform_shapes = ctx.pp_size > 1 and model.token_dispatcher == "allgather"
        if ctx.pp_size > 1 and not self._uniform_shapes:
            overrides["variable_seq_lengths"] = True  # microbatches of different widths through the pipeline
        policy_overrides = dict(overrides, moe_enable_routing_replay=True) if self.arch.num_experts else overrides
        from megatron_rl.models.kernels import choose_overlap, detect_kernels, packed_params_device

        overlap, _ = choose_overlap(detect_kernels(), ctx.dp_size)
        self.model = build_model(
            model, ctx, hf_config=self.hf_config, wrap_ddp=True, ddp_config=ddp_config(optimizer, overlap_grad_reduce=overlap),
            config_overrides=policy_overrides, load_weights=None if load_weights else False,
        )
        self.routing = RoutingControl(self.model, self.arch, ctx)
        self._params_device = packed_params_device(model_info(self.model).use_te, ctx.device)
        self.optimizer = build_optimizer(optimizer, self.model, dtype=self.dtype)
        steps = total_optimizer_steps or max(1, train.steps * train.mini_batches_per_step)
        self.scheduler = build_scheduler(optimizer, self.optimizer, total_optimizer_steps=steps)
        self.reference = None
        if algorithm.beta > 0:  # a frozen copy of the initial policy: no DDP, no optimizer, no replay
            self.reference = build_model(model, ctx, hf_config=self.hf_config, wrap_ddp=False, config_overrides=overrides)
            for chunk in self.reference:
                chunk.eval()
                chunk.requires_grad_(False)
        self.settings = LogprobSettings(ctx.tp_group, ctx.tp_rank, self.arch.vocab_size, temperature)
        self.optimizer_steps = 0
        # Each sequence (packed) or row (padded) is padded to a multiple of TP under sequence
        # parallelism (each TP rank holds 1/TP of the positions) and of 2 x CP (load-balanced chunks).
        self._width_multiple = (ctx.tp_size if ctx.sequence_parallel else 1) * (2 * ctx.cp_size if ctx.cp_size > 1 else 1)
        self.last_share_bytes = 0
        """Bytes of the last batch share this rank received (`distribute`)."""
        self.max_staleness = max(train.max_staleness, train.off_policy_lag)
        """Response tokens sampled more weight versions before the batch's policy_version leave the loss."""

    @classmethod
    def from_config(cls, cfg, ctx, *, load_weights: bool = True) -> "Actor":
        """An actor for an RLConfig (temperature from rollout, Dr. GRPO's constant from rollout.max_new_tokens)."""
        return cls(
            ctx,
            load_weights=load_weights,
            model=cfg.model,
            optimizer=cfg.optimizer,
            train=cfg.train,
            algorithm=cfg.algorithm,
            temperature=cfg.rollout.temperature,
            max_response_tokens=cfg.algorithm.max_response_tokens or cfg.rollout.max_new_tokens,
        )

    # -- checks and plans ---------------------------------------------------------------------------

    def validate(self, batch: TrainBatch, *, step: bool = False) -> torch.Tensor:
        """validate_batch against this model; returns the [B] sequence lengths. step: the step's batch that
        `distribute` shares out, the only one that may hold `PackedRoutes`."""
        if not step and isinstance(batch.routed_experts, PackedRoutes):
            raise BatchError("batch.routed_experts are packed by sample (Rollouts.to_padded(pack_routes=True): the trainer's step batch), "
                             "for actor.distribute: give the step's batch to actor.distribute and train the share it returns")
        validate_batch(
            batch,
            vocab_size=self.arch.vocab_size,
            max_positions=self.arch.max_position_embeddings,
            num_moe_layers=self.routing.num_moe_layers,
            topk=self.arch.moe_topk,
            num_experts=self.arch.num_experts,
            complete_routes={"R2": ("old_routed_experts",), "R3": ("routed_experts",)}.get(self.algorithm.routing_replay, ()),
        )
        return batch.lengths()

    def _step_plan(self, step_lengths: torch.Tensor) -> list[list[list[Microbatch]]]:
        """plan[mini_batch][dp_rank]: the step's microbatches, rows indexed in the step's batch."""
        ctx = self.ctx
        return plan_step(
            step_lengths.tolist(),
            mini_batches=self.train_cfg.mini_batches_per_step,
            dp_size=ctx.dp_size,
            micro_batch_size=self.train_cfg.micro_batch_size,
            max_tokens_per_microbatch=self.train_cfg.max_tokens_per_microbatch,
            width_multiple=self._width_multiple,
            equal_shapes_across_dp=self.model_cfg.token_dispatcher == "allgather" and ctx.ep_size > 1,
            uniform_shapes=self._uniform_shapes,
            pack_sequences=self.train_cfg.pack_sequences,
        )

    def _inputs(self, batch: TrainBatch, mb: Microbatch, lengths: torch.Tensor, *, with_loss_inputs: bool):
        ctx = self.ctx
        return microbatch_inputs(batch, mb, lengths, ctx.device, with_loss_inputs=with_loss_inputs,
                                 multiple=self._width_multiple, cp_size=ctx.cp_size, cp_rank=ctx.cp_rank,
                                 max_staleness=self.max_staleness, params_device=self._params_device)

    def distribute(self, batch: TrainBatch | None) -> TrainBatch:
        """This rank's share of the step's batch: rank 0 passes the step's batch, every other rank None.

        Rows go to DP ranks as the plan assigns them (balanced by tokens per mini-batch);
        only rank 0 ever holds the whole step (actor.distribute). The bytes this rank
        received are in `last_share_bytes`. Under R3 the share's engine routes (`PackedRoutes` from the
        trainer, or [B/D, T, L, K]) become the `RankRoutes` this rank's routers replay (`routing.replay_routes`:
        its sequence-parallel slice and CP chunks of its rows, its stage's MoE layers); with TP x PP x CP peers
        the leader cuts each peer's and sends it only that.
        """

        def assign(whole: TrainBatch) -> list[list[int]]:
            plan = self._step_plan(self.validate(whole, step=True))
            return [sorted(r for mini in plan for mb in mini[d] for r in mb.rows if r >= 0) for d in range(self.ctx.dp_size)]

        r3, ctx, routing = self.algorithm.routing_replay == "R3", self.ctx, self.routing
        peers = routing.share_peers() if r3 and ctx.share_group is not None else None

        def split(share: TrainBatch):  # R3, on the share group's leader: each peer's cut of the routes
            return routing.split_share(share, self._my_microbatches(share), self._width_multiple, peers)

        share, self.last_share_bytes = scatter_shares(batch, ctx, assign, split=split if peers else None)
        routes = share.routed_experts
        if r3 and isinstance(routes, (torch.Tensor, PackedRoutes)):  # no peers: this rank cuts its own
            share = share.replace(routed_experts=routing.share_cut(share, self._my_microbatches(share), self._width_multiple))
        elif isinstance(routes, PackedRoutes):  # kept for the routing metrics: the share's [B/D, T, L, K]
            share = share.replace(routed_experts=routes.to_padded(share.seq_len))
        return share

    def _my_microbatches(self, batch: TrainBatch) -> list[list[Microbatch]]:
        """This rank's microbatches per mini-batch, rows indexed in `batch` (a share or the whole step).

        Both cases go through `plan.rank_microbatches` from the same step plan, so a share keeps
        every property of the plan (packing, CP chunking, widths) and is checked against it.
        """
        if batch.row_ids is None:
            step_lengths, row_ids = batch.lengths(), None
        else:
            if batch.step_lengths is None:
                raise BatchError("batch.row_ids is set without batch.step_lengths: make shares with actor.distribute")
            step_lengths, row_ids = batch.step_lengths, batch.row_ids.tolist()
        plan = self._step_plan(step_lengths)
        if row_ids is not None:
            planned = {r for mini in plan for mb in mini[self.ctx.dp_rank] for r in mb.rows if r >= 0}
            if planned != set(row_ids):
                raise BatchError(
                    f"this share holds step rows {sorted(row_ids)[:8]}..., but DP rank {self.ctx.dp_rank}'s plan trains rows "
                    f"{sorted(planned)[:8]}...: the share was made for another rank or another plan; make shares with "
                    "actor.distribute on the same actor settings"
                )
        try:
            return [rank_microbatches(mini[self.ctx.dp_rank], row_ids) for mini in plan]
        except PlanMismatch as exc:
            raise BatchError(str(exc)) from None

    def _replay_source(self, batch: TrainBatch) -> torch.Tensor | None:
        mode = self.algorithm.routing_replay
        if mode == "R2":
            if batch.old_routed_experts is None:
                raise BatchError(
                    "algorithm.routing_replay=R2 needs batch.old_routed_experts, the routes of the old-policy forward: "
                    "get them from actor.compute_logprobs(batch, record_routes=True) (actor.prepare_batch does this)"
                )
            return batch.old_routed_experts
        if mode == "R3":
            if batch.routed_experts is None:
                raise BatchError(
                    "algorithm.routing_replay=R3 needs batch.routed_experts from the rollout engine: "
                    "set rollout.return_routed_experts=true (and routed_experts_include_prompt=true)"
                )
            return batch.routed_experts
        return None

    # -- forwards -------------------------------------------------------------------------------------

    @torch.no_grad()
    def _forward_logprobs(self, batch: TrainBatch, *, reference_model: bool, record: bool, replay, drift_reference,
                          first_mini_batch: int = 0):
        """Forward-only pass over this rank's rows (`schedule.forward_logprobs`); (logprobs [B, T], recorded routes
        or None) aligned with `batch`."""
        routing = None if reference_model else self.routing
        recorded = None
        if record and routing is not None and routing.num_moe_layers:  # kept on this rank: no collective
            recorded = RouteRecorder((batch.batch_size, batch.seq_len), routing.num_moe_layers, self.arch.moe_topk, self.arch.num_experts)
        logprobs = forward_logprobs(
            self.reference if reference_model else self.model, batch, self._my_microbatches(batch)[first_mini_batch:],
            lambda mb, lengths: self._inputs(batch, mb, lengths, with_loss_inputs=False), self.settings, self.ctx,
            routing=routing, record=record, recorder=recorded, replay=replay, drift_reference=drift_reference,
        )
        routes = recorded.finish(routing.layer_ids) if recorded is not None else None
        return logprobs, routes

    def route_groups(self, batch: TrainBatch) -> list:
        """The groups over which `RankRoutes.gather` assembles `batch`'s whole routes (TP x PP, CP, and DP
        for a whole batch): a collective for inspection, not used in training."""
        ctx = self.ctx
        return [ctx.model_parallel_group, ctx.cp_group if ctx.cp_size > 1 else None,
                ctx.dp_group if batch.row_ids is None and ctx.dp_size > 1 else None]

    def compute_logprobs(self, batch: TrainBatch, *, record_routes: bool = False, skip_first_mini_batch: bool = False):
        """log pi_theta of every token under the current policy, no gradient ([B, T], on every rank).

        With algorithm.routing_replay=R3 the forward replays batch.routed_experts (so
        that the old policy and the training forward route alike). With
        record_routes=True (R2) returns `LogprobsWithRoutes`: the logprobs, the
        experts this rank's routers used (`RankRoutes`, kept where they were
        computed, for train_step to replay there), and, when the batch carries engine
        routes, per layer and overall: ``routing/engine_vs_trainer`` (fraction of
        tokens whose top-k set from the trainer's own router differs from the
        engine's) and ``routing/engine_vs_trainer_used`` (the same for the experts
        the forward used: 0 under R3 replay). skip_first_mini_batch: the rows of the step's first mini-batch
        are not computed (0, no routes): its training forward supplies them (train.old_logprobs).
        """
        self.validate(batch)
        replay = batch.routed_experts if self.algorithm.routing_replay == "R3" else None
        if replay is None and self.algorithm.routing_replay == "R3":
            self._replay_source(batch)  # raises with the fix
        drift_reference = batch.routed_experts if record_routes else None
        logprobs, routes = self._forward_logprobs(
            batch, reference_model=False, record=record_routes and replay is None, replay=replay, drift_reference=drift_reference,
            first_mini_batch=1 if skip_first_mini_batch else 0,
        )
        self._check_model_output(batch, logprobs, "policy")
        if not record_routes:
            return logprobs
        metrics = {}
        if self.routing.num_moe_layers:
            metrics = self.routing.take_drift_metrics("routing/engine_vs_trainer_used", own_prefix="routing/engine_vs_trainer")
        if routes is None and replay is not None:
            routes = replay  # the engine's, as they came (int8 / int16): no copy
        return LogprobsWithRoutes(logprobs, routes, metrics)

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log pi_ref of every token under the frozen reference model ([B, T], every rank); needs algorithm.beta > 0."""
        if self.reference is None:
            raise ConfigError("compute_ref_logprobs: there is no reference model (algorithm.beta=0 skips it)")
        self.validate(batch)
        logprobs, _ = self._forward_logprobs(batch, reference_model=True, record=False, replay=None, drift_reference=None)
        self._check_model_output(batch, logprobs, "reference")
        return logprobs

    def _check_model_output(self, batch: TrainBatch, logprobs: torch.Tensor, which: str) -> None:
        check_finite(batch, f"{which} logprobs", logprobs,
                     fix=f"the {which} model's forward produced NaN/inf: its weights or activations diverged (lower the lr, check the checkpoint)")

    def prepare_batch(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """Fill old_logprobs (+ old_routed_experts under R2, + ref_logprobs when beta > 0); returns (batch, metrics).

        With algorithm.bypass_mode the engine's logprobs are the old policy and no forward runs for it. Where the
        first mini-batch's training forward is the old policy (`old_logprobs_from` "training_forward",
        train.old_logprobs) the forward covers only the other mini-batches' rows (the first's old_logprobs
        are left 0: train_step takes its own forward's, detached), and none runs with one mini-batch
        (old_logprobs stay None).
        """
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.algorithm.bypass_mode:
            if batch.rollout_logprobs is None:
                raise BatchError("algorithm.bypass_mode needs batch.rollout_logprobs (the engine's logprobs serve as the old policy)")
            batch = batch.replace(old_logprobs=batch.rollout_logprobs)
            if self.reference is not None:
                batch = batch.replace(ref_logprobs=self.compute_ref_logprobs(batch))
            metrics["time/old_logprobs_s"] = time.perf_counter() - t0
            return batch, metrics
        first_old_from_training = self.old_logprobs_from == "training_forward"
        if first_old_from_training and self.train_cfg.mini_batches_per_step == 1:
            self.validate(batch)
            batch = batch.replace(old_logprobs=None, old_routed_experts=None, old_logprobs_first_from_training=True)
            if self.reference is not None:
                batch = batch.replace(ref_logprobs=self.compute_ref_logprobs(batch))
            metrics["time/old_logprobs_s"] = time.perf_counter() - t0
            return batch, metrics
        record = self.routing.num_moe_layers > 0 and (
            self.algorithm.routing_replay == "R2" or self.train_cfg.routing_drift_metrics or batch.routed_experts is not None
        )
        result = self.compute_logprobs(batch, record_routes=record, skip_first_mini_batch=first_old_from_training)
        if record:
            batch = batch.replace(old_logprobs=result.logprobs, old_routed_experts=result.routed_experts)
            metrics.update(result.metrics)
        else:
            batch = batch.replace(old_logprobs=result)
        batch = batch.replace(old_logprobs_first_from_training=first_old_from_training)
        if self.reference is not None:
            batch = batch.replace(ref_logprobs=self.compute_ref_logprobs(batch))
        metrics["time/old_logprobs_s"] = time.perf_counter() - t0
        return batch, metrics

    # -- training -------------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step: train.mini_batches_per_step optimizer steps over the batch; metrics on every rank.

        Metrics: the loss's (algorithms.losses; ``/sum`` keys summed over the step's
        mini-batches, means exact over every token of the step), ``grad_norm`` (mean
        over mini-batches, before clipping) and ``grad_norm/max``, ``lr`` (of the last
        optimizer step), ``microbatches_per_rank``, ``optimizer_steps``, and for MoE
        models with old-policy or engine routes in the batch ``routing/drift`` (per
        layer ``routing/drift/layer_l``: fraction of tokens whose experts used in the
        training forward differ, as a set, from the old policy's; 0 under replay) and
        ``routing/drift_own`` (the router's own top-k instead of the used experts).
        With batch.token_versions and batch.policy_version: ``async/token_staleness`` (mean
        over response tokens) and ``/max``, and ``async/stale_tokens_masked/sum``, the tokens
        more than `max_staleness` versions old, which leave the loss and its denominators.
        """
        t0 = time.perf_counter()
        first_old_from_training = batch.old_logprobs_first_from_training  # the first mini-batch's old logprobs: its own (prepare_batch)
        if first_old_from_training and self.old_logprobs_from != "training_forward":
            raise BatchError(f"the batch leaves the first mini-batch's old logprobs to its training forward, but this actor takes "
                             f"them from {self.old_logprobs_why}: prepare the batch with this actor")
        if batch.old_logprobs is None and not (first_old_from_training and self.train_cfg.mini_batches_per_step == 1):
            raise BatchError("batch.old_logprobs is missing: compute them with actor.compute_logprobs(batch) (actor.prepare_batch)")
        if self.algorithm.beta > 0 and batch.ref_logprobs is None:
            raise BatchError(f"algorithm.beta={self.algorithm.beta} needs batch.ref_logprobs: use actor.prepare_batch(batch)")
        lengths = self.validate(batch)
        r2_without_old_routes = first_old_from_training and self.algorithm.routing_replay == "R2" and batch.old_routed_experts is None
        replay = None if r2_without_old_routes else self._replay_source(batch)
        drift_reference = batch.old_routed_experts if batch.old_routed_experts is not None else batch.routed_experts
        loss_metrics, step_metrics = [], {"grad_norm": [], "lr": [], "microbatches": []}
        for index, microbatches in enumerate(self._my_microbatches(batch)):
            old_from_training = first_old_from_training and index == 0
            # the training forward at the old policy's weights routes as the old policy did: nothing to replay under
            # R2, and no drift from the old routes (none were recorded for these rows)
            mini_batch_replay = None if old_from_training and self.algorithm.routing_replay == "R2" else replay
            mini_batch_drift_reference = None if old_from_training and batch.old_routed_experts is not None else drift_reference
            metrics, grad_norm = self._optimizer_step(batch, lengths, microbatches, mini_batch_replay, mini_batch_drift_reference,
                                                      old_from_training)
            loss_metrics.append(metrics)
            step_metrics["grad_norm"].append(grad_norm)
            step_metrics["lr"].append(self.optimizer.param_groups[0]["lr"])
            step_metrics["microbatches"].append(len(microbatches))
        out = reduce_step_metrics(loss_metrics, self.ctx)
        out["grad_norm"] = sum(step_metrics["grad_norm"]) / len(step_metrics["grad_norm"])
        out["grad_norm/max"] = max(step_metrics["grad_norm"])
        out["lr"] = step_metrics["lr"][-1]
        out["microbatches_per_rank"] = float(sum(step_metrics["microbatches"]))
        out["optimizer_steps"] = float(self.optimizer_steps)
        if self.routing.num_moe_layers and drift_reference is not None:
            if batch.old_routed_experts is None:  # the engine's routes against the training forward's (at the old weights)
                out.update(self.routing.take_drift_metrics("routing/engine_vs_trainer_used", own_prefix="routing/engine_vs_trainer"))
            else:
                out.update(self.routing.take_drift_metrics("routing/drift", own_prefix="routing/drift_own"))
        out["time/train_step_s"] = time.perf_counter() - t0
        return out

    def _optimizer_step(self, batch, lengths, microbatches, replay, drift_reference, old_from_training=False) -> tuple[dict, float]:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        ctx = self.ctx
        items = [self._inputs(batch, mb, lengths, with_loss_inputs=True) for mb in microbatches]
        if old_from_training:  # the old policy is this forward's own (policy_loss): the batch holds none for these rows
            for item in items:
                item.old_logprobs = None
        # The step's global counts: one all-reduce over DP x CP, before the first microbatch.
        algo = self.algorithm
        # Whole rows' masks (under CP every CP rank holds the same rows), summed over DP: each sequence once.
        masks = [
            item.sequence_mask if algo.tis_mode == "none" or old_from_training  # old_from_training: the correction drops nothing
            else rejection_response_mask(algo, item.old_logprobs, item.rollout_logprobs, item.sequence_mask)
            for item in items
        ]
        denom = compute_loss_denominators(masks, group=ctx.dp_group, max_response_tokens=self.max_response_tokens)
        if ctx.cp_size > 1:  # sequence-level terms sum each row over its CP ranks
            denom = dataclasses.replace(denom, context_parallel_group=ctx.cp_group, context_parallel_rank=ctx.cp_rank)
        scale = loss_scale(len(items), ctx.dp_size)
        routing = self.routing

        def forward_step(data_iterator, model):
            inputs = next(data_iterator)
            routing.begin_microbatch(inputs.layout, lengths, replay=replay, reference=drift_reference)
            output = model(inputs.tokens, inputs.position_ids, attention_mask=None, packed_seq_params=inputs.layout.packed_seq_params)
            routing.end_microbatch()
            return output, policy_loss(
                inputs, self.settings, loss_fn=self.loss_fn, algorithm_cfg=self.algorithm, denom=denom, scale=scale,
                compute_entropy=self.train_cfg.compute_entropy, count_nonfinite=old_from_training,
            )

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        try:
            outputs = run_schedule(self.model, items, forward_step, forward_only=False)
        finally:
            routing.reset()
            clear_aux_losses_tracker()
        if old_from_training:
            refuse_nonfinite_own_logprobs(outputs, self.ctx.device)
        self.scheduler.step(increment=1)  # optimizer step k runs at the schedule's rate for k
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron's optimizer skipped the step (non-finite gradients): the loss or the model diverged")
        self.optimizer_steps += 1
        if not outputs:  # not the last pipeline stage: its metrics are not reported
            return {}, float(grad_norm) if grad_norm is not None else float("nan")
        return {**merge_metrics(outputs), **layout_metrics(items, lengths, ctx.device)}, float(grad_norm) if grad_norm is not None else float("nan")

    # -- state --------------------------------------------------------------------------------------

    def state_dict(self, *, is_loading: bool = False, optimizer_format: str = "dp_reshardable") -> dict:
        """Model chunks (``model{i}``) and optimizer (``optimizer``) as one megatron sharded state dict (dist
        checkpointing): `optim.sharded_state`. optimizer_format: megatron's sharding type of the optimizer state
        (checkpoint.optimizer_format; a load must use the one the checkpoint was saved with)."""
        return sharded_state(self.model, self.optimizer, is_loading=is_loading, optimizer_format=optimizer_format)

    def load_state_dict(self, state: dict) -> None:
        """Load what `state_dict(is_loading=True)` described, after dist checkpointing filled it (`optim.load_sharded_state`)."""
        load_sharded_state(self.model, self.optimizer, state)

    def schedule_state(self) -> dict:
        """The LR schedule and optimizer-step counter (small, JSON-serialisable; the same on every rank)."""
        return {"scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_schedule_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = state["optimizer_steps"]

    # -- weights --------------------------------------------------------------------------------------

    def export_hf_weights(self, bucket_bytes: int, *, dst_rank: int = 0, fresh: bool = True):
        """HF-named weight buckets for weight sync (models.export_hf_weights; every rank must iterate). fresh=False:
        the pushing rank's own tensors as views of its parameters, for a push that copies each bucket at once."""
        return export_hf_weights(self.model, self.ctx, bucket_bytes=bucket_bytes, dst_rank=dst_rank, fresh=fresh)

    def close(self) -> None:
        """Release the actor's device memory and its hold on megatron's globals; the actor is unusable after.

        1. routing hooks and this model's entries in megatron's global RouterReplay list;
        2. every storage of the model, its gradient buffers, the optimizer's main parameters and moments,
           and the reference model, freed in place (``resize_(0)``): megatron's DDP registers a
           backward hook per parameter on autograd's gradient accumulators, which can outlive the
           Python objects, so dropping references alone does not return the bytes;
        3. the references themselves (DDP's accumulators, the config's bound DDP/optimizer functions).
        """
        self.routing.close()
        if getattr(self, "model", None) is None:
            return
        from megatron_rl.actor.offload import free_device_memory

        free_device_memory(list(self.model) + list(self.reference or []), self.optimizer)
        self.model, self.reference, self.optimizer, self.scheduler = None, None, None, None
        collect_after_close()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["Actor", "LogprobsWithRoutes"]
