"""megatron_rl.heap: a process's long-lived imports frozen out of the collector's scans, and the closes of a
process's last run without their collection. Each case runs in a fresh interpreter (the collector's state is
process-wide), with the collector paused so that only the calls under test collect."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.extras import VLLM_EXTRA

REPO = Path(__file__).resolve().parents[2]

CYCLE = """
import gc, weakref
class Node:
    pass
def garbage_cycle():
    node = Node()
    node.me = node  # unreachable once returned: only a collection frees it
    return weakref.ref(node)
"""


def _run(body: str, tmp_path: Path, **env: str) -> None:
    (tmp_path / "many_objects.py").write_text("ROWS = [[i] for i in range(20000)]  # lists: tracked by the collector\n")
    code = CYCLE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin", **env})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_imports_are_frozen_and_garbage_made_before_is_collected_not_frozen(tmp_path):
    _run("""
        from megatron_rl.heap import import_long_lived
        for enabled in (False, True):
            gc.enable() if enabled else gc.disable()
            before, dead = gc.get_freeze_count(), garbage_cycle()
            import_long_lived("many_objects" if enabled else "json", "no_such_module_anywhere", "never_reached")
            assert dead() is None, "garbage made before the call was frozen instead of collected"
            assert gc.isenabled() is enabled
        import many_objects
        assert gc.get_freeze_count() >= before + 20000, (before, gc.get_freeze_count())
        row = many_objects.ROWS[-1]
        assert not any(o is row for o in gc.get_objects()), "an imported object is still scanned by the collector"
        assert "never_reached" not in __import__("sys").modules
        """, tmp_path)


def test_closes_collect_unless_the_process_ends_after_them(tmp_path):
    _run("""
        gc.disable()
        from megatron_rl.heap import collect_after_close, process_ends_after_close
        dead = garbage_cycle()
        collect_after_close()
        assert dead() is None
        process_ends_after_close()
        alive = garbage_cycle()
        collect_after_close()
        assert alive() is not None, "collected although the process ends after its closes"
        """, tmp_path)


@pytest.mark.extra(VLLM_EXTRA, "vllm")
def test_vllms_shutdown_leaves_the_heap_frozen_only_where_the_process_ends_after_it(tmp_path):
    """vLLM's own teardown (cleanup_dist_env_and_memory: gc.unfreeze, then a full collection), as its engine shutdown
    runs it: unfrozen in a process that goes on (a closed engine must be collectable), kept frozen in one that ends."""
    _run("""
        gc.disable()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        from megatron_rl.heap import (frozen_until_exit, heap_kept_frozen, keep_frozen_until_exit,
                                      process_ends_after_close)
        import many_objects
        gc.freeze()
        with heap_kept_frozen():  # the process goes on
            assert not frozen_until_exit()
            cleanup_dist_env_and_memory()
        assert gc.get_freeze_count() == 0, "vLLM's teardown no longer unfreezes the heap: heap_kept_frozen is moot"
        process_ends_after_close()
        gc.freeze()
        frozen, dead = gc.get_freeze_count(), garbage_cycle()
        assert frozen >= 20000, frozen
        with heap_kept_frozen():
            assert frozen_until_exit()
            cleanup_dist_env_and_memory()
        assert gc.get_freeze_count() == frozen, "the heap was unfrozen in a process that ends next"
        assert dead() is None, "vLLM's collection no longer ran over what was made since the freeze"
        assert not frozen_until_exit()  # gc.unfreeze is the collector's own again after the shutdown
        gc.unfreeze()
        assert gc.get_freeze_count() == 0
        keep_frozen_until_exit()  # a process vLLM started for its engine core: to its end
        gc.freeze()
        cleanup_dist_env_and_memory()
        assert gc.get_freeze_count() >= frozen and frozen_until_exit()
        """, tmp_path, HOME=str(tmp_path), VLLM_LOGGING_LEVEL="WARNING")
