"""Independent references for the vLLM engine tests: HF transformers logprobs and router top-k; and a fault to
inject into an engine's worker (fail_next_step).

Nothing here uses megatron_rl.rollout: the numbers the engine returns are
checked against a plain HF forward of the same token sequences.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_rl.models.tiny import make_tiny_model_dir

# Dense Qwen2 derives head_dim from hidden_size / heads in vLLM: keep 64 / 2 = 32
# (vLLM's CPU attention rejects head_dim 16, and HF would disagree on 64 / 4).
DENSE_OVERRIDES = {"num_attention_heads": 2, "num_key_value_heads": 1}


def fail_next_step(worker) -> None:
    """Runs inside an engine's worker (vllm.LLM.collective_rpc): the worker's next model step raises."""
    runner = worker.model_runner
    original = runner.execute_model

    def broken(*args, **kwargs):
        runner.execute_model = original
        raise RuntimeError("injected engine fault")

    runner.execute_model = broken


def build_models(root: Path) -> dict[str, Path]:
    """moe0/moe1: tiny Qwen3-MoE (8 experts, top-2, 2 layers) with seeds 0/1; dense0/dense1: tiny Qwen2."""
    return {
        "moe0": make_tiny_model_dir(root / "moe0", family="qwen3_moe", seed=0, init_std=0.05),
        "moe1": make_tiny_model_dir(root / "moe1", family="qwen3_moe", seed=1, init_std=0.05),
        "dense0": make_tiny_model_dir(root / "dense0", family="qwen2", seed=0, init_std=0.05, **DENSE_OVERRIDES),
        "dense1": make_tiny_model_dir(root / "dense1", family="qwen2", seed=1, init_std=0.05, **DENSE_OVERRIDES),
    }


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@torch.no_grad()
def hf_sampled_logprobs(model_dir: str | Path, rollouts, temperature: float, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per sample: log_softmax(logits / T) of each response token, from an HF forward of prompt + response (the
    model's weights in `dtype`; the softmax in fp32)."""
    model = hf_model(str(model_dir), dtype)
    out = []
    for s in rollouts.samples:
        logits = model(s.token_ids[None]).logits[0].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        p, r = s.prompt_length, s.response_length
        out.append(logprobs[p - 1 : p - 1 + r].gather(1, s.response_token_ids[:, None])[:, 0])
    return out


def max_logprob_error(model_dir: str | Path, rollouts, temperature: float) -> float:
    reference = hf_sampled_logprobs(model_dir, rollouts, temperature)
    return max(float((ref - s.rollout_logprobs).abs().max()) for ref, s in zip(reference, rollouts.samples))


@torch.no_grad()
def hf_router_topk(model_dir: str | Path, token_ids: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-k of every position of one sequence, per MoE layer, from the HF model's own router weights.

    Returns (ids [T, L, K] sorted ascending per row, margin [T, L]: the
    probability gap between the k-th and (k+1)-th expert, to tell real
    disagreements from float ties).
    """
    model = hf_model(str(model_dir))
    gates = [layer.mlp.gate for layer in model.model.layers]
    inputs: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach())) for g in gates]
    try:
        model(token_ids[None])
    finally:
        for h in hooks:
            h.remove()
    ids, margins = [], []
    for gate, hidden in zip(gates, inputs):
        probs = F.softmax(F.linear(hidden.reshape(-1, hidden.shape[-1]), gate.weight), dim=-1)
        top = probs.topk(top_k + 1, dim=-1)
        ids.append(top.indices[:, :top_k].sort(dim=-1).values)
        margins.append(top.values[:, top_k - 1] - top.values[:, top_k])
    return torch.stack(ids, dim=1), torch.stack(margins, dim=1)


def vllm_processes_below(pid: int) -> list[str]:
    """The names of vLLM's processes below `pid` (it names them by role: VLLM::EngineCore, VLLM::Worker...); the
    spawn context's resource tracker, which imports nothing of vLLM, is left out."""
    import psutil

    names = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            name = " ".join(child.cmdline()).strip()  # a retitled process pads its command line
        except psutil.NoSuchProcess:
            continue
        if "multiprocessing.resource_tracker" not in name:
            names.append(name)
    return sorted(names)


def socket_files(directory: str | None) -> list[str]:
    """The Unix socket files in `directory` (vLLM's ZMQ sockets between an engine's processes); [] if it is gone."""
    import stat

    if directory is None or not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory) if stat.S_ISSOCK(os.lstat(os.path.join(directory, name)).st_mode))
