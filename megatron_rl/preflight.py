"""Checks of a run's inputs before any work: what is known at start is refused at start.

    check_before_start(cfg, resume)   # in trainer.run, before the parallel context, the engine or a step

1. the model directory: config.json readable, a supported family (models.hf_config);
2. output, checkpoint and log directories: created if missing, writable, free space said;
3. lengths: rollout.max_prompt_tokens + rollout.max_new_tokens fit the model's positions
   (and rollout.max_model_len when set);
4. the checkpoint the run resumes from (`resume`, chosen and checked complete by checkpoint.resume.decide_resume, the
   one the trainer loads): saved from a model of the same architecture (trainer_state.json records it,
   `model_architecture` below; compared key by key);
5. plug-ins: every import path among algorithm.loss / advantage / tis_mode / group_filter, data.reward,
   rollout.agent and rollout.function imports and takes the call its key makes (megatron_rl.plugins;
   before any directory is made).

Each failure is a ConfigError or CheckpointError naming the key, the value and the fix
(megatron_rl.errors turns it into one line and exit code 2).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ConfigError, RLConfig

if TYPE_CHECKING:
    from megatron_rl.checkpoint.resume import ResumeDecision

logger = logging.getLogger(__name__)

LOW_FREE_SPACE_BYTES = 1 << 30
"""Below this much free space in a run directory, start-up warns (a checkpoint of even a small model may not fit)."""


def check_before_start(cfg: RLConfig, resume: ResumeDecision) -> None:
    """Every check of the module docstring; the first failure raises. resume: the checkpoint the run starts from."""
    from megatron_rl.models import load_hf_config

    hf_config = load_hf_config(cfg.model.path)
    architecture = model_architecture(hf_config)
    check_plugins(cfg)
    check_writable_dirs(cfg)
    check_lengths(cfg, hf_config)
    check_resume_matches(cfg, resume, architecture)


def check_plugins(cfg: RLConfig) -> None:
    """Each plug-in's import path imports and fits its key's call (a ConfigError naming the key), on every rank; the
    algorithm ones are added to their registries for the run (megatron_rl.plugins.load_plugins)."""
    from megatron_rl.plugins import load_plugins

    load_plugins(cfg)


def model_architecture(hf_config: dict) -> dict[str, Any]:
    """The model's family-independent description (models.hf_config.HFArch) as plain JSON values: what a
    checkpoint records and a resume compares."""
    from megatron_rl.models.hf_config import parse_hf_config

    arch = parse_hf_config(hf_config)
    fields = dataclasses.asdict(arch) if dataclasses.is_dataclass(arch) else dict(vars(arch))
    return json.loads(json.dumps(fields, default=str))


def check_writable_dirs(cfg: RLConfig) -> None:
    """logging.dir and checkpoint.dir: made if missing, a file written and removed in each; free space logged."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    report = []
    for key, path in (("logging.dir", cfg.logging.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        directory = Path(path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
                pass
        except OSError as err:
            raise ConfigError(
                f"{key}={path!r} is not writable ({err.strerror or err}): choose a directory this user can write, "
                f"e.g. {key}=outputs/run1"
            ) from None
        free = shutil.disk_usage(directory).free
        report.append(f"{key}={path} ({free / (1 << 30):.1f} GiB free)")
        if rank0 and free < LOW_FREE_SPACE_BYTES:
            logger.warning("%s=%s: only %.1f GiB free: a checkpoint may not fit", key, path, free / (1 << 30))
    if rank0:  # one console line at start: where the run writes and the room it has there
        print(f"megatron_rl: run directories: {', '.join(report)}", file=sys.stderr, flush=True)


def check_lengths(cfg: RLConfig, hf_config: dict) -> None:
    """A prompt and its response must fit the model's positions (and the engine's max_model_len)."""
    rollout = cfg.rollout
    needed = rollout.max_prompt_tokens + rollout.max_new_tokens
    positions = hf_config.get("max_position_embeddings")
    if isinstance(positions, int) and needed > positions:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.max_new_tokens = {rollout.max_prompt_tokens} + {rollout.max_new_tokens} "
            f"= {needed} is more than the model's {positions} positions (max_position_embeddings in "
            f"{cfg.model.path}/config.json): lower rollout.max_prompt_tokens or rollout.max_new_tokens"
        )
    if rollout.max_model_len and needed > rollout.max_model_len:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.max_new_tokens = {needed} is more than rollout.max_model_len="
            f"{rollout.max_model_len}: raise rollout.max_model_len or lower the lengths"
        )


def check_resume_matches(cfg: RLConfig, resume: ResumeDecision, architecture: dict[str, Any]) -> None:
    """The checkpoint the run resumes from (if any) was saved from a model of this architecture."""
    from megatron_rl.checkpoint.state import RESUME_ADVICE, TRAINER_STATE, CheckpointError

    path = resume.path
    if path is None:
        return
    saved = resume.trainer_state.get("model_architecture")
    if saved is not None and not isinstance(saved, dict):
        raise CheckpointError(f"{path / TRAINER_STATE} has model_architecture={saved!r:.80}, not the object a save "
                              f"writes: it is damaged; {RESUME_ADVICE}")
    if saved is None:  # saved before checkpoints recorded the model: megatron's load compares the shapes
        return
    differ = {key: (saved.get(key), value) for key, value in architecture.items() if saved.get(key) != value}
    if differ:
        shown = ", ".join(f"{key}: {old!r} in the checkpoint, {new!r} in the model" for key, (old, new) in list(differ.items())[:4])
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved from another model than model.path={cfg.model.path!r} ({shown}): "
            "resume with the model it was trained from, or start fresh (checkpoint.resume=none, or another checkpoint.dir)"
        )
