"""`megatron-rl eval`: score data.eval_sets with a checkpoint or an HF model directory, no trainer, no optimizer.

    megatron-rl eval --config configs/tiny-gspo.yaml checkpoint.load=outputs/checkpoints/step_00000100
    megatron-rl eval --config configs/tiny-gspo.yaml model.path=Qwen3-30B-A3B rollout.engines=4

1. The model: checkpoint.load (a training step_XXXXXXXX directory, its root with
   `latest`, or a converted megatron checkpoint, any parallel layout) is converted
   to an HF directory in a temporary folder by the existing streaming conversion
   (megatron_rl.checkpoint.convert, one process, no model-parallel state);
   otherwise model.path is used as it is.
2. The sets are read and checked (megatron_rl.evaluation.runner): a bad file
   stops here, before any engine starts.
3. The engines, with the preset's rollout settings: remote servers
   (rollout.engine=vllm_server with rollout.server_urls, serving model.path),
   rollout.engines > 1 vLLM servers started here on the model, or one
   in-process engine.
4. The same evaluation the trainer runs (same seeds), the table printed and
   <logging.dir>/eval/step_<n>.json written (n = the checkpoint's step, 0 for
   an HF directory), or --out FILE.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from megatron_rl.config.core import ConfigError

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def model_to_serve(cfg) -> Iterator[tuple[Path, int]]:
    """(an HF model directory, the step its weights are from): checkpoint.load converted on the fly, or model.path."""
    if not cfg.checkpoint.load:
        from megatron_rl.models.tiny import ensure_tiny_model_dir

        if cfg.model.make_tiny_if_missing:
            ensure_tiny_model_dir(cfg.model.path, cfg.model.make_tiny_if_missing, seed=cfg.model.init_seed)
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.model.path!r} is not an HF model directory (no config.json): set model.path or checkpoint.load")
        yield Path(cfg.model.path), 0
        return
    from megatron_rl.checkpoint.convert import convert_mcore_to_hf, find_hf_side_dir, resolve_mcore_dir
    from megatron_rl.checkpoint.dist_format import ConversionError

    try:
        source = resolve_mcore_dir(cfg.checkpoint.load)
    except ConversionError as err:
        raise ConfigError(f"checkpoint.load={cfg.checkpoint.load!r}: {err}") from None
    from megatron_rl.checkpoint.state import TRAINER_STATE, read_trainer_state

    step = read_trainer_state(source)["step"] if (source / TRAINER_STATE).is_file() else 0  # a converted one has none
    try:  # config.json and tokenizer: the checkpoint's own (<ckpt>/hf, its run's model.path), else model.path
        side_dir = find_hf_side_dir(source)
    except ConversionError:
        side_dir = find_hf_side_dir(source, cfg.model.path) if cfg.model.path else None
        if side_dir is None:
            raise
    with tempfile.TemporaryDirectory(prefix="megatron-rl-eval-") as tmp:
        yield convert_mcore_to_hf(source, Path(tmp) / "hf", hf_dir=side_dir), step


@contextlib.contextmanager
def started_engines(model_dir: Path, cfg) -> Iterator:
    """The engine(s) of step 3 of the module docstring; stopped on exit."""
    from megatron_rl.config.placement import resolve_placement
    from megatron_rl.rollout import VLLMServer, VLLMServerEngine, make_engine

    placement = resolve_placement(cfg.rollout)
    rollout = placement.rollout_config(cfg.rollout)
    servers: list = []
    engine = None
    try:
        if placement.kind == "colocated_servers":  # here no trainer ranks host them: this process starts them all
            import torch

            from megatron_rl.rollout.colocated import engine_devices, visible_devices

            from megatron_rl.rollout.server_auth import run_token

            size = rollout.tensor_parallel * rollout.pipeline_parallel
            token = run_token(rollout.server_token_file)  # one for every server this process starts
            for i in range(placement.engines):  # engine i on GPUs i*size .. (i+1)*size-1 of this node
                env = {"CUDA_VISIBLE_DEVICES": engine_devices(i * size, size, visible_devices())} if torch.cuda.is_available() else {}
                log = Path(cfg.logging.dir) / "logs" / f"vllm-eval-engine{i}.log"
                servers.append(VLLMServer(model_dir, rollout, seed=cfg.train.seed, log_path=log, env=env, token=token,
                                          engines_on_host=placement.engines))
            for server in servers:  # started one after the other: a failed start names its log
                server.start()
            engine = VLLMServerEngine(servers, rollout, model_dir=model_dir)
        else:
            engine = make_engine(str(model_dir), rollout)
        yield engine
    finally:
        if engine is not None:
            engine.shutdown()
        for server in servers:
            server.stop()


def eval_errors() -> tuple[type[Exception], ...]:
    """The errors `megatron-rl eval` reports in one line: bad config, data, rows, reward or checkpoint."""
    from megatron_rl.checkpoint.dist_format import ConversionError
    from megatron_rl.checkpoint.state import CheckpointError
    from megatron_rl.data.dataset import DatasetError
    from megatron_rl.evaluation.answers import EvalSetError
    from megatron_rl.rollout.rewards import RewardError

    return (ConfigError, DatasetError, EvalSetError, RewardError, ConversionError, CheckpointError)


def run_eval(config_path: str, overrides: Sequence[str], out: str | None = None):
    """`megatron-rl eval` (module docstring); returns the EvalReport."""
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.console import library_logs
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.evaluation.runner import Evaluator

    cfg = load_config(RLConfig, config_path, list(overrides))
    if not cfg.data.eval_sets:
        raise ConfigError("data.eval_sets is empty: name the sets to score, e.g. data.eval_sets={math500: data/math500.jsonl}")
    if cfg.rollout.engine == "vllm_server" and cfg.checkpoint.load:
        raise ConfigError(
            f"checkpoint.load={cfg.checkpoint.load!r} with rollout.engine=vllm_server: remote servers serve their own model; "
            "score a checkpoint with rollout.engine=vllm (rollout.engines=N starts N servers on it)"
        )
    # library warnings (the conversion's megatron-core build included) go to <logging.dir>/logs/warnings.log
    with library_logs(cfg.logging.dir) as logs, model_to_serve(cfg) as (model_dir, step), contextlib.ExitStack() as stack:
        tokenizer = load_tokenizer(cfg.data.tokenizer or model_dir)
        evaluator = Evaluator.from_config(cfg, tokenizer)
        with logs.engine_start():  # vLLM's start-up output goes to <logging.dir>/logs/vllm.log
            engine = stack.enter_context(started_engines(model_dir, cfg))
        report = evaluator.evaluate(engine, step)
    path = report.write(Path(cfg.logging.dir) / "eval", out)
    print(report.table(), flush=True)
    print(f"[eval] {path}", flush=True)
    return report
