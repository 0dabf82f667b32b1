"""The worker's end of BLS in a Python process instance, safe from any thread of the model.

Triton's BLS is thread-safe: ``exec()``, ``async_exec()`` and ``exec(decoupled=True)`` may run
from several threads of one model at once (a ``ThreadPoolExecutor`` mapping ``exec`` over calls).
Every message comes over the one pipe, so one thread at a time reads it: whichever thread is
waiting and finds no other reading (the leader), be it a caller or the worker's main loop
between batches (``next_message``). It files what it read (a reply under its call's id, anything
else for the main loop) and wakes the others; each takes only what is its own, and call ids are
unique for the worker's life, so no call ever gets another's answer, and a thread the model left
waiting after its batch (an ``async_exec`` given up by ``asyncio.wait_for``) never swallows the
next batch. ``async_exec`` waits the same way on a thread of its event loop's executor, never
reading the pipe on the loop.

Tensor lifetimes: a call's inputs are packed into the responses arena at a range reserved for
that call alone (the offset moves under a lock) and stay untouched until the next batch (the
batch's outputs go after them); the server copies them out as it reads the call, which it does
before it reads the batch's end. A reply's outputs lie in the requests arena at a range the server
never rewrites while the batch runs, and the reading thread copies them before filing the reply:
what a caller holds is its own, whatever other calls do meanwhile. Past its batch the arenas are
the next batch's: a call made then travels pickled, and a reply read then from an arena is refused
(its caller gets an error: the bytes there may be another batch's).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from shoal.backends.python import bls, pb_utils
from shoal.dataplane.arena import Arena
from shoal.instances.worker_pipe import (
    REQUESTS,
    RESPONSES,
    Bls,
    BlsReply,
    CancelRequest,
    NewArena,
    RunRequests,
    put,
    take,
    with_descriptor,
)

T = TypeVar("T")
# How long a reply read before its batch began waits for it (the main loop begins it without reading the pipe).
BEGIN_WAIT_S = 30.0


class Mailbox(collections.deque[tuple[bls.BlsResult, bool]]):
    """One call's replies as (result, final), oldest first."""


class PipeLink:
    """In the worker: BLS calls go to the server over the pipe; replies are matched by call id."""

    def __init__(self, conn: Any, arenas: dict[str, Arena]) -> None:
        self._conn, self._arenas = conn, arenas
        self._ids = itertools.count()
        # Guards the two below: one call at a time reserves its range of the responses arena, and a
        # batch does not end while a reply's outputs are being copied from its arena.
        self._packing = threading.Lock()
        self._offset: int | None = None  # where the next BLS call's inputs go; None between batches
        self._batch: int | None = None  # the running batch's number; None between batches
        self._announced: int | None = None  # a batch whose RunRequests was read, not yet begun
        self._begun = threading.Condition(self._packing)  # notified when a batch begins
        self._filed = threading.Condition()  # guards what follows; notified whenever something is filed
        self._reading = False  # a thread is reading the pipe
        # Each call's replies (one, or an exec(decoupled=True)'s stream), held weakly: the box of a call
        # its caller let go (an iterator dropped halfway) goes with it, and replies for it are dropped.
        self._mailboxes: weakref.WeakValueDictionary[int, Mailbox] = weakref.WeakValueDictionary()
        self._cancelled: set[int] = set()  # the running decoupled batch's requests whose clients gave up
        self._cancelling: int | None = None  # the batch they belong to (guarded by _filed); None between batches
        self._control: collections.deque[Any] = collections.deque()  # the main loop's: runs, pings, arenas, stop
        self._ended: BaseException | None = None  # the pipe's end (EOF): every waiter sees it

    def begin(self, batch: int) -> None:
        """Batch ``batch`` starts (its arenas mapped): BLS inputs go from the start of the responses arena
        again, and a reply for it read before now may be taken."""
        with self._packing:
            self._offset, self._batch, self._announced = 0, batch, None
            self._begun.notify_all()
        with self._filed:
            if self._cancelling != batch:  # else counted since its RunRequests was read (cancellations kept)
                self._cancelled.clear()
                self._cancelling = batch

    def end(self) -> int:
        """After a batch: where in the responses arena its outputs may start (after its calls' inputs).
        Every call whose inputs lie in the arena is on the pipe by now (``_send`` sends them under the
        lock this takes), so the server reads them before the batch's end. Its cancellations are
        forgotten. Calls still waiting (a thread the model left) keep their mailboxes; a call made
        from now on travels pickled."""
        with self._packing:
            first_free, self._offset, self._batch = self._offset or 0, None, None
        with self._filed:
            self._cancelled.clear()
            self._cancelling = None
        return first_free

    def next_message(self) -> Any:
        """The main loop's next message: RunRequests, Ping, Stop, or NewArena (its descriptor received)."""
        return self._wait(lambda: self._control.popleft() if self._control else None)

    def infer(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        box = self._send(request)
        result, _ = self._wait(lambda: box.popleft() if box else None)
        return bls.response_of(result)

    def infer_stream(self, request: pb_utils.InferenceRequest) -> Iterator[pb_utils.InferenceResponse]:
        """``exec(decoupled=True)``: the responses as they come, read while iterating."""
        return self._stream(self._send(request, decoupled=True))

    def _stream(self, box: Mailbox) -> Iterator[pb_utils.InferenceResponse]:
        final = False
        while not final:
            result, final = self._wait(lambda: box.popleft() if box else None)
            yield bls.response_of(result)

    def infer_async(self, request: pb_utils.InferenceRequest) -> Any:
        box = self._send(request)

        async def wait() -> pb_utils.InferenceResponse:
            loop = asyncio.get_running_loop()
            result, _ = await loop.run_in_executor(None, self._wait, lambda: box.popleft() if box else None)
            return bls.response_of(result)

        return wait()

    def is_cancelled(self, index: int) -> bool:
        """Whether the decoupled batch's request ``index`` was cancelled, after reading what has come."""
        with self._filed:
            if self._reading:  # the reader files a cancellation too
                return index in self._cancelled
            self._reading = True
        try:
            while self._conn.poll(0):
                self._receive_one()
        finally:
            with self._filed:
                self._reading = False
                self._filed.notify_all()
        with self._filed:
            return index in self._cancelled

    def _send(self, request: pb_utils.InferenceRequest, decoupled: bool = False) -> Mailbox:
        """Send the call; the mailbox its replies go to, open before it is sent (another thread may read them)."""
        call = bls.call_of(request, decoupled)
        box: Mailbox = Mailbox()
        with self._filed:
            call_id = next(self._ids)
            self._mailboxes[call_id] = box
        with self._packing:  # held until sent: the batch cannot end between the two (see ``end``)
            if self._offset is not None:
                slots, self._offset = put(self._arenas[RESPONSES], self._offset, call.inputs)
                if slots is not None:
                    self._conn.send(Bls(call_id, replace(call, inputs={}), slots))
                    return box
        self._conn.send(Bls(call_id, call, None))
        return box

    def _wait(self, claim: Callable[[], T | None]) -> T:
        """``claim()``'s first value other than None (tried with the lock held); until then, this thread
        reads the pipe whenever no other does, and sleeps while one does."""
        with self._filed:
            while (found := claim()) is None:
                if self._ended is not None:
                    raise EOFError("the server closed the worker's pipe") from self._ended
                if self._reading:
                    self._filed.wait()
                    continue
                self._reading = True
                self._filed.release()
                try:
                    self._receive_one()
                finally:
                    self._filed.acquire()
                    self._reading = False
                    self._filed.notify_all()
            return found

    def _receive_one(self) -> None:
        """Read one message (this thread is the reader) and file it under the lock."""
        try:
            message = self._conn.recv()
            if isinstance(message, NewArena):  # its descriptor follows at once
                message = with_descriptor(self._conn, message)
        except (EOFError, OSError) as exc:
            with self._filed:
                self._ended = exc
            return
        if isinstance(message, CancelRequest):
            with self._filed:  # one read after its batch ended (the model lingered) is not the next batch's
                if message.batch == self._cancelling:
                    self._cancelled.add(message.position)
            return
        if isinstance(message, RunRequests):
            # The server may follow a batch at once with a reply to a call a thread of the model left
            # waiting, in the batch's arena, and this thread (that waiting one, perhaps) may read it before
            # the main loop has mapped the batch's arenas and begun it: such a reply waits for ``begin``.
            # Its cancellations count from here (they are kept by ``begin``).
            with self._packing:
                self._announced = message.batch
            with self._filed:
                self._cancelled.clear()
                self._cancelling = message.batch
        if not isinstance(message, BlsReply):
            with self._filed:
                self._control.append(message)
            return
        self._file_reply(message)

    def _file_reply(self, message: BlsReply) -> None:
        """A reply to its call's mailbox, its outputs copied from the arena while their batch runs (a reply
        for the batch read but not yet begun waits for ``begin``, which maps its arena first); else an
        error says they are gone."""
        call_id, result, slots, final, batch = message
        if slots is not None:
            with self._packing:
                if self._batch is None and batch == self._announced:
                    # This thread is no main loop (which stops reading once it has its RunRequests), and
                    # the main loop needs no read to begin the batch: this reader waits for it.
                    self._begun.wait_for(lambda: self._announced != batch, timeout=BEGIN_WAIT_S)
                if batch == self._batch:
                    result = replace(result, outputs=take(self._arenas[REQUESTS], slots))
                else:
                    result = bls.BlsResult(
                        error="the BLS call's reply came after the batch that made the call had "
                        "ended; its outputs are gone (await BLS calls within execute)"
                    )
        with self._filed:
            box = self._mailboxes.get(call_id)
            if box is not None:  # else its caller let go of it
                box.append((result, final))
