"""Process instances: executors in worker processes over ONE copy of a model's weights.

For models whose Python-side work holds the GIL (the pytorch backend today). The server loads
the model once and the backend's ``share_weights`` hook puts its weights where other processes
can reach them (PyTorch: shared memory, or CUDA IPC handles on a GPU). Each worker calls the
backend's ``attach`` hook, which builds the model over those weights, so they exist once; this
module knows no framework. Requests and replies travel through ``multiprocessing.shared_memory``
blocks; the pipe carries only names, shapes and dtypes. A worker that dies, or passes the model's
``execution_timeout_ms``, fails the request it was running with UNAVAILABLE and is killed and
started again; a watchdog pings idle workers every ``liveness_check_interval_ms`` and replaces one
that is dead or does not answer (stopped, hung). While a worker cannot be started its instance is
not ``healthy``; ModelReady is false when no instance of a version is.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from shoal.backends.base import backend_for
from shoal.backends.devices import Device
from shoal.errors import ErrorCode, ShoalError, load_failed
from shoal.repository.config import ModelSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
CLOSE_GRACE_S = 2.0  # a worker asked to stop gets this long before it is killed
KILL_TIMEOUT_S = 10.0
# Parameters: fail a request after this long (0: never), and ping idle workers at this interval (0: never).
EXECUTION_TIMEOUT_KEY = "execution_timeout_ms"
LIVENESS_KEY = "liveness_check_interval_ms"
WORKER_PARAMETERS = (EXECUTION_TIMEOUT_KEY, LIVENESS_KEY)
DEFAULT_LIVENESS_INTERVAL_S = 5.0
PING = "ping"  # the liveness check: an idle worker echoes it at once


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


def _worker(spec: ModelSpec, model_path: Path, device: Device, handle: Any, threads: int, conn: Any) -> None:
    """A worker process: the backend attaches the model to the server's weights, requests come from the pipe."""
    model = backend_for(spec).attach(spec, model_path, device, handle, threads)
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        if message == PING:
            conn.send(PING)
            continue
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


@dataclass(frozen=True)
class WorkerLimits:
    """How long a worker may take: per request, and to answer a liveness ping when idle (0: never checked)."""

    execution_timeout_s: float = 0.0
    liveness_interval_s: float = DEFAULT_LIVENESS_INTERVAL_S

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> WorkerLimits:
        def milliseconds(key: str, default: float) -> float:
            text = spec.parameters.get(key, "")
            if not text:
                return default
            if not text.isdigit():
                raise load_failed(f"model '{spec.name}': parameter {key} must be a whole number of milliseconds")
            return int(text) / 1000

        return cls(milliseconds(EXECUTION_TIMEOUT_KEY, 0.0), milliseconds(LIVENESS_KEY, DEFAULT_LIVENESS_INTERVAL_S))


class ProcessModel:
    """One executor: a worker process. ``run`` is called by one instance thread at a time.

    A worker that dies, does not answer a request within ``execution_timeout_ms``, or (while idle)
    does not answer a liveness ping within ``liveness_check_interval_ms`` is killed and started
    again. While it cannot be started, ``healthy`` is false, requests fail with UNAVAILABLE and the
    watchdog retries at every interval.
    """

    weight_bytes = 0  # the weights belong to the server's shared copy, counted there

    def __init__(self, spec: ModelSpec, model_path: Path, device: Device, handle: Any, threads: int,
                 limits: WorkerLimits, preload: Sequence[str]) -> None:
        """``handle``: what the backend's ``share_weights`` returned; ``preload``: its worker modules."""
        self._spec, self._path, self._device, self._handle, self._threads = spec, model_path, device, handle, threads
        self._limits = limits
        # Workers fork from a fork server that imported the backend's libraries once (never from this
        # process: its gRPC threads do not survive a fork), so their pages are shared, not repeated.
        # The handle travels with multiprocessing's pickler, where a framework registers how its
        # objects cross processes (importing torch makes shared tensors travel as their memory
        # segment or CUDA IPC handle, never by value): the same context torch.multiprocessing gives.
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([*preload, __name__])
        self._lock = threading.Lock()  # one conversation with the worker at a time
        self._closing = threading.Event()
        self._failure = ""  # why no worker is running; "" while one is
        self._cause = ""  # what happened to the last worker replaced
        self._start()
        self._watchdog: threading.Thread | None = None
        if self._limits.liveness_interval_s:
            self._watchdog = threading.Thread(target=self._watch, name=f"shoal-{spec.name}-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def healthy(self) -> bool:
        """A worker is running and was not found dead or hung."""
        return not self._failure

    def _start(self) -> None:
        self._conn, child = self._context.Pipe()
        self._process = self._context.Process(
            target=_worker, args=(self._spec, self._path, self._device, self._handle, self._threads, child),
            daemon=True, name=f"shoal-{self._spec.name}-worker",
        )
        self._process.start()
        child.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        ready = False
        while time.monotonic() < deadline and self._process.is_alive():
            try:
                if self._conn.poll(0.05):
                    ready = self._conn.recv() == "ready"
                    break
            except (EOFError, OSError):
                break
        if not ready:
            self._kill()
            raise ShoalError(ErrorCode.LOAD_FAILED, f"model '{self._spec.name}': a worker process did not start "
                                                    f"(exit code {self._process.exitcode})")
        logger.info("model %s: worker process %d ready", self._spec.name, self._process.pid)

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        self._process.join(timeout=KILL_TIMEOUT_S)
        self._conn.close()

    def _replace(self, why: str | None) -> None:
        """Kill the worker (dead, hung or stopped) and start another; on failure stay unhealthy. Lock held.

        ``why`` is None to retry a restart that failed before, keeping the first cause.
        """
        if why is None:
            why = self._cause
        else:
            self._cause = why
            logger.error("model %s: worker process %d %s; restarting", self._spec.name, self._process.pid, why)
        self._failure = why
        self._kill()
        if self._closing.is_set():
            return
        try:
            self._start()
        except ShoalError as exc:
            self._failure = f"{why}, and it could not be restarted: {exc.message}"
            logger.error("model %s: %s", self._spec.name, self._failure)
            return
        self._failure = ""
        if self._closing.is_set():  # closed while this worker started
            self._kill()

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        with self._lock:
            if self._failure and not self._closing.is_set():
                self._replace(None)  # a restart that failed before: try once more
            if self._failure or self._closing.is_set():
                raise ShoalError(ErrorCode.UNAVAILABLE, f"model '{self._spec.name}': the instance process "
                                                        f"{self._failure or 'is stopping'}")
            block, layout = _pack(inputs)
            try:
                try:
                    self._conn.send((block.name, layout, list(outputs)))
                except OSError:
                    pass  # the worker is gone: the wait finds it dead and replaces it
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
        """The worker's reply; if it dies or passes the execution timeout, replace it and fail this request."""
        timeout_s = self._limits.execution_timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s else None
        while True:
            try:
                if self._conn.poll(0.05):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            if not self._process.is_alive():
                code = self._process.exitcode
                if self._closing.is_set():
                    raise ShoalError(ErrorCode.UNAVAILABLE, f"model '{self._spec.name}' is unloading")
                self._replace(f"died (exit code {code})")
                raise ShoalError(
                    ErrorCode.UNAVAILABLE,
                    f"model '{self._spec.name}': the instance process running this request died "
                    f"(exit code {code}); {'it has been restarted' if self.healthy else 'it could not be restarted'}",
                )
            if deadline is not None and time.monotonic() > deadline:
                limit_ms = round(timeout_s * 1000)
                self._replace(f"did not answer a request within execution_timeout_ms {limit_ms}")
                raise ShoalError(
                    ErrorCode.UNAVAILABLE,
                    f"model '{self._spec.name}': the instance process did not answer within "
                    f"{limit_ms} ms (execution_timeout_ms); it was killed and restarted",
                )

    # -- liveness -------------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Every interval, check an idle worker (a busy one is watched by its request's wait)."""
        interval_s = self._limits.liveness_interval_s
        while not self._closing.wait(interval_s):
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self._closing.is_set():
                    return
                if self._failure:
                    self._replace(None)
                elif not self._answers_ping(interval_s):
                    alive = self._process.is_alive()
                    self._replace(f"did not answer a liveness check within {round(interval_s * 1000)} ms"
                                  if alive else f"died (exit code {self._process.exitcode})")
            finally:
                self._lock.release()

    def _answers_ping(self, timeout_s: float) -> bool:
        try:
            self._conn.send(PING)
            return bool(self._conn.poll(timeout_s)) and self._conn.recv() == PING
        except (EOFError, OSError):
            return False

    # -- closing --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker, bounded even when it is stopped (SIGSTOP) or stuck: ask, wait briefly, kill."""
        self._closing.set()
        if self._lock.acquire(timeout=CLOSE_GRACE_S):
            try:
                if self._process.is_alive():
                    try:
                        if self._process.pid:
                            os.kill(self._process.pid, signal.SIGCONT)  # a stopped worker can read the request
                        self._conn.send(None)
                    except (OSError, ValueError):
                        pass
                    self._process.join(timeout=CLOSE_GRACE_S)
                self._kill()
            finally:
                self._lock.release()
        elif self._process.is_alive():  # a request or a restart holds the worker: kill it under them
            self._process.kill()
        if self._watchdog is not None:
            self._watchdog.join(timeout=KILL_TIMEOUT_S)

