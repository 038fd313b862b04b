"""DP2 x CP2 x EP2 with packed microbatches, through the trainer's calls, gives the single rank's step.

A common production layout (context parallelism inside each data-parallel rank, experts spread over both) on 4
gloo ranks, with a model and batch chosen to reach the corners of the packed layout's bookkeeping:

- a Qwen3-MoE of 3 layers whose middle one is dense (`mlp_only_layers`), one key/value head (MQA), head_dim 16,
  hidden 48, 6 experts top-3 without renormalisation, vocabulary 163 (padded by megatron), every weight drawn with
  std 0.1 (routing far from uniform);
- 12 sequences of 1-61 tokens: one of length 1 with no response token, one with a 1-token prompt and a 1-token
  response, one whose 3 response tokens all fall in the last of its 2 x CP chunks, lengths not divisible by 4 or 8,
  random advantages. A packed microbatch holds at most 64 tokens, so a DP rank's share spans several microbatches
  and, under CP, some sequences have no real token on one CP rank (a sequence of 1 token padded to 4: chunks 1
  and 2, held by CP rank 1, are all padding).

The batch goes as the trainer gives it: rank 0 holds the step, `actor.distribute` sends each rank its DP rank's
rows, `actor.prepare_batch` fills the old policy (train.old_logprobs=forward: a forward of its own; auto: the
training forward's own, one mini-batch) and `actor.train_step` runs one SGD step (lr 1, no clipping: the update is
minus the gradient). For GSPO, DAPO and GRPO with a KL term (beta 0.05, k3, against the frozen reference), the old
logprobs (forward), the reference logprobs, the loss and the update must equal the single rank's, which trains the
whole batch padded in one microbatch. The old policy is the current one, so every ratio is 1 and forward and auto
must agree; the gradient is still the advantage-weighted score function (and the KL term's).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed

T = 61
LENGTHS = (61, 2, 19, 33, 45, 7, 53, 26, 38, 14, 29, 1)
PROMPTS = (5, 1, 4, 30, 9, 3, 11, 6, 10, 4, 7, 1)  # row 1: prompt 1, response 1; row 11: no response token
# Row 3: 33 tokens pad to 36 = 4 chunks of 9 under CP2; its response, tokens 30-32, lies in chunk 3 only.
# Row 11, the last (the largest row index of its share and its microbatch): its one token lies in chunk 0, so
# CP rank 1 holds none of it.
LOSSES = ("gspo", "dapo", "grpo")
CLIP, BETA, TEMPERATURE = 0.2, 0.05, 0.9
TOLERANCE = 1e-5
PACKED = {"pack_sequences": True, "max_tokens_per_microbatch": 64}
LAYOUT = {"context_parallel": 2, "expert_parallel": 2}  # 4 ranks: DP2 x CP2, EP2 over DP x CP


def make_batch():
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(61)
    lengths, prompts = torch.tensor(LENGTHS), torch.tensor(PROMPTS)
    positions = torch.arange(T)
    mask = (positions[None] >= prompts[:, None]) & (positions[None] < lengths[:, None])
    return TrainBatch(tokens=torch.randint(0, 163, (len(LENGTHS), T), generator=g), response_mask=mask,
                      advantages=torch.randn(len(LENGTHS), generator=g), prompt_lengths=prompts, sequence_lengths=lengths)


def _worker(rank: int, world_size: int, model_dir: str, layout: dict, train: dict, modes: tuple[str, ...]) -> dict | None:
    import torch.distributed as dist

    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import export_hf_state_dict, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(timeout_s=120, **layout), shape=model_shape(load_hf_config(model_dir)))
    sgd = OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0, use_distributed_optimizer=False)
    out = {}
    try:
        for mode in modes:
            for loss in LOSSES:
                algorithm = AlgorithmConfig(loss=loss, eps_low=CLIP, eps_high=CLIP, beta=BETA if loss == "grpo" else 0.0,
                                            max_response_tokens=T)
                actor = Actor(ctx, model=ModelConfig(path=model_dir, token_dispatcher="alltoall"), optimizer=sgd,
                              train=TrainConfig(old_logprobs=mode, **train), algorithm=algorithm, temperature=TEMPERATURE)
                try:
                    share = actor.distribute(make_batch() if rank == 0 else None)
                    prepared, _ = actor.prepare_batch(share)
                    metrics = actor.train_step(prepared)
                    whole = {}
                    for field in ("old_logprobs", "ref_logprobs"):
                        values = getattr(prepared, field)
                        if values is None:
                            continue
                        gathered = [None] * world_size
                        dist.all_gather_object(gathered, (share.row_ids, values))
                        whole[field] = torch.zeros(len(LENGTHS), T)
                        for rows, part in gathered:
                            if rows is None:  # the whole batch on one rank
                                whole[field][:, : part.shape[1]] = part
                            else:
                                whole[field][rows, : part.shape[1]] = part
                    params = export_hf_state_dict(actor.model, ctx)
                    out[(mode, loss)] = {"metrics": metrics, "params": params if rank == 0 else None, **whole}
                finally:
                    actor.close()
    finally:
        destroy_parallel(ctx, keep_world=True)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(
        tmp_path_factory.mktemp("dp-cp-ep") / "moe", "qwen3_moe", seed=61, with_tokenizer=False, vocab_size=163,
        init_std=0.1, num_hidden_layers=3, mlp_only_layers=[1], hidden_size=48, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
    ))


@pytest.fixture(scope="module")
def single(model_dir):
    return run_distributed(_worker, 1, model_dir, {}, {"micro_batch_size": len(LENGTHS)}, ("forward",), timeout=300)[0]


@pytest.fixture(scope="module")
def dp_cp_ep(model_dir):
    return run_distributed(_worker, 4, model_dir, LAYOUT, PACKED, ("forward", "auto"), timeout=400)[0]


def _update(params: dict, initial: dict) -> torch.Tensor:
    return torch.cat([(params[k] - initial[k]).flatten() for k in sorted(initial)])


def test_the_single_rank_reference_is_the_formula(model_dir, single):
    """The reference's old and reference logprobs are transformers' (the old policy is the initial model), and
    its GSPO loss is GSPO's Eq. 5-7 at ratio 1: -(1/N_seq) sum_i A_i over the sequences with response tokens."""
    import warnings

    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_batch()
    with torch.no_grad():
        logits = model(batch.tokens).logits / TEMPERATURE
    picked = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    expected = torch.cat([torch.zeros(len(LENGTHS), 1), picked], dim=1)
    mask = batch.response_mask
    for field in ("old_logprobs", "ref_logprobs"):
        got = single[("forward", "grpo")][field]
        assert ((got - expected).abs() * mask).max() <= TOLERANCE, field
    has_tokens = mask.any(dim=1)
    gspo = -(batch.advantages * has_tokens).sum() / has_tokens.sum()
    assert single[("forward", "gspo")]["metrics"]["loss/sum"] == pytest.approx(gspo.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("mode", ["forward", "auto"])
def test_dp2_cp2_ep2_packed_gives_the_single_rank_step(model_dir, single, dp_cp_ep, mode):
    from safetensors.torch import load_file

    initial = load_file(f"{model_dir}/model.safetensors")
    mask = make_batch().response_mask
    failures = []
    for loss in LOSSES:
        got, want = dp_cp_ep[(mode, loss)], single[("forward", loss)]
        for field in ("old_logprobs", "ref_logprobs"):
            if field in want and (mode == "forward" or field == "ref_logprobs"):
                err = ((got[field] - want[field]).abs() * mask).max().item()
                if err > TOLERANCE:
                    failures.append(f"{loss}: {field} differ from the single rank's by {err:.3g}")
        loss_got, loss_want = got["metrics"]["loss/sum"], want["metrics"]["loss/sum"]
        if abs(loss_got - loss_want) > TOLERANCE * max(abs(loss_want), 1e-3):
            failures.append(f"{loss}: loss {loss_got} != the single rank's {loss_want}")
        if got["metrics"]["tokens/sum"] != want["metrics"]["tokens/sum"] or got["metrics"]["tokens/sum"] != int(mask.sum()):
            failures.append(f"{loss}: tokens/sum {got['metrics']['tokens/sum']} != {int(mask.sum())}")
        expected = _update(want["params"], initial)
        err = ((_update(got["params"], initial) - expected).norm() / expected.norm()).item()
        print(f"{mode} {loss}: relative update error {err:.2e}")
        if err > TOLERANCE:
            failures.append(f"{loss}: relative update error {err:.3g}")
        if got["metrics"]["batch/packed_fraction"] != 1.0:
            failures.append(f"{loss}: batch/packed_fraction {got['metrics']['batch/packed_fraction']}")
    assert not failures, "\n".join(failures)
