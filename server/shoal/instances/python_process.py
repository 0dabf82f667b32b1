"""A Python model's instance in its own worker process (Triton's stub process), the default: the host's side.

Built on the process instances' one mechanism (``shoal.instances.process``): a forkserver child
per instance, two memfd arenas for tensors, a pipe for small messages, the same restart on death,
execution timeout and liveness checks. What differs is the conversation for a batch (its messages
in ``instances.worker_pipe``; the worker's side is ``instances.python_worker``): the batch's
requests go in (RunRequests), any number of BLS calls come out (Bls) and each is answered (BlsReply;
an ``exec(decoupled=True)`` once per response), a decoupled model's responses come out as it sends
them (Response), the host says which of its requests' clients gave up (CancelRequest), the
outputs may ask for a bigger arena (Grow), and Done ends the batch.

Inputs of every request are packed one after another at the start of the requests arena,
outputs in the responses arena after the batch's BLS inputs. A BLS call's tensors go the same way
while a batch runs: its inputs into the responses arena (the worker's side) after those of earlier
calls, its outputs into the requests arena after the batch's inputs; each side copies what it
reads, since the next batch rewrites both arenas. So a reply says which batch's arena holds it
(``batch``): the worker takes a reply's tensors from the arena only while that batch runs, and a
caller the model left waiting past its batch gets an error, never the next batch's bytes. An arena
is never replaced during a batch (the model holds views of its inputs), so BLS tensors that do not
fit in the room left travel pickled on the pipe instead (their slots are then None). While a batch
runs, the server thread waits on both the pipe and a wake-up pipe that finished BLS calls write to,
so a reply goes back as soon as it is ready; it only reads: what it says to the worker meanwhile goes
through an ``Outbox`` (why: ``shoal.instances.outbox``). In the worker, BLS calls may come from any
thread of the model at once: ``python_link`` reads their replies and keeps each call's tensors its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import queue
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import connection
from pathlib import Path
from typing import Any, NoReturn

import shoal.backends.python as python_backend
from shoal import custom_metrics, off_loop
from shoal.backends.devices import Device
from shoal.backends.python import bls, runner
from shoal.dataplane import inline, packing
from shoal.dataplane.arena import PoolFull
from shoal.errors import ErrorCode, ShoalError
from shoal.instances import metrics_pipe, process, python_worker
from shoal.instances.outbox import Outbox
from shoal.instances.pool import InstanceThread, OnLoop, settle
from shoal.instances.process import WorkerLimits
from shoal.instances.worker_pipe import (
    REQUESTS,
    RESPONSES,
    Answer,
    Bls,
    BlsReply,
    CancelRequest,
    Carried,
    Done,
    FrameReader,
    Grow,
    PipedRequest,
    Response,
    RunRequests,
    aligned,
    as_tensors,
    framed,
    pickled,
    put,
    take,
    trim,
)
from shoal.repository.config import ModelSpec

logger = logging.getLogger(__name__)
# A BLS call the liveness check reads between batches (``_answers_ping``).
OUTSIDE_EXECUTE = (
    "a BLS call made outside execute (from a thread the model started, after execute returned) is not "
    "served by a process instance; make it within execute, or serve the model on a thread "
    "(process_instances: false)"
)


class PythonProcessModel(process.ProcessModel, OnLoop):
    """One Python model instance: a worker process running the model's ``execute`` on request lists."""

    worker_main = staticmethod(python_worker.worker_main)
    runs_requests = True  # execute(requests), as Triton's; the pipe carries a batch's requests, not one feed

    def run(self, inputs: Any, outputs: Any) -> dict[str, Any]:
        """Inherited from the feed models' process instance, which this worker does not speak: refused at
        once (it would wait on the worker forever). Nothing calls it: ``runs_requests`` routes batches."""
        raise ShoalError(ErrorCode.UNSUPPORTED, "a Python model runs lists of requests (run_requests)")

    def __init__(
        self, spec: ModelSpec, model_file: Path, device: Device, instance_name: str, version: int, limits: WorkerLimits
    ) -> None:
        self._host: bls.HostInfer | None = None
        self._caller: Any = None
        self._reply_offset = 0  # where the next BLS call's outputs go in the requests arena
        self._calls_end = 0  # where the running batch's BLS calls' inputs end in the responses arena
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._wake_lock = threading.Lock()  # a BLS call ending after close() must not write to a reused fd
        # Finished BLS calls: (the worker's connection that made the call, its call id, the outcome: the
        # call's future, or one (BlsResult, final) response of an exec(decoupled=True)).
        self._finished: queue.SimpleQueue[tuple[Any, int, Any]] = queue.SimpleQueue()
        self._decoupled = spec.decoupled
        self._sinks: list[Any] = []  # the running batch's response sinks (a decoupled model)
        self._cancel_sent: set[int] = set()
        self._streams_closed: set[int] = set()  # exec(decoupled=True) calls whose FINAL went to the worker
        self._batches = itertools.count()  # which batch's arena holds a BLS reply's outputs
        self._batch = -1
        self._outbox: Outbox | None = None  # what the running batch's conversation says to the worker
        self._loop_socket: socket.socket | None = None  # the pipe as the event loop reads it (FrameReader)
        self._loop_watch: LoopWatch | None = None  # the loop's eye on this worker (made by the first loop batch)
        try:
            super().__init__(
                spec, model_file, device, (instance_name, version), 1, limits, ("numpy", "shoal.backends.python.runner")
            )
        except BaseException:  # the load failed: nothing will close this instance
            os.close(self._wake_read)
            os.close(self._wake_write)
            raise
        # Takes over a conversation the event loop began (LoopConversation). A thread of its own, never
        # the instance's: that one may be waiting for this instance's lock, which the conversation holds.
        self._relay = InstanceThread(f"shoal-{spec.name}-{instance_name}-relay")

    def bind_host(self, host: bls.HostInfer, caller: Any) -> None:
        """``caller``: this instance's version, named by every BLS call of the worker, from any thread."""
        self._host, self._caller = host, caller

    def run_requests(self, batch: Sequence[Any]) -> list[dict[str, Any] | ShoalError]:
        """Each queued request's outputs, or its own error; the batch goes to the worker as a list."""
        with self._lock:
            if self._failure and not self._closing.is_set():
                self._replace(None)
            if self._failure or self._closing.is_set():
                raise ShoalError(
                    ErrorCode.UNAVAILABLE,
                    f"model '{self._spec.name}': the instance process {self._failure or 'is stopping'}",
                )
            run, deadline = self._begin(batch)
            conn = self._conn
            try:
                message = framed(pickled(run))
                try:
                    # Written as the loop writes it, never blocking past a tick: a stopped worker whose pipe
                    # is full is replaced at the deadline. A broken pipe: the wait finds the worker dead.
                    self._send_rest(message, deadline)
                except BaseException:
                    if self._conn is conn and not self._closing.is_set():  # not replaced: maybe half sent
                        self._replace("was left with half of a batch's message")
                    raise
            except BaseException:
                self._trim_requests()
                raise
            return self._finish(deadline, None)

    def start_on_loop(self, batch: Sequence[Any]) -> asyncio.Future[Any] | None:
        """The batch sent and its answer read by the event loop (``LoopConversation``), when nothing
        else holds the worker and it is up; None otherwise (``run_requests`` on the thread waits for it,
        or restarts it). Also None for a decoupled model (its responses stream), for inputs too large
        to copy on the loop (``off_loop``), and while a BLS call of an earlier batch has ended with
        nobody yet to forward its reply (the thread's conversation does)."""
        if self._decoupled or _costly_inputs(batch) or not self._finished.empty():
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._failure or self._closing.is_set() or self._loop_socket is None or self._inputs_kept:
                self._lock.release()  # the thread hands the worker a new arena (a blocking write) first
                return None
            try:
                watch = self._watch_on_loop(self._loop_socket)
            except OSError:  # no descriptor left for a watch (EMFILE): the thread's conversation needs none
                self._lock.release()
                return None
            run, deadline = self._begin(batch, may_grow=False)
            message = pickled(run)
        except PoolFull:
            self._lock.release()
            return None  # the thread grows the arena
        except BaseException:
            self._lock.release()
            raise
        return LoopConversation(self, watch, deadline).start(message)

    def _watch_on_loop(self, sock: socket.socket) -> LoopWatch:
        """The running loop's watch on the current worker (on the loop, lock held): one per worker and
        loop, made by its first batch there; a replaced worker's is closed here."""
        loop = asyncio.get_running_loop()
        watch = self._loop_watch
        if watch is not None and (watch.socket is not sock or watch.loop is not loop):
            watch.close_soon()
            watch = None
        if watch is None:
            watch = self._loop_watch = LoopWatch(loop, sock, self._process.sentinel, self._wake_read)
        return watch

    def _begin(self, batch: Sequence[Any], may_grow: bool = True) -> tuple[RunRequests, float | None]:
        """Pack the batch's inputs and make its message (lock held): what the worker is sent, and the
        execution timeout's deadline. PoolFull when the inputs need a bigger arena and ``may_grow`` is
        false (the loop: handing a worker an arena is a blocking write)."""
        if self._inputs_kept:
            self._leave_inputs_to_worker()
        self._sinks = [python_backend.sink_of(pending) for pending in batch] if self._decoupled else []
        self._cancel_sent, self._streams_closed = set(), set()
        requests, used = self._pack_inputs(batch, may_grow)
        self._reply_offset = used  # BLS outputs go after the batch's inputs
        self._calls_end = 0
        self._batch = next(self._batches)
        timeout_s = self._limits.execution_timeout_s
        return RunRequests(requests, self._batch), time.monotonic() + timeout_s if timeout_s else None

    def _finish(self, deadline: float | None, first: Any) -> list[dict[str, Any] | ShoalError]:
        """The rest of the batch's conversation, from the worker's message ``first`` if one was read
        already (lock held). A conversation that fails before the worker answered leaves the worker in
        the middle of the batch (waiting for an arena, or still running it): it is replaced, or the
        next batch would read what it says next."""
        conn = self._conn
        try:
            try:
                answers = self._conversation(deadline, first)
            except BaseException:
                if self._conn is conn and not self._closing.is_set():  # not replaced already (a dead or late one is)
                    self._replace("was left in the middle of a batch that failed in the server")
                self._trim_responses(None)
                raise
            return self._unpack_outputs(answers)
        finally:
            self._end_outbox()
            self._trim_requests()

    def continue_on_thread(self, handed: Handover, deadline: float | None) -> list[dict[str, Any] | ShoalError]:
        """A conversation the event loop began, taken over by the relay thread where it stood (see
        ``Handover``); releases the lock."""
        conn = self._conn
        try:
            try:
                first, ending = handed.first, handed.ending
                if handed.unsent:
                    ending = self._send_rest(handed.unsent, deadline)
                if ending is None and handed.partial is not None:
                    first, ending = self._read_message(handed.partial, deadline)
                if ending is not None:
                    self._fail_conversation(ending, deadline)
            except BaseException:
                if self._conn is conn and not self._closing.is_set():  # half a message: out of step
                    self._replace("was left in the middle of a batch that failed in the server")
                self._end_outbox()
                self._trim_requests()
                self._trim_responses(None)
                raise
            return self._finish(deadline, first)
        finally:
            self._lock.release()

    def _send_rest(self, data: bytes, deadline: float | None) -> str | None:
        """Write what the loop could not of the batch's message, watching the worker while the pipe is
        full (a stopped or dead worker reads nothing): ENDED when the pipe broke, else None."""
        sock = self._loop_socket
        assert sock is not None
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view, socket.MSG_DONTWAIT) :]
            except (BlockingIOError, InterruptedError):
                _wait_a_tick(readable=self._process.sentinel, writable=sock.fileno())
                self._check_running(deadline)
            except OSError:
                return ENDED
        return None

    def _read_message(self, partial: FrameReader, deadline: float | None) -> tuple[Any, str | None]:
        """The worker's next message, or the one ``partial`` began to read (the loop's), read to its end
        while the worker is watched (it may have stopped or died mid-write): the message, or why the
        pipe cannot go on."""
        while True:
            try:
                data = partial.read()
            except (EOFError, OSError):
                return None, ENDED
            except Exception:  # noqa: BLE001 - a length no message has
                return None, UNREADABLE
            if data is not None:
                break
            _wait_a_tick(readable=self._process.sentinel, also_readable=partial.fileno())
            self._check_running(deadline)
        try:
            return pickle.loads(data), None
        except BaseException:  # noqa: BLE001 - whatever unpickling raises (SystemExit too): out of step
            return None, UNREADABLE

    def _fail_conversation(self, ending: str, deadline: float | None) -> NoReturn:
        """The batch cannot go on: its execution timeout passed, the worker's pipe ended, a message on it
        could not be read or answered another batch (the pipe out of step: reading on could give a batch
        another's answer). The worker is replaced (a dead one is reported as such) and the batch fails."""
        if ending == ENDED:  # its pipe ended: it is exiting (given no longer than its deadline leaves)
            grace_s = ENDED_GRACE_S if deadline is None else min(ENDED_GRACE_S, max(0.0, deadline - time.monotonic()))
            self._process.join(timeout=grace_s)
        self._check_running(deadline if ending == TIMED_OUT else None)  # raises for a dead or late worker
        why = _WHY[ending]
        self._replace(why)
        raise ShoalError(
            ErrorCode.UNAVAILABLE,
            f"model '{self._spec.name}': the instance process running this request {why}; "
            f"{'it has been restarted' if self.healthy else 'it could not be restarted'}",
        )

    def finish_on_loop(self, done: Done) -> list[dict[str, Any] | ShoalError]:
        """The batch's outcome from the worker's answer, read by the event loop; releases the lock."""
        self._inputs_kept = done.inputs_kept
        try:
            return self._unpack_outputs(done.answers)
        finally:
            try:
                self._trim_requests()
            finally:
                self._lock.release()

    def _trim_requests(self) -> None:
        if not self._inputs_kept:  # else the arena is the model's views' now: its pages stay as they are
            trim(self._arenas[REQUESTS], self._reply_offset)  # the batch's inputs, then its BLS calls' outputs

    def _trim_responses(self, used: int | None) -> None:
        """After a batch: give back the RESPONSES arena's pages past its resident part, up to ``used``
        bytes (its outputs and its BLS calls' inputs), or all of them (None: the batch failed, and its
        worker, replaced, wrote who knows how far, or its outputs could not be read). Lock held: the
        arenas are closed under it only."""
        responses = self._arenas[RESPONSES]
        trim(responses, responses.size if used is None else min(used, responses.size))

    def _pack_inputs(self, batch: Sequence[Any], may_grow: bool = True) -> tuple[list[PipedRequest], int]:
        """Each request's message, its inputs in it when they are small (``inline``), else copied into
        the REQUESTS arena (grouped by name, one copy per input for the whole batch,
        ``packing.pack_feeds_at``; tensor by tensor where the requests differ); with the arena's bytes
        they take."""
        feeds = [pending.feed for pending in batch]
        laid_out: Sequence[Carried] | None = inline.inline_feeds(feeds)
        while laid_out is None:
            try:
                laid_out = self._lay_out(feeds)
            except PoolFull as full:
                if not may_grow:
                    raise
                self._grow(REQUESTS, full.wanted)
        requests = []
        for pending, slots in zip(batch, laid_out, strict=True):
            data = runner.request_data({}, pending.outputs, pending.context, getattr(pending, "traced", None))
            requests.append(
                PipedRequest(
                    slots,
                    list(data.outputs),
                    data.request_id,
                    data.correlation_id,
                    data.parameters,  # the request's own copy (request_data's)
                    data.trace_id,
                    data.trace_context,
                )
            )
        in_arena = [slots for slots in laid_out if isinstance(slots, list)]
        return requests, aligned(max((packing.extent(slots) for slots in in_arena), default=0))

    def _lay_out(self, feeds: list[Any]) -> list[list[packing.Slot]]:
        """Each feed's slots in the REQUESTS arena, written from its start (PoolFull when they do not fit)."""
        arena = self._arenas[REQUESTS]
        grouped = packing.pack_feeds_at(arena, 0, feeds)
        if grouped is not None:
            return grouped
        tensors = [as_tensors(feed) for feed in feeds]
        slots = iter(packing.pack_at(arena, 0, [tensor for feed in tensors for tensor in feed]))
        return [list(itertools.islice(slots, len(feed))) for feed in tensors]

    def _conversation(self, deadline: float | None, first: Any = None) -> list[Answer]:
        """Serve the worker's BLS calls and arena requests until it answers the batch; ``first``: a
        message of the worker read already, handled before the pipe is read again."""
        ready: list[Any]
        while True:
            if first is not None:
                ready, pending, first = [self._conn], first, None
            else:
                pending = None
                try:
                    ready = connection.wait([self._conn, self._wake_read], timeout=0.05)
                except (OSError, ValueError):  # closed under us: _check_running says so
                    ready = []
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            while not self._finished.empty():
                caller, call_id, done = self._finished.get()
                if caller is not self._conn:  # a replaced worker's calls are dropped: the new one counts ids from 0
                    continue
                if isinstance(done, tuple):  # one response of an exec(decoupled=True)
                    self._reply(call_id, *done)
                    if done[1]:
                        self._streams_closed.add(call_id)
                elif call_id not in self._streams_closed:  # ended: its one answer, or the end of a stream
                    self._reply(call_id, bls.result_of(done))
            if self._conn in ready:
                message = pending if pending is not None else self._receive(deadline)
                match message:
                    case Done() as done:
                        if done.batch != self._batch:
                            self._fail_conversation(OUT_OF_STEP, deadline)
                        self._inputs_kept = done.inputs_kept
                        self._flush(deadline)  # the worker reads again; what follows goes on the pipe directly
                        return done.answers
                    case Grow(needed):
                        self._flush(deadline)
                        self._grow(RESPONSES, needed)
                        self._calls_end = 0  # a new arena (no larger, maybe): the outputs go from its start
                    case Response():
                        self._forward(message)
                    case Bls(call_id, call, slots):
                        if slots is not None:
                            call = replace(call, inputs=take(self._arenas[RESPONSES], slots))
                            self._calls_end = max(self._calls_end, packing.extent(slots))
                        self._start_call(call_id, call)
            self._send_cancellations()
            self._check_outbox()
            self._check_running(deadline)

    def _receive(self, deadline: float | None) -> Any:
        """The worker's next message, read as the loop reads it (``FrameReader``), watching the worker
        while it comes: one that stopped or died mid-message fails the batch at its deadline or death
        (the Connection's blocking read waited for the rest for good); a pipe that ended, or bytes that
        are no message (the model's own code may write on it), fail it and replace the worker."""
        sock = self._loop_socket
        if sock is None:  # closed under us
            self._fail_conversation(ENDED, deadline)
        message, ending = self._read_message(FrameReader(sock), deadline)
        if ending is not None:
            self._fail_conversation(ending, deadline)
        return message

    def _post(self, message: Any) -> None:
        """Say ``message`` to the worker during the batch, without ever blocking the reading thread."""
        if self._outbox is None:
            self._outbox = Outbox(self._conn, f"shoal-{self._spec.name}-outbox")
        self._outbox.send(message)

    def _flush(self, deadline: float | None) -> None:
        """Until all posted is written: the worker is reading (it waits for the server's next word)."""
        while self._outbox is not None and not self._outbox.wait_sent(0.05):
            self._check_running(deadline)
        self._check_outbox()

    def _check_outbox(self) -> None:
        """A message the outbox could not send (not a dead pipe): a call of the worker would wait for
        its reply for good, so the worker is replaced and the batch fails."""
        if self._outbox is not None and self._outbox.error is not None:
            error = self._outbox.error
            self._replace(f"could not be sent a message ({type(error).__name__}: {error})")
            raise ShoalError(
                ErrorCode.INTERNAL,
                f"model '{self._spec.name}': a message to the instance process "
                f"could not be sent ({type(error).__name__}); it was restarted",
            )

    def _end_outbox(self) -> None:
        """After the batch: the outbox ends once it has written what it holds. Had the conversation
        ended with messages still unsent to a live worker (an error on the way), their writes could
        interleave with the next direct ones (a request, a ping, close's stop): that worker is replaced
        instead, or killed when the instance is closing."""
        outbox, self._outbox = self._outbox, None
        if outbox is None:
            return
        drained = outbox.wait_sent(0)
        outbox.close()
        if drained or outbox.target is not self._conn:
            return
        if self._closing.is_set():
            self._kill()
        else:
            self._replace("was left with messages of a failed batch unsent")

    def _forward(self, response: Response) -> None:
        """One response of a decoupled model, on to its request's sink."""
        item: dict[str, Any] | ShoalError | None = response.outputs
        if response.error:
            item = ShoalError(ErrorCode(response.code), response.error)
        self._sinks[response.position].put(item, response.final)

    def _send_cancellations(self) -> None:
        for index, sink in enumerate(self._sinks):
            if sink.cancelled and index not in self._cancel_sent:
                self._cancel_sent.add(index)
                self._post(CancelRequest(index, self._batch))

    def _start_call(self, call_id: int, call: bls.BlsCall) -> None:
        caller = self._conn

        def finished(done: Any) -> None:  # the call's future, or one (BlsResult, final) of a decoupled call
            self._finished.put((caller, call_id, done))
            with self._wake_lock:
                if self._wake_write < 0:
                    return  # closed
                try:
                    os.write(self._wake_write, b"x")
                except OSError:
                    pass  # the pipe is full: a wake-up is pending anyway

        sink = bls.CallbackSink(lambda result, final: finished((result, final))) if call.decoupled else None
        bls.start(self._host, call, sink, self._caller).add_done_callback(finished)

    def _answer_unasked(self, message: Any) -> bool:
        """A BLS call the model made between batches from a thread of its own, outside ``execute``: nothing
        else reads the pipe then, so the liveness check answers it, at once, with an error (a process
        instance serves BLS calls while a batch runs), where it was taken for a wrong echo and the worker
        killed."""
        if not isinstance(message, Bls):
            return False
        self._conn.send(BlsReply(message.call_id, bls.BlsResult(error=OUTSIDE_EXECUTE), None, True, self._batch))
        return True

    def _reply(self, call_id: int, result: bls.BlsResult, final: bool = True) -> None:
        slots = None
        if result.outputs is not None:
            slots, self._reply_offset = put(self._arenas[REQUESTS], self._reply_offset, result.outputs)
            if slots is not None:
                result = replace(result, outputs={})
        self._post(BlsReply(call_id, result, slots, final, self._batch))

    def _unpack_outputs(self, answers: list[Answer]) -> list[dict[str, Any] | ShoalError]:
        """Each answer's outputs: made from its message (``inline``), or copied out of the RESPONSES
        arena (for the whole batch at once: ``packing.unpack_copies``); or its error. The arena's pages
        past its resident part are given back up to the end of the outputs or of the batch's BLS
        inputs, whichever is further (outputs in the message, or errors, leave those inputs' pages); all
        of them when the outputs cannot be read (a MemoryError copying them, say): nothing needs them."""
        used: int | None = None
        try:
            responses = self._arenas[RESPONSES]
            in_arena = [answer.outputs for answer in answers if not answer.error and isinstance(answer.outputs, list)]
            slots = [slot for outputs in in_arena for slot in outputs]
            arrays = iter(packing.unpack_copies(responses, slots) if slots else ())
            results: list[dict[str, Any] | ShoalError] = []
            for outputs, error, code in answers:
                if error:
                    results.append(ShoalError(ErrorCode(code), error))
                elif isinstance(outputs, dict):
                    results.append(inline.arrays_of(outputs))
                else:
                    results.append({slot[0]: next(arrays) for slot in outputs})
            used = max(packing.extent(slots), self._calls_end)
            return results
        finally:
            self._trim_responses(used)

    def _start(self) -> None:
        # Each worker gets a pipe for its model's custom metrics, answered by a thread of its own from
        # before the model initializes until the worker's end closes it (``instances.metrics_pipe``);
        # the worker's end travels in its handle.
        ours, theirs = self._context.Pipe()
        instance_name, version = self._handle[:2]
        self._metrics_thread = threading.Thread(
            target=metrics_pipe.serve,
            args=(ours, custom_metrics.REGISTRY, f"model instance {instance_name}'s worker"),
            name=f"shoal-{instance_name}-metrics",
            daemon=True,
        )
        try:
            self._metrics_thread.start()
        except BaseException:  # no thread left ("can't start new thread"): the restart fails, nothing leaks
            ours.close()
            theirs.close()
            raise
        self._handle = (instance_name, version, theirs)
        try:
            super()._start()  # closes ``theirs`` once the worker has it (``_launched``)
        except BaseException:
            theirs.close()
            self._metrics_thread.join(METRICS_THREAD_JOIN_S)  # the worker is gone: its pipe ends, and the thread
            raise
        finally:
            theirs.close()
            self._handle = (instance_name, version)
        self._loop_socket = socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)

    def _launched(self) -> None:
        self._handle[2].close()  # the worker's end of its metrics pipe: the thread ends when the worker's closes

    def _kill(self) -> None:
        super()._kill()
        if self._loop_socket is not None:
            self._loop_socket.close()
            self._loop_socket = None
        # The worker is gone (reaped, its group killed): its metrics thread reads the pipe's end at once
        # and closes the server's end, here, as the batch pipe's is, not at some later moment of its own
        # (a descriptor freed then was taken by whatever opened one next: CI saw a test's socket so).
        self._metrics_thread.join(METRICS_THREAD_JOIN_S)

    def close(self) -> None:
        super().close()
        # The worker ended: its metrics thread gives back the worker's series as it reads the pipe's end,
        # so an unloaded model's series are gone from /metrics once its unload is answered.
        self._metrics_thread.join(METRICS_THREAD_JOIN_S)
        self._relay.shutdown(wait=False)  # a conversation it still runs (close gave up waiting) ends on its own
        watch, self._loop_watch = self._loop_watch, None
        if watch is not None:
            watch.close_soon()
        with self._wake_lock:
            fds, self._wake_read, self._wake_write = (self._wake_read, self._wake_write), -1, -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


# Why a conversation cannot go on, and what the worker did, as its error says.
ENDED, TIMED_OUT, UNREADABLE, OUT_OF_STEP = "ended", "timed out", "unreadable", "out of step"
_WHY = {
    ENDED: "closed its end of the pipe",
    UNREADABLE: "sent a message that could not be read",
    OUT_OF_STEP: "answered a batch it was not running",
}
METRICS_THREAD_JOIN_S = 10.0  # bounds close's wait for it, should a descendant of the worker hold the pipe open
ENDED_GRACE_S = 5.0  # a worker whose pipe ended is given this long to exit before it is reported
WATCH_TICK_S = 0.05  # how often the relay, writing or reading a message, checks that the worker lives
MAX_LOOP_SLOTS = 4096  # the most output tensors of a batch the loop unpacks


@dataclass(frozen=True)
class Handover:
    """Where a conversation on the event loop stood when the relay thread took it over: ``unsent``, what
    the loop could not write of the batch's framed message; ``first``, a whole message of the worker
    that is not the batch's answer (or an answer too large to unpack on the loop); ``partial``, the
    reader of a message only begun (the thread reads its rest before anything else); ``ending``, why
    the conversation cannot go on (TIMED_OUT, ENDED, UNREADABLE), the batch then failing."""

    first: Any = None
    partial: FrameReader | None = None
    unsent: bytes = b""
    ending: str | None = None


# What a worker's watch found readable: its pipe, its sentinel (it exited), the wake-up pipe of finished BLS calls.
PIPE, EXITED, WOKEN = "pipe", "exited", "woken"


class LoopWatch:
    """The event loop's eye on one worker process: its pipe, its sentinel and the model's wake-up pipe,
    through an epoll (kqueue) descriptor of their own that the loop watches (``loop.add_reader``).

    Why a descriptor of their own: a loop's add_reader may change a descriptor (uvloop's, libuv's
    uv_poll, makes it non-blocking, and the flag is the pipe's, shared with the relay thread and the
    outbox, which read and write it blocking: a large message then failed half-written, and the
    worker waited for its rest for good). Why one per worker, not one per batch: setting it up and
    tearing it down took ~14 system calls a batch (epoll_create, nine epoll_ctl between it and the
    loop's, uvloop's ioctl and io_uring_enter, close), a seventh of the loop's CPU for a small batch
    (``bench/python_conversation.py``). The loop keeps watching between batches, when nothing of the
    worker is readable; whenever it finds something readable with no conversation of its own under
    way (the relay thread has the pipe, the worker died between batches), it stops watching until
    the next batch begins on the loop, so it never spins on what another thread reads.
    Used on the loop's thread only, but for ``close_soon``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, sentinel: int, wake_read: int) -> None:
        self.loop, self.socket = loop, sock
        self._selector = selectors.DefaultSelector()
        for fd, what in ((sock.fileno(), PIPE), (sentinel, EXITED), (wake_read, WOKEN)):
            self._selector.register(fd, selectors.EVENT_READ, what)
        self._watching = False
        self._closing = False
        self.conversation: LoopConversation | None = None

    def follow(self, conversation: LoopConversation) -> None:
        """``conversation`` hears what becomes readable, until ``release``."""
        self.conversation = conversation
        if not self._watching:
            self.loop.add_reader(self._selector.fileno(), self._ready)
            self._watching = True

    def release(self, keep_watching: bool) -> None:
        """The conversation ended: with ``keep_watching`` the loop goes on watching (it answered, and the
        next batch will likely come here too), else the pipe is the relay thread's now."""
        self.conversation = None
        if self._closing:
            self._close()
        elif not keep_watching:
            self._unwatch()

    def _ready(self) -> None:
        conversation = self.conversation
        if conversation is None:  # another thread's to read, or the worker's end: not the loop's business
            self._unwatch()
            return
        conversation.on_ready(self._readable)

    def _readable(self) -> set[str]:
        return {key.data for key, _ in self._selector.select(0)}

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self.loop.remove_reader(self._selector.fileno())

    def _close(self) -> None:
        self._closing = True
        if self.conversation is not None:
            return  # closed when it ends (release): it still needs to hear its worker
        self._unwatch()
        self._selector.close()

    def close_soon(self) -> None:
        """Close it from any thread: on its loop, once no conversation needs it (at once when the loop is gone)."""
        if self.loop.is_closed():
            self._selector.close()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._close()
            return
        try:
            self.loop.call_soon_threadsafe(self._close)
        except RuntimeError:  # the loop closed meanwhile: nothing watches any more
            self._selector.close()


class LoopConversation:
    """One batch of a worker process carried by the event loop: its message written, the worker's
    answer read when the pipe is readable (its ``LoopWatch``, ``FrameReader``) and unpacked there.

    For a batch that is sent and answered, and nothing else, this spares two wake-ups of a server
    thread (from the loop, then back to it) and that thread's own time. Any other turn hands the
    conversation to the model's relay thread where it stands (``Handover``, ``continue_on_thread``):
    a BLS call or an arena to grow; an answer or message too large for the loop (``off_loop``); the
    worker's exit (its process sentinel: a child of the worker may hold the pipe open, so no end of
    file comes) or the pipe's end; the execution timeout; a BLS call of an earlier batch that ended
    (the wake-up pipe: its reply is the thread's to forward); a message the pipe did not take at once
    (the loop never waits on a worker, which may be stopped). The instance's lock, taken when the
    batch began, is released by whoever ends the conversation. The caller's giving up (its task
    cancelled) ends nothing: the conversation goes on to the worker's answer, so that the next batch
    never reads this one's.
    """

    def __init__(self, model: PythonProcessModel, watch: LoopWatch, deadline: float | None) -> None:
        self._model, self._watch, self._deadline = model, watch, deadline
        self._socket = watch.socket
        self._reader = FrameReader(watch.socket)
        self._loop = watch.loop
        self._outcome: asyncio.Future[Any] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, message: bytes) -> asyncio.Future[Any]:
        """Write the batch's pickled ``message``, and watch for what comes back."""
        data = framed(message)
        try:
            sent = self._socket.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._hand_over(Handover(ending=ENDED))
            return self._outcome
        if sent < len(data):
            self._hand_over(Handover(unsent=data[sent:]))
            return self._outcome
        self._watch.follow(self)
        if self._deadline is not None:
            self._timer = self._loop.call_later(self._deadline - time.monotonic(), self._check_deadline)
        return self._outcome

    def on_ready(self, readable: Callable[[], set[str]]) -> None:
        """Something watched is readable: the pipe first, then the sentinel, then the wake-up pipe,
        while the conversation is still the loop's. The pipe is read before asking ``readable()``
        which: most often it holds the answer, and the conversation ends there."""
        self._readable()
        if not self._following:
            return
        ready = readable()
        if EXITED in ready and self._following:
            self._exited()
        if WOKEN in ready and self._following:
            self._woken()

    def _readable(self) -> None:
        try:
            self._read()
        except BaseException:  # noqa: BLE001 - whatever the worker's bytes make raise (SystemExit included)
            if self._following:  # the loop goes on; the worker is replaced and the batch fails
                self._hand_over(Handover(ending=UNREADABLE))

    def _read(self) -> None:
        try:
            data = self._reader.read(stop_past=off_loop.OFF_LOOP_BYTES)
        except (EOFError, OSError):
            self._hand_over(Handover(ending=ENDED))
            return
        if data is None:
            if self._reader.announced is not None and self._reader.announced > off_loop.OFF_LOOP_BYTES:
                self._hand_over(Handover(partial=self._reader))  # a large message: read on the relay
            return
        message = pickle.loads(data)
        if isinstance(message, Done) and message.batch != self._model._batch:
            self._hand_over(Handover(ending=OUT_OF_STEP))
            return
        if not isinstance(message, Done) or _costly_answers(message.answers):
            self._hand_over(Handover(first=message))
            return
        self._stop_following(keep_watching=True)
        try:
            result, error = self._model.finish_on_loop(message), None
        except Exception as exc:  # noqa: BLE001 - the batch's failure, given to its caller
            result, error = None, exc
        settle(self._outcome, result, error)

    def _exited(self) -> None:
        self._readable()  # an answer the worker wrote before it ended counts (the thread path read it too)
        if self._following:
            self._hand_over(Handover(ending=ENDED))

    def _woken(self) -> None:
        self._hand_over(Handover(partial=self._reader if self._reader.mid_message else None))

    def _check_deadline(self) -> None:
        assert self._deadline is not None
        left = self._deadline - time.monotonic()
        if left >= 0:  # the loop's timer may run a hair early: the thread must find the deadline passed
            self._timer = self._loop.call_later(left, self._check_deadline)
            return
        self._timer = None
        self._hand_over(Handover(ending=TIMED_OUT))

    def _hand_over(self, handed: Handover) -> None:
        self._stop_following(keep_watching=False)
        relayed: asyncio.Future[Any] = self._loop.create_future()  # never cancelled: the relay always runs it
        relayed.add_done_callback(self._relayed)
        self._model._relay.run_into(relayed, self._model.continue_on_thread, handed, self._deadline)

    def _relayed(self, relayed: asyncio.Future[Any]) -> None:
        error = relayed.exception()
        settle(self._outcome, None if error is not None else relayed.result(), error)

    @property
    def _following(self) -> bool:
        """The watch tells this conversation what becomes readable (from ``start`` until it ends)."""
        return self._watch.conversation is self

    def _stop_following(self, keep_watching: bool) -> None:
        if self._following:
            self._watch.release(keep_watching)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _wait_a_tick(readable: int, also_readable: int = -1, writable: int = -1) -> None:
    """Until a descriptor is ready or ``WATCH_TICK_S`` passed (poll: a server's descriptors pass 1024)."""
    poller = select.poll()
    poller.register(readable, select.POLLIN)
    if also_readable >= 0:
        poller.register(also_readable, select.POLLIN)
    if writable >= 0:
        poller.register(writable, select.POLLOUT)
    poller.poll(WATCH_TICK_S * 1000)


def _costly_inputs(batch: Sequence[Any]) -> bool:
    """Whether copying the batch's inputs into the arena and pickling its message is work for a thread,
    not the loop: its tensors' bytes (BYTES elements counted one by one, up to the bound) and its
    parameters' text."""
    data_bytes = elements = 0
    for pending in batch:
        for array in pending.feed.values():
            if array.dtype != object:
                data_bytes += array.nbytes
                continue
            elements += array.size
            if off_loop.costly(elements=elements):
                return True
            data_bytes += sum(len(value) if isinstance(value, bytes | str) else 8 for value in array.flat)
        context = pending.context
        if context is not None:
            data_bytes += len(context.id) + sum(
                len(key) + (len(value) if isinstance(value, bytes | str) else 8)
                for key, value in context.parameters.items()
            )
        if off_loop.costly(data_bytes, elements):
            return True
    return False


def _costly_answers(answers: Sequence[Answer]) -> bool:
    """Whether copying the outputs out of the arena is work for a thread, not the loop (outputs past
    ``MAX_LOOP_SLOTS`` are counted no further: a worker's message may be made to name many)."""
    slots: list[packing.Slot] = []
    for answer in answers:
        if isinstance(answer.outputs, dict):  # in the message, read whole already (at most OFF_LOOP_BYTES)
            continue
        if len(slots) + len(answer.outputs) > MAX_LOOP_SLOTS:
            return True
        slots += answer.outputs
    return packing.costly(slots) or off_loop.costly(data_bytes=sum(slot[4] for slot in slots))
