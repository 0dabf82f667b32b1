"""``Core`` in a front-end worker process: every call goes to the host over a ``dataplane`` channel.

Input tensors are copied once, from the gRPC message into a block of the worker's arena; the host
reads them in place, and the block is reused only once the host has RELEASEd it (views of inputs
can outlive the answer there, see ``core.messages``). BYTES inputs that the transport left in their
wire encoding (``EncodedTensor``) are copied as they are, and the host decodes and checks them.
Outputs come back the same way in the host's arena and are handed to the transport as views, BYTES
as ``EncodedTensor`` views of their wire bytes (nothing decoded here); the block goes back to the
host once the last view is gone (after the transport has encoded the reply). A full arena answers
UNAVAILABLE: the pool bounds the memory.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from shoal.core import (
    CudaRegionStatus,
    HealthSnapshot,
    IndexEntry,
    ModelMetadata,
    RegionStatus,
    ServerMetadata,
    StatisticsRow,
    StreamedResponse,
    messages,
)
from shoal.dataplane import packing
from shoal.dataplane.arena import Arena, BlockAllocator, PoolFull
from shoal.dataplane.channel import Channel
from shoal.errors import ErrorCode, ShoalError, rebuilt
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, Tensor
from shoal.tracing.trace import Origin

HOST_GONE = "the server's model host process is gone"
# Freed response blocks ride along with the next request to the host; when none goes out this
# long, they go on their own (a message of their own would wake the host once per request).
FREE_FLUSH_S = 0.002


class RemoteStream:
    """A streaming request the host answers: its parts for the reader."""

    def __init__(self) -> None:
        self.parts: asyncio.Queue[StreamedResponse | ShoalError] = asyncio.Queue()
        self.abandoned = False  # the reader gave up: parts still coming are released, not queued

    def put(self, part: StreamedResponse | ShoalError) -> None:
        if not self.abandoned:
            self.parts.put_nowait(part)


class RemoteCore:
    """``Core`` answered by the host process. ``connect`` before the first call."""

    def __init__(self, requests: Arena, responses: Arena, on_health: Any = None, on_stop: Any = None) -> None:
        self.requests = requests  # this worker's arena: it allocates inputs here
        self.responses = responses  # the host's arena: outputs arrive here
        self._allocator = BlockAllocator(requests.size)
        self._on_health = on_health or (lambda: None)
        self._on_stop = on_stop or (lambda grace_s: None)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}  # id -> its answer
        self._input_blocks: dict[int, int] = {}  # id -> its input block, until the host releases it
        self._streams: dict[int, RemoteStream] = {}  # streaming requests the host still answers
        self._freed: list[int] = []  # response blocks to give back
        # Whether each (model, version) is decoupled, asked once per stream request: kept until the host
        # says a model changed (``Health``); ``_model_changes`` counts those, so that an answer asked
        # before a change is not kept after it.
        self._decoupled: dict[tuple[str, str], bool] = {}
        self._model_changes = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._channel: Channel | None = None
        self.closed = asyncio.Event()

    async def connect(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._channel = await Channel.open(sock, self._received, self._host_gone, messages.RECORDS)

    def started(self, port_or_problem: tuple[int, int] | str) -> None:
        """Tell the host this worker serves on its (gRPC, HTTP) ports, HTTP 0 when off (or why it cannot)."""
        if self._channel is not None:
            self._channel.send(messages.Started(port_or_problem))

    # -- the interface -----------------------------------------------------------------------------

    async def live(self) -> bool:
        return bool(await self._call("live"))

    async def ready(self) -> bool:
        return bool(await self._call("ready"))

    async def health(self) -> HealthSnapshot:
        snapshot: HealthSnapshot = await self._call("health")
        return snapshot

    async def server_metadata(self) -> ServerMetadata:
        metadata: ServerMetadata = await self._call("server_metadata")
        return metadata

    async def model_ready(self, name: str, version: str) -> bool:
        return bool(await self._call("model_ready", name, version))

    async def model_metadata(self, name: str, version: str) -> ModelMetadata:
        metadata: ModelMetadata = await self._call("model_metadata", name, version)
        return metadata

    async def model_config(self, name: str, version: str) -> dict[str, Any]:
        config: dict[str, Any] = await self._call("model_config", name, version)
        return config

    async def model_decoupled(self, name: str, version: str) -> bool:
        known = self._decoupled.get((name, version))
        if known is not None:
            return known
        changes = self._model_changes
        decoupled = bool(await self._call("model_decoupled", name, version))
        if changes == self._model_changes:
            self._decoupled[(name, version)] = decoupled
        return decoupled

    async def _pack_inputs(self, request: InferRequest) -> tuple[int, list[packing.Slot]]:
        try:
            if packing.costly(request.inputs):  # many BYTES to encode: off the loop
                return await packing.pack_off_loop(self.requests, self._allocator, request.inputs)
            return packing.pack(self.requests, self._allocator, request.inputs)
        except PoolFull as exc:
            advice = (
                "it can never fit: start the server with a larger --grpc-worker-pool-mb"
                if exc.wanted > exc.capacity
                else "retry later, or start the server with a larger --grpc-worker-pool-mb"
            )
            message = f"the front-end worker's shared-memory pool is full: the request {exc}; {advice}"
            raise ShoalError(ErrorCode.UNAVAILABLE, message) from None

    async def infer(self, request: InferRequest, origin: Origin | None = None) -> InferResponse:
        block, slots = await self._pack_inputs(request)
        response: InferResponse = await self._send(
            lambda request_id: _infer_message(request_id, request, slots, False, self._take_freed(), origin), block
        )
        return response

    async def infer_stream(
        self, request: InferRequest, origin: Origin | None = None
    ) -> AsyncIterator[StreamedResponse]:
        """The host's responses as they come (``RemoteStream``); a give-up is sent as CANCEL."""
        block, slots = await self._pack_inputs(request)
        channel = self._channel
        if channel is None or channel.closed:
            self._free_input(block)
            raise ShoalError(ErrorCode.UNAVAILABLE, HOST_GONE)
        request_id = next(self._ids)
        stream = RemoteStream()
        self._streams[request_id] = stream
        self._hold_input(request_id, block)
        channel.send(_infer_message(request_id, request, slots, True, self._take_freed(), origin))
        try:
            while True:
                part = await stream.parts.get()
                if isinstance(part, ShoalError):
                    raise part
                yield part
                if part.final:
                    return
        finally:
            if request_id in self._streams:  # given up before its end: later parts are dropped
                stream.abandoned = True
                channel.send(messages.Cancel(request_id))

    def _streamed(self, message: messages.Streamed | messages.Error) -> None:
        """A Streamed or Error for a streaming request: on to its reader; the final one frees the inputs."""
        stream = self._streams[message.id]
        if isinstance(message, messages.Error):
            del self._streams[message.id]
            stream.put(rebuilt(message.code, message.message, message.kind))
            return
        if message.final:
            del self._streams[message.id]
        block = message.block
        if stream.abandoned:
            self._release(block)
            if message.trace_id and message.final:  # nobody writes it: its trace need not wait for it
                self.sent(message.trace_id, 0, 0)
            return
        response = None
        if message.names is not None:
            outputs = packing.unpack(self.responses, message.slots, lambda: self._release(block), encoded_bytes=True)
            model_name, model_version, response_id = message.names
            response = InferResponse(model_name, model_version, response_id, outputs)
        stream.put(StreamedResponse(response, message.final, message.error, message.trace_id))

    def sent(self, trace_id: int, started_ns: int, ended_ns: int, last: bool = True) -> None:
        if self._channel is not None and not self._channel.closed:
            self._channel.send(messages.Sent(trace_id, started_ns, ended_ns, last))

    async def model_statistics(self, name: str, version: str) -> list[StatisticsRow]:
        rows: list[StatisticsRow] = await self._call("model_statistics", name, version)
        return rows

    async def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        entries: list[IndexEntry] = await self._call("repository_index", ready_only)
        return entries

    async def load_model(self, name: str, config_override: dict[str, Any] | None) -> None:
        await self._call("load_model", name, config_override)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self._call("unload_model", name, unload_dependents)

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self._call("register_system_shared_memory", name, key, offset, byte_size)

    async def unregister_system_shared_memory(self, name: str) -> None:
        await self._call("unregister_system_shared_memory", name)

    async def system_shared_memory_status(self, name: str) -> list[RegionStatus]:
        regions: list[RegionStatus] = await self._call("system_shared_memory_status", name)
        return regions

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        await self._call("register_cuda_shared_memory", name, raw_handle, device_id, byte_size)

    async def unregister_cuda_shared_memory(self, name: str) -> None:
        await self._call("unregister_cuda_shared_memory", name)

    async def cuda_shared_memory_status(self, name: str) -> list[CudaRegionStatus]:
        regions: list[CudaRegionStatus] = await self._call("cuda_shared_memory_status", name)
        return regions

    async def trace_settings(self, model: str) -> dict[str, list[str] | str]:
        settings: dict[str, list[str] | str] = await self._call("trace_settings", model)
        return settings

    async def update_trace_settings(self, model: str, changes: dict[str, list[str] | None]) -> dict[str, Any]:
        settings: dict[str, Any] = await self._call("update_trace_settings", model, changes)
        return settings

    async def log_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = await self._call("log_settings")
        return settings

    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        settings: dict[str, Any] = await self._call("update_log_settings", changes)
        return settings

    # -- the channel -------------------------------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._send(lambda request_id: messages.Call(request_id, method, args), packing.NO_BLOCK)

    async def _send(self, message_for: Callable[[int], Any], block: int) -> Any:
        """Send one request (``message_for`` its id) and wait for its answer. The input block stays taken
        until the host releases it, whenever that is (answered, cancelled or not): the host may still be
        reading it."""
        channel = self._channel
        if channel is None or channel.closed:
            self._free_input(block)
            raise ShoalError(ErrorCode.UNAVAILABLE, HOST_GONE)
        request_id = next(self._ids)
        assert self._loop is not None
        answer = self._loop.create_future()
        self._pending[request_id] = answer
        self._hold_input(request_id, block)
        channel.send(message_for(request_id))
        try:
            return await answer
        except asyncio.CancelledError:
            if request_id in self._pending:
                channel.send(messages.Cancel(request_id))
            raise

    def _received(self, message: Any) -> None:
        kind = type(message)
        if kind is messages.Release:
            for request_id in message.ids:
                self._free_input(self._input_blocks.pop(request_id, packing.NO_BLOCK))
            return
        if kind is messages.Health:
            self._model_changes += 1
            self._decoupled.clear()
            self._on_health()
            return
        if kind is messages.Stop:
            self._on_stop(message.grace_s)
            return
        if kind is messages.Ping:
            if self._channel is not None:
                self._channel.send(messages.Pong())
            return
        if message.id in self._streams:
            self._streamed(message)
            return
        if kind is messages.Inferred:
            for request_id in message.released:
                self._free_input(self._input_blocks.pop(request_id, packing.NO_BLOCK))
        answer = self._pending.pop(message.id, None)
        if answer is None:  # an id this worker never sent: ignore it rather than fail every later answer
            return
        if kind is messages.Inferred:
            self._inferred(answer, message)
        elif answer.done():
            return  # cancelled meanwhile
        elif kind is messages.Result:
            answer.set_result(message.value)
        else:
            answer.set_exception(rebuilt(message.code, message.message, message.kind))

    def _inferred(self, answer: asyncio.Future[Any], message: messages.Inferred) -> None:
        """The outputs as views of the host's block (BYTES still encoded: no work per element here)."""
        block = message.block
        if answer.done():  # cancelled meanwhile: nobody reads the outputs, nobody writes them
            self._release(block)
            if message.trace_id:
                self.sent(message.trace_id, 0, 0)
            return
        outputs = packing.unpack(self.responses, message.slots, lambda: self._release(block), encoded_bytes=True)
        if message.in_regions:
            listed = list(outputs)
            for index, name, datatype_name, shape in message.in_regions:  # in the client's shared memory
                datatype = DataType(datatype_name)
                listed.insert(index, Tensor(name, datatype, shape, np.empty(0, datatype.numpy_dtype)))
            outputs = tuple(listed)
        answer.set_result(
            InferResponse(
                message.model_name,
                message.model_version,
                message.response_id,
                outputs,
                frozenset(r[1] for r in message.in_regions),
                message.trace_id,
            )
        )

    def _hold_input(self, request_id: int, block: int) -> None:
        if block != packing.NO_BLOCK:
            self._input_blocks[request_id] = block

    def _free_input(self, block: int) -> None:
        if block != packing.NO_BLOCK:
            self.requests.release_pages(block, self._allocator.free(block))

    def _release(self, block: int) -> None:
        """A response block is no longer read here; give it back (from any thread)."""
        if block == packing.NO_BLOCK or self._loop is None or self._loop.is_closed():
            return
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._release, block)
            return
        if self._flush_timer is None:
            self._flush_timer = self._loop.call_later(FREE_FLUSH_S, self._flush_freed)
        self._freed.append(block)

    def _take_freed(self) -> list[int]:
        """The response blocks to give back, for a message going to the host now."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        freed, self._freed = self._freed, []
        return freed

    def _flush_freed(self) -> None:
        freed = self._take_freed()
        if self._channel is not None and freed:
            self._channel.send(messages.Free(freed))

    def _host_gone(self) -> None:
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(ShoalError(ErrorCode.UNAVAILABLE, HOST_GONE))
        self._pending.clear()
        for block in self._input_blocks.values():  # nothing reads them any more
            self._free_input(block)
        self._input_blocks.clear()
        for stream in self._streams.values():
            stream.put(ShoalError(ErrorCode.UNAVAILABLE, HOST_GONE))
        self._streams.clear()
        self.closed.set()


def _infer_message(
    request_id: int,
    request: InferRequest,
    slots: list[packing.Slot],
    streaming: bool,
    freed: list[int],
    origin: Origin | None = None,
) -> messages.Infer:
    return messages.Infer(
        request_id,
        request.model_name,
        request.model_version,
        request.id,
        request.requested_outputs,
        request.parameters,
        request.class_counts,
        request.region_inputs,
        request.output_regions,
        slots,
        streaming,
        freed,
        origin,
    )
