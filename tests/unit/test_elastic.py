"""How a failed torchrun job ends: each rank's one line in torchrun's error file, the launcher's lines (rank 0's last),
a bad-input verdict that a restarted attempt replays at once, the reasons a restarted attempt gives, and the stop
signals."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron_rl import errors
from megatron_rl.checkpoint.resume import previous_attempt_failures
from megatron_rl.elastic import failure_lines
from megatron_rl.parallel.watch import StopSignals


def _attempt(monkeypatch, root: Path, attempt: int, local_rank: int) -> Path:
    """The torchrun variables of one rank in one attempt, as the elastic agent sets them."""
    error_file = root / "run-id" / f"attempt_{attempt}" / str(local_rank) / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(errors.LAUNCHER_ENV, "1")
    return error_file


def test_error_files_the_launcher_lines_and_a_replayed_bad_input(monkeypatch, tmp_path, capsys):
    from megatron_rl.data.dataset import DatasetError
    from megatron_rl.parallel.watch import CollectiveError

    rank0 = _attempt(monkeypatch, tmp_path, 0, 0)
    assert errors.report_error("megatron-rl train", DatasetError("rows.jsonl:2: not valid JSON"), log_dir=None) == 2
    rank1 = _attempt(monkeypatch, tmp_path, 0, 1)
    lost = CollectiveError("rank 1: a collective of step 0, phase generate, lost its connection")
    assert errors.report_error("megatron-rl train", lost, log_dir=None) == 1
    assert capsys.readouterr().err == ""  # under the launcher the ranks leave the console to it

    first, second = json.loads(rank0.read_text()), json.loads(rank1.read_text())
    assert first["message"] == "megatron-rl train: error: rows.jsonl:2: not valid JSON" and first["exitcode"] == 2
    assert "DatasetError" in first["traceback"] and second["exitcode"] == 1
    # torchrun reads the files into its ProcessFailures (exit codes as the processes returned them)
    killed = ProcessFailure(local_rank=1, pid=4321, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    failures = {0: ProcessFailure(0, 1234, 2, str(rank0)), 1: ProcessFailure(1, 4321, 1, str(rank1))}
    lines, code = failure_lines(failures)
    assert lines == [second["message"], first["message"]] and code == 2
    assert second["message"] == "megatron-rl train: error: rank 1: a collective of step 0, phase generate, lost its connection"
    lines, code = failure_lines({1: killed})
    assert code == 1 and len(lines) == 1 and lines[0].startswith("rank 1 (pid 4321 on ") and "killed by SIGKILL" in lines[0]
    lines, _ = failure_lines({0: ProcessFailure(0, 1234, 2, str(rank0)), 1: ProcessFailure(1, 4321, 2, str(rank0))})
    assert lines == [first["message"]]  # the same line from every rank: printed once
    stopped = ProcessFailure(local_rank=1, pid=4321, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none.json"))
    assert failure_lines({0: ProcessFailure(0, 1234, 2, str(rank0)), 1: stopped}) == ([first["message"]], 2)  # torchrun's own stop

    # the restarted attempt: no work, the first attempt's verdict, this rank's error file written again
    replay = _attempt(monkeypatch, tmp_path, 1, 1)
    assert errors.replay_bad_input() == 2
    assert json.loads(replay.read_text())["message"] == first["message"] and capsys.readouterr().err == ""
    reasons = previous_attempt_failures()
    assert reasons == [f"local rank 0: {first['message']}", f"local rank 1: {second['message']}"]
    monkeypatch.delenv(errors.LAUNCHER_ENV)
    _attempt(monkeypatch, tmp_path, 1, 0)
    monkeypatch.delenv(errors.LAUNCHER_ENV)
    assert errors.replay_bad_input() == 2 and capsys.readouterr().err == first["message"] + "\n"  # plain torchrun: rank 0 says it


def test_no_verdict_outside_torchrun_or_in_a_first_attempt(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert errors.replay_bad_input() is None and previous_attempt_failures() == []
    _attempt(monkeypatch, tmp_path, 0, 0)
    assert errors.replay_bad_input() is None and previous_attempt_failures() == []


def test_stop_signals_are_held_until_asked_for_and_then_restored():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals()
    stop.install()
    try:
        assert stop.agreed(None) is None
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the signal only sets the flag
        stop.install()  # installed again (after an engine's start): the received signal is kept
        assert stop.agreed(None) == signal.SIGTERM
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_stop_is_exit_code_3_and_not_an_error(monkeypatch, tmp_path, capsys):
    from megatron_rl.trainer import StoppedBySignal

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv(errors.LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    code = errors.report_error("megatron-rl train", StoppedBySignal("stopped by SIGTERM after step 3 of 4"), log_dir=tmp_path)
    assert code == errors.EXIT_PREEMPTED == 3
    assert capsys.readouterr().err == "megatron-rl train: stopped by SIGTERM after step 3 of 4\n"
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("preset_text, culprit", [("defaults: [models/nope.yaml]\n", "nope.yaml")])
def test_a_preset_including_a_missing_file_names_both(tmp_path, preset_text, culprit):
    from megatron_rl.config.core import ConfigError, load_yaml_preset

    (tmp_path / "run.yaml").write_text(preset_text)
    with pytest.raises(ConfigError) as raised:
        load_yaml_preset(tmp_path / "run.yaml")
    message = str(raised.value)
    assert f"preset {str(tmp_path / 'run.yaml')!r} includes" in message and culprit in message and "defaults list" in message


def test_each_world_of_a_launch_reads_store_keys_of_its_own(monkeypatch):
    """torchrun's shared store outlives a world: a second run in the same processes (after destroy_parallel) or a
    restarted attempt must not read the keys the world before it left (gloo's peer addresses: torch numbers a new
    world's groups from 0 again), or its ranks connect to peers that are gone and wait."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_rl.parallel import context

    launcher = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # torchrun's agent store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launcher.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = context._attempt_store(timedelta(seconds=30))
    first.set("0/rank_0", "address of a peer that is gone")
    second = context._attempt_store(timedelta(seconds=30))  # the next run's world, same attempt
    assert not second.check(["0/rank_0"])
    second.set("0/rank_0", "a live peer")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = context._attempt_store(timedelta(seconds=30))
    assert not restarted.check(["0/rank_0"])
    assert first.get("0/rank_0") == b"address of a peer that is gone"  # each world's keys are its own
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert context._attempt_store(timedelta(seconds=30)) is None  # not under torchrun's shared store: env:// as usual


RANK_SAVES_ON_SIGTERM = """
import os, signal, sys, time
from pathlib import Path

out = Path(sys.argv[1])
def stop(signum, frame):
    (out / "signalled").touch()
    time.sleep(float(sys.argv[2]))  # the step's end and the save
    (out / "saved").touch()
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
(out / "ready").touch()
time.sleep(120)
"""


def _stopped_launch(tmp_path: Path, grace_s: int, save_s: float) -> tuple[int, str, set[str]]:
    """megatron_rl.elastic over one rank that takes `save_s` to save after SIGTERM, stopped by SIGTERM with
    --shutdown-timeout=`grace_s`: (exit code, stderr, the rank's marker files)."""
    import subprocess
    import sys
    import time

    out = tmp_path / f"grace{grace_s}"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SAVES_ON_SIGTERM)
    launch = subprocess.Popen([sys.executable, "-m", "megatron_rl.elastic", f"--log-file={out / 'torchrun.log'}",
                               f"--shutdown-timeout={grace_s}", "--standalone", "--nproc-per-node=1", "--max-restarts=0",
                               str(script), str(out), str(save_s)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "ready").exists() and launch.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    launch.send_signal(signal.SIGTERM)
    _, err = launch.communicate(timeout=120)
    return launch.returncode, err, {p.name for p in out.iterdir()} - {"torchrun.log"}


def test_a_stop_signal_gives_the_ranks_the_shutdown_timeout_on_this_torchrun(tmp_path):
    """The ranks get --shutdown-timeout seconds to save after a stop signal, then SIGKILL, on the installed torch:
    torch 2.13's torchrun takes the option; 2.11's closes them with a fixed 30 s, and the launcher's own agent waits
    instead. A 1 s grace kills a 4 s save midway (a fixed 30 s would let it finish); a 6 s grace lets a 1 s save end."""
    from megatron_rl.elastic import torchrun_takes

    code, err, markers = _stopped_launch(tmp_path, grace_s=1, save_s=4)
    assert code == errors.EXIT_PREEMPTED and markers == {"ready", "signalled"}, (code, markers, err[-3000:])
    assert "(within 1 s)" in err, err[-3000:]
    code, err, markers = _stopped_launch(tmp_path, grace_s=6, save_s=1)
    assert code == errors.EXIT_PREEMPTED and markers == {"ready", "signalled", "saved"}, (code, markers, err[-3000:])
    # which path ran: the installed torchrun's option where it has one (its parser, independently of ours)
    import torch.distributed.run as run

    has_option = any("--shutdown-timeout" in action.option_strings for action in run.get_args_parser()._actions)
    assert torchrun_takes("--shutdown-timeout") == has_option
