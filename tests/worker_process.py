"""One engine worker in a process of its own, outside vLLM: the real worker extension over a torch module.

rollout.worker_ext's RolloutWorkerExtension (mrl_begin_push, mrl_ipc_receive,
the streaming load, mrl_commit_push, mrl_abort_push) runs over a model runner
whose reload copies each tensor into a torch module's parameters, as vLLM's
load does, and is called by name over a pipe. Used by tests/unit/test_weight_ipc.py,
tests/gpu/test_weight_ipc_gpu.py and bench/ipc_gpu.py (no pytest import: the
benchmark runs where only torch and safetensors are installed).
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch


def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


class TorchModelRunner:
    """What the worker extension needs of vLLM's model runner, over a torch module: reload copies each tensor
    into the module's parameters (from an iterator, or a model directory when a broken push is restored)."""

    def __init__(self, model_dir: str, device: str):
        self.model_config = type("ModelConfig", (), {"model": model_dir})()
        self.device = torch.device(device)
        self.model = torch.nn.Module()
        self.names: dict[str, str] = {}
        for name, tensor in load_state(Path(model_dir)).items():
            key = name.replace(".", "_")
            self.model.register_parameter(key, torch.nn.Parameter(tensor.to(self.device), requires_grad=False))
            self.names[name] = key

    def get_model(self) -> torch.nn.Module:
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True):
        if weights_iterator is None:
            weights_iterator = load_state(Path(weights_path)).items()
        with torch.no_grad():
            for name, tensor in weights_iterator:
                getattr(self.model, self.names[name]).copy_(tensor)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _serve(conn, model_dir: str, device: str, rank: int = 0) -> None:
    """An engine worker's process: the worker extension over a TorchModelRunner, called over a pipe."""
    from megatron_rl.rollout.worker_ext import RolloutWorkerExtension

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))

    class Worker(RolloutWorkerExtension):
        def __init__(self):
            self.rank = rank  # its rank among its engine's workers (which handle of a bucket it maps)
            self.model_runner = TorchModelRunner(model_dir, device)

    worker = Worker()
    while True:
        method, args = conn.recv()
        if method == "stop":
            return
        try:
            if method == "restart":  # what an engine restart leaves: a new worker on its model directory
                worker, value = Worker(), None
            elif method == "state":  # the module's parameters, copied to the host
                value = {name: getattr(worker.model_runner.model, key).detach().cpu().clone()
                         for name, key in worker.model_runner.names.items()}
            else:
                value = getattr(worker, method)(*args)
            conn.send(("ok", value))
        except Exception as error:  # noqa: BLE001 - returned like an RPC error
            conn.send(("error", f"{type(error).__name__}: {error}"))


class WorkerProcess:
    """One engine worker in a process of its own (spawned: a CUDA context does not survive fork)."""

    def __init__(self, model_dir: Path, device: str = "cpu", rank: int = 0):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, str(model_dir), device, rank), daemon=True)
        self.process.start()

    def call(self, method: str, *args):
        self.conn.send((method, args))
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop", ()))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


TCP_AUTHKEY = b"megatron-rl-engine-worker"


def _serve_tcp(ready, model_dir: str, rank: int) -> None:
    """An engine worker reached over TCP (trainer ranks forked elsewhere connect to it by address)."""
    from multiprocessing.connection import Listener

    with Listener(("127.0.0.1", 0), authkey=TCP_AUTHKEY) as listener:
        ready.send(listener.address)
        conn = listener.accept()
    try:
        _serve(conn, model_dir, "cpu", rank)
    except EOFError:  # the driving rank exited
        pass


class TcpWorkers:
    """Engines of host worker processes (the worker extension's loop), `workers[i]` for engine i, reached over TCP:
    `addresses` go to the trainer ranks, which make a `TcpEngine` of each engine's list."""

    def __init__(self, model_dir: Path, workers: list[int], context):
        self.processes, self.addresses = [], []
        for count in workers:
            engine = []
            for rank in range(count):
                parent, child = context.Pipe()
                process = context.Process(target=_serve_tcp, args=(child, str(model_dir), rank), daemon=True)
                process.start()
                self.processes.append(process)
                engine.append(parent.recv())
            self.addresses.append(engine)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()


class TcpEngine:
    """An engine of TcpWorkers' processes; a call runs on all of its workers at once (collective_rpc)."""

    def __init__(self, addresses: list):
        from multiprocessing.connection import Client

        self.conns = [Client(address, authkey=TCP_AUTHKEY) for address in addresses]

    def call_each(self, method: str, *args) -> list:
        for conn in self.conns:
            conn.send((method, args))
        answers = [conn.recv() for conn in self.conns]
        for status, value in answers:
            if status != "ok":
                raise RuntimeError(value)
        return [value for _, value in answers]

    def target(self, name: str):
        """The engine as the push protocol sees it (weight_sync.push.PushTarget; buckets by reference)."""
        from megatron_rl.weight_sync.push import PushTarget

        return PushTarget(name, lambda method, *args: self.call_each(method, *args)[0], lambda bucket: bucket,
                          lambda: None, call_each=self.call_each)
