"""Process instances: executors in worker processes over ONE copy of a PyTorch model's weights.

For models whose Python-side work holds the GIL. The server loads the module once and moves
its parameters and buffers to shared memory (``share_memory_``; on a GPU, torch.multiprocessing
passes CUDA tensors as CUDA IPC handles). Each worker loads the module's code, then points every
parameter and buffer at the shared tensors, so the weights exist once. Requests and replies
travel through ``multiprocessing.shared_memory`` blocks; the pipe carries only names, shapes
and dtypes. A worker that dies fails the request it was running with UNAVAILABLE, and is
started again; the model stays available.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from server.backends.devices import Device
from server.errors import ErrorCode, ShoalError
from server.repository.config import ModelSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class _Array:
    """A tensor in a shared-memory block: where it starts and what it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


def _pack(arrays: Mapping[str, np.ndarray]) -> tuple[shared_memory.SharedMemory, list[_Array]]:
    size = sum(a.nbytes for a in arrays.values()) or 1
    block = shared_memory.SharedMemory(create=True, size=size)
    layout, offset = [], 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        np.ndarray(array.shape, array.dtype, buffer=block.buf, offset=offset)[...] = array
        layout.append(_Array(name, array.dtype.name, array.shape, offset))
        offset += array.nbytes
    return block, layout


def _unpack(block: shared_memory.SharedMemory, layout: list[_Array], copy: bool) -> dict[str, np.ndarray]:
    arrays = {}
    for item in layout:
        view = np.ndarray(item.shape, _dtype(item.dtype), buffer=block.buf, offset=item.offset)
        arrays[item.name] = view.copy() if copy else view
    return arrays


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _worker(spec: ModelSpec, model_path: str, device: str, shared: dict[str, Any], threads: int, conn: Any) -> None:
    """A worker process: the module's code, the server's weights, requests from the pipe."""
    import torch

    from server.backends import pytorch

    torch.set_num_threads(threads)
    target = torch.device(device)
    if model_path.endswith(".pt2") and not pytorch.is_pickled(spec):
        module, names = pytorch.read_module(spec, Path(model_path), target)
        with torch.no_grad():
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                tensor.set_(shared[name])  # our own copy is dropped: the weights are the server's
    else:
        # The code only, onto the meta device (no weight allocated here), then every parameter
        # and buffer pointed at the server's shared tensor.
        module, names = pytorch.read_module(spec, Path(model_path), torch.device("meta"))
        if pytorch.is_pickled(spec):
            module.load_state_dict({k: shared[k] for k in module.state_dict()}, strict=True, assign=True)
        else:
            for name in [*dict(module.named_parameters()), *dict(module.named_buffers())]:
                owner = module
                *path, attribute = name.split(".")
                for part in path:
                    owner = getattr(owner, part)
                owner._c.setattr(attribute, shared[name])  # ScriptModules take attributes only this way
    model = pytorch.TorchModel(module, spec, target, names)
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        block_name, layout, outputs = message
        block = shared_memory.SharedMemory(name=block_name)
        try:
            results = model.run(_unpack(block, layout, copy=False), outputs)
            out_block, out_layout = _pack(results)
            conn.send(("ok", out_block.name, out_layout))
            out_block.close()
        except Exception as exc:  # noqa: BLE001 - reported to the server, the worker goes on
            conn.send(("error", f"{type(exc).__name__}: {exc}", None))
        finally:
            block.close()


class ProcessModel:
    """One executor: a worker process. ``run`` is called by one instance thread at a time."""

    weight_bytes = 0  # the weights belong to the server's shared copy, counted there

    def __init__(self, spec: ModelSpec, model_path: Path, device: Device, shared: dict[str, Any],
                 threads: int) -> None:
        import torch.multiprocessing as mp

        self._spec, self._path, self._shared, self._threads = spec, model_path, shared, threads
        self._device = "cpu" if device.kind == "cpu" else f"cuda:{device.index}"
        # Workers fork from a fork server that imported torch once (never from this process: its
        # gRPC threads do not survive a fork), so the libraries' pages are shared, not repeated.
        self._context = mp.get_context("forkserver")
        self._context.set_forkserver_preload(["torch", "server.backends.pytorch", "server.instances.process"])
        self._lock = threading.Lock()
        self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _start(self) -> None:
        self._conn, child = self._context.Pipe()
        self._process = self._context.Process(
            target=_worker, args=(self._spec, str(self._path), self._device, self._shared, self._threads, child),
            daemon=True, name=f"shoal-{self._spec.name}-worker",
        )
        self._process.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S) or self._conn.recv() != "ready":
            raise ShoalError(ErrorCode.LOAD_FAILED, f"model '{self._spec.name}': a worker process did not start")
        logger.info("model %s: worker process %d ready", self._spec.name, self._process.pid)

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        with self._lock:
            block, layout = _pack(inputs)
            try:
                self._conn.send((block.name, layout, list(outputs)))
                reply = self._wait()
            finally:
                block.close()
                block.unlink()
        status, payload, out_layout = reply
        if status != "ok":
            raise RuntimeError(payload)
        out_block = shared_memory.SharedMemory(name=payload)
        try:
            return _unpack(out_block, out_layout, copy=True)
        finally:
            out_block.close()
            out_block.unlink()

    def _wait(self) -> Any:
        """The worker's reply; if it dies instead, restart it and fail this request."""
        while True:
            try:
                if self._conn.poll(0.05):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            if not self._process.is_alive():
                code = self._process.exitcode
                logger.error("model %s: worker process %d died (exit code %s); restarting",
                             self._spec.name, self._process.pid, code)
                self._start()
                raise ShoalError(
                    ErrorCode.UNAVAILABLE,
                    f"model '{self._spec.name}': the instance process running this request died "
                    f"(exit code {code}); it has been restarted",
                )

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def share_weights(model: Any) -> dict[str, Any]:
    """Move a loaded TorchModel's parameters and buffers to shared memory; name → tensor."""
    module = model.module
    shared = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type == "cpu":
            tensor.share_memory_()
        shared[name] = tensor.detach()
    return shared
