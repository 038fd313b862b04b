"""Episode machinery overhead on CPU: multi-turn episodes vs the same tokens as plain single-turn requests.

    python bench/agent.py                 # in-process engine; writes bench/results/agent.json
    python bench/agent.py --server        # also one vLLM server (started here; about a minute more)

Model: the tiny random Qwen3-MoE of the tests (fp32). An episode is TURNS model
turns; a turn ends at one of STOP_IDS (16 of the 256 token ids, so turns average
about 16 tokens on the random model) or at MAX_TURN_TOKENS; between turns an
environment step sleeps TOOL_MS (0 or 50 ms, a tool's latency) and returns
OBS_TOKENS observation tokens. For 1, 8 and 64 episodes in flight (one runner call
holding that many episodes), the reference is the same tokens as plain requests:
one request per episode, prompt = the episode's prompt, exactly as many new
tokens as the episode's model tokens (ignore_eos), all submitted at once to
vLLM itself (in-process: LLM.generate with a SamplingParams per request; a
server: concurrent /v1/completions requests, at most max_num_seqs at a time).
Reported per case: episodes/s, engine tokens/s (model tokens / wall time), and
ratio = episode tokens/s / plain tokens/s (1 = no overhead; episodes also
prefill their observations, send a request per turn, and wait for their tools).
Best of REPEATS after a warm-up, the episode runs and the plain runs interleaved
(other processes on a shared machine slow both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TURNS, MAX_TURN_TOKENS, OBS_TOKENS, REPEATS = 3, 48, 6, 3
STOP_IDS = list(range(4, 20))
IN_FLIGHT, TOOL_MS = (1, 8, 64), (0, 50)


def _environment(tool_ms: int, observation: list[int]):
    from megatron_rl.rollout.agents import Environment, StepResult

    class Sleeper(Environment):
        def step(self, turn):
            time.sleep(tool_ms / 1000)
            return StepResult(observation=list(observation), done=turn.index + 1 >= TURNS)

    return Sleeper


def measure(engine, tokenizer, label: str) -> list[dict]:
    from types import SimpleNamespace

    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout.agents import EpisodeRunner
    from megatron_rl.rollout.rewards import exact_match
    from megatron_rl.rollout.sampling import SamplingSpec

    prompts = [SimpleNamespace(token_ids=[1] + [4 + (7 * i + k) % 250 for k in range(9)], text="", answer="", index=i, row={})
               for i in range(max(IN_FLIGHT))]
    observation = [4 + k for k in range(OBS_TOKENS)]
    rows = []
    for in_flight in IN_FLIGHT:
        batch_prompts = prompts[:in_flight]
        for tool_ms in TOOL_MS:
            runner = EpisodeRunner(_environment(tool_ms, observation), tokenizer, exact_match,
                                   RolloutConfig(agent="single_turn", agent_max_turns=TURNS, agent_reward="env"))
            spec = SamplingSpec(n=1, max_new_tokens=MAX_TURN_TOKENS, stop_token_ids=STOP_IDS, seed=0)
            batch = runner.run(engine, batch_prompts, spec)  # warm-up; the same tokens every run (same seeds)
            tokens = int(batch.model_tokens.sum())
            lengths = [int(n) for n in batch.model_tokens]
            plain(engine, [p.token_ids for p in batch_prompts], lengths)  # warm-up
            times, plain_times = [], []
            for _ in range(REPEATS):
                times.append(_timed(runner.run, engine, batch_prompts, spec))
                plain_times.append(_timed(plain, engine, [p.token_ids for p in batch_prompts], lengths))
            stats = runner.stats.take()
            runner.close()
            episodes, plain_s = min(times), min(plain_times)
            rows.append({
                "engine": label, "episodes_in_flight": in_flight, "tool_ms": tool_ms,
                "model_tokens": tokens, "turns_mean": round(stats["agent/turns_mean"], 2),
                "episodes_per_s": round(in_flight / episodes, 2), "engine_tokens_per_s": round(tokens / episodes, 1),
                "plain_tokens_per_s": round(tokens / plain_s, 1),
                "ratio": round(plain_s / episodes, 3),
            })
            print(rows[-1], flush=True)
    return rows


def plain(engine, prompts: list[list[int]], lengths: list[int]) -> None:
    """The reference: one request per sequence with exactly `lengths[k]` new tokens, all at once, to vLLM itself."""
    params = dict(temperature=1.0, ignore_eos=True, logprobs=0)
    if hasattr(engine, "_llm"):  # in-process: vllm.LLM.generate
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                             [SamplingParams(max_tokens=n, seed=k, detokenize=False, **params) for k, n in enumerate(lengths)],
                             use_tqdm=False)
        return
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    with httpx.Client(timeout=300, headers=engine.auth_headers) as client, ThreadPoolExecutor(max_workers=engine.max_num_seqs[0]) as pool:
        bodies = [{"model": engine.model_name, "prompt": p, "max_tokens": n, "seed": k, "return_token_ids": True, **params}
                  for k, (p, n) in enumerate(zip(prompts, lengths))]
        for response in pool.map(lambda b: client.post(f"{engine.urls[0]}/v1/completions", json=b), bodies):
            response.raise_for_status()


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="store_true", help="also measure one vLLM server (HTTP, token-id prompts)")
    args = parser.parse_args()
    from megatron_rl.config import RolloutConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import VLLMEngine

    load_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "tiny-moe", family="qwen3_moe", seed=0)
        tokenizer = load_tokenizer(model_dir)
        engine = VLLMEngine(model_dir, RolloutConfig(kv_cache_gib=0.5, max_model_len=256))
        try:
            rows += measure(engine, tokenizer, "in-process")
        finally:
            engine.shutdown()
        if args.server:
            from megatron_rl.rollout import VLLMServer, VLLMServerEngine

            server = VLLMServer(model_dir, RolloutConfig(kv_cache_gib=0.5, max_model_len=256)).start()
            try:
                engine = VLLMServerEngine([server.url], RolloutConfig(engine="vllm_server", server_urls=[server.url]))
                rows += measure(engine, tokenizer, "server")
            finally:
                server.stop()
    result = {
        "device": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "load_average_1min_at_start_and_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "model": "tiny qwen3_moe (2 layers, hidden 64, 8 experts top-2, vocab 256, fp32)",
        "episode": {"turns": TURNS, "max_turn_tokens": MAX_TURN_TOKENS, "stop_ids": len(STOP_IDS), "observation_tokens": OBS_TOKENS,
                    "repeats": REPEATS},
        "rows": rows,
    }
    out = ROOT / "bench" / "results" / "agent.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
