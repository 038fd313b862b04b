"""Configuration of the rollout engine: where vLLM runs, how it samples, how pushed weights reach it, agents.

`RolloutConfig.validate` checks what the rollout section decides alone, the
weight transport's rules included (megatron_rl.config.transport). Where engines
are placed and which transport `auto` picks is megatron_rl.config.placement's;
the checks that span sections (top-p / top-k sampling with an importance-sampling
option, partial rollouts, sleep mode beside asynchronous generation) are
`RLConfig.validate`'s (megatron_rl.config.schema).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.core import ConfigError, check_at_least, check_name_or_import_path
from megatron_rl.config.transport import Transport, check_rollout_transport

ROLLOUT_FUNCTION_NAMES = ("generate",)
"""The names megatron_rl.rollout.function.ROLLOUT_FUNCTIONS holds (a test keeps the two in step)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """The vLLM engine and how it samples."""

    engine: Literal["vllm", "vllm_server"] = "vllm"
    """vllm = colocated with the trainer (an in-process engine on rank 0, or `engines` servers hosted by trainer
    ranks); vllm_server = OpenAI-compatible servers at server_urls (disaggregated)."""
    server_urls: list[str] = field(default_factory=list)
    """Base URLs of running vLLM servers (engine=vllm_server); launch/slurm.sbatch fills it in for the servers it
    starts on the nodes cluster.rollout_gpus sets aside."""
    server_token_file: str = ""
    """File (mode 600) holding the token every request to the vLLM servers carries (rollout.server_auth);
    `megatron-rl serve` and the trainer read it. Empty: the file $MEGATRON_RL_SERVER_TOKEN_FILE names, else
    $MEGATRON_RL_SERVER_TOKEN, else servers the trainer starts itself get a random token per run."""
    server_max_body_mb: float = 4096.0
    """Largest request body a vLLM server this project starts reads, in MB (10^6 bytes): a larger one is answered
    413 before its body is read (rollout.server_limits). A weight push over HTTP (weight_transport=rpc to a
    server) sends each bucket as base64 text, 4/3 of its bytes: keep this above 4/3 x the largest bucket (a tensor
    larger than weight_bucket_mb goes alone). Request heads (request line and headers) are limited to 64 KiB
    (431), before the token is checked."""
    engines: int = 0
    """Colocated engines (engine=vllm) the trainer starts; 0 = one per tensor_parallel x pipeline_parallel of the
    trainer's GPUs, one on CPU. With more than one, each runs as a vLLM server hosted by a trainer rank on that
    rank's GPUs (megatron_rl.rollout.colocated) and rank 0 spreads prompts and pushes weights over all of them."""
    n_samples: int = 4
    """Samples per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample from the k most likely tokens (-1 = all)."""
    max_new_tokens: int = 64
    """Maximum response length in tokens (L_max for overlong shaping)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are dropped (counted) or rejected (data.long_prompts)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop token ids besides EOS."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory the engine may take (GPU only)."""
    tensor_parallel: int = 1
    """GPUs one engine splits each layer over (vLLM tensor_parallel_size); stays inside a node."""
    pipeline_parallel: int = 1
    """Pipeline stages of one engine (vLLM pipeline_parallel_size); the way an engine spans nodes."""
    kv_cache_gib: float = 1.0
    """KV-cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    return_routed_experts: bool = False
    """Capture each token's top-k experts per MoE layer (needed for R3); the engine then runs without prefix caching
    (with rollout.agent too: an episode's observation tokens get the routes of the next turn's prefill)."""
    routed_experts_include_prompt: bool = True
    """Routed experts cover prompt tokens too (rows [P + R, L, K]), not only the response ([R, L, K])."""
    multiprocessing: bool | None = None
    """In-process engine (engine=vllm): run vLLM's engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1).
    Slower start (the tiny model on 2 CPU cores: 9.9 s vs 3 s; the worker runs inside the engine core,
    rollout.engine_env.worker_in_engine_core), but vLLM's thread binding stays out of the trainer's process.
    None = automatic: in the trainer's process for a single-process run; its own process when the trainer
    has several ranks (an in-process engine would start its distributed groups on the trainer's world)."""
    max_model_len: int = 0
    """Engine context length in tokens (prompt + response); 0 = the model's max_position_embeddings."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; auto = float32 on CPU (logprobs match the trainer to ~1e-6), bfloat16 on GPU."""
    server_start_timeout_s: float = 0.0
    """Seconds to wait for a vLLM server to start (or restart) and answer /health; 0 = scaled with the model:
    300 s + 30 s per GiB of its safetensors (rollout.client_limits)."""
    request_timeout_s: float = 600.0
    """Seconds one control call (a weight-sync RPC to a server or a multiprocess engine) may take before the engine
    counts as dead; also how often a server with generation requests in flight is asked /health (at most every
    30 s). Generation requests have no limit of their own: a server that answers /health is slow, not dead."""
    weight_bucket_mb: float = 512.0
    """Size of one weight-sync bucket in MB."""
    weight_transport: Literal["auto", Transport] = "auto"
    """How pushed weights reach the engine. rpc: through the worker extension's RPC (tensors by reference to an
    in-process engine, safetensors bytes to an engine process or over HTTP to a server); broadcast: a
    torch.distributed broadcast from the pushing trainer rank into every engine worker (weight_broadcast_backend);
    ipc: memory handles to engines on the trainer's own devices, an engine process or colocated servers (CUDA IPC on
    a GPU, shared memory on the host; weight_sync.ipc: with colocated servers every rank shares each bucket with the
    workers on its GPU); vllm_nccl_m2n (remote servers on GPUs): vLLM's own nccl_m2n engine, every trainer rank sends
    its own slice of each tensor over NCCL; vllm_ipc (an engine process or colocated servers on GPUs): vLLM's own
    ipc engine (weight_sync.vllm_transfer; both need CUDA and a vLLM build that registers the engine); auto: rpc for
    an engine inside the trainer's process; for engines on the trainer's GPUs vllm_ipc, else ipc with CUDA, else
    broadcast; for remote servers vllm_nccl_m2n where CUDA, NCCL and the nccl.m2n runtime are there, else
    broadcast (config.placement.choose_transport; the start-up log names the choice and why)."""
    weight_senders: Literal["rank0", "owners"] = "rank0"
    """Who sends a push (weight_transport=broadcast, or ipc to colocated servers). rank0: every bucket through trainer
    rank 0, one group with the engine workers; owners: every rank that owns parameters (one per PP stage and EP rank
    at least, replicas share the load) broadcasts its own buckets in a group of its own with every worker, rank 0
    sends only its share and drives the engines (weight_sync.parallel; the bytes through a rank are about model /
    senders); with ipc each owner sends its buckets to the ranks whose GPUs hold workers, which share them by
    memory handle (weight_sync.owner_ipc)."""
    weight_senders_max: int = 0
    """With weight_senders=owners: at most this many ranks send (every world_size / N-th rank: one per node when N is
    the number of nodes); the other holders hand them their shards over the trainer's own links. Each engine worker
    joins one group per sender (over NCCL a communicator of tens of MB of device memory each), so at hundreds of
    ranks cap it. 0: every rank that owns parameters sends."""
    weight_delta: bool = False
    """With weight_senders=owners: send only the values that changed since the last push (positions + values per
    tensor, dense when not smaller), checked by a checksum per tensor on the engine (weight_sync.delta). Each engine
    worker keeps a copy of the whole model in the wire dtype on its device: for models that fit beside vLLM."""
    weight_delta_full_every: int = 10
    """With weight_delta: a full push every this many versions (also after a broken push or an engine restart)."""
    weight_broadcast_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Backend of the weight broadcast. auto: nccl for servers when CUDA is available (their GPUs differ from the
    trainer's), gloo for an engine process next to the trainer (it shares the trainer's GPU, which NCCL refuses) or
    on CPU."""
    weight_broadcast_host: str = ""
    """Address engine workers reach the pushing trainer rank at for the broadcast ("" = 127.0.0.1 when every
    engine is local, else this host's address)."""
    max_restarts: int = 2
    """Engine restarts (with a weight push) before a failed batch is an error."""
    enforce_eager: bool = True
    """Skip CUDA graph capture (faster start; graphs help large GPU runs)."""
    sleep_level: Literal[0, 1, 2] = 0
    """vLLM's sleep mode while the trainer trains (every engine: in-process, or servers through vLLM's /sleep and
    /wake_up, started with --enable-sleep-mode; the weights wake for the push, the KV cache after it):
    1 = the weights to host memory, the KV cache dropped; 2 = both dropped (the push restores the weights);
    0 = never. vllm-cpu has no sleep mode: the calls run and only pause the scheduler (the run says so, and
    logs engine/sleep_frees_memory = 0)."""
    function: str = "generate"
    """How a batch of prompts becomes samples: generate (one engine.generate call, n_samples per prompt), or an
    import path called as fn(engine, prompts, spec, tokenizer, cfg) -> Rollouts (megatron_rl.rollout.function).
    Not with agent (episodes are generated turn by turn) nor train.partial_rollouts."""
    agent: str = ""
    """Multi-turn episodes (megatron_rl.rollout.agents): a built-in (single_turn, lookup) or an import path
    'package.module:Class' of an Environment / ToolsAgent subclass; "" = one completion per sample."""
    agent_max_turns: int = 4
    """Model turns per episode at most; an episode still going after this many is cut (counted)."""
    agent_max_tokens: int = 0
    """Token budget of one episode (prompt + every turn + every observation); 0 = the engine's context length.
    An episode that would exceed it is cut (counted); each turn also stops at max_new_tokens."""
    agent_tool_timeout_s: float = 30.0
    """Seconds one tool call may take; past that its observation says it timed out and the episode goes on."""
    agent_tool_parser: str = ""
    """vLLM tool parser (vllm.tool_parsers, e.g. hermes, pythonic, qwen3_xml) of a ToolsAgent; "" = the class's."""
    agent_reward: Literal["answer", "env", "both"] = "answer"
    """answer = data.reward on the final model turn's text; env = the sum of the rewards the environment's steps
    returned; both = their sum."""
    agent_workers: int = 32
    """Threads running environment steps and tool calls (concurrently with generation)."""
    agent_trace_every: int = 0
    """Every this many steps, write a few whole episodes to <logging.dir>/episodes.jsonl (0 = never)."""
    agent_trace_episodes: int = 2
    """Episodes per trace."""

    def validate(self) -> None:
        if self.n_samples < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"rollout.n_samples={self.n_samples}, rollout.max_new_tokens={self.max_new_tokens}: both must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature}: must be > 0 (use a small value for near-greedy sampling)")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ConfigError(
                f"rollout.tensor_parallel={self.tensor_parallel}, rollout.pipeline_parallel={self.pipeline_parallel}: "
                "engine parallel sizes are whole numbers >= 1"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        check_at_least("rollout.engines", self.engines, 0, "0 = one per rollout.tensor_parallel x pipeline_parallel GPUs")
        if self.max_restarts < 0 or self.weight_bucket_mb <= 0 or self.kv_cache_gib <= 0:
            raise ConfigError(
                f"rollout.max_restarts={self.max_restarts}, rollout.weight_bucket_mb={self.weight_bucket_mb}, "
                f"rollout.kv_cache_gib={self.kv_cache_gib}: restarts must be >= 0, sizes > 0"
            )
        if self.server_max_body_mb <= 0:
            raise ConfigError(f"rollout.server_max_body_mb={self.server_max_body_mb}: must be > 0 (MB a server reads of "
                              "one request body)")
        if self.server_start_timeout_s < 0 or self.request_timeout_s <= 0:
            raise ConfigError(
                f"rollout.server_start_timeout_s={self.server_start_timeout_s}, rollout.request_timeout_s="
                f"{self.request_timeout_s}: the start-up timeout must be >= 0 (0 = scaled with the model's size), "
                "the request timeout > 0"
            )
        if self.weight_senders == "owners" and self.weight_transport.startswith("vllm_"):
            raise ConfigError(f"rollout.weight_senders=owners with rollout.weight_transport={self.weight_transport}: vLLM's "
                              "engine already sends from every rank; set weight_senders=rank0, or weight_transport=broadcast")
        check_at_least("rollout.weight_senders_max", self.weight_senders_max, 0, "0 = every owner sends")
        if self.weight_senders_max and self.weight_senders != "owners":
            raise ConfigError(f"rollout.weight_senders_max={self.weight_senders_max} caps the owner ranks that send, but "
                              f"rollout.weight_senders={self.weight_senders} sends through rank 0: set "
                              "rollout.weight_senders=owners, or drop weight_senders_max")
        if self.weight_delta and self.weight_senders != "owners":
            raise ConfigError("rollout.weight_delta=true needs rollout.weight_senders=owners (each owner keeps what the "
                              "engines hold of its tensors): set both, or weight_delta=false")
        check_at_least("rollout.weight_delta_full_every", self.weight_delta_full_every, 1)
        check_name_or_import_path("rollout.function", self.function, ROLLOUT_FUNCTION_NAMES, "a rollout function")
        if self.agent and self.function != "generate":
            raise ConfigError(f"rollout.function={self.function!r} with rollout.agent={self.agent!r}: an agent generates "
                              "its episodes turn by turn, without the rollout function; set one of the two")
        if self.agent and (self.agent_max_turns < 1 or self.agent_max_tokens < 0 or self.agent_tool_timeout_s <= 0 or self.agent_workers < 1):
            raise ConfigError(
                f"rollout.agent_max_turns={self.agent_max_turns}, agent_max_tokens={self.agent_max_tokens}, agent_tool_timeout_s="
                f"{self.agent_tool_timeout_s}, agent_workers={self.agent_workers}: turns and workers must be >= 1, the budget >= 0 "
                "(0 = the engine's context), the timeout > 0"
            )
        if self.return_routed_experts and not self.enforce_eager:
            raise ConfigError(
                "rollout.return_routed_experts=true with rollout.enforce_eager=false: the routes are captured by a "
                "function each MoE router calls, and CUDA graphs replay decode steps without calling it (their tokens "
                "would have no routes); set rollout.enforce_eager=true, or rollout.return_routed_experts=false with "
                "algorithm.routing_replay other than R3"
            )
        check_rollout_transport(self.engine, self.weight_transport, self.multiprocessing)


def sender_ranks(world_size: int, most: int) -> list[int] | None:
    """The ranks that may own parameters when at most `most` send (rollout.weight_senders_max): every
    world_size / most-th rank, spread over the nodes; None (every rank) when `most` is 0 or covers the world."""
    if most <= 0 or most >= world_size:
        return None
    stride = -(-world_size // most)
    return list(range(0, world_size, stride))
