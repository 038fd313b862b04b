"""Which checkpoint a run starts from: decided once per process, and used by everything that follows.

    resume = decide_resume(cfg.checkpoint)   # trainer.run, before the start-up checks
    check_before_start(cfg, resume)          # preflight: the checkpoint was saved from this run's model
    Trainer(cfg, ctx, resume, ...)           # loads resume.path; its resume line names resume.path and resume.why

The choice (ResumeDecision.kind):
1. none: checkpoint.resume=none: the run starts from model.path's weights;
2. auto: what checkpoint.dir/latest names (a save writes `latest` only after its checkpoint is complete,
   checkpoint.state); no `latest` yet: the run starts from model.path's weights;
3. path: checkpoint.resume=<a step_XXXXXXXX directory>, or <a run's checkpoint.dir>, meaning what its `latest` names;
4. restart: an attempt torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0, cluster.max_restarts): the newest
   complete checkpoint of checkpoint.dir when it has a `latest`, whatever checkpoint.resume says (the attempt
   before may have saved since the job started); without one, what checkpoint.resume says. `why` names the restart
   and what stopped the attempt before: the one-line messages its ranks left in torchrun's error files
   (megatron_rl.errors.write_error_file writes them).

The chosen checkpoint is checked complete once (checkpoint.state.check_complete) and its trainer_state.json read
once, here; one that is missing, incomplete or damaged is a CheckpointError naming it (exit code 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from megatron_rl.checkpoint.state import (
    LATEST, check_resume_fields, checkpoint_path, load_checkpoint, optimizer_format_to_load, read_trainer_state,
)

if TYPE_CHECKING:
    from megatron_rl.config.schema import CheckpointConfig

NO_MESSAGE = ("a rank ended without a message (killed by a signal: out of memory, a lost node, a kill; torchrun's log "
              "names its exit)")
"""The reason a restart gives when no rank of the attempt before left a message in its error file."""


@dataclass(frozen=True)
class ResumeDecision:
    """The checkpoint this process starts from (module docstring), with what its resume line says."""

    kind: Literal["none", "auto", "path", "restart"]
    """How it was chosen: checkpoint.resume=none, =auto, =<a path>, or an attempt torchrun restarted."""
    path: Path | None
    """The checkpoint directory to load, checked complete; None: the run starts from model.path's weights."""
    step: int | None
    """The step it was saved after (its trainer_state.json); None without a checkpoint."""
    why: str = ""
    """The end of the resume line: ' (torchrun restart k of M; the attempt before stopped: ...)' on a restart."""
    trainer_state: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    """The checkpoint's trainer_state.json, read when the checkpoint was chosen."""

    def load(self, state_dict_to_load: Callable[..., dict], layout: dict[str, int]) -> tuple[dict, dict[str, Any]]:
        """Load the chosen checkpoint on every rank: (megatron state dict, trainer state).

        1. the trainer state read when deciding must hold every field a training resume reads (RESUME_FIELDS, of the
           types a save writes: CheckpointError naming the field otherwise), checked before any is used;
        2. this run's layout must read its optimizer state (checkpoint.state.optimizer_format_to_load);
        3. megatron's dist checkpoint into `state_dict_to_load(optimizer_format=...)` (the actor's sharded state dict),
           and this rank's random states (checkpoint.state.load_checkpoint; trainer_state.json is not read again).
        layout: this run's parallel sizes, as a save records them."""
        if self.path is None or self.trainer_state is None:
            raise ValueError(f"no checkpoint to load: this run starts from model.path's weights (kind={self.kind})")
        saved = check_resume_fields(self.path, self.trainer_state)
        optimizer_format = optimizer_format_to_load(self.path, saved, layout)
        state, trainer_state, _ = load_checkpoint(self.path, state_dict_to_load(optimizer_format=optimizer_format),
                                                  trainer_state=saved)
        return state, trainer_state


def torchrun_restart(env: Mapping[str, str] = os.environ) -> int:
    """torchrun's restart count of this attempt (TORCHELASTIC_RESTART_COUNT): 0 in a first attempt or outside torchrun."""
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def decide_resume(checkpoint: CheckpointConfig, env: Mapping[str, str] = os.environ) -> ResumeDecision:
    """The checkpoint to start from, for checkpoint.resume and checkpoint.dir in `env`'s torchrun attempt."""
    spec, restart = checkpoint.resume, torchrun_restart(env)
    kind = "restart" if restart else spec if spec in ("none", "auto") else "path"
    why = ""
    if restart:
        failures = previous_attempt_failures(env) or [NO_MESSAGE]
        why = (f" (torchrun restart {restart} of {env.get('TORCHELASTIC_MAX_RESTARTS', '?')}; the attempt before "
               f"stopped: {'; '.join(failures)})")
        if (Path(checkpoint.dir) / LATEST).is_file():
            spec = "auto"
    path = checkpoint_path(spec, checkpoint.dir)
    if path is None:
        return ResumeDecision(kind, None, None, why)
    saved = read_trainer_state(path)  # check_complete: once, for the checkpoint chosen
    return ResumeDecision(kind, path, saved["step"], why, saved)


def previous_attempt_failures(env: Mapping[str, str] = os.environ) -> list[str]:
    """Under torchrun after a restart: the one-line messages the ranks of this node left in the attempt before.

    torchrun gives each rank TORCHELASTIC_ERROR_FILE=<run dir>/attempt_<k>/<local rank>/error.json."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    attempt = torchrun_restart(env)
    if not path or attempt == 0:
        return []
    before = Path(path).parents[2] / f"attempt_{attempt - 1}"
    found = []
    for error_file in sorted(before.glob("*/error.json")):
        try:
            found.append(f"local rank {error_file.parent.name}: {json.loads(error_file.read_text())['message']}")
        except (OSError, ValueError, KeyError):
            continue
    return found
