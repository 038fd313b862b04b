"""Metric sinks for the RL loop: jsonl, wandb, tensorboard, a progress bar and a PNG summary.

Only rank 0 logs (`MetricsLogger(enabled=rank == 0)`); other ranks get a
logger whose calls do nothing, so the loop needs no rank checks. wandb runs
offline unless the user has logged in (an API key is configured) or set
WANDB_MODE themselves.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, Mapping

from megatron_rl.extras import import_extra

# The console's summary line every `summary_every` steps: (metric, label, format), means over those steps.
SUMMARY_LINE = [
    ("reward/mean", "reward", "{:.3f}"),
    ("response/length_mean", "response tokens", "{:.1f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("batch/packed_fraction", "packed", "{:.2f}"),
    ("batch/padding_fraction", "padding", "{:.2f}"),
    ("time/step_s", "s/step", "{:.2f}"),
    ("rollout/generate_s", "generate", "{:.2f}"),
    ("time/old_logprobs_s", "logprobs", "{:.2f}"),
    ("time/train_step_s", "train", "{:.2f}"),
    ("time/weight_sync_s", "sync", "{:.2f}"),
    ("memory/peak_rss_gib", "peak RSS", "{:.1f} GiB"),
]
SUMMARY_MAX = frozenset({"memory/peak_rss_gib"})
"""SUMMARY_LINE metrics shown as their largest value over the window, not their mean (a peak so far)."""

# Panels of the PNG summary, in order: (metrics drawn as lines, title); absent metrics are skipped.
SUMMARY_PLOTS = [
    (("reward/mean",), "mean reward"),
    (("response/length_mean",), "response length (tokens)"),
    (("clipfrac_low", "clipfrac_high"), "clip fraction (low, high)"),
    (("entropy",), "entropy (nats/token)"),
    (("routing/drift",), "routing drift (fraction of tokens)"),
]


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars -> Python numbers for JSON."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    return value


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    try:
        import wandb

        return "online" if wandb.api.api_key else "offline"
    except Exception:  # noqa: BLE001 - no login, no netrc: stay offline
        return "offline"


class MetricsLogger:
    """Writes each step's metrics to every configured sink (rank 0 only)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        enabled: bool = True,
        use_wandb: bool = False,
        wandb_project: str = "megatron_rl",
        use_tensorboard: bool = False,
        progress_total: int | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = False,
        summary_every: int = 0,
    ):
        """summary_every: print a line of SUMMARY_LINE means every this many steps (0: never)."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb = self._tb = self._bar = None
        self.summary_every = summary_every
        self._window: list[Mapping[str, Any]] = []
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a" if resume else "w")
        if use_wandb:
            wandb = import_extra("wandb", extra="wandb", feature="logging.wandb=true")
            self._wandb = wandb.init(
                project=wandb_project, dir=str(self.run_dir), config=dict(config or {}), mode=_wandb_mode(), resume="allow" if resume else None
            )
        if use_tensorboard:
            import_extra("tensorboard", extra="wandb", feature="logging.tensorboard=true")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if progress_total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=progress_total, desc="rl steps", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics (plain numbers or 0-d tensors)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            shown = {k.split("/")[-1] if k != "reward/mean" else "reward": f"{v:.3f}" for k, v in numeric.items() if k in ("reward/mean", "loss/total")}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        if self.summary_every:
            self._window.append(numeric)
            # on the steps' own boundaries, so a run resumed at any step ends on the same line as an uninterrupted one
            if (step + 1) % self.summary_every == 0:
                self._print(summary_line(step, self._window))
                self._window = []

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """An evaluation's numbers for the weights of version `step`: a row of <run_dir>/eval/metrics.jsonl (metrics.jsonl
        keeps one row per training step), and wandb / tensorboard at `step` (the progress bar and summary line skip it)."""
        if not self.enabled:
            return
        path = self.run_dir / "eval" / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)

    def print(self, text: str) -> None:
        """Print on the console (above the progress bar), rank 0 only."""
        if self.enabled:
            self._print(text)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)  # above the bar, which stays at the bottom
        else:
            print(line, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def summary_line(step: int, window: list[Mapping[str, Any]]) -> str:
    """"step 49: reward 0.412, response tokens 2.0, ..." with each SUMMARY_LINE metric's mean over `window`
    (its largest value for those in SUMMARY_MAX)."""
    parts = []
    for key, label, fmt in SUMMARY_LINE:
        values = [row[key] for row in window if isinstance(row.get(key), (int, float))]
        if values:
            value = max(values) if key in SUMMARY_MAX else sum(values) / len(values)
            parts.append(f"{label} {fmt.format(value)}")
    return f"step {step}: " + ", ".join(parts)


def process_memory_metrics() -> dict[str, float]:
    """This process's memory, in GiB (1024^3 bytes), for each step's metrics:

    * memory/peak_rss_gib: the most resident memory it has held so far, the number `/usr/bin/time -v` reports as
      "Maximum resident set size" when the process ends. Read from /proc/self/status (VmHWM, the high-water mark of
      this process's own memory); getrusage's ru_maxrss elsewhere (KiB, bytes on macOS), which on Linux also starts
      from the peak of the process that forked this one (a launcher's, torchrun's), before its exec;
    * memory/rss_gib: its resident memory now (VmRSS; left out where there is no /proc).

    Only rank 0 logs: its process also holds an in-process rollout engine (megatron_rl.plan.memory counts both).
    """
    status = _proc_status_kib(("VmHWM", "VmRSS"))
    if "VmHWM" not in status:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"memory/peak_rss_gib": peak / 1024**3}
    metrics = {"memory/peak_rss_gib": status["VmHWM"] / 1024**2}
    if "VmRSS" in status:
        metrics["memory/rss_gib"] = status["VmRSS"] / 1024**2
    return metrics


def _proc_status_kib(keys: tuple[str, ...]) -> dict[str, int]:
    """The `keys` of /proc/self/status ("VmHWM:   123456 kB" lines) in KiB; empty where there is no such file."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in keys and rest.split()[1:] == ["kB"]:
            values[key] = int(rest.split()[0])
    return values


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl (the last row per step wins, as after a resume)."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def plot_summary(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, title: str = "") -> Path:
    """One panel per SUMMARY_PLOTS curve present in the run, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_jsonl)
    present = [(keys, label) for keys, label in SUMMARY_PLOTS if any(k in r for r in rows for k in keys)]
    if not present:
        raise ValueError(f"{metrics_jsonl} holds none of the summary metrics {[k for keys, _ in SUMMARY_PLOTS for k in keys]}")
    fig, axes = plt.subplots(1, len(present), figsize=(3.6 * len(present), 3.0), squeeze=False)
    for ax, (keys, label) in zip(axes[0], present):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", markersize=3, linewidth=1.0, label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
