"""The host's side of one front-end worker: answers its ``RemoteCore`` with the host's ``LocalCore``.

Inputs are read in place from the worker's arena, and the worker reuses a request's block only
when the host says (RELEASE) that nothing here refers to it any more: the last view of the inputs
is gone, wherever it went (a batch, a sequence's state, a decoupled model's thread), however long
after the answer. Outputs are copied once into a block of the host's arena for that worker, which
the worker gives back when it has encoded the reply. If the worker dies, what it had in flight
still runs to the end (the scheduler never loses an accepted request) and the answers are dropped
with the channel.

The host decodes BYTES inputs once, here: a worker forwards them as the wire carries them,
unchecked, so content that does not fit its shape is refused here with the words and status the
one-process layout's transport uses (``core.wire.UnfitContents``). Outputs are encoded once, into
the block; the worker writes them to the wire as they are.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

from shoal.core import messages
from shoal.core.local import LocalCore
from shoal.core.wire import UnfitContents
from shoal.dataplane import packing
from shoal.dataplane.arena import Arena, BlockAllocator, PoolFull
from shoal.dataplane.channel import Channel
from shoal.errors import ErrorCode, ShoalError, bounded, internal_error
from shoal.request_types import InferRequest, Tensor

logger = logging.getLogger(__name__)


class CoreHost:
    """Serves one worker's calls; ``closed`` is set when the worker's end of the channel goes."""

    def __init__(self, core: LocalCore, requests: Arena, responses: Arena) -> None:
        self.core = core
        self.requests = requests  # the worker's arena: inputs are read from it
        self.responses = responses  # this host's arena for the worker: outputs are written to it
        self._allocator = BlockAllocator(responses.size)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._releases: dict[int, InputRelease] = {}  # requests whose inputs the worker still keeps for us
        # Their ids once nothing here reads them: the next RELEASE. A deque that is drained, never
        # swapped for another, so an id appended by another thread at any moment is never lost.
        self._released: deque[int] = deque()
        self._release_pending = False  # a RELEASE is scheduled on the loop
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._closing = False
        self._channel: Channel | None = None
        self.closed = asyncio.Event()
        self.answered_ping_at = 0.0  # time.monotonic() of the worker's last PONG
        # The (gRPC, HTTP) ports the worker serves on (HTTP 0: off), or why it could not start.
        self.started: asyncio.Future[tuple[int, int] | str] = asyncio.get_running_loop().create_future()

    async def connect(self, sock: socket.socket) -> None:
        self._channel = await Channel.open(sock, self._received, self.closed.set, messages.RECORDS)

    def send(self, message: Any) -> None:
        if self._channel is not None:
            self._channel.send(message)

    def close(self) -> None:
        """The worker is gone or stopping: close the channel, and unmap both arenas once no request of
        the worker is left running here (a dead worker's arenas would otherwise stay mapped)."""
        if self._channel is not None:
            self._channel.close()
        self._closing = True
        self._unmap_when_idle()

    def _unmap_when_idle(self) -> None:
        if self._closing and not self._tasks:
            self.requests.close()  # a view still alive somewhere keeps its mapping until it goes
            self.responses.close()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def _received(self, message: Any) -> None:
        kind = type(message)
        if kind is messages.Infer:
            self._free_blocks(message.freed)
            self._releases[message.id] = InputRelease(self, message.id)
            self._start(message.id, self._stream(message) if message.streaming else self._infer(message))
        elif kind is messages.Free:
            self._free_blocks(message.blocks)
        elif kind is messages.Call:
            self._start(message.id, self._call(message))
        elif kind is messages.Cancel:
            task = self._tasks.get(message.id)
            if task is not None:
                task.cancel()
        elif kind is messages.Sent:
            self.core.sent(message.trace_id, message.started_ns, message.ended_ns, message.last)
        elif kind is messages.Pong:
            self.answered_ping_at = time.monotonic()
        elif kind is messages.Started:
            if not self.started.done():
                self.started.set_result(message.ports_or_problem)
        else:
            logger.error("a front-end worker sent an unknown message %.100r", message)

    def _free_blocks(self, blocks: list[int]) -> None:
        for block in blocks:
            self.responses.release_pages(block, self._allocator.free(block))

    def _start(self, request_id: int, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks[request_id] = task
        task.add_done_callback(lambda done: self._finished(request_id, done))

    def _finished(self, request_id: int, task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)
        release = self._releases.pop(request_id, None)
        if release is not None and not release.handed_out:  # its inputs were never read: free them now
            release()
        self._unmap_when_idle()
        if task.cancelled():
            # Cancelled before its first step (INFER and CANCEL read together): the coroutine never
            # ran its own handler, and the worker still waits for the answer that frees its block.
            self._failed(request_id, asyncio.CancelledError())

    async def _request(self, message: messages.Infer) -> InferRequest:
        """The request, its inputs views of the worker's block (BYTES decoded, once); the block is
        released with the last view."""
        release = self._releases[message.id]
        release.handed_out = True
        if packing.costly(message.slots):  # many BYTES to decode: off the loop
            inputs = await asyncio.to_thread(
                self._unpack, message.model_name, message.request_id, message.slots, release
            )
        else:
            inputs = self._unpack(message.model_name, message.request_id, message.slots, release)
        return InferRequest(
            message.model_name,
            message.model_version,
            message.request_id,
            inputs,
            message.requested_outputs,
            message.parameters,
            message.class_counts,
            message.region_inputs,
            message.output_regions,
        )

    def _unpack(
        self, model: str, request_id: str, slots: list[packing.Slot], release: InputRelease
    ) -> tuple[Tensor, ...]:
        """The inputs; BYTES that do not fit their shape refused as the one-process transport refuses them
        (every input read first, the last unfit one named: ``UnfitContents``)."""
        unfit = UnfitContents(model, request_id)
        try:
            inputs = packing.unpack(self.requests, slots, release, on_unfit=unfit.note)
            try:
                unfit.check()
            except ShoalError:
                del inputs  # refused: no view of the block may stay in this frame's traceback
                raise
            return inputs
        except BaseException:
            release()  # no view was made, or none is left: the block is the worker's again
            raise

    def inputs_released(self, request_id: int) -> None:
        """Nothing here refers to the request's inputs any more; from any thread (a view's finalizer)."""
        self._released.append(request_id)
        if not self._release_pending:
            self._release_pending = True
            try:
                if threading.get_ident() == self._loop_thread:  # the usual case: no wake-up write needed
                    self._loop.call_soon(self._send_released)
                else:
                    self._loop.call_soon_threadsafe(self._send_released)
            except RuntimeError:  # the loop is closed (a view let go at exit): so is the channel, and the worker
                self._release_pending = False

    def _send_released(self) -> None:
        self._release_pending = False  # before draining: an id added after the drain schedules another send
        released = self._take_released()
        if released:
            self.send(messages.Release(released))

    def _take_released(self) -> list[int]:
        """The ids released since the last message that said so, for a message going to the worker now."""
        released = []
        while self._released:
            released.append(self._released.popleft())
        return released

    async def _pack(self, moved: list[Tensor]) -> tuple[int, list[packing.Slot]]:
        """Outputs copied into a block of this host's arena for the worker, which frees it when done."""
        try:
            if packing.costly(moved):
                return await packing.pack_off_loop(self.responses, self._allocator, moved)
            return packing.pack(self.responses, self._allocator, moved)
        except PoolFull as exc:
            raise ShoalError(ErrorCode.UNAVAILABLE, f"the response does not fit: it {exc}") from None

    async def _infer(self, message: messages.Infer) -> None:
        request_id = message.id
        trace_id = 0
        try:
            response = await self.core.infer(await self._request(message), message.origin)
            trace_id = response.trace_id
            in_regions = [
                (index, t.name, t.datatype.value, t.shape)
                for index, t in enumerate(response.outputs)
                if t.name in response.in_regions
            ]  # written into the client's memory: no bytes to move
            block, out = await self._pack([t for t in response.outputs if t.name not in response.in_regions])
        except BaseException as exc:  # noqa: BLE001 - every request gets its one answer
            if trace_id:  # its answer is an error now: no send of it will be reported
                self.core.sent(trace_id, 0, 0)
            self._failed(request_id, exc)
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
            return
        names = (response.model_name, response.model_version, response.id)
        del response  # its outputs may be views of the inputs (an identity model): copied, so let them go
        # Inputs let go of by now ride with the answer: the worker can reuse them for its next request.
        self.send(messages.Inferred(request_id, *names, block, out, in_regions, self._take_released(), trace_id))

    async def _stream(self, message: messages.Infer) -> None:
        """A streaming inference: a Streamed message per response, each outputs in its own block,
        until the final one; an Error instead when the request fails before (or cancelled)."""
        request_id = message.id
        trace_id, told = 0, False  # the trace its sends are reported to; the worker was told it (and reports)
        try:
            async for part in self.core.infer_stream(await self._request(message), message.origin):
                trace_id = part.trace_id
                names, block = None, packing.NO_BLOCK
                out: list[packing.Slot] = []
                if part.response is not None:
                    response = part.response
                    names = (response.model_name, response.model_version, response.id)
                    block, out = await self._pack(list(response.outputs))
                self.send(messages.Streamed(request_id, names, block, out, part.final, part.error, trace_id))
                told = True
                if part.final:
                    return
            raise ShoalError(ErrorCode.INTERNAL, "the stream of responses ended without its final response")
        except BaseException as exc:  # noqa: BLE001 - every request gets its one final answer
            if trace_id and not told:  # the worker cannot report a trace it never heard of
                self.core.sent(trace_id, 0, 0)
            self._failed(request_id, exc)
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise

    async def _call(self, message: messages.Call) -> None:
        request_id, method = message.id, message.method
        try:
            if method not in messages.CALLS:
                raise ShoalError(ErrorCode.INVALID_ARGUMENT, f"unknown core call {method!r}")
            value = await getattr(self.core, method)(*message.args)
        except BaseException as exc:  # noqa: BLE001
            self._failed(request_id, exc)
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
            return
        self.send(messages.Result(request_id, value))

    def _failed(self, request_id: int, exc: BaseException) -> None:
        kind = ""
        if isinstance(exc, ShoalError):
            code, message, kind = exc.code, exc.message, exc.kind
        elif isinstance(exc, asyncio.CancelledError):
            code, message = ErrorCode.UNAVAILABLE, "the request was cancelled"
        else:
            code, message = ErrorCode.INTERNAL, internal_error(exc, "serving a front-end worker's request")
        self._send_released()
        self.send(messages.Error(request_id, code.value, bounded(message), kind))


class InputRelease:
    """Tells the worker, once, that the host is done with one request's input block.

    Runs when the last view of the inputs is collected (``packing.unpack``'s ``on_release``), or at
    once when no view was ever made (``handed_out`` False: the request failed or was cancelled first).
    """

    __slots__ = ("host", "request_id", "handed_out", "done")

    def __init__(self, host: CoreHost, request_id: int) -> None:
        self.host, self.request_id = host, request_id
        self.handed_out = False
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.host.inputs_released(self.request_id)
