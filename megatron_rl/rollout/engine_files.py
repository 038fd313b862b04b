"""The files vLLM leaves in the temp directory for each engine: the ZMQ sockets between its processes and the file
store its worker group meets in, kept in a directory of the engine's own and removed with it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

class SocketDir:
    """A directory of one vLLM engine's own for the ZMQ sockets between its processes (VLLM_RPC_BASE_PATH), and the
    temp directory of the processes the engine starts (TMPDIR), removed with it. vLLM names its sockets by uuid in
    the system temp directory and leaves them there, and so the file store its worker's process group meets in
    (vllm_dist_<uuid>, made by the engine-core process): every engine start left 3 socket files and a store file
    behind, a server 3 more, and a machine's /tmp collects thousands over restarts and runs. (An engine in this
    process makes its store in this process's temp directory: the engine's stop removes it once the group is gone,
    remove_store_file.)"""

    VARIABLE = "VLLM_RPC_BASE_PATH"
    TEMP = "TMPDIR"
    MAX_PATH = 107 - 1 - 36  # a Unix socket's path holds 107 bytes (Linux sun_path); vLLM adds "/" and a uuid4
    PREFIX = "mrl-vllm-"

    def __init__(self) -> None:
        self.path: str | None = None

    def environment(self) -> dict[str, str]:
        """A new directory (the one before removed) as the variable vLLM reads when it names a socket; nothing (vLLM's
        own temp directory) where the temp directory's path is too long for a directory in it to hold the sockets."""
        self.remove()
        room = self.MAX_PATH - len(os.path.join(tempfile.gettempdir(), self.PREFIX)) - 8  # mkdtemp's 8 characters
        if room < 0:
            return {}
        self.path = tempfile.mkdtemp(prefix=self.PREFIX)  # this process's own temp directory stays the one it read
        return {self.VARIABLE: self.path, **self._temp_environment(self.path)}

    @classmethod
    def _temp_environment(cls, path: str) -> dict[str, str]:
        """TMPDIR=path, with torch inductor's compile cache kept where it was (its default is under the temp
        directory; a server's restart must find its compiled kernels). Nothing where torch does not say where."""
        if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
            return {cls.TEMP: path}
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:
            return {}
        return {cls.TEMP: path, "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}

    def remove(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


STORE_PREFIX = "vllm_dist_"
"""vLLM's file store for a one-process engine's worker group: <temp directory>/vllm_dist_<uuid>
(vllm.utils.network_utils.get_file_store_init_method); vLLM's CPU worker puts its name in VLLM_DIST_IDENT."""


def store_file_of_this_process() -> str | None:
    """The file store an engine in this process made for its group (VLLM_DIST_IDENT), if the file is there."""
    name = os.environ.get("VLLM_DIST_IDENT", "")
    path = os.path.join(tempfile.gettempdir(), name)
    return path if name.startswith(STORE_PREFIX) and os.path.isfile(path) else None


def remove_store_file(path: str | None) -> None:
    """Remove an engine's file store once the group it served is gone (torch leaves it where that group's store is
    still referenced, as megatron's groups made on the engine's default group keep it)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
