"""The actor's training step gives the single-rank whole-batch gradient on every layout, for every loss.

One batch (12 sequences of 10-40 tokens, uneven prompts, one row without
response tokens, temperature 0.8, a vocabulary of 200 padded to 256 by
megatron) is trained for one optimizer step with SGD at lr 1, no clipping, no
momentum: the parameter update is minus the gradient. For gspo, gspo_token,
dapo, dr_grpo and grpo (grpo with a KL term to the frozen reference model), the update
on TP2, PP2, EP2 (allgather dispatcher, token-budget packing), DP2 x 3
microbatches, TP2xEP2 and TP2xPP2xEP2 (token budget) must equal the single-rank run
on the whole batch in ONE microbatch within 1e-5 relative; the microbatches of
the split layouts hold different numbers of tokens. TP2's logprobs must equal
the single rank's within 1e-5. Three more layouts (TP2xPP2, DP2xTP2, DP4: D = 1,
2, 4) get the batch as the trainer gives it: only rank 0 holds it and
actor.distribute sends each rank its DP rank's rows; the bytes each rank
receives must shrink as 1/D. Packed microbatches (THD, a 64-token budget that
the 40-token sequence fills more than half, several microbatches) on one rank,
TP2 (sequence parallel), EP2 (allgather: one width on every rank) and
TP2xPP2xEP2 give the padded single rank's gradients too, and its entropy within
1e-6 (and, on one rank, its logprobs). So do packed microbatches with context
parallelism (each sequence in 2 x CP load-balanced chunks; GSPO's ratio from
the log-ratio sum over the whole sequence) on CP2, CP2xEP2, CP2xTP2 and
DP2xCP2. A DeepSeek-V3 model (multi-latent attention, sigmoid router with
expert bias, a dense first layer) and a GLM-4.5 model give the single rank's
gspo gradient on TP2, PP2, EP2 and TP2xEP2. A batch carrying per-token weight
versions, 16 of its tokens beyond the staleness bound, distributed over DP2 x 3
microbatches, gives the single rank's gspo and dapo update on the batch whose
mask leaves those tokens out. With icepop importance sampling against engine
logprobs (tokens whose ratio leaves [0.5, 5] drop out of the loss and the
counts), DP2 x 3 microbatches and CP2 packed give the single rank's dapo and
gspo update. With their routed experts built as megatron-core's
GroupedMLP (moe_grouped_gemm), Qwen3-MoE and DeepSeek-V3 give their
SequentialMLP single rank's gspo gradient on 1, EP2 and TP2xEP2. A batch of multi-turn
episodes (observation tokens inside responses, out of the mask) gives the single
rank's gspo update on TP2, DP2 x 3 microbatches (distributed) and CP2 packed.

Every case gets the batch as the trainer gives it (trainer.py): only rank 0 holds
the step and actor.distribute sends each rank its DP rank's rows, packed and
padded alike; one case (CP2/packed/whole) hands the whole batch to every rank,
the form tools use. Its logprobs come from actor.prepare_batch under
train.old_logprobs=forward; each case also runs one step of its first loss under
train.old_logprobs=auto (the training forward's own old policy, ratio 1, where it
applies: all but the icepop cases) and must give the single rank's auto step,
which for gspo is transformers' gradient at ratio 1. Each case's response-token count equals the single rank's
(CP once counted every token on both CP ranks), and batch/packed_fraction says
that the plan's packing reached the microbatches.

The chain is anchored outside megatron_rl: the single-rank logprobs and the
gspo and dapo gradients are checked against transformers' model and the
losses written out below from the papers' formulas.

One launch per world size (1, 2, 4); layouts switch in-process.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.probes import bytes_handed_to_torch_distributed

LOSSES = ("gspo", "gspo_token", "dapo", "dr_grpo", "grpo")
B, T = 12, 40
TEMPERATURE = 0.8
CLIP = 0.2
GRPO_BETA = 0.05
TOLERANCE = 1e-5
PACKED_TOLERANCE = 1e-6

# name -> (layout, train settings, token dispatcher[, {"model": ModelConfig fields, "losses": the losses run}])
PACKED = {"pack_sequences": True, "max_tokens_per_microbatch": 64}  # the 40-token sequence fills more than half
# Routed experts as megatron-core's GroupedMLP (fused weight1 / weight2; on CPU the compatibility layer's grouped GEMM),
# gspo only: compared with the single rank's SequentialMLP experts.
GROUPED = {"model": {"moe_grouped_gemm": True}, "losses": ("gspo",)}
WORLD1 = {
    "single": ({}, {"micro_batch_size": B}, "alltoall"),
    "single/packed": ({}, PACKED, "alltoall"),
    "single/grouped": ({}, {"micro_batch_size": B}, "alltoall", GROUPED),
}
WORLD2 = {
    "TP2": ({"tensor_parallel": 2, "expert_tensor_parallel": 2}, {"micro_batch_size": 3}, "alltoall"),
    "PP2": ({"pipeline_parallel": 2}, {"micro_batch_size": 2}, "alltoall"),
    "EP2": ({"expert_parallel": 2}, {"max_tokens_per_microbatch": 96}, "allgather"),
    "DP2x3mb": ({}, {"micro_batch_size": 2}, "alltoall"),
    "TP2/packed": ({"tensor_parallel": 2, "expert_tensor_parallel": 2}, PACKED, "alltoall"),
    "EP2/packed": ({"expert_parallel": 2}, PACKED, "allgather"),
    "CP2/packed": ({"context_parallel": 2}, PACKED, "alltoall"),
    "CP2xEP2/packed": ({"context_parallel": 2, "expert_parallel": 2}, PACKED, "alltoall"),
    # The whole step's batch handed to every rank (tools that hold it anyway): each rank takes its own rows.
    "CP2/packed/whole": ({"context_parallel": 2}, PACKED, "alltoall"),
    "EP2/grouped": ({"expert_parallel": 2}, {"micro_batch_size": 3}, "alltoall", GROUPED),
}
WORLD4 = {
    "TP2xEP2": ({"tensor_parallel": 2, "expert_parallel": 2}, {"micro_batch_size": 2}, "alltoall"),
    "TP2xPP2xEP2": ({"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2}, {"max_tokens_per_microbatch": 120}, "alltoall"),
    "TP2xPP2xEP2/packed": ({"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2}, PACKED, "alltoall"),
    "CP2xTP2/packed": ({"context_parallel": 2, "tensor_parallel": 2}, PACKED, "alltoall"),
    "DP2xCP2/packed": ({"context_parallel": 2}, PACKED, "alltoall"),
    # Shares: rank 0 alone holds the batch and actor.distribute sends each rank its DP rank's rows (D = 1, 2, 4).
    "TP2xPP2/shares": ({"tensor_parallel": 2, "pipeline_parallel": 2}, {"micro_batch_size": 3}, "alltoall"),
    "DP2xTP2/shares": ({"tensor_parallel": 2}, {"micro_batch_size": 2, "mini_batches_per_step": 1}, "alltoall"),
    "DP4/shares": ({"expert_parallel": 4}, {"max_tokens_per_microbatch": 64}, "alltoall"),
    "TP2xEP2/grouped": ({"tensor_parallel": 2, "expert_parallel": 2}, {"micro_batch_size": 2}, "alltoall", GROUPED),
}

# DeepSeek-V3 (multi-latent attention, sigmoid router) and GLM-4.5: gspo on TP2, PP2, EP2, TP2xEP2.
MLA_LOSSES = ("gspo",)
MLA_WORLD1 = {"single": WORLD1["single"]}
MLA_WORLD2 = {k: WORLD2[k] for k in ("TP2", "PP2", "EP2")}
MLA_WORLD4 = {"TP2xEP2": WORLD4["TP2xEP2"]}
# DeepSeek-V3 with GroupedMLP experts: gspo on 1, EP2, TP2xEP2 against its SequentialMLP single rank.
MLA_GROUPED = {1: {"single/grouped": WORLD1["single/grouped"]}, 2: {"EP2/grouped": WORLD2["EP2/grouped"]},
               4: {"TP2xEP2/grouped": WORLD4["TP2xEP2/grouped"]}}


# Importance sampling against the engine's logprobs (icepop: tokens whose pi_old / pi_rollout leaves [0.5, 5] drop out
# of the loss and of the step's counts), on DP2 x 3 microbatches and CP2 packed, against the single rank's.
TIS = {"algorithm": {"tis_mode": "icepop"}, "losses": ("dapo", "gspo")}
TIS_LOSSES = TIS["losses"]
TIS_WORLD1 = {"single/tis": ({}, {"micro_batch_size": B}, "alltoall", TIS)}
TIS_WORLD2 = {"DP2x3mb/tis": ({}, {"micro_batch_size": 2}, "alltoall", TIS),
              "CP2/tis/packed": ({"context_parallel": 2}, PACKED, "alltoall", TIS)}


def rollout_from(old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Engine logprobs up to 1 nat off the old policy's: about a sixth of the ratios fall below icepop's 0.5."""
    noise = (torch.rand(old.shape, generator=torch.Generator().manual_seed(8)) - 0.5) * 2.0
    return torch.where(mask, old + noise, 0.0)


# Per-token versions (the step trains version 3, the bound is 1): the first 4 response tokens of rows 0, 2, 4
# and 9 were sampled at version 1 and leave the loss. DP2 x 3 microbatches, the batch distributed from rank 0,
# must give the single rank's update on the batch whose response mask simply leaves those 16 tokens out.
STALE_ROWS, STALE_PER_ROW, POLICY_VERSION = (0, 2, 4, 9), 4, 3
STALE_LOSSES = ("gspo", "dapo")
STALE_WORLD1 = {"single/stale-removed": ({}, {"micro_batch_size": B}, "alltoall")}
STALE_WORLD2 = {"DP2x3mb/stale/shares": ({}, {"micro_batch_size": 2, "max_staleness": 1}, "alltoall")}


# A batch of multi-turn episodes (megatron_rl.rollout.agents): 5 observation tokens inside the responses of rows
# 0, 2, 4 and 9 are context but out of the mask. TP2, DP2 x 3 microbatches (the batch distributed from rank 0)
# and CP2 with packed microbatches must give the single rank's gspo update on that batch.
EPISODE_ROWS, EPISODE_OBS = (0, 2, 4, 9), (5, 10)
EPISODE_LOSSES = ("gspo",)
EPISODE_WORLD1 = {"single/episode": ({}, {"micro_batch_size": B}, "alltoall")}
EPISODE_WORLD2 = {
    "TP2/episode": ({"tensor_parallel": 2, "expert_tensor_parallel": 2}, {"micro_batch_size": 3}, "alltoall"),
    "DP2x3mb/episode/shares": ({}, {"micro_batch_size": 2}, "alltoall"),
    "CP2/episode/packed": ({"context_parallel": 2}, PACKED, "alltoall"),
}


def observation_tokens(batch) -> torch.Tensor:
    obs = torch.zeros_like(batch.response_mask)
    for row in EPISODE_ROWS:
        start = int(batch.prompt_lengths[row])
        obs[row, start + EPISODE_OBS[0] : start + EPISODE_OBS[1]] = True
    return obs


def stale_tokens(batch) -> torch.Tensor:
    stale = torch.zeros_like(batch.response_mask)
    for row in STALE_ROWS:
        start = int(batch.prompt_lengths[row])
        stale[row, start : start + STALE_PER_ROW] = True
    return stale


def batch_for(name: str):
    """make_batch(), with per-token versions for a /stale case, or without the stale tokens for its reference."""
    batch = make_batch()
    if "/episode" in name:
        return batch.replace(response_mask=batch.response_mask & ~observation_tokens(batch))
    if name.endswith("/stale-removed"):
        return batch.replace(response_mask=batch.response_mask & ~stale_tokens(batch))
    if "/stale" in name:
        versions = torch.where(batch.response_mask, POLICY_VERSION, -1)
        versions[stale_tokens(batch)] = POLICY_VERSION - 2
        return batch.replace(token_versions=versions, policy_version=POLICY_VERSION)
    return batch


def make_batch():
    """The step's batch (identical on every rank): tokens, masks, advantages (no old logprobs yet)."""
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(2024)
    lengths = torch.tensor([40, 23, 31, 12, 37, 18, 27, 10, 35, 29, 15, 33])
    prompts = torch.tensor([6, 3, 9, 4, 5, 7, 3, 4, 8, 6, 5, 4])
    positions = torch.arange(T)
    mask = (positions[None] >= prompts[:, None]) & (positions[None] < lengths[:, None])
    mask[5] = False  # a sample whose response was filtered out: in no denominator, no gradient
    return TrainBatch(
        tokens=torch.randint(0, 200, (B, T), generator=g),
        response_mask=mask,
        advantages=torch.randn(B, generator=g),
        prompt_lengths=prompts,
        sequence_lengths=lengths,
    )


def old_from(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Old-policy logprobs a little off the current ones (ratios 0.95..1.05: nothing clipped at 0.2)."""
    noise = (torch.rand(logprobs.shape, generator=torch.Generator().manual_seed(7)) - 0.5) * 0.1
    return torch.where(mask, logprobs + noise, logprobs)


def _worker(rank: int, world_size: int, model_dir: str, cases: dict, old_logprobs, losses=LOSSES) -> dict | None:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import export_hf_state_dict, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    shape = model_shape(load_hf_config(model_dir))
    sgd = OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0, use_distributed_optimizer=False)
    out = {}
    for name, (layout, train, dispatcher, *extras) in cases.items():
        extra = extras[0] if extras else {}
        ctx = init_parallel(ParallelConfig(timeout_s=120, **layout), shape=shape)
        shares = not name.endswith("/whole")  # every case as the trainer runs it, but the one whole-batch case
        try:
            case = {"updates": {}, "metrics": {}}
            batch = batch_for(name)
            for loss in extra.get("losses", losses):
                algorithm = AlgorithmConfig(loss=loss, eps_low=CLIP, eps_high=CLIP, beta=GRPO_BETA if loss == "grpo" else 0.0,
                                            max_response_tokens=T, **extra.get("algorithm", {}))
                actor = Actor(ctx, model=ModelConfig(path=model_dir, token_dispatcher=dispatcher, **extra.get("model", {})), optimizer=sgd,
                              train=TrainConfig(old_logprobs="forward", **train), algorithm=algorithm, temperature=TEMPERATURE)
                try:
                    if "logprobs" not in case:
                        if shares:
                            with bytes_handed_to_torch_distributed(rank) as handed:
                                batch = actor.distribute(batch if rank == 0 else None)
                            case["handed_bytes"] = _gather(sum(handed), ctx)
                            case["share_bytes"] = _gather(actor.last_share_bytes, ctx)
                            case["share_rows"] = _gather(batch.row_ids.tolist(), ctx)
                        prepared, _ = actor.prepare_batch(batch)  # the trainer's call (train.old_logprobs=forward)
                        case["logprobs"] = _whole(prepared.old_logprobs, batch, ctx)
                        old = old_logprobs if old_logprobs is not None else old_from(case["logprobs"], make_batch().response_mask)
                        case["old_logprobs"] = old
                        batch = batch.replace(old_logprobs=_rows_of(old, batch))
                        if algorithm.tis_mode != "none":
                            rollout = rollout_from(old, make_batch().response_mask)
                            batch = batch.replace(rollout_logprobs=_rows_of(rollout, batch))
                    step_batch = batch
                    if loss == "gspo_token":  # per-token advantages (the sequence's value, varied along the response)
                        ramp = 1.0 + 0.1 * torch.linspace(-1, 1, T)[: batch.seq_len]
                        step_batch = batch.replace(advantages=batch.advantages[:, None] * ramp[None])
                    if algorithm.beta > 0:
                        step_batch = step_batch.replace(ref_logprobs=actor.compute_ref_logprobs(step_batch))
                        case["ref_logprobs"] = _whole(step_batch.ref_logprobs, step_batch, ctx)
                    case["metrics"][loss] = actor.train_step(step_batch)
                    params = export_hf_state_dict(actor.model, ctx)
                    if rank == 0:
                        case["updates"][loss] = params
                finally:
                    actor.close()
            case["auto"] = _auto_step(rank, ctx, model_dir, name, (layout, train, dispatcher, extra), case, shares, losses)
            out[name] = case
            if old_logprobs is None:  # every later case trains against the first case's old policy
                old_logprobs = case["old_logprobs"]
        finally:
            destroy_parallel(ctx, keep_world=True)
    return out if rank == 0 else None


def _auto_step(rank: int, ctx, model_dir: str, name: str, spec: tuple, case: dict, shares: bool, losses) -> dict:
    """One step of the case's first loss under train.old_logprobs=auto, through the trainer's calls (distribute,
    prepare_batch, train_step): the old policy is the training forward's own where it applies (ratio 1), else a
    forward of its own. Returns the loss metrics and, on rank 0, the weights after the step."""
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, TrainConfig
    from megatron_rl.models import export_hf_state_dict

    layout, train, dispatcher, extra = spec
    loss = extra.get("losses", losses)[0]
    algorithm = AlgorithmConfig(loss=loss, eps_low=CLIP, eps_high=CLIP, beta=GRPO_BETA if loss == "grpo" else 0.0,
                                max_response_tokens=T, **extra.get("algorithm", {}))
    sgd = OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0, use_distributed_optimizer=False)
    actor = Actor(ctx, model=ModelConfig(path=model_dir, token_dispatcher=dispatcher, **extra.get("model", {})), optimizer=sgd,
                  train=TrainConfig(old_logprobs="auto", **train), algorithm=algorithm, temperature=TEMPERATURE)
    try:
        batch = batch_for(name)
        if algorithm.tis_mode != "none":
            batch = batch.replace(rollout_logprobs=rollout_from(case["old_logprobs"], make_batch().response_mask))
        if shares:
            batch = actor.distribute(batch if rank == 0 else None)
        prepared, _ = actor.prepare_batch(batch)
        metrics = actor.train_step(prepared)
        params = export_hf_state_dict(actor.model, ctx)
        return {"loss": loss, "metrics": metrics, "params": params if rank == 0 else None, "source": actor.old_logprobs_from}
    finally:
        actor.close()


def _runs(rank: int, world_size: int, runs: list) -> list:
    """Several (model_dir, cases, old_logprobs, losses) runs in one launch."""
    return [_worker(rank, world_size, *run) for run in runs]


def _gather(value, ctx) -> list:
    import torch.distributed as dist

    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _rows_of(values: torch.Tensor, batch) -> torch.Tensor:
    """The rows of a whole-step [B, T] tensor that `batch` holds (all of them for a whole batch)."""
    if batch.row_ids is None:
        return values
    return values[batch.row_ids, : batch.seq_len].clone()


def _whole(values: torch.Tensor, batch, ctx) -> torch.Tensor:
    """A share's [B_share, T_share] values placed into the step's [B, T] (gathered from every rank)."""
    if batch.row_ids is None:
        return values
    whole = torch.zeros(B, T)
    for rows, part in _gather((batch.row_ids, values), ctx):
        whole[rows, : part.shape[1]] = part
    return whole


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    # Vocabulary 200, padded by megatron to 256 (128 x TP): the padded columns must stay out of the softmax.
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("actor") / "moe", "qwen3_moe", seed=11, with_tokenizer=False,
                                   vocab_size=200))


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    # DeepSeek-V3: multi-latent attention, sigmoid router with expert bias and groups, dense layer 0
    # (4 layers: PP2 holds the dense layer and one MoE layer on stage 0); init std 0.1: routing far from uniform.
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("actor") / "mla", "deepseek_v3", seed=11, with_tokenizer=False,
                                   vocab_size=200, init_std=0.1, num_hidden_layers=4))


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    # GLM-4.5: partial rotary, q/k/v biases and norms, sigmoid router with expert bias, dense layer 0.
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("actor") / "glm", "glm4_moe", seed=12, with_tokenizer=False,
                                   vocab_size=200, init_std=0.1, num_hidden_layers=4))


@pytest.fixture(scope="module")
def world1_all(model_dir, mla_dir, glm_dir):
    runs = [(model_dir, WORLD1, None, LOSSES), (mla_dir, {**MLA_WORLD1, **MLA_GROUPED[1]}, None, MLA_LOSSES),
            (glm_dir, MLA_WORLD1, None, MLA_LOSSES), (model_dir, STALE_WORLD1, None, STALE_LOSSES),
            (model_dir, TIS_WORLD1, None, TIS_LOSSES), (model_dir, EPISODE_WORLD1, None, EPISODE_LOSSES)]
    return run_distributed(_runs, 1, runs, timeout=300)[0]


@pytest.fixture(scope="module")
def world1(world1_all):
    return world1_all[0]


@pytest.fixture(scope="module")
def mla_single(world1_all):
    return world1_all[1]["single"]


@pytest.fixture(scope="module")
def glm_single(world1_all):
    return world1_all[2]["single"]


@pytest.fixture(scope="module")
def single(world1):
    return world1["single"]


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def _flat_update(params: dict, initial: dict) -> torch.Tensor:
    return torch.cat([(params[k] - initial[k]).flatten() for k in sorted(initial)])


def _compare(results: dict, reference: dict, initial: dict, losses=LOSSES) -> list[str]:
    failures = []
    mask = make_batch().response_mask
    for name, case in results.items():
        lp_err = (case["logprobs"] - reference["logprobs"]).abs().max().item()
        line = [f"{name:12s} logprobs {lp_err:.1e}"]
        if lp_err > TOLERANCE:
            failures.append(f"{name}: logprobs differ from the single rank's by {lp_err:.3g}")
        if "ref_logprobs" in case:
            ref_err = ((case["ref_logprobs"] - reference["logprobs"]) * mask).abs().max().item()
            if ref_err > TOLERANCE:
                failures.append(f"{name}: reference-model logprobs differ from the initial policy's by {ref_err:.3g}")
        case_losses = [loss for loss in losses if loss in case["updates"]]
        if not case_losses:
            failures.append(f"{name}: none of the losses {losses} ran")
        for loss in case_losses:
            expected = _flat_update(reference["updates"][loss], initial)
            got = _flat_update(case["updates"][loss], initial)
            err = ((got - expected).norm() / expected.norm()).item()
            loss_value, ref_loss = case["metrics"][loss]["loss/sum"], reference["metrics"][loss]["loss/sum"]
            loss_err = abs(loss_value - ref_loss) / abs(ref_loss)
            line.append(f"{loss} {err:.1e}")
            if not (err <= TOLERANCE and loss_err <= TOLERANCE):
                failures.append(f"{name}/{loss}: relative gradient error {err:.3g}, loss error {loss_err:.3g}")
            tokens, ref_tokens = case["metrics"][loss].get("tokens/sum"), reference["metrics"][loss].get("tokens/sum")
            if tokens != ref_tokens:  # each response token counted once, whatever the split (CP counted it twice once)
                failures.append(f"{name}/{loss}: tokens/sum {tokens} != the single rank's {ref_tokens}")
            packed = case["metrics"][loss]["batch/packed_fraction"]
            if packed != (1.0 if "/packed" in name else 0.0):  # the plan's packing survives actor.distribute
                failures.append(f"{name}/{loss}: batch/packed_fraction {packed}, packing is {'/packed' in name}")
            if name.endswith("/packed"):  # the mean entropy over the step's response tokens, packed vs padded
                ent_err = abs(case["metrics"][loss]["entropy"] - reference["metrics"][loss]["entropy"])
                if ent_err > PACKED_TOLERANCE:
                    failures.append(f"{name}/{loss}: entropy differs from the padded single rank's by {ent_err:.3g}")
        auto, auto_reference = case["auto"], reference["auto"]
        expected = _flat_update(auto_reference["params"], initial)
        err = ((_flat_update(auto["params"], initial) - expected).norm() / expected.norm()).item()
        loss_err = abs(auto["metrics"]["loss/sum"] - auto_reference["metrics"]["loss/sum"]) / abs(auto_reference["metrics"]["loss/sum"])
        line.append(f"auto/{auto['loss']} {err:.1e}")
        if not (err <= TOLERANCE and loss_err <= TOLERANCE):
            failures.append(f"{name}/auto/{auto['loss']}: relative gradient error {err:.3g}, loss error {loss_err:.3g} "
                            f"(old policy: {auto['source']})")
        print("  ".join(line))
    return failures


def test_single_rank_matches_transformers(model_dir, single):
    """Logprobs and the gspo / dapo gradients of the single-rank actor = transformers + the papers' formulas."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_batch()
    mask = batch.response_mask
    initial = _initial(model_dir)

    def hf_logprobs():
        logits = model(batch.tokens).logits / TEMPERATURE
        picked = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros(B, 1), picked], dim=1)  # token-aligned

    with torch.no_grad():
        expected = hf_logprobs()
    lengths = batch.sequence_lengths
    real = torch.arange(T)[None] < lengths[:, None]
    assert ((single["logprobs"] - expected).abs() * real).max() <= TOLERANCE
    old = single["old_logprobs"]
    advantages = batch.advantages
    has_tokens = mask.any(dim=1)

    def gspo(logprobs):
        # s_i = exp(mean_t log-ratio); L = -(1/N_seq) sum_i min(s_i A_i, clip(s_i, 1-e, 1+e) A_i)   (GSPO Eq. 5, 7)
        log_ratio = torch.where(mask, logprobs - old, 0.0)
        s = torch.exp(log_ratio.sum(1) / mask.sum(1).clamp(min=1))
        per_seq = torch.minimum(s * advantages, s.clamp(1 - CLIP, 1 + CLIP) * advantages)
        return -(per_seq * has_tokens).sum() / has_tokens.sum()

    def dapo(logprobs):
        # L = -(1/N_tok) sum_{i,t} min(w A, clip(w, 1-e, 1+e) A)   (DAPO Eq. 8)
        w = torch.exp(torch.where(mask, logprobs - old, 0.0))
        a = advantages[:, None]
        per_token = torch.minimum(w * a, w.clamp(1 - CLIP, 1 + CLIP) * a)
        return -(per_token * mask).sum() / mask.sum()

    def gspo_at_ratio_1(logprobs):  # train.old_logprobs=auto: the old policy is this forward's own, detached
        log_ratio = torch.where(mask, logprobs - logprobs.detach(), 0.0)
        s = torch.exp(log_ratio.sum(1) / mask.sum(1).clamp(min=1))
        return -(torch.minimum(s * advantages, s.clamp(1 - CLIP, 1 + CLIP) * advantages) * has_tokens).sum() / has_tokens.sum()

    for loss_name, loss_fn in (("gspo", gspo), ("dapo", dapo), ("auto", gspo_at_ratio_1)):
        model.zero_grad()
        loss = loss_fn(hf_logprobs())
        loss.backward()
        grads = _hf_grads_by_export_name(model)
        assert set(grads) == set(initial)
        run = single["auto"] if loss_name == "auto" else {"params": single["updates"][loss_name], "metrics": single["metrics"][loss_name]}
        got = _flat_update(run["params"], initial)
        want = -torch.cat([grads[k].flatten() for k in sorted(initial)])
        err = ((got - want).norm() / want.norm()).item()
        print(f"{loss_name}: relative gradient error vs transformers {err:.2e}, loss {loss.item():.6f} vs {run['metrics']['loss/sum']:.6f}")
        assert err <= TOLERANCE, (loss_name, err)
        assert abs(loss.item() - run["metrics"]["loss/sum"]) <= TOLERANCE * abs(loss.item())


def _hf_grads_by_export_name(model) -> dict[str, torch.Tensor]:
    """transformers 5 fuses each layer's experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]); the
    checkpoint and megatron_rl's export use per-expert names."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(grad.shape[0]):
                gate, up = grad[e].chunk(2, dim=0)
                grads[f"{prefix}{e}.gate_proj.weight"], grads[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(grad.shape[0]):
                grads[f"{prefix}{e}.down_proj.weight"] = grad[e]
        else:
            grads[name] = grad
    return grads


def test_packed_microbatches_give_the_padded_results(model_dir, world1):
    """One rank, packed microbatches (budget 64 tokens: 5 microbatches, one sequence of 40) vs one padded
    microbatch of the whole batch: logprobs and entropy within 1e-6, gradients within 1e-5 for every loss."""
    packed, single = world1["single/packed"], world1["single"]
    lengths = make_batch().sequence_lengths
    real = torch.arange(T)[None] < lengths[:, None]
    assert ((packed["logprobs"] - single["logprobs"]).abs() * real).max() <= PACKED_TOLERANCE
    assert packed["metrics"]["gspo"]["microbatches_per_rank"] >= 4
    failures = _compare({"single/packed": packed}, single, _initial(model_dir))
    assert not failures, "\n".join(failures)


def test_grouped_experts_give_the_sequential_experts_gradient(model_dir, world1, world1_all, mla_dir, mla_single):
    """One rank, GroupedMLP experts (one grouped GEMM per layer) vs SequentialMLP: logprobs and the gspo gradient within 1e-5."""
    failures = _compare({"single/grouped": world1["single/grouped"]}, world1["single"], _initial(model_dir), ("gspo",))
    failures += [f"deepseek_v3 {f}" for f in _compare({"single/grouped": world1_all[1]["single/grouped"]}, mla_single, _weights(mla_dir), ("gspo",))]
    assert not failures, "\n".join(failures)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def test_padding_fraction_is_the_layouts_padding(world1, single):
    """batch/padding_fraction by hand: one padded microbatch of B rows x 40 columns holds 310 real tokens;
    packed on one rank, sequences back to back hold no padding; packed on CP2 each sequence pads to 2 x CP."""
    lengths = make_batch().sequence_lengths.tolist()
    assert sum(lengths) == 310
    assert single["metrics"]["gspo"]["batch/padding_fraction"] == pytest.approx(1 - 310 / (B * T), abs=1e-12)
    assert world1["single/packed"]["metrics"]["gspo"]["batch/padding_fraction"] == 0.0
    assert single["metrics"]["gspo"]["batch/packed_fraction"] == 0.0
    assert world1["single/packed"]["metrics"]["gspo"]["batch/packed_fraction"] == 1.0


def test_single_rank_step_moves_the_weights(model_dir, single):
    initial = _initial(model_dir)
    for loss in LOSSES:
        assert _flat_update(single["updates"][loss], initial).norm() > 1e-3, loss
        assert single["metrics"][loss]["sequences/sum"] == B - 1  # the filtered sample counts nowhere


def _family_runs(cases: dict, mla_dir, mla_single, glm_dir, glm_single, mla_grouped: dict | None = None) -> list:
    """DeepSeek-V3 and GLM-4.5 runs (gspo) on `cases` (DeepSeek-V3 also on `mla_grouped`)."""
    return [
        (mla_dir, {**cases, **(mla_grouped or {})}, mla_single["old_logprobs"], MLA_LOSSES),
        (glm_dir, cases, glm_single["old_logprobs"], MLA_LOSSES),
    ]


def _family_failures(mla_results, glm_results, mla_dir, mla_single, glm_dir, glm_single) -> list[str]:
    failures = [f"deepseek_v3 {f}" for f in _compare(mla_results, mla_single, _weights(mla_dir), MLA_LOSSES)]
    return failures + [f"glm4_moe {f}" for f in _compare(glm_results, glm_single, _weights(glm_dir), MLA_LOSSES)]


@pytest.fixture(scope="module")
def world4_all(model_dir, single, mla_dir, mla_single, glm_dir, glm_single):
    runs = [(model_dir, WORLD4, single["old_logprobs"], LOSSES),
            *_family_runs(MLA_WORLD4, mla_dir, mla_single, glm_dir, glm_single, MLA_GROUPED[4])]
    return run_distributed(_runs, 4, runs, timeout=400)[0]


@pytest.fixture(scope="module")
def world4(world4_all):
    return world4_all[0]


def test_two_rank_layouts_give_the_single_rank_gradient(model_dir, world1_all, single, mla_dir, mla_single, glm_dir, glm_single):
    runs = [(model_dir, WORLD2, single["old_logprobs"], LOSSES),
            *_family_runs(MLA_WORLD2, mla_dir, mla_single, glm_dir, glm_single, MLA_GROUPED[2]),
            (model_dir, STALE_WORLD2, single["old_logprobs"], STALE_LOSSES),
            (model_dir, TIS_WORLD2, single["old_logprobs"], TIS_LOSSES),
            (model_dir, EPISODE_WORLD2, single["old_logprobs"], EPISODE_LOSSES)]
    results, mla_results, glm_results, stale_results, tis_results, episode_results = run_distributed(_runs, 2, runs, timeout=600)[0]
    failures = _compare(results, single, _initial(model_dir))
    failures += _family_failures(mla_results, glm_results, mla_dir, mla_single, glm_dir, glm_single)
    # tokens beyond the staleness bound, masked on each DP rank's share: the update of the batch without them
    stale_reference = world1_all[3]["single/stale-removed"]
    failures += _compare(stale_results, stale_reference, _initial(model_dir), STALE_LOSSES)
    tis_reference = world1_all[4]["single/tis"]
    masked = {loss: tis_reference["metrics"][loss]["tokens/sum"] for loss in TIS_LOSSES}
    assert all(0 < n < single["metrics"]["dapo"]["tokens/sum"] for n in masked.values()), masked  # icepop dropped some
    failures += _compare(tis_results, tis_reference, _initial(model_dir), TIS_LOSSES)
    # CP2, packed: each sequence padded to a multiple of 2 x CP = 4 (both CP ranks' chunks counted).
    padded = sum(_round_up(n, 4) for n in make_batch().sequence_lengths.tolist())
    cp_padding = results["CP2/packed"]["metrics"]["gspo"]["batch/padding_fraction"]
    if abs(cp_padding - (padded - 310) / padded) > 1e-12:
        failures.append(f"CP2/packed: batch/padding_fraction {cp_padding} != {(padded - 310) / padded}")
    for loss in STALE_LOSSES:
        metrics = stale_results["DP2x3mb/stale/shares"]["metrics"][loss]
        assert metrics["async/stale_tokens_masked/sum"] == len(STALE_ROWS) * STALE_PER_ROW, metrics
        assert metrics["async/token_staleness/max"] == 2 and metrics["tokens/sum"] == stale_reference["metrics"][loss]["tokens/sum"]
    # episodes: observation tokens inside responses, out of the mask, on TP2, DP2 shares and CP2 packed
    episode_reference = world1_all[5]["single/episode"]
    failures += _compare(episode_results, episode_reference, _initial(model_dir), EPISODE_LOSSES)
    tokens = int((make_batch().response_mask & ~observation_tokens(make_batch())).sum())
    for name in EPISODE_WORLD2:
        assert episode_results[name]["metrics"]["gspo"]["tokens/sum"] == tokens, (name, episode_results[name]["metrics"]["gspo"])
    assert not failures, "\n".join(failures)


def test_four_rank_layouts_give_the_single_rank_gradient(model_dir, single, world4, world4_all, mla_dir, mla_single, glm_dir, glm_single):
    failures = _compare(world4, single, _initial(model_dir))
    failures += _family_failures(world4_all[1], world4_all[2], mla_dir, mla_single, glm_dir, glm_single)
    assert not failures, "\n".join(failures)


def test_each_rank_receives_only_its_share(world4):
    """Rows partition the step over DP ranks (model-parallel peers get the same rows), and the bytes each
    rank received for the step (measured: the pickled share) shrink as 1/D. Rank 0 hands torch.distributed
    one copy of the step (each DP rank's share once), not one per rank: W / D copies on TP2 x PP2 would be 4;
    a DP rank's leader hands on its own share once, and its peers nothing but sizes."""
    from megatron_rl.actor.distribute import select_rows

    dp_groups = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 4: [[0], [1], [2], [3]]}  # ranks sharing rows (TP x PP peers)
    most = {}
    for name, dp in (("TP2xPP2/shares", 1), ("DP2xTP2/shares", 2), ("DP4/shares", 4)):
        rows, sent, handed = world4[name]["share_rows"], world4[name]["share_bytes"], world4[name]["handed_bytes"]
        shares = [rows[group[0]] for group in dp_groups[dp]]
        for group in dp_groups[dp]:
            assert all(rows[r] == rows[group[0]] for r in group), (name, rows)
        assert sorted(r for share in shares for r in share) == list(range(B)), (name, shares)
        most[dp] = max(sent)
        print(f"D={dp}: rows per rank {[len(x) for x in shares]}, bytes received per rank {sent}, handed to "
              f"torch.distributed per rank {handed}")
        step = sum(sent[group[0]] for group in dp_groups[dp])  # one copy of the step: each DP rank's share once
        sizes = 8 * (dp + 1)  # the 8-byte lengths sent before the shares
        assert step - sent[0] <= handed[0] <= step + sizes, (name, handed, step)  # its own share: broadcast or kept
        for group in dp_groups[dp]:
            for r in group[1:]:
                assert handed[r] <= 8, (name, r, handed)  # a peer sends nothing of the step
            if group[0] != 0:
                assert handed[group[0]] <= sent[group[0]] + 8, (name, group[0], handed)  # a leader: its share once
    # What a share costs beyond its rows (field names, pickling, the [B] step lengths): an empty share, measured.
    fixed = len(pickle.dumps(select_rows(make_batch(), [])))
    for dp in (2, 4):
        assert most[dp] < most[1], most
        assert most[dp] - fixed <= 1.25 * (most[1] - fixed) / dp, (dp, most, fixed)


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The trained weights of a model with a sigmoid router: its expert bias is not a gradient-trained weight."""
    return {k: v for k, v in _initial(model_dir).items() if not k.endswith("e_score_correction_bias")}


def test_deepseek_v3_single_rank_matches_transformers(mla_dir, mla_single):
    """Multi-latent attention + sigmoid routing: the single-rank actor's logprobs and gspo gradient = transformers'."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(mla_dir, dtype=torch.float32)
    batch = make_batch()
    mask, old, advantages = batch.response_mask, mla_single["old_logprobs"], batch.advantages
    logits = model(batch.tokens).logits / TEMPERATURE
    picked = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    logprobs = torch.cat([torch.zeros(B, 1), picked], dim=1)
    real = torch.arange(T)[None] < batch.sequence_lengths[:, None]
    assert ((mla_single["logprobs"] - logprobs.detach()).abs() * real).max() <= TOLERANCE
    # GSPO Eq. 5, 7: s_i = exp(mean_t log-ratio); L = -(1/N_seq) sum_i min(s_i A_i, clip(s_i, 1-e, 1+e) A_i)
    has_tokens = mask.any(dim=1)
    s = torch.exp(torch.where(mask, logprobs - old, 0.0).sum(1) / mask.sum(1).clamp(min=1))
    loss = -(torch.minimum(s * advantages, s.clamp(1 - CLIP, 1 + CLIP) * advantages) * has_tokens).sum() / has_tokens.sum()
    loss.backward()
    weights = _weights(mla_dir)
    grads = _hf_grads_by_export_name(model)
    got = _flat_update(mla_single["updates"]["gspo"], weights)
    want = -torch.cat([grads[k].flatten() for k in sorted(weights)])
    assert ((got - want).norm() / want.norm()).item() <= TOLERANCE
    # The expert bias moves as megatron-core's aux-loss-free balancing does: by +-rate (1e-3) or 0 per expert.
    initial = _initial(mla_dir)
    for name, value in mla_single["updates"]["gspo"].items():
        if name.endswith("e_score_correction_bias"):
            steps = ((value - initial[name]) / 1e-3).round()
            assert torch.allclose(value - initial[name], steps * 1e-3, atol=1e-6) and steps.abs().max() <= 1 and steps.abs().sum() > 0, name
