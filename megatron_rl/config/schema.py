"""The configuration schema: one kw_only dataclass per component.

Every field carries a docstring saying what it does and its unit. Cross-field
checks that need no process group live in each class's `validate()`; the
parallel layout is checked against the world size and the model's shape by
`megatron_rl.config.layout.check_layout` before torch.distributed starts.
Two sections have modules of their own, megatron_rl.config.algorithm and
megatron_rl.config.rollout (RolloutConfig is importable from here as well);
RLConfig gathers every section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.core import ConfigError, check_at_least
from megatron_rl.config.rollout import RolloutConfig


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor's model is split over ranks. DP is whatever is left of the world."""

    tensor_parallel: int = 1
    """Tensor-parallel size (TP): attention heads and MLP columns split over this many ranks."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (PP): layers split into this many stages."""
    expert_parallel: int = 1
    """Expert-parallel size (EP): MoE experts split over this many ranks (carved from DP x CP)."""
    expert_tensor_parallel: int | None = None
    """Tensor-parallel size inside each expert (megatron's expert_tensor_parallel_size).

    None = tensor_parallel when expert_parallel is 1 (megatron then syncs expert
    gradients over the dense data-parallel group, so expert copies on TP ranks
    would drift apart under any other value), else 1."""
    context_parallel: int = 1
    """Context-parallel size (CP): the sequence split over this many ranks."""
    sequence_parallel: bool | None = None
    """Shard activations along the sequence between TP ranks; None = on whenever TP > 1 (MoE requires it)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto = nccl when CUDA is present, else gloo."""
    timeout_s: float = 600.0
    """Collective timeout in seconds: a rank that fails makes the others exit instead of waiting forever."""

    def __post_init__(self) -> None:
        if self.expert_tensor_parallel is None:
            self.expert_tensor_parallel = self.tensor_parallel if self.expert_parallel == 1 else 1

    def validate(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_tensor_parallel", "context_parallel"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"parallel.{name}={value}: parallel sizes are whole numbers >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s}: must be > 0 seconds")

    def use_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel


@dataclass(kw_only=True)
class ModelConfig:
    """Which model the actor builds and how its megatron-core layers are set up."""

    path: str = ""
    """Directory holding a Hugging Face config.json (and safetensors weights to load, if any)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter/compute dtype; auto = bfloat16 on GPU, float32 on CPU."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer spec: Transformer Engine when importable on GPU (auto), else megatron's local spec."""
    token_dispatcher: Literal["auto", "sorted", "alltoall", "allgather"] = "auto"
    """MoE token dispatch: sorted = models.moe's path (router output kept as [tokens, top-k], one gather each way,
    no host sync; the local spec with every expert on its rank: expert parallel x expert tensor parallel = 1);
    alltoall / allgather = megatron's dispatchers (moe_token_dispatcher_type); auto = sorted where it applies,
    else alltoall (models.kernels; the start-up line says which)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient (0 disables it)."""
    moe_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    """Load-balancing loss type when moe_aux_loss_coeff > 0."""
    moe_grouped_gemm: bool | None = None
    """Run each MoE layer's routed experts as grouped GEMMs (megatron's moe_grouped_gemm): Transformer Engine's
    TEGroupedMLP when TE imports, else megatron-core's GroupedMLP on the grouped_gemm package or torch's
    grouped matmul (torch._grouped_mm: bf16 on compute capability 9.0+, and CPU). False: SequentialMLP, one
    GEMM per expert. None (auto): grouped where a grouped kernel runs on the GPU, SequentialMLP on CPU
    (models.kernels; the start-up line says which)."""
    fusions: bool = True
    """Turn on each megatron fusion whose kernel exists here (models.kernels: jit-fused bias-SwiGLU and
    bias-dropout-add with triton on CUDA, RoPE / router fusion with Transformer Engine, ...); False turns every
    one off (for before/after measurements). On CPU none exists."""
    compile_regions: bool = False
    """torch.compile (dynamic shapes: one compilation serves every microbatch size) the small ops each layer runs
    around its kernels: the packed RoPE of the query and key (models.rope), fused into a kernel or two each way.
    Off by default until measured on a GPU (bench/op_count.py --compile counts its recompilations); the start-up
    line says which regions are compiled."""
    packed_attention: Literal["auto", "varlen", "per_sequence"] = "auto"
    """Packed (THD) attention of the local spec: varlen = torch's flash varlen kernel, one call per microbatch
    (CUDA, bf16/fp16, no context parallelism); per_sequence = one exact SDPA per sequence; auto = varlen where
    it runs, else per_sequence. Ignored with Transformer Engine (its own attention)."""
    moe_permute_fusion: bool = False
    """Transformer Engine's fused token permute / unpermute in the MoE dispatcher (megatron's moe_permute_fusion);
    needs Transformer Engine."""
    recompute: Literal["none", "selective", "moe", "full"] = "none"
    """Activation recomputation in backward (megatron-core's recompute settings), compute traded for memory:
    none = keep every activation; selective = each layer's core attention softmax(QK^T)V (recompute_modules
    core_attn: frees the softmax statistics, or the score matrix of a non-flash kernel); moe = also each layer's
    MLP block, the whole MoE layer (router, dispatch, experts, combine, shared experts) or a dense MLP (core_attn,
    moe, mlp: the MoE layer's k copies of each token are the largest activations of a sparse model); full = every transformer layer, keeping only its input (granularity full, uniform, 1 layer).
    `megatron-rl plan` estimates the activation memory of each choice."""
    recompute_activations: bool = False
    """Replaced by `recompute` (true = recompute=full); only false is accepted."""
    init_seed: int = 1234
    """Seed for random initialisation when no weights are loaded."""
    load_weights: bool = True
    """Load the safetensors weights in `path` (False: random init from the config)."""
    make_tiny_if_missing: Literal["", "llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"] = ""
    """When `path` does not exist, first build a tiny random model of this family there (megatron_rl.models.tiny,
    seed `init_seed`), as the CPU demo does: the tiny presets run from a fresh clone. Only at the path the preset
    itself gives (a `model.path=...` typed on the command line that does not exist stays an error, unless
    `make_tiny`). Empty: a missing path is an error."""
    make_tiny: bool = False
    """Build the tiny random model (family `make_tiny_if_missing`, qwen3_moe when empty) at a missing `path` even
    when `path` is not the preset's own, e.g. `model.path=outputs/tiny-b model.make_tiny=true`."""

    def validate(self) -> None:
        if self.recompute_activations:
            raise ConfigError(
                "model.recompute_activations=true was replaced by model.recompute: set model.recompute=full (or moe, "
                "selective) and remove model.recompute_activations"
            )


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam with warmup + decay, through megatron's (distributed) optimizer."""

    name: Literal["adam", "sgd"] = "adam"
    """Optimizer type."""
    lr: float = 1.0e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """How the learning rate goes from lr to min_lr after warmup."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1.0e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1, megatron's distributed optimizer)."""
    sgd_momentum: float = 0.0
    """Momentum of the SGD optimizer (name=sgd); unused by Adam."""
    lr_decay_steps: int = 0
    """Optimizer steps over which the learning rate decays from lr to min_lr (after warmup);
    0 = the run's optimizer steps (train.steps x train.mini_batches_per_step)."""

    def validate(self) -> None:
        if self.lr < 0 or self.min_lr < 0:
            raise ConfigError(f"optimizer.lr={self.lr}, optimizer.min_lr={self.min_lr}: learning rates must be >= 0")
        check_at_least("optimizer.clip_grad", self.clip_grad, 0, "0 disables clipping")
        check_at_least("optimizer.weight_decay", self.weight_decay, 0, "0 disables weight decay")
        for key, beta in (("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2), ("sgd_momentum", self.sgd_momentum)):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"optimizer.{key}={beta}: must be in [0, 1), e.g. adam_beta1=0.9, adam_beta2=0.999")
        if self.adam_eps <= 0:
            raise ConfigError(f"optimizer.adam_eps={self.adam_eps}: must be > 0, e.g. 1.0e-8")
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} is above optimizer.lr={self.lr}: set min_lr <= lr")
        if self.warmup_steps < 0 or self.lr_decay_steps < 0:
            raise ConfigError(
                f"optimizer.warmup_steps={self.warmup_steps}, optimizer.lr_decay_steps={self.lr_decay_steps}: must be >= 0"
            )
        check_at_least("optimizer.sgd_momentum", self.sgd_momentum, 0)


OFFLOAD_PARTS: dict[str, tuple[str, ...]] = {"none": (), "optimizer": ("optimizer",), "all": ("optimizer", "grads", "params")}
"""What each train.offload mode moves to the host: the optimizer's state, the gradient buffers, the parameters
(megatron_rl.actor.offload moves them; megatron_rl.plan.memory counts what that frees)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Batch shape of one RL step and how it is cut into optimizer steps and microbatches."""

    steps: int = 10
    """RL steps (generate -> train -> sync) to run."""
    prompts_per_step: int = 8
    """Prompt groups per RL step (the train batch after dynamic sampling)."""
    mini_batches_per_step: int = 1
    """Optimizer steps per RL step; each takes an equal share of the groups."""
    micro_batch_size: int = 1
    """Sequences per microbatch (when max_tokens_per_microbatch is 0)."""
    max_tokens_per_microbatch: int = 0
    """Token budget per microbatch; > 0 fills microbatches up to this many tokens: packed, the sum of the
    sequences' lengths (each padded only to the multiple TP sequence parallelism / CP need; a sequence
    above the budget is an error); padded rows, rows x padded width (a longer sequence gets a microbatch
    of its own)."""
    pack_sequences: bool = False
    """Packed microbatches (THD): whole sequences back to back in one row with megatron's PackedSeqParams,
    position ids restarting per sequence; no padding row or column goes through the model. Required by
    context parallelism. False: right-padded rows."""
    old_logprobs: Literal["auto", "forward", "training_forward"] = "auto"
    """Where the PPO ratio's old-policy logprobs come from. forward: a forward-only pass over the step's rows
    before training (actor.prepare_batch). training_forward: the first mini-batch's optimizer step runs at the
    old policy's weights, so its training forward's own logprobs, detached, are its old logprobs (the ratio
    exactly 1, the same gradient); the forward-only pass covers only the other mini-batches' rows, and with
    mini_batches_per_step=1 it does not run (a third of the actor's FLOPs per step). Needs an
    algorithm.tis_mode that drops no token (none, token, sequence); under routing_replay=R2 the first
    mini-batch's own routes are the old policy's. auto: training_forward where it applies, else forward
    (algorithm.bypass_mode takes the engine's logprobs: neither runs)."""
    routing_drift_metrics: bool = True
    """MoE: record the old-policy forward's experts even without routing replay, so that train_step logs
    routing/drift per layer (costs one all-reduce of B x T x MoE-layers x top-k bytes per RL step). Where the
    first mini-batch's training forward is the old policy (train.old_logprobs) its drift is 0 by construction:
    routing/drift is then over the later mini-batches (not logged with one mini-batch)."""
    compute_entropy: bool = True
    """Compute the policy's entropy at each response token in the training forward (logged as `entropy`;
    always computed, with gradient, when algorithm.entropy_coeff > 0)."""
    seed: int = 42
    """Seed for data order, sampling and everything random in the loop."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """Move the actor's memory to (pinned) host memory while the engine generates and back before the
    old-policy forward: optimizer = the optimizer's state; all = also parameters and gradient buffers, the
    optimizer's state and gradients before the weight push and the parameters after it
    (megatron_rl.actor.offload). Needs synchronous generation (off_policy_lag 0, max_staleness 0)."""
    off_policy_lag: Literal[0, 1] = 0
    """1 = generate step k+1 while training step k (importance-corrected one-step off-policy)."""
    max_staleness: int = 0
    """> 0 = asynchronous training: rollout runs continuously beside training and each step trains on groups
    sampled at most this many weight versions ago (older ones are dropped and counted); 0 = synchronous."""
    partial_rollouts: bool = False
    """With max_staleness > 0: a weight push interrupts the generation in progress after the engine's current
    decode step; the samples in flight keep their tokens and continue under the new weights, each token
    tagged with its weight version and engine logprob (rollout.partial). False = a push waits for the
    generation batch in progress."""
    partial_rollout_tokens: int = 0
    """Replaced by partial_rollouts (generation is no longer chunked); only 0 is accepted."""
    eval_every: int = 0
    """Evaluate data.eval_sets every this many steps (0 = only at eval_before_train and after the last step)."""
    eval_before_train: bool = True
    """Evaluate data.eval_sets before the first step (the step-0 score the run is judged against)."""
    stop_at_reward: float = 0.0
    """Stop early once the mean reward of the last 10 steps reaches this (0 = run all train.steps)."""

    def validate(self) -> None:
        if self.steps < 0 or self.prompts_per_step < 1 or self.mini_batches_per_step < 1 or self.micro_batch_size < 1:
            raise ConfigError(
                f"train.steps={self.steps}, train.prompts_per_step={self.prompts_per_step}, "
                f"train.mini_batches_per_step={self.mini_batches_per_step}, train.micro_batch_size={self.micro_batch_size}: "
                "steps must be >= 0 and the batch sizes >= 1"
            )
        if self.prompts_per_step % self.mini_batches_per_step:
            raise ConfigError(
                f"train.prompts_per_step={self.prompts_per_step} is not divisible by "
                f"train.mini_batches_per_step={self.mini_batches_per_step}: choose sizes where each optimizer step gets whole groups"
            )
        check_at_least("train.max_tokens_per_microbatch", self.max_tokens_per_microbatch, 0, "0 = by count")
        check_at_least("train.max_staleness", self.max_staleness, 0)
        check_at_least("train.eval_every", self.eval_every, 0, "0 = evaluate only before and after training")
        if self.partial_rollout_tokens:
            raise ConfigError(
                f"train.partial_rollout_tokens={self.partial_rollout_tokens}: chunked partial rollouts were replaced by "
                "train.partial_rollouts=true (a push now interrupts generation after the current decode step, not at "
                "a chunk boundary); set train.partial_rollouts=true and remove train.partial_rollout_tokens"
            )
        if self.offload != "none" and (self.off_policy_lag or self.max_staleness):
            raise ConfigError(
                f"train.offload={self.offload} with train.off_policy_lag={self.off_policy_lag}, train.max_staleness="
                f"{self.max_staleness}: offload frees the actor's memory while the engine generates, but there "
                "generation overlaps training; set train.offload=none or generate synchronously"
            )
        if self.max_staleness and self.off_policy_lag:
            raise ConfigError(
                f"train.off_policy_lag={self.off_policy_lag} with train.max_staleness={self.max_staleness}: pick one "
                "(max_staleness=1 is the asynchronous form of a one-step lag)"
            )
        if self.partial_rollouts and not self.max_staleness:
            raise ConfigError(
                "train.partial_rollouts=true needs train.max_staleness >= 1 "
                "(partial rollouts continue samples across the weight pushes of asynchronous training)"
            )


@dataclass(kw_only=True)
class DataConfig:
    """Prompt dataset and tokenizer."""

    path: str = ""
    """jsonl or parquet file of prompts, or a built-in task: synthetic:<task>[:<num_prompts>[:<seed>]] with task one of
    add, first_letter, first_letter8, last_letter, lookup8 (megatron_rl.data.tasks)."""
    prompt_key: str = "prompt"
    """Field holding the prompt text (or chat messages)."""
    answer_key: str = "answer"
    """Field holding the reference answer passed to the reward."""
    tokenizer: str = ""
    """HF tokenizer directory or sentencepiece .model file; empty = model.path."""
    apply_chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template."""
    long_prompts: Literal["drop", "error"] = "drop"
    """What to do with prompts longer than rollout.max_prompt_tokens."""
    reward: str = "math"
    """Reward function: exact, math, or an import path 'package.module:function' called as
    fn(response, answer, *, prompt) -> float (megatron_rl.rollout.rewards)."""
    shuffle: bool = True
    """Shuffle prompts every epoch (seeded by train.seed)."""
    eval_sets: dict[str, Any] = field(default_factory=dict)
    """Held-out sets evaluated whole (at train.eval_before_train, every train.eval_every steps, after the last step,
    and by `megatron-rl eval`): {name: path} or {name: {path, k, temperature, top_p, max_new_tokens, reward, ...}}
    (megatron_rl.config.evaluation.EvalSetConfig)."""
    eval_path: str = ""
    """Replaced by eval_sets; only empty is accepted."""
    eval_samples: int = 0
    """Replaced by eval_sets.<name>.k; only 0 is accepted."""

    def validate(self) -> None:
        if self.eval_path or self.eval_samples:
            raise ConfigError(
                f"data.eval_path={self.eval_path!r}, data.eval_samples={self.eval_samples}: replaced by data.eval_sets, which "
                "evaluates whole sets; write data.eval_sets={eval: {path: <file>, k: <samples per prompt>}}"
            )
        from megatron_rl.config.evaluation import parse_eval_sets
        from megatron_rl.config.synthetic import SYNTHETIC_PREFIX, parse_synthetic

        if self.path.startswith(SYNTHETIC_PREFIX):
            parse_synthetic(self.path, "data.path")
        self.eval_sets = parse_eval_sets(self.eval_sets)


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming."""

    dir: str = "outputs/checkpoints"
    """Directory for step_XXXXXX checkpoints and the `latest` pointer."""
    save_every: int = 0
    """Save every this many RL steps (0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a successful save."""
    resume: str = "none"
    """'auto' = continue from `latest` if present; 'none'; or a path: a step_XXXXXXXX checkpoint directory, or a run's
    checkpoint.dir (what its `latest` names). Hugging Face weights go in model.path. The launch scripts pass 'auto', and a
    run torchrun restarts (cluster.max_restarts) continues from `latest` whatever this says."""
    optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """How the distributed optimizer's state is saved. dp_reshardable: each rank writes and reads its own shard, with
    no gather (resume on the same TP / PP / EP / expert-TP / CP layout, any data-parallel size). fully_reshardable:
    resume on any layout, but while saving and loading every rank holds its model-parallel slice's whole optimizer
    state, gathered over data parallelism (DP times its own shard in host memory)."""
    load: str = ""
    """`megatron-rl eval`: the megatron checkpoint to score (a step_XXXXXXXX directory, a run's checkpoint root, or a
    converted checkpoint), converted to HF on the fly; empty = score model.path."""


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go (rank 0 only)."""

    dir: str = "outputs"
    """Run directory for metrics.jsonl, tensorboard, plots."""
    wandb: bool = False
    """Log to Weights & Biases (offline unless the user has logged in)."""
    wandb_project: str = "megatron_rl"
    """W&B project name."""
    tensorboard: bool = False
    """Write tensorboard event files."""
    progress_bar: bool = True
    """Show a progress bar with the live reward."""
    summary_every: int = 25
    """Print a line of means over this many steps (reward, response length, entropy, seconds per phase); 0 = never."""

    def validate(self) -> None:
        check_at_least("logging.summary_every", self.summary_every, 0, "0 = no summary lines")


@dataclass(kw_only=True)
class ClusterConfig:
    """The machines a run is planned for (the planner and launch scripts read this)."""

    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int = 0
    """GPUs per node (0 = CPU run; one process per `cpu_processes`)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (CPU runs: not read; the planner takes the machine's memory, plan.memory.host_memory_bytes)."""
    gpu_name: str = "cpu"
    """GPU model name, for reports (e.g. H100-80GB)."""
    rollout_gpus: int = 0
    """GPUs set aside for the rollout engine (0 = colocated with the trainer)."""
    cpu_processes: int = 1
    """Trainer processes on a CPU-only run."""
    cpu_threads: int = 0
    """Torch threads of each trainer process on a CPU-only run (an in-process engine shares them);
    0 = OMP_NUM_THREADS where it is set, else the cores the process may run on divided by cpu_processes."""
    push_link_gb_per_s: float = 50.0
    """GB/s of the link between one trainer rank and one engine worker, for the planner's weight-push time
    (megatron_rl.plan.push_time; 50 = 400 Gb/s InfiniBand per GPU)."""
    max_restarts: int = 3
    """Times the launch scripts' torchrun starts every trainer process again after one of them dies (torchrun
    --max-restarts); each restart resumes from the newest complete checkpoint. 0 = a failure ends the job."""

    def validate(self) -> None:
        check_at_least("cluster.cpu_threads", self.cpu_threads, 0, "0 = the cores divided by cluster.cpu_processes")
        if self.push_link_gb_per_s <= 0:
            raise ConfigError(f"cluster.push_link_gb_per_s={self.push_link_gb_per_s}: must be > 0 (GB/s of one rank's link)")
        check_at_least("cluster.max_restarts", self.max_restarts, 0, "0 = a dead rank ends the job")

    @property
    def trainer_world_size(self) -> int:
        if self.gpus_per_node == 0:
            return self.cpu_processes
        return self.nodes * self.gpus_per_node - self.rollout_gpus


def old_logprobs_source(train: TrainConfig, algorithm: AlgorithmConfig) -> tuple[str, str]:
    """(source, why): where a step's old-policy logprobs come from under train.old_logprobs (see it).

    source: "rollout" (algorithm.bypass_mode), "training_forward" or "forward"; why: where from and why, for the
    start-up line. Raises ConfigError for train.old_logprobs=training_forward where it cannot apply.
    """
    from megatron_rl.config.algorithm import TRUNCATING_IS_CORRECTIONS

    if train.old_logprobs == "forward" and not algorithm.bypass_mode:
        return "forward", "a forward of their own (train.old_logprobs=forward)"
    blockers = ["algorithm.bypass_mode takes the engine's logprobs as the old policy"] if algorithm.bypass_mode else []
    if algorithm.tis_mode not in ("none", *TRUNCATING_IS_CORRECTIONS):
        blockers.append(f"algorithm.tis_mode={algorithm.tis_mode} drops tokens by the old logprobs, which sets the step's "
                        "denominators before any training forward")
    if blockers and train.old_logprobs == "training_forward":
        raise ConfigError(f"train.old_logprobs=training_forward cannot apply: {'; '.join(blockers)}; set train.old_logprobs="
                          "auto (a forward of its own where one is needed) or change those settings")
    if algorithm.bypass_mode:
        return "rollout", "the engine's (algorithm.bypass_mode)"
    if blockers:
        return "forward", f"a forward of their own ({'; '.join(blockers)})"
    if train.mini_batches_per_step == 1:
        return "training_forward", "the training forward's own (one optimizer step per RL step: it runs at the old policy's weights)"
    return "training_forward", (f"the first of {train.mini_batches_per_step} mini-batches' training forward (it runs at the old "
                                "policy's weights); a forward of their own for the other mini-batches' rows")


@dataclass(kw_only=True)
class RLConfig:
    """One RL run: every component's config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The actor's model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The actor's parallel layout."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, policy loss and data-side filters."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch shape and loop length."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts, tokenizer and reward."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Machines the run is planned for."""

    def validate(self) -> None:
        """Checks that span sections (each section validates itself first)."""
        self._validate_sampling_truncation()
        self._validate_partial_rollouts()
        if self.rollout.sleep_level and (self.train.off_policy_lag or self.train.max_staleness):
            raise ConfigError(
                f"rollout.sleep_level={self.rollout.sleep_level} with train.off_policy_lag={self.train.off_policy_lag}, "
                f"train.max_staleness={self.train.max_staleness}: the engine would sleep while it generates the next "
                "batch; set rollout.sleep_level=0 or generate synchronously"
            )
        self._validate_asynchronous_correction()
        old_logprobs_source(self.train, self.algorithm)  # refuses training_forward where it cannot apply

    def _validate_asynchronous_correction(self) -> None:
        """Asynchronous training without an importance-sampling correction is refused.

        Step k trains on samples of weight versions k - max_staleness .. k, but its
        old-policy forward (the ratio's anchor and clip centre) runs at version k:
        without a correction the update treats the older policy's samples as samples
        of the current one (on the demo task that halves the reward reached at
        max_staleness 2, `bench/results/async.json`). tis_mode=token weights each
        token by pi_old / pi_rollout: AReaL's decoupled objective (arXiv 2505.24298,
        Sec. 5.2), which gspo applies per token. Bypass mode (the clip around the
        sampling policy) is accepted too.
        """
        train, algo = self.train, self.algorithm
        if train.max_staleness and algo.tis_mode == "none" and not algo.bypass_mode:
            raise ConfigError(
                f"train.max_staleness={train.max_staleness} with algorithm.tis_mode=none: each step trains on samples up to "
                f"{train.max_staleness} weight versions old while its ratio is taken against the current weights, so nothing "
                "corrects for the older policy that sampled them; set algorithm.tis_mode=token (each token weighted by "
                "pi_old / pi_rollout: the decoupled objective, per token also under loss=gspo), or algorithm.bypass_mode=true "
                "(the clip then bites around the sampling policy)"
            )

    def _validate_partial_rollouts(self) -> None:
        if self.train.partial_rollouts and self.rollout.function != "generate":
            raise ConfigError(f"train.partial_rollouts=true with rollout.function={self.rollout.function!r}: only the "
                              "built-in generate is interrupted at a push; set train.partial_rollouts=false or "
                              "rollout.function=generate")
        if self.train.partial_rollouts and self.rollout.engine == "vllm_server":
            raise ConfigError(
                "train.partial_rollouts=true with rollout.engine=vllm_server: generations are interrupted at a push only "
                "in an engine the trainer drives step by step (rollout.engine=vllm); servers are not interrupted yet. "
                "Set train.partial_rollouts=false (a push then waits for the generation batch in flight) or "
                "rollout.engine=vllm"
            )
        if self.train.partial_rollouts and (self.rollout.return_routed_experts or self.rollout.stop):
            raise ConfigError(
                f"train.partial_rollouts=true with rollout.return_routed_experts={self.rollout.return_routed_experts}, "
                f"rollout.stop={self.rollout.stop}: a continued sample's prefix is recomputed under the new weights, so "
                "its recorded routes would not be those its tokens were sampled with, and a stop string could span the "
                "interruption; use rollout.stop_token_ids instead of stop strings, or train.partial_rollouts=false"
            )

    def _validate_sampling_truncation(self) -> None:
        """Top-p / top-k sampling with an importance-sampling option is refused.

        With truncation the engine's logprobs are renormalised over the kept tokens
        (vLLM's processed_logprobs) while the trainer's are over the whole
        vocabulary, so pi_old / pi_rollout is biased below 1 on every token by the
        mass the truncation removed: masks and weights would act on that bias, not
        on the mismatch they exist to correct (and bypass mode would use the
        renormalised logprobs as the old policy).
        """
        rollout, algo = self.rollout, self.algorithm
        truncates = rollout.top_p < 1.0 or rollout.top_k > 0
        uses_engine_logprobs = algo.tis_mode != "none" or algo.bypass_mode
        if truncates and uses_engine_logprobs:
            option = f"algorithm.tis_mode={algo.tis_mode}" if algo.tis_mode != "none" else "algorithm.bypass_mode=true"
            raise ConfigError(
                f"rollout.top_p={rollout.top_p}, rollout.top_k={rollout.top_k} with {option}: the engine's logprobs are "
                "renormalised over the top-p/top-k set while the trainer's cover the whole vocabulary, so their ratio "
                "measures the truncation, not the engine/trainer mismatch; sample with top_p=1 and top_k=-1, or turn the "
                "option off (algorithm.tis_mode=none, algorithm.bypass_mode=false)"
            )
