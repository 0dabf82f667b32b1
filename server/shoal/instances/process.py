"""Process instances: executors in worker processes over ONE copy of a model's weights.

For models whose Python-side work holds the GIL (the pytorch backend today). The server loads
the model once and the backend's ``share_weights`` hook puts its weights where other processes
can reach them (PyTorch: shared memory, or CUDA IPC handles on a GPU). Each worker calls the
backend's ``attach`` hook, which builds the model over those weights, so they exist once; this
module knows no framework.

The worker's side is ``instances.process_worker``; the pipe and arenas between them, one protocol
for both kinds of process instance, ``instances.worker_pipe``. Tensors travel through the
``dataplane``: each worker has two memfd arenas, created here and handed to it over its pipe
(``multiprocessing.reduction.send_handle``): nothing is named in /dev/shm, and the kernel frees them
whenever the last holder exits, SIGKILL included. A worker runs one batch at a time, so the server
writes the inputs at offset 0 of the requests arena and the worker its outputs at offset 0 of the
responses arena (``packing.pack_at``); the pipe carries only the slots, but for a batch whose
tensors are all numeric and small (at most ``inline.INLINE_BYTES``), which it carries in its
messages (``dataplane.inline``). A batch that does not fit is not refused: its side asks for a
bigger arena (the server creates it and hands it over) up to ``MAX_ARENA_BYTES`` per direction, past
which the batch fails with a message that says so. The first ``arena.RESIDENT_BYTES`` of each arena
stay backed between batches (giving pages back and faulting them in again costs several times the
copy: in bench/process_request.py a 4 MiB request took 9 ms that way, 1.6 ms without); pages past
them are given back after each batch (``Arena.release_pages``), so a rare huge batch leaves no
lasting footprint.

A worker that dies, or passes the model's ``execution_timeout_ms``, fails the request it was
running with UNAVAILABLE and is killed and started again (the arenas stay, the new worker gets
them); a watchdog pings idle workers every ``liveness_check_interval_ms`` and replaces one that
is dead or does not answer (stopped, hung). While a worker cannot be started its instance is
not ``healthy``; ModelReady is false when no instance of a version is. And every worker dies
with the server, however the server dies (``shoal.instances.lifeline``).
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
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import numpy as np

from shoal import logs
from shoal.backends.devices import Device
from shoal.dataplane import inline, packing
from shoal.dataplane.arena import Arena, PoolFull
from shoal.errors import ErrorCode, ShoalError, load_failed
from shoal.instances import lifeline, process_worker
from shoal.instances.worker_pipe import (
    INITIAL_ARENA_BYTES,
    REQUESTS,
    RESPONSES,
    Carried,
    Failed,
    Grow,
    NewArena,
    Ping,
    Ran,
    Ready,
    Run,
    Stop,
    arena_bytes,
    as_tensors,
    trim,
)
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
MAX_MILLISECONDS = 2**31 - 1  # about 24.8 days: threading's waits refuse much larger ones (OverflowError)
FORKSERVER_GUARD = "shoal.instances.forkserver_guard"


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
            # ASCII digits only ("²" is a digit to str.isdigit), and no more than a timer can wait.
            if not (text.isascii() and text.isdigit()) or int(text) > MAX_MILLISECONDS:
                raise load_failed(
                    f"model '{spec.name}': parameter {key} must be a whole number of milliseconds, "
                    f"at most {MAX_MILLISECONDS}"
                )
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
    runs_requests = False  # one feed per batch, which its worker runs
    # What the worker process runs: (spec, model_path, device, handle, threads, conn). A subclass
    # may run its own loop over the same pipe and arenas (shoal.instances.python_process).
    worker_main = staticmethod(process_worker.worker_main)

    def __init__(
        self,
        spec: ModelSpec,
        model_path: Path,
        device: Device,
        handle: Any,
        threads: int,
        limits: WorkerLimits,
        preload: Sequence[str],
    ) -> None:
        """``handle``: what the backend's ``share_weights`` returned; ``preload``: its worker modules."""
        self._spec, self._path, self._device, self._handle, self._threads = spec, model_path, device, handle, threads
        self._limits = limits
        # Workers fork from a fork server that imported the backend's libraries once (never from this
        # process: its gRPC threads do not survive a fork), so their pages are shared, not repeated.
        # The handle travels with multiprocessing's pickler, where a framework registers how its
        # objects cross processes (importing torch makes shared tensors travel as their memory
        # segment or CUDA IPC handle, never by value): the same context torch.multiprocessing gives.
        self._context = multiprocessing.get_context("forkserver")
        # The guard comes first: the fork server dies with this process (shoal.instances.lifeline).
        self._context.set_forkserver_preload(
            [FORKSERVER_GUARD, *preload, __name__, type(self).__module__, type(self).worker_main.__module__]
        )
        self._lock = threading.Lock()  # one conversation with the worker at a time
        self._closing = threading.Event()
        self._failure = ""  # why no worker is running; "" while one is
        self._cause = ""  # what happened to the last worker replaced
        self._inputs_kept = False  # the model holds views of the REQUESTS arena: the next batch goes to a new one
        self._worker_started: int | None = None  # the worker's start time (lifeline.kill_group)
        # Inputs go into one, outputs come back in the other; a restarted worker gets the same two.
        self._arenas = {
            which: Arena.create(f"shoal-instance-{which}", INITIAL_ARENA_BYTES) for which in (REQUESTS, RESPONSES)
        }
        try:
            self._start()
        except BaseException:
            self._close_arenas()
            raise
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
            target=process_worker.entry,
            args=(
                type(self).worker_main,
                logs.current(),
                self._spec,
                self._path,
                self._device,
                self._handle,
                self._threads,
                child,
            ),
            daemon=True,
            name=f"shoal-{self._spec.name}-worker",
        )
        try:
            lifeline.launch(self._process)
        except OSError as exc:  # the system's refusal (no fork server, process or descriptor left), not the model's
            child.close()
            self._conn.close()
            raise ShoalError(
                ErrorCode.LOAD_FAILED, f"model '{self._spec.name}': a worker process could not be started: {exc}"
            ) from None
        self._worker_started = lifeline.start_time(self._process.pid)
        child.close()
        self._launched()
        deadline = time.monotonic() + START_TIMEOUT_S
        reply: Any = None
        while time.monotonic() < deadline and self._process.is_alive() and not self._closing.is_set():
            try:
                if self._conn.poll(0.05):
                    reply = self._conn.recv()
                    break
            except (EOFError, OSError):
                break
        if reply is None:
            reply = self._last_word()  # a worker that said why and exited at once: its reason is still in the pipe
        if not isinstance(reply, Ready):
            self._kill()
            if isinstance(reply, Failed):  # the worker said why (a model file's error)
                raise ShoalError(ErrorCode.LOAD_FAILED, reply.message)
            raise ShoalError(
                ErrorCode.LOAD_FAILED,
                f"model '{self._spec.name}': a worker process did not start (exit code {self._process.exitcode})",
            )
        for which in self._arenas:
            self._send_arena(which)
        logger.info("model %s: worker process %d ready", self._spec.name, self._process.pid)

    def _launched(self) -> None:
        """The worker has its ends of what it was handed: a subclass closes its own copies now, before
        the model initializes (a fork of this process meanwhile would keep them open). Lock held."""

    def _last_word(self) -> Any:
        """What a worker that ended while starting left in the pipe, if anything."""
        try:
            return self._conn.recv() if self._conn.poll(0) else None
        except (EOFError, OSError):
            return None

    def _send_arena(self, which: str) -> None:
        """Hand the worker an arena: a message, then its descriptor over the pipe. Lock held."""
        arena = self._arenas[which]
        try:
            self._conn.send(NewArena(which, arena.size))
            reduction.send_handle(self._conn, arena.fd, self._process.pid)
        except OSError:
            pass  # the worker is gone: the next wait finds it dead and replaces it

    def _grow(self, which: str, needed: int) -> None:
        """Replace an arena by one of at least ``needed`` bytes and hand it to the worker. Lock held.
        Never by a smaller one: a Python model's outputs that do not fit after its batch's BLS inputs
        ask for a new arena of their own size, which can be less than the one they left."""
        before = self._arenas[which].size
        size = max(before, arena_bytes(needed, "inputs" if which == REQUESTS else "outputs"))
        self._new_arena(which, size)
        if size > before:
            logger.info("model %s: a process instance's %s arena grows to %d MiB", self._spec.name, which, size >> 20)

    def _new_arena(self, which: str, size: int) -> None:
        """Write no more into the arena ``which``: hand the worker a new one of ``size`` bytes in its
        place (the worker's mapping of the old one lasts while its views do). Lock held."""
        old = self._arenas[which]
        self._arenas[which] = Arena.create(f"shoal-instance-{which}", size)
        old.close()
        self._send_arena(which)

    def _leave_inputs_to_worker(self) -> None:
        """The model kept views of a batch's inputs past the batch (``worker_pipe.InputViews``): before
        the next batch, a new REQUESTS arena (the worker copies its inputs from now on). Lock held. If
        no arena can be made (no descriptor left), the batch fails and the next one tries again: no
        batch is ever written into the arena the model reads."""
        self._new_arena(REQUESTS, self._arenas[REQUESTS].size)
        self._inputs_kept = False
        logger.warning(
            "model %s: an input outlived its batch in the instance process (the model kept it, or a thread "
            "of the model still held it as the batch ended); it stays as it was, in a shared-memory arena of "
            "%d MiB of its own, and the instance process copies its inputs from now on",
            self._spec.name,
            self._arenas[REQUESTS].size >> 20,
        )

    def _close_arenas(self) -> None:
        for arena in self._arenas.values():
            arena.close()

    def _kill(self) -> None:
        if self._process.pid is not None:  # else it never started (a restart the system refused)
            lifeline.kill_group(self._process.pid, self._worker_started)  # what the model started, the worker too
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
        except (ShoalError, OSError, RuntimeError) as exc:  # the system's refusals too: no descriptor, no thread
            reason = exc.message if isinstance(exc, ShoalError) else f"{type(exc).__name__}: {exc}"
            self._failure = f"{why}, and it could not be restarted: {reason}"
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
                raise ShoalError(
                    ErrorCode.UNAVAILABLE,
                    f"model '{self._spec.name}': the instance process {self._failure or 'is stopping'}",
                )
            if self._inputs_kept:  # the last feed's inputs are the model's: a new arena first
                self._leave_inputs_to_worker()
            slots = self._carry(inputs)
            timeout_s = self._limits.execution_timeout_s
            deadline = time.monotonic() + timeout_s if timeout_s else None
            try:
                self._conn.send(Run(slots, list(outputs)))
            except OSError:
                pass  # the worker is gone: the wait finds it dead and replaces it
            reply = None
            try:
                reply = self._wait(deadline)
                while isinstance(reply, Grow):  # the outputs do not fit: a bigger arena, then the reply
                    self._grow(RESPONSES, reply.needed)
                    reply = self._wait(deadline)
                if not isinstance(reply, Ran):
                    raise RuntimeError(reply.message if isinstance(reply, Failed) else f"the worker answered {reply!r}")
                if isinstance(reply.outputs, dict):
                    return inline.arrays_of(reply.outputs)
                responses = self._arenas[RESPONSES]
                results = {
                    slot[0]: array
                    for slot, array in zip(reply.outputs, packing.unpack_copies(responses, reply.outputs), strict=True)
                }
                trim(responses, packing.extent(reply.outputs))
                return results
            finally:
                if isinstance(reply, (Ran, Failed)) and reply.inputs_kept:
                    self._inputs_kept = True  # the next feed goes to a new arena (``_leave_inputs_to_worker``)
                elif isinstance(slots, list):
                    trim(self._arenas[REQUESTS], packing.extent(slots))

    def _carry(self, inputs: Mapping[str, np.ndarray]) -> Carried:
        """The feed's inputs as its message carries them (``inline``), or copied into the REQUESTS arena."""
        carried = inline.inline_feeds([inputs])
        if carried is not None:
            return carried[0]
        feed = as_tensors(inputs)
        try:
            return packing.pack_at(self._arenas[REQUESTS], 0, feed)
        except PoolFull as full:
            self._grow(REQUESTS, full.wanted)
            return packing.pack_at(self._arenas[REQUESTS], 0, feed)

    def _wait(self, deadline: float | None) -> Any:
        """The worker's reply; if it dies or passes the execution timeout, replace it and fail this request."""
        while True:
            try:
                if self._conn.poll(0.05):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            self._check_running(deadline)

    def _check_running(self, deadline: float | None) -> None:
        """While a request waits: if the worker died or passed the execution timeout, replace it and
        fail the request (UNAVAILABLE)."""
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
            limit_ms = round(self._limits.execution_timeout_s * 1000)
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
                    self._replace(
                        f"did not answer a liveness check within {round(interval_s * 1000)} ms"
                        if alive
                        else f"died (exit code {self._process.exitcode})"
                    )
            finally:
                self._lock.release()

    def _answers_ping(self, timeout_s: float) -> bool:
        """Whether the idle worker echoes a ping within ``timeout_s`` (lock held, no batch running);
        what else it says first goes to ``_answer_unasked``."""
        deadline = time.monotonic() + timeout_s
        try:
            self._conn.send(Ping())
            while self._conn.poll(max(0.0, deadline - time.monotonic())):
                message = self._conn.recv()
                if isinstance(message, Ping):
                    return True
                if not self._answer_unasked(message):
                    return False
        except (EOFError, OSError):
            pass
        return False

    def _answer_unasked(self, message: Any) -> bool:
        """A message the idle worker sent unasked, read by the liveness check: answered (True), or a sign
        that the worker is out of step (False: it is replaced). A feed model's worker sends none."""
        return False

    # -- closing --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker, bounded even when it is stopped (SIGSTOP) or stuck: ask, wait briefly, kill."""
        self._closing.set()
        locked = self._lock.acquire(timeout=CLOSE_GRACE_S)
        if not locked:  # a request or a restart holds the worker: kill it under them, they see it dead and let go
            if self._process.is_alive():
                self._process.kill()
            locked = self._lock.acquire(timeout=KILL_TIMEOUT_S)
        if locked:
            try:
                if self._process.is_alive():
                    try:
                        if self._process.pid:
                            os.kill(self._process.pid, signal.SIGCONT)  # a stopped worker can read the request
                        self._conn.send(Stop())
                    except (OSError, ValueError):
                        pass
                    self._process.join(timeout=CLOSE_GRACE_S)
                self._kill()
                self._close_arenas()
            finally:
                self._lock.release()
        if self._watchdog is not None:
            self._watchdog.join(timeout=KILL_TIMEOUT_S)
