"""Per-device memory of the trainer and the rollout engine, from the model's shape and the layout.

Sources for each term:
- Weights, gradients and optimizer state: the byte counts of megatron's
  distributed optimizer (Megatron-LM docs/source/distrib_optimizer.md, "bytes
  per parameter": bf16 parameters with fp32 gradients take 6 + 12/d bytes,
  where 12 = fp32 main copy + Adam's two fp32 moments, sharded over the d
  data-parallel ranks; fp32 parameters take 8 + 8/d, no main copy). Expert
  parameters are sharded over the expert-data-parallel group instead,
  world / (expert TP x EP x PP) ranks.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models" (arXiv 2205.05198), section 4: a layer stores
  s b h (34 / t) bytes with tensor + sequence parallelism and the attention
  scores recomputed (flash attention never stores them), and only its input,
  2 s b h / t bytes, under full recomputation; model.recompute=moe keeps the
  attention's part and rematerialises the MLP block (`layer_activations`). Their 34 counts a GPT layer
  (MHA, 4h GeLU MLP, dropout); `layer_activation_bytes` recounts the same
  stored tensors for GQA, SwiGLU, RMSNorm, q/k norms, no dropout, and routed
  experts (each token's k copies). With 1F1B pipelining the first stage
  holds min(PP, microbatches) microbatches in flight (their section 4.2.3).
  On the CPU (megatron's local spec with every fusion off, models.build) torch
  keeps more of each layer: the recount in `layer_activations`, checked against
  the tensors autograd saves.
- Logits: the last stage holds the [tokens, V/t] logits shard, its gradient
  and the vocab-parallel log-softmax's working memory (at most 1.5x the
  shard, the actor's own target): 3.5 x the shard. On the CPU, as measured:
  CPU_LOGITS_COPIES shards and the output layer's weight gradient.
- Heap kept (CPU): what a training step frees stays in the process
  (CPU_HEAP_KEPT_FRACTION): the push and the next generation run beside it.
- Batch share: each DP rank receives only its rows of the step (actor.distribute):
  S = prompts x samples / D sequences of up to T tokens. On the device, while the
  old-policy forward assembles them: their float32 logprobs [S, T]; for MoE models
  replaying or recording routes (R2, R3, drift metrics), the routes this rank's routers
  use: S x T / (SP x CP) tokens x (an 8-byte key + this stage's MoE layers x K expert
  ids, 1 byte each up to 256 experts, else 2); R3's engine routes arrive with the rows
  and are cut to those (Actor.distribute). Engine routes kept for drift metrics only
  (rollout.return_routed_experts without R3) stay whole: the rows' [S, T, L, K] (int8
  ids up to 128 experts, else int16).
- Engine: vLLM takes `gpu_memory_utilization` of each of its GPUs for its
  weights (split over its TP x PP GPUs) and its KV cache, 2 x layers x
  kv_heads x head_dim values per token. On the CPU it takes its weights, the
  KV cache of rollout.kv_cache_gib (kv_cache_memory_bytes; a server started
  here also gets VLLM_CPU_KVCACHE_SPACE), its own overhead, and a second
  copy of the input embedding and of the output layer: vLLM's CPU embedding
  method packs each for its matmul and keeps the weight too
  (UnquantizedEmbeddingMethod -> dispatch_cpu_unquantized_gemm with
  remove_weight=False; linear layers drop theirs).
- A CPU run's memory is the machine's (`host_memory_bytes`: physical memory,
  or the cgroup's limit), shared by every trainer process on it, each with
  its runtime (python, torch, megatron-core); the engine lives in rank 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config.schema import OFFLOAD_PARTS, RLConfig

if TYPE_CHECKING:
    from megatron_rl.plan.model_spec import ModelSpec

GIB = 1024**3
GPU_RUNTIME_OVERHEAD_GIB = 3.0
"""CUDA context (~0.5-1 GiB), NCCL communicators and buffers, allocator fragmentation."""
CPU_RUNTIME_OVERHEAD_GIB = 1.0
"""Python, torch and megatron-core loaded in one process."""
ENGINE_OVERHEAD_GIB = {"gpu": 2.0, "cpu": 0.7}
"""vLLM's own memory beside weights and KV cache, kept while it sleeps: CUDA context, NCCL communicators,
sampler and logits buffers (on CPU an in-process engine of a tiny model held 1.7 GiB with a 1 GiB KV cache: 0.7 GiB;
about 0.9 GiB left asleep on one 80 GB GPU at TP 1, vLLM PR #11743, and NCCL about 0.5-1 GiB more per rank at
TP 4-8, vLLM PR #51485)."""
ENGINE_CUDA_GRAPH_GIB = 2.0
"""CUDA graphs' memory pool (rollout.enforce_eager=false), on top: it is not under vLLM's sleep allocator, so it
stays while the engine sleeps (vLLM PRs #11743, #56373); vLLM estimates 2.22 GiB for a 35B-A3B MoE at TP 4
(issue #50722), and 7 GiB per GPU stayed asleep for Kimi-K2 at TP 8 with graphs (issue #47654)."""
PUSH_BUCKETS_TRAINER = 2
"""Weight-sync buckets the pushing rank holds at once: the export's bucket and the broadcast's packing buffer
(2.0 measured, bench/results/weight_sync.json)."""
PUSH_BUCKETS_ENGINE = 3
"""Buckets an engine worker holds at once while it loads a push: the received bucket and a fused layer's
parts staged until the layer is complete (at most 3.0 measured, bench/results/weight_sync.json)."""
LOGITS_FACTOR = 3.5
"""Logits shard + its gradient + up to 1.5x working memory of the vocab-parallel log-softmax."""
CPU_LOGITS_COPIES = 2
"""[tokens, V/t] float32 logits shards alive at once on the CPU. Forward: megatron's GPTModel returns the output
layer's [s, b, V] as a contiguous [b, s, V] copy, both alive while it is made (GPTModel._postprocess); the
log-softmax's two row chunks (at most 1/8 of a shard each, actor.logprobs) come once the first is freed. Backward:
the gradient is written into the logits' own storage (in place) and the output layer's weight-gradient GEMM takes a
contiguous copy of its transpose (megatron's prepare_input_tensors_for_wgrad_compute); beside them the output layer's
[V/t, h] weight gradient, made whole before it is added into the gradient buffer (`logits_bytes`). Measured with
8 x 288 tokens and SmolLM2-135M's vocabulary (49,152; a shard 0.42 GiB): the log-probabilities and their backward on
given logits peaked 0.27 shards above them (the chunks); hidden states -> output layer -> contiguous copy ->
log-probabilities -> backward peaked 2.04 shards; a whole training step of the model cut to 2 layers 2.39 shards above
its weights, optimizer state and saved activations (counted here: 2 + the weight gradient's 0.25)."""
CPU_HEAP_KEPT_FRACTION = 0.5
"""Memory a CPU training step holds beyond what lives in it, as a fraction of its activations. glibc's malloc serves
tensors below its mmap threshold (which rises to 32 MiB once a block that large is freed: every activation of a
small model) from its heap and keeps what they free in the process; each layer's backward makes gradients of its
activations beside them, which the freed blocks do not fit exactly. So the step's resident peak runs above the
count, and the memory stays resident after the step (only the logits, above the threshold, go back to the system):
the push and the next generation run beside the activations and this. Measured on SmolLM2-135M's shape (8 x 288
tokens, fp32, the 2nd and 3rd training steps of one process, peak resident memory less the counted terms and the
0.38 GiB of imports): 30 layers 0.36 and 0.40 of the activations (3.46 GiB), 8 layers 0.38 and 0.51, 2 layers 0.25;
the resident memory after a step stayed within 0.2 GiB of the peak less the logits. 0.5: about the largest (0.51)."""


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Bytes per value of each kind of tensor."""

    param: int
    """Model weights (bf16 on GPU, fp32 on CPU)."""
    grad: int
    """Gradient buffer (fp32: megatron accumulates and reduces bf16 models' grads in fp32)."""
    main: int
    """fp32 main copy of the weights kept by the optimizer (0 when the weights are fp32)."""
    moments: int
    """Optimizer moments (Adam: 2 x fp32, SGD with momentum: 1 x fp32)."""
    activation: int
    """Stored activations."""


def precision_for(cfg: RLConfig) -> Precision:
    on_gpu = cfg.cluster.gpus_per_node > 0
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    half = dtype in ("bfloat16", "float16")
    moments = 8 if cfg.optimizer.name == "adam" else 4
    return Precision(param=2 if half else 4, grad=4, main=4 if half else 0, moments=moments, activation=2 if half else 4)


@dataclass(kw_only=True, frozen=True)
class StageMemory:
    """Bytes on one device of one pipeline stage."""

    stage: int
    dense_params: int
    """Non-expert parameters on this device (embedding/output shards included where they live)."""
    expert_params: int
    """Routed-expert parameters on this device."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    reference: float
    """Reference model weights (only when algorithm.beta > 0)."""
    batch_share: float = 0.0
    """This DP rank's rows of the step on the device: logprobs and recorded / replayed routes."""
    heap: float = 0.0
    """CPU: what the training step's allocations hold beyond the count and keep after it (CPU_HEAP_KEPT_FRACTION)."""

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.reference
                + self.batch_share + self.heap)


def _per_rank_layer_dense(spec: ModelSpec, moe: bool, tp: int) -> float:
    """Non-expert weights of one layer on one TP rank: linear weights split, norms and router replicated."""
    replicated = 2 * spec.hidden_size + spec.attention_replicated_params()
    split = spec.attention_params() - spec.attention_replicated_params()
    if moe:
        replicated += spec.router_params()
        split += spec.shared_expert_params()
    else:
        split += spec.dense_mlp_params()
    return replicated + split / tp


def stage_layers(spec: ModelSpec, pp: int, stage: int) -> range:
    per_stage = spec.num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def stage_params(spec: ModelSpec, cfg: RLConfig, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one device of pipeline stage `stage`."""
    par = cfg.parallel
    tp, pp, ep, etp = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel, par.expert_tensor_parallel
    layers = stage_layers(spec, pp, stage)
    dense = sum(_per_rank_layer_dense(spec, spec.moe_layers[i], tp) for i in layers)
    vocab_shard = spec.padded_vocab(tp) * spec.hidden_size / tp
    if stage == 0:
        dense += vocab_shard
    if stage == pp - 1:
        dense += spec.hidden_size  # final norm
        if not spec.tie_embeddings or pp > 1:  # tied + PP keeps a copy of the embedding on the last stage
            dense += vocab_shard
    moe_layers = sum(spec.moe_layers[i] for i in layers)
    expert = moe_layers * (spec.num_experts // ep) * spec.expert_params() / etp
    return dense, expert


@dataclass(kw_only=True, frozen=True)
class LayerActivations:
    """Bytes per token of one layer's activations under model.recompute."""

    kept: float
    """Stored from the layer's forward until its backward."""
    recomputed: float
    """Rematerialised in the layer's backward (alive for one layer at a time)."""


def layer_activations(spec: ModelSpec, moe: bool, cfg: RLConfig, act: int) -> LayerActivations:
    """Bytes one layer stores per token for backward (Korthikanti et al. 2022, sec. 4.1, recounted), by part.

    Elements per token, with t = TP, u = t if sequence parallel else 1 (the
    norm/linear inputs live in the sequence-parallel region, the rest is split
    over heads or the MLP width):
      attention: norm input h                                    -> h / u
                 norm output (the qkv input) h                   -> h / u
                 Q (a d), K and V (g d each), attention output   -> (2 a d + 2 g d) / t
                 q/k before their norms (Qwen3)                  -> (a d + g d) / t
                 softmax statistics (fp32, one per head)         -> 4 a / t bytes
      MLP block: norm input h                                    -> h / u
                 norm output (the router / fc1 input) h          -> h / u
        dense:   gate, up (2f) and down-projection input (f)     -> 3f / t
        MoE:     router logits and probabilities, fp32           -> 8 E / u bytes
                 per routed copy (k per token, gathered over the
                 expert-TP group e): fc1 input h, gate+up 2f_e/e,
                 down input f_e/e, output h                      -> k (2h e + 3 f_e) / u
                 shared expert: 3 f_s / t + output h / u
    On the CPU (megatron's local spec, every fusion off: models.build) torch keeps more (`cpu_unfused`):
      each norm:  its normalised input x / rms(x), which torch's RMSNorm saves for the weight's gradient,
                  and 1 / rms(x) (fp32)                                                    -> h / u + 4 / u bytes
      attention:  RoPE writes Q and K to new tensors while V stays a view of the fused QKV projection's output,
                  which autograd therefore keeps whole (its Q and K parts too)                      -> (a d + g d) / t
      each gated MLP: megatron's unfused glu keeps silu(gate) and `up + glu_linear_offset` (a new
                  tensor even at offset 0) beside gate/up and their product                       -> 2 f / t
                  (2 f_e / e per routed copy, 2 f_s / t for a shared expert)
    Checked: per token and layer of SmolLM2-135M's shape (h 576, 9 heads, 3 KV heads of 64, f 1536; 8 x 288 tokens)
    the storages that autograd saves (torch.autograd.graph.saved_tensors_hooks) hold 13,483 float32 values; this
    count gives 13,451 (6h + 3 (a d + g d) + 5f + the statistics and the norms' 1 / rms), the other 32 being RoPE's
    cos and sin tables ([positions, head_dim], saved by the products with Q and with K: not per token).
    model.recompute (megatron-core's recompute of those parts; models.build.RECOMPUTE_MODULES):
      none:      everything kept;
      selective: the core attention is recomputed: its inputs Q, K, V are kept (the checkpoint's
                 inputs) and the attention output too (the output projection's input), so with a
                 flash kernel only the softmax statistics go (a non-flash kernel's score matrix,
                 which this count never includes, would go too);
      moe:       also the whole MLP block: kept = the norms' inputs and outputs (the MLP
                 block's input among them), Q, K, V, attention output and q/k norm inputs;
                 the MLP block's inside is rematerialised in backward;
      full:      the layer's input h / u is kept, the whole layer rematerialised in backward.
    """
    parts = _layer_parts(spec, moe, cfg, act)
    everything = parts.norms + parts.attention + parts.statistics + parts.mlp
    mode = cfg.model.recompute
    if mode == "selective":
        return LayerActivations(kept=everything - parts.statistics, recomputed=parts.statistics)
    if mode == "moe":
        return LayerActivations(kept=parts.norms + parts.attention, recomputed=parts.mlp)
    if mode == "full":
        return LayerActivations(kept=parts.layer_input, recomputed=everything)
    return LayerActivations(kept=everything, recomputed=0.0)


@dataclass(kw_only=True, frozen=True)
class LayerParts:
    """Bytes per token of one layer's stored tensors, by the part model.recompute treats alike (`layer_activations`)."""

    layer_input: float
    """The layer's input (what full recomputation keeps)."""
    norms: float
    """Both norms' inputs and outputs (and, on the CPU, their normalised inputs)."""
    attention: float
    """Q, K, V, the attention output, the q/k norms' inputs (and, on the CPU, the fused QKV output)."""
    statistics: float
    """The attention's fp32 softmax statistics."""
    mlp: float
    """The MLP block's inside (dense or MoE)."""


def cpu_unfused(cfg: RLConfig) -> bool:
    """The actor runs megatron's local spec with every fusion off: on the CPU (models.build, models.kernels)."""
    return cfg.cluster.gpus_per_node == 0


def _layer_parts(spec: ModelSpec, moe: bool, cfg: RLConfig, act: int) -> LayerParts:
    """Bytes per token of each part of one layer's stored tensors (see `layer_activations`)."""
    par = cfg.parallel
    t = par.tensor_parallel
    u = t if par.use_sequence_parallel() else 1
    h, q, kv = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    unfused = cpu_unfused(cfg)
    glu_kept = 5 if unfused else 3  # gate/up (2), the product (1); unfused also silu(gate) and up + offset
    norm = h / u * act
    # two norms: input, output (unfused also the normalised input, and 1 / rms(x): one fp32 per token)
    norms = 6 * norm + 2 * 4 / u if unfused else 4 * norm
    attention = ((2 * q + 2 * kv) / t + ((q + kv) / t if spec.qk_norm else 0.0) + ((q + kv) / t if unfused else 0.0)) * act
    statistics = 4 * spec.num_attention_heads / t
    if moe:
        e = par.expert_tensor_parallel
        mlp = spec.experts_per_token * (2 * h * e + glu_kept * spec.moe_ffn_hidden_size) / u * act + 8 * spec.num_experts / u
        if spec.shared_expert_ffn_hidden_size:
            mlp += (glu_kept * spec.shared_expert_ffn_hidden_size / t + h / u) * act
    else:
        mlp = glu_kept * spec.ffn_hidden_size / t * act
    return LayerParts(layer_input=norm, norms=norms, attention=attention, statistics=statistics, mlp=mlp)


def layer_activation_bytes(spec: ModelSpec, moe: bool, cfg: RLConfig, act: int) -> float:
    """Bytes one layer stores per token for backward without recomputation (`layer_activations`)."""
    parts = _layer_parts(spec, moe, cfg, act)
    return parts.norms + parts.attention + parts.statistics + parts.mlp


def batch_share_bytes(spec: ModelSpec, cfg: RLConfig, dp: int, stage_moe_layers: int | None = None) -> float:
    """Device bytes of one DP rank's share of the step on a stage with `stage_moe_layers` (see the module docstring)."""
    rollout, algo, par = cfg.rollout, cfg.algorithm, cfg.parallel
    seq = rollout.max_prompt_tokens + rollout.max_new_tokens
    rows = -(-cfg.train.prompts_per_step * rollout.n_samples // dp)
    total = rows * seq * 4.0  # float32 logprobs
    if not spec.is_moe:
        return total
    engine_routes = algo.routing_replay == "R3" or rollout.return_routed_experts
    if engine_routes and algo.routing_replay != "R3":  # metrics only: every layer, int8 up to 128 experts, else int16
        total += rows * seq * spec.num_moe_layers * spec.experts_per_token * (1 if spec.num_experts <= 128 else 2)
    if algo.routing_replay != "none" or cfg.train.routing_drift_metrics or engine_routes:
        layers = spec.num_moe_layers if stage_moe_layers is None else stage_moe_layers
        token_split = (par.tensor_parallel if par.use_sequence_parallel() else 1) * par.context_parallel
        expert_id = 1 if spec.num_experts <= 256 else 2
        total += rows * seq / token_split * (8 + layers * spec.experts_per_token * expert_id)
    return total


def tokens_per_microbatch(cfg: RLConfig) -> int:
    """Tokens one microbatch holds on one context-parallel rank (sequences at full length)."""
    seq = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = cfg.train.max_tokens_per_microbatch or cfg.train.micro_batch_size * seq
    return -(-tokens // cfg.parallel.context_parallel)


def logits_bytes(spec: ModelSpec, cfg: RLConfig, tokens: int) -> float:
    """Bytes of the last stage's logits path for one microbatch of `tokens` tokens (the module docstring, Logits).

    GPU: LOGITS_FACTOR x the [tokens, V/t] shard. CPU: CPU_LOGITS_COPIES shards in float32, the output layer's
    [V/t, h] weight gradient, and the tokens' final-norm input, normalised input and output-layer input (3 h each)."""
    prec, par = precision_for(cfg), cfg.parallel
    shard = spec.padded_vocab(par.tensor_parallel) / par.tensor_parallel
    if not cpu_unfused(cfg):
        return LOGITS_FACTOR * tokens * shard * prec.activation
    sequence_split = par.tensor_parallel if par.use_sequence_parallel() else 1
    final_norm_and_input = 3 * tokens * spec.hidden_size / sequence_split * prec.activation
    return CPU_LOGITS_COPIES * tokens * shard * 4 + shard * spec.hidden_size * prec.param + final_norm_and_input


def stage_memory(spec: ModelSpec, cfg: RLConfig, world: int, microbatches: int, stage: int) -> StageMemory:
    par = cfg.parallel
    prec = precision_for(cfg)
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    dp = world // (tp * pp * cp)
    expert_dp = world // (par.expert_tensor_parallel * par.expert_parallel * pp)
    dense, expert = stage_params(spec, cfg, stage)
    params = dense + expert
    state_bytes = prec.main + prec.moments
    if cfg.optimizer.use_distributed_optimizer:
        optimizer = state_bytes * (dense / (dp * cp) + expert / expert_dp)
    else:
        optimizer = state_bytes * params

    tokens = tokens_per_microbatch(cfg)
    layers = stage_layers(spec, pp, stage)
    in_flight = max(1, min(pp - stage, microbatches))
    per_layer = [layer_activations(spec, spec.moe_layers[i], cfg, prec.activation) for i in layers]
    # Kept parts of every microbatch in flight, + the largest part rematerialised in one layer's backward.
    activations = tokens * (in_flight * sum(a.kept for a in per_layer) + max((a.recomputed for a in per_layer), default=0.0))
    logits = logits_bytes(spec, cfg, tokens) if stage == pp - 1 else 0.0
    reference = params * prec.param if cfg.algorithm.beta > 0 else 0.0
    return StageMemory(
        heap=CPU_HEAP_KEPT_FRACTION * activations if cpu_unfused(cfg) else 0.0,
        batch_share=batch_share_bytes(spec, cfg, dp, sum(spec.moe_layers[i] for i in layers)),
        stage=stage,
        dense_params=round(dense),
        expert_params=round(expert),
        weights=params * prec.param,
        grads=params * prec.grad,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        reference=reference,
    )


def worst_stage(spec: ModelSpec, cfg: RLConfig, world: int, microbatches: int) -> StageMemory:
    """The pipeline stage whose devices need the most memory."""
    stages = [stage_memory(spec, cfg, world, microbatches, s) for s in range(cfg.parallel.pipeline_parallel)]
    return max(stages, key=lambda m: m.total)


@dataclass(kw_only=True, frozen=True)
class EngineMemory:
    """Memory of one rollout engine device."""

    weights: float
    """Engine weights on one of its devices."""
    reserved: float
    """What the engine takes on that device (gpu_memory_utilization x memory on GPU; weights + KV on CPU)."""
    kv_bytes_per_token: float
    """KV cache bytes one token takes on one engine device."""
    kv_tokens: int
    """Tokens the KV cache holds (on one engine)."""


def engine_overhead(cfg: RLConfig) -> float:
    """Bytes an engine holds on a device beside its weights and KV cache, awake or asleep (CUDA graphs included
    when it captures them)."""
    if cfg.cluster.gpus_per_node <= 0:
        return ENGINE_OVERHEAD_GIB["cpu"] * GIB
    graphs = 0.0 if cfg.rollout.enforce_eager else ENGINE_CUDA_GRAPH_GIB
    return (ENGINE_OVERHEAD_GIB["gpu"] + graphs) * GIB


def engine_memory(spec: ModelSpec, cfg: RLConfig) -> EngineMemory:
    rollout, cluster = cfg.rollout, cfg.cluster
    prec = precision_for(cfg)
    etp, epp = rollout.tensor_parallel, rollout.pipeline_parallel
    weights = spec.total_params() * prec.param / (etp * epp)
    kv_per_token = (spec.num_layers / epp) * spec.kv_cache_values_per_token(etp) * prec.param
    if cluster.gpus_per_node > 0:
        reserved = rollout.gpu_memory_utilization * cluster.gpu_memory_gib * GIB
        kv_space = reserved - weights - engine_overhead(cfg)
    else:
        kv_space = rollout.kv_cache_gib * GIB
        packed_vocab = 2 * spec.padded_vocab(etp) * spec.hidden_size / etp * prec.param  # module docstring, Engine
        reserved = weights + packed_vocab + kv_space + ENGINE_OVERHEAD_GIB["cpu"] * GIB
    return EngineMemory(
        weights=weights, reserved=reserved, kv_bytes_per_token=kv_per_token, kv_tokens=max(0, int(kv_space // kv_per_token))
    )


def host_memory_bytes() -> int:
    """This machine's memory: its physical memory, or its cgroup's limit where that is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def device_budget(cfg: RLConfig, processes_per_node: int = 1) -> float:
    """Bytes one device offers the trainer and a colocated engine together, after the runtime.

    On a CPU cluster the device is the machine (host_memory_bytes, not cluster.gpu_memory_gib), less the runtime
    of each of its `processes_per_node` trainer processes; the planner counts the other processes' actors."""
    if cfg.cluster.gpus_per_node > 0:
        return (cfg.cluster.gpu_memory_gib - GPU_RUNTIME_OVERHEAD_GIB) * GIB
    return host_memory_bytes() - processes_per_node * CPU_RUNTIME_OVERHEAD_GIB * GIB


@dataclass(kw_only=True, frozen=True)
class PhaseMemory:
    """What one device holds during one phase of an RL step."""

    name: str
    """generation, push or training."""
    actor: float
    """The actor's bytes on the device (what train.offload has not moved to the host)."""
    engine: float
    """The colocated engine's bytes on the device (what rollout.sleep_level has not released)."""
    push_buffers: float = 0.0
    """Weight-sync buckets alive during the push (PUSH_BUCKETS_TRAINER + PUSH_BUCKETS_ENGINE)."""

    @property
    def total(self) -> float:
        return self.actor + self.engine + self.push_buffers


def phase_memory(stage: StageMemory, engine: EngineMemory | None, cfg: RLConfig, model_bytes: float) -> list[PhaseMemory]:
    """Bytes on the worst device in each phase of a step, in the trainer's order (megatron_rl.trainer):

    1. generation: the engine awake (weights + KV cache, its whole reservation);
       the actor's states less what train.offload moved to the host;
    2. training: every actor term (weights, gradients, optimizer state,
       activations, logits, reference, batch share); the engine asleep at
       rollout.sleep_level 1 or 2 keeps only its own overhead (vLLM's sleep
       mode: level 1 moves the weights to host memory and drops the KV cache,
       level 2 drops both; vllm/entrypoints/llm.py, LLM.sleep), at 0 all of it;
    3. push: the optimizer state and gradients have left (offload) before the
       engine's weights wake (not its KV cache, woken after the push, once the
       parameters have left too): parameters + the engine's weights + the
       push's buckets.
    Offload and sleep free nothing on CPU, where host and device are one memory, and the memory a training step
    frees stays in the process (CPU_HEAP_KEPT_FRACTION): the push and the next step's generation hold the
    activations and the heap term too (not the logits, given back to the system).
    An engine on GPUs of its own (cluster.rollout_gpus) is not on the device.
    model_bytes: the whole model in the engine's dtype (no bucket is larger).
    """
    gpu = cfg.cluster.gpus_per_node > 0
    moved = OFFLOAD_PARTS[cfg.train.offload] if gpu else ()
    s = stage
    kept_after_training = 0.0 if gpu else s.activations + s.heap
    kept = {
        "params": 0.0 if "params" in moved else s.weights,
        "grads": 0.0 if "grads" in moved else s.grads,
        "optimizer": 0.0 if "optimizer" in moved else s.optimizer,
    }
    colocated = engine is not None and cfg.cluster.rollout_gpus == 0
    awake = engine.reserved if colocated else 0.0
    overhead = engine_overhead(cfg)
    sleeps = colocated and gpu and cfg.rollout.sleep_level > 0
    bucket = min(cfg.rollout.weight_bucket_mb * (1 << 20), model_bytes)
    push_buffers = bucket * (PUSH_BUCKETS_TRAINER + (PUSH_BUCKETS_ENGINE if colocated else 0))
    return [
        PhaseMemory(name="generation", actor=sum(kept.values()) + s.reference + kept_after_training, engine=awake),
        PhaseMemory(name="training", actor=s.total, engine=overhead if sleeps else awake),
        PhaseMemory(
            name="push", actor=s.weights + kept["grads"] + kept["optimizer"] + s.reference + kept_after_training,
            engine=engine.weights + overhead if sleeps else awake, push_buffers=push_buffers,
        ),
    ]
