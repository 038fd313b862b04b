"""Where a run's output goes: the console for the run itself, files under the run directory for libraries.

The console keeps the progress bar, a summary line every
logging.summary_every steps (megatron_rl.metrics), the project's own warnings
and errors, and vLLM's errors. Everything else the libraries print goes to
`<logging.dir>/logs/`:

- vllm.log: vLLM's log (its INFO lines, and warnings such as "RotaryEmbedding:
  Failed to load weights" on every weight reload), from this process and from
  engine processes it starts (they read VLLM_LOGGING_CONFIG_PATH), plus what
  the engine's start-up prints below Python's logging (C++ warnings, progress
  bars);
- warnings.log: Python warnings raised inside libraries (megatron-core's
  "Apex is not installed", torch deprecations).

    with library_logs(cfg.logging.dir) as logs:
        with logs.engine_start():
            engine = make_engine(...)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

VLLM_LOG = "vllm.log"
WARNINGS_LOG = "warnings.log"
_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"


def vllm_logging_config(path: Path) -> dict:
    """A logging.config.dictConfig for vLLM's "vllm" logger: everything to `path`, errors also to the console."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT}},
        "handlers": {
            "vllm_file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "plain", "level": "DEBUG"},
            "vllm_console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain", "level": "ERROR"},
        },
        "loggers": {"vllm": {"handlers": ["vllm_file", "vllm_console"], "level": "INFO", "propagate": False}},
    }


class LibraryLogs:
    """The run's library log files (see the module docstring); made by `library_logs`."""

    def __init__(self, log_dir: Path, rank: int = 0):
        self.dir = log_dir
        suffix = f".rank{rank}" if rank else ""  # every trainer rank of a torchrun job writes its own
        self.vllm = log_dir / VLLM_LOG.replace(".log", f"{suffix}.log")
        self.warnings = log_dir / WARNINGS_LOG.replace(".log", f"{suffix}.log")

    @contextlib.contextmanager
    def engine_start(self) -> Iterator[None]:
        """Send what this process writes to stdout and stderr (sys.stdout/stderr and file descriptors 1, 2) to vllm.log.

        vLLM's start-up writes below Python's logging too (C++ warnings such as
        "NUMA binding", torch's "Triton not available"); nothing else of the run
        prints while the engine starts.
        """
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = [os.dup(1), os.dup(2)]
        console = sys.stderr
        with open(self.vllm, "a", buffering=1) as log:
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                # sys.stdout/sys.stderr may be objects of their own (a notebook, a test's capture)
                with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    yield
            finally:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
                repoint_stream_handlers(log, console)


def repoint_stream_handlers(old, new) -> int:
    """Point every logging.StreamHandler writing to `old` at `new`; how many were.

    Handlers made while the engine starts (vLLM's console handler from its logging
    config's ext://sys.stderr, the root handler of a library's basicConfig,
    transformers' default handler) bind the sys.stderr of that moment: the log file,
    closed when engine_start ends. Left so, every later warning (the project's own
    included) ended in "--- Logging error --- ValueError: I/O operation on closed file".
    """
    loggers = [logging.getLogger(), *(lg for lg in list(logging.Logger.manager.loggerDict.values()) if isinstance(lg, logging.Logger))]
    count = 0
    for lg in loggers:
        for handler in list(lg.handlers):
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is old:
                handler.setStream(new)
                count += 1
    return count


def _handler(handler: logging.Handler, level: int) -> logging.Handler:
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.setLevel(level)
    return handler


@contextlib.contextmanager
def library_logs(run_dir: str | os.PathLike) -> Iterator[LibraryLogs]:
    """Route vLLM's log and library warnings to files under `run_dir`/logs for the duration of a run."""
    logs = LibraryLogs(Path(run_dir) / "logs", int(os.environ.get("RANK", "0")))
    logs.dir.mkdir(parents=True, exist_ok=True)
    config = vllm_logging_config(logs.vllm)
    config_path = logs.vllm.with_suffix(".logging.json")
    config_path.write_text(json.dumps(config, indent=1))
    vllm_logger = logging.getLogger("vllm")
    saved_vllm = (list(vllm_logger.handlers), vllm_logger.level, vllm_logger.propagate)
    saved_env = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    # vLLM configures its logger when imported and when an engine starts, from this file (also in its child
    # processes); the same handlers set here cover a vLLM imported earlier in this process (not by dictConfig,
    # which would close every other handler of the process)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    vllm_logger.handlers = [_handler(logging.FileHandler(logs.vllm), logging.DEBUG), _handler(logging.StreamHandler(sys.stderr), logging.ERROR)]
    vllm_logger.setLevel(logging.INFO)
    vllm_logger.propagate = False

    warnings_handler = _handler(logging.FileHandler(logs.warnings), logging.DEBUG)
    py_warnings = logging.getLogger("py.warnings")
    saved_warnings = (list(py_warnings.handlers), py_warnings.propagate)
    py_warnings.handlers, py_warnings.propagate = [warnings_handler], False
    logging.captureWarnings(True)
    try:
        yield logs
    finally:
        logging.captureWarnings(False)
        py_warnings.handlers, py_warnings.propagate = saved_warnings
        warnings_handler.close()
        for handler in vllm_logger.handlers:
            if handler not in saved_vllm[0]:
                handler.close()
        vllm_logger.handlers, vllm_logger.level, vllm_logger.propagate = saved_vllm
        if saved_env is None:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        else:
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = saved_env
