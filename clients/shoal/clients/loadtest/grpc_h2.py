"""shoal-load's gRPC sender: one prebuilt unary request, written as ready-made HTTP/2 frames.

Why not grpcio: on a machine the server shares, every microsecond the load generator spends is
taken from the server, and grpc.aio's client cost 2–3× the CPU per request of perf_analyzer's
C++ one here (~240 µs against ~100 at c=1), so shoal-load read 0.6–0.8× of perf_analyzer's
throughput on the same server. h2 (python-hyper's HTTP/2 state machine) cost more than grpc.aio.
A load generator sends the same request again and again, so nearly all of HTTP/2 can be done
once: the request's HEADERS block (HPACK, literals that never enter the dynamic table, so the
same bytes stay valid on every stream) and its one DATA frame are built at start; a request is
one ``transport.write`` with the stream id patched in. Answers are read frame by frame; only
header blocks are decoded (hpack, the python-hyper library h2 itself uses) for ``:status`` and
``grpc-status``; response bodies are counted, never parsed. ~50–85 µs per request
(``bench/load_client_cost.py``).

What it implements of RFC 9113 and gRPC over HTTP/2, and no more:
- the client preface; SETTINGS (acknowledged; push disabled; the peer's MAX_CONCURRENT_STREAMS and
  INITIAL_WINDOW_SIZE honoured), PING (answered), GOAWAY (streams above its last id and requests not
  yet sent go to a new connection, as grpc's client retries them transparently: the server never
  saw them), RST_STREAM (mapped to a status as gRPC does; REFUSED_STREAM sent again), WINDOW_UPDATE
  (the connection's send window is tracked; a request that does not fit waits); PADDED, PRIORITY
  and CONTINUATION in what it reads;
- receive windows of 1 GiB per stream and a connection window topped up as answers arrive:
  answers larger than 1 GiB are not read (gRPC's own limit is 2 GiB);
- requests whose gRPC message fits one DATA frame of the smallest size a peer may set (16 KiB)
  and the peer's stream window; ``fits`` says whether a request qualifies: shoal-load sends any
  other request, or to a peer whose window is smaller, with grpc.aio.

A request's result is None on success or the gRPC status name, as ``grpc.aio`` would report it:
``UNAVAILABLE`` when the server cannot be reached or the connection is lost with the request on it,
``DEADLINE_EXCEEDED`` when the deadline passes first (while connecting too), ``CANCELLED`` when the
channel is closed under it.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x3, 0x4
SMALLEST_MAX_FRAME = 16_384  # a peer may not set SETTINGS_MAX_FRAME_SIZE below this
DEFAULT_WINDOW = 65_535
RECEIVE_WINDOW = 1 << 30
TOP_UP_AFTER = 1 << 20  # received DATA bytes before the connection window is topped up again
STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
# gRPC's mapping of an HTTP status without grpc-status (doc/http-grpc-status-mapping.md).
HTTP_STATUS_NAMES = {
    400: "INTERNAL",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "UNIMPLEMENTED",
    429: "UNAVAILABLE",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "UNAVAILABLE",
}
# ... and of an RST_STREAM error code (grpc core's chttp2 transport).
RESET_NAMES = {0x7: "UNAVAILABLE", 0x8: "CANCELLED", 0xB: "RESOURCE_EXHAUSTED", 0xC: "PERMISSION_DENIED"}
REFUSED_STREAM, CANCEL = 0x7, 0x8
MAX_RETRIES = 10  # times one request is sent again (refused, or moved to a new connection) before it fails
HANDSHAKE_S = 20.0  # a server that accepts the connection but sends no SETTINGS within this is unavailable


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _without_grpc_status(http_status: bytes) -> str:
    """The status of an answer that ended without grpc-status, as gRPC names it."""
    if not http_status.isdigit() or http_status == b"200":
        return "UNKNOWN"  # a gRPC answer always ends with grpc-status; a status that is not a number says nothing
    return HTTP_STATUS_NAMES.get(int(http_status), "UNKNOWN")


def _status_name(grpc_status: bytes) -> str | None:
    """None for OK, else the status's name; a grpc-status that is not a known number is UNKNOWN."""
    if not grpc_status.isdigit():
        return "UNKNOWN"
    code = int(grpc_status)
    return None if code == 0 else STATUS_NAMES.get(code, "UNKNOWN")


def fits(request: bytes) -> bool:
    """Whether this sender can carry ``request`` (a serialized message): its gRPC frame fits one DATA frame."""
    return 5 + len(request) <= SMALLEST_MAX_FRAME


@dataclass(frozen=True)
class Prebuilt:
    """The bytes of one request, but for the stream id written between them."""

    headers_prefix: bytes  # HEADERS frame length, type, flags
    header_block: bytes
    data_prefix: bytes  # DATA frame length, type, flags
    message: bytes  # the gRPC length-prefixed message

    @classmethod
    def build(cls, authority: str, path: str, request: bytes) -> Prebuilt:
        block = hpack.Encoder().encode(
            [
                hpack.NeverIndexedHeaderTuple(name, value)
                for name, value in (
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", path),
                    (":authority", authority),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                )
            ]
        )
        message = b"\x00" + struct.pack(">I", len(request)) + request
        return cls(
            len(block).to_bytes(3, "big") + bytes((HEADERS, END_HEADERS)),
            block,
            len(message).to_bytes(3, "big") + bytes((DATA, END_STREAM)),
            message,
        )

    def wire(self, stream: int) -> bytes:
        sid = stream.to_bytes(4, "big")
        return b"".join((self.headers_prefix, sid, self.header_block, self.data_prefix, sid, self.message))


@dataclass(eq=False)
class _Call:
    result: asyncio.Future[str | None]
    stream: int = 0  # 0 until sent
    retries: int = 0
    http_status: bytes = b""
    connection: _Connection | None = None  # the one it was last given to


class _ProtocolError(Exception):
    """A frame no HTTP/2 peer may send: the connection cannot be read on."""


Redirect = Callable[[list[_Call]], None]


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying the prebuilt request on as many streams as the peer allows.

    Requests the server cannot have processed (never sent, above a GOAWAY's last stream id, or
    queued when the connection ended) are handed to ``redirect``, which gives them to the next one.
    """

    def __init__(self, prebuilt: Prebuilt, redirect: Redirect) -> None:
        self.prebuilt = prebuilt
        self.redirect = redirect
        self.decoder = hpack.Decoder()
        self.transport: asyncio.Transport | None = None
        self.settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the peer's SETTINGS
        self.settled.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, if no one waits
        self.buffer = bytearray()
        self.next_stream = 1
        self.active: dict[int, _Call] = {}
        self.waiting: deque[_Call] = deque()  # no stream or no send window free yet
        self.refused: list[_Call] = []  # refused by the server: sent again once a stream has ended
        self.max_streams = 1 << 31
        self.stream_window = DEFAULT_WINDOW
        self.send_window = DEFAULT_WINDOW
        self.received = 0  # DATA bytes since the connection window was last topped up
        self.block: list[bytes] = []  # the header block being read (HEADERS, then CONTINUATION frames)
        self.block_stream = 0
        self.block_ends_stream = False
        self.closed = False  # GOAWAY received, connection lost or closed: no new streams
        self.lost = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW)
        transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", RECEIVE_WINDOW - DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.settled.done():
            self.settled.set_exception(ConnectionError("the server closed the connection"))
        self.end("UNAVAILABLE")

    def end(self, outcome: str) -> None:
        """End the connection: requests on it get ``outcome``; those the server never saw go elsewhere."""
        self.closed = True
        sent = list(self.active.values())
        self.active.clear()
        for call in sent:
            self._finish(call, outcome)
        self._redirect_unsent()
        if self.transport is not None:
            self.transport.close()

    def _retire(self) -> None:
        """No new streams; unsent requests go elsewhere; the transport closes once the last answer is in."""
        self.closed = True
        self._redirect_unsent()
        self._close_if_drained()

    def _redirect_unsent(self) -> None:
        unsent = [*self.refused, *self.waiting]
        self.refused.clear()
        self.waiting.clear()
        if unsent:
            self.redirect(unsent)

    def _close_if_drained(self) -> None:
        if self.closed and not self.active and self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        position, end = 0, len(buffer)
        replies: list[bytes] = []
        while end - position >= 9:
            length = int.from_bytes(buffer[position : position + 3], "big")
            if end - position < 9 + length:
                break
            kind, flags = buffer[position + 3], buffer[position + 4]
            stream = int.from_bytes(buffer[position + 5 : position + 9], "big") & 0x7FFF_FFFF
            payload = bytes(buffer[position + 9 : position + 9 + length])
            position += 9 + length
            try:
                self._frame(kind, flags, stream, payload, replies)
            except (hpack.HPACKError, _ProtocolError):  # nothing more on this connection can be trusted
                self.end("INTERNAL")
                return
        del buffer[:position]
        if self.received >= TOP_UP_AFTER:
            replies.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
            self.received = 0
        if replies and self.transport is not None and not self.lost:
            self.transport.write(b"".join(replies))
        self._send_waiting()

    # -- frames
    def _frame(self, kind: int, flags: int, stream: int, payload: bytes, replies: list[bytes]) -> None:
        if kind == DATA:
            self.received += len(payload)
            if flags & END_STREAM:
                self._trailers_missing(stream)
        elif kind in (HEADERS, CONTINUATION):
            self._header_fragment(kind, flags, stream, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
                replies.append(frame(SETTINGS, ACK, 0))
        elif kind == WINDOW_UPDATE:
            if stream == 0:
                self.send_window += int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
        elif kind == PING:
            if not flags & ACK:
                replies.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self._stream_ended(stream)
            if call is not None:
                self._reset(call, int.from_bytes(payload[:4], "big"))
        elif kind == GOAWAY:
            self._goaway(int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF)

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ProtocolError("a SETTINGS frame's length is not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.max_streams = value
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:
                self.stream_window = value
        if not self.settled.done():
            self.settled.set_result(None)
        elif self.window_too_small():  # shrunk under us: the channel finds out when it connects again
            self._retire()

    def _header_fragment(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        """Collect a header block (HEADERS, then CONTINUATION until END_HEADERS) and read it whole: every block
        goes through the decoder, a stream's we gave up on too, or the decoder's table would drift from the
        server's encoder."""
        if kind == HEADERS:
            start, stop = 0, len(payload)
            if flags & PADDED:
                if not payload or payload[0] >= len(payload):
                    raise _ProtocolError("padding as long as the frame")
                start, stop = 1, len(payload) - payload[0]
            if flags & PRIORITY:
                start += 5
            if start > stop:
                raise _ProtocolError("a HEADERS frame too short for its priority")
            self.block_stream, self.block_ends_stream, self.block = stream, bool(flags & END_STREAM), []
            payload = payload[start:stop]
        self.block.append(payload)
        if flags & END_HEADERS:
            headers = self.decoder.decode(b"".join(self.block), raw=True)
            self.block = []
            call = self.active.get(self.block_stream)
            if call is not None:
                self._headers(call, headers, self.block_ends_stream)

    def _headers(self, call: _Call, headers: Iterable[tuple[bytes, bytes]], ends_stream: bool) -> None:
        grpc_status = None
        for name, value in headers:
            if name == b":status":
                call.http_status = value
            elif name == b"grpc-status":
                grpc_status = value
        if not ends_stream:
            return
        self._stream_ended(call.stream)
        self._finish(call, _without_grpc_status(call.http_status) if grpc_status is None else _status_name(grpc_status))

    def _trailers_missing(self, stream: int) -> None:
        """A stream the server ended with its DATA: no grpc-status came."""
        call = self._stream_ended(stream)
        if call is not None:
            self._finish(call, _without_grpc_status(call.http_status))

    def _stream_ended(self, stream: int) -> _Call | None:
        """Whatever ended a stream, it frees one for the refused and the waiting."""
        call = self.active.pop(stream, None)
        if call is not None:
            self._retry_refused()
            self._close_if_drained()
        return call

    def _reset(self, call: _Call, code: int) -> None:
        """A refused stream was never processed (RFC 9113 §8.7), so it is sent again, as grpc's client does,
        once another stream has ended: grpc's server counts a stream against its limit a little after it
        answered it. A refusal counts against ``MAX_RETRIES`` only when no other stream of this connection
        was open: with others open, the server's limit explains it (a busy machine stretches that "little
        after" over many answers, and 300 requests on a limit of 100 were refused more than 10 times each),
        and the request's deadline still bounds it. Any other reset ends the request."""
        if code != REFUSED_STREAM or call.retries >= MAX_RETRIES:
            self._finish(call, RESET_NAMES.get(code, "INTERNAL"))
            return
        if self.closed:
            self.redirect([call])
            return
        if not self.active:
            call.retries += 1
        self.refused.append(call)
        if not self.active:
            self._retry_refused()

    def _retry_refused(self) -> None:
        while self.refused:
            self.waiting.appendleft(self.refused.pop())

    def _goaway(self, last_stream: int) -> None:
        """Streams above ``last_stream`` were not processed (RFC 9113 §6.8): they go elsewhere with the unsent."""
        above = [self.active.pop(stream) for stream in [s for s in self.active if s > last_stream]]
        self.refused[:0] = above
        self._retire()

    # -- requests
    def start(self, call: _Call) -> None:
        """Send ``call`` now if a stream and the send window allow, else queue it."""
        call.connection = self
        if self.next_stream > 0x7FFF_FFFF:  # stream ids used up: the next request opens a new connection
            self._retire()
        if self.closed:
            self.redirect([call])
            return
        if self.waiting or not self._can_send():
            self.waiting.append(call)
            return
        self._send(call)

    def _can_send(self) -> bool:
        size = len(self.prebuilt.message)
        return len(self.active) < self.max_streams and self.send_window >= size and self.stream_window >= size

    def _send(self, call: _Call) -> None:
        call.stream, self.next_stream = self.next_stream, self.next_stream + 2
        self.send_window -= len(self.prebuilt.message)
        self.active[call.stream] = call
        assert self.transport is not None
        self.transport.write(self.prebuilt.wire(call.stream))

    def _send_waiting(self) -> None:
        while self.waiting and not self.closed and self._can_send():
            call = self.waiting.popleft()
            if not call.result.done():
                self._send(call)

    def abandon(self, call: _Call) -> None:
        """The caller stopped waiting (deadline or cancellation): reset its stream, or drop it from the queue."""
        if self._stream_ended(call.stream) is not None:
            if self.transport is not None and not self.lost:
                self.transport.write(frame(RST_STREAM, 0, call.stream, struct.pack(">I", CANCEL)))
            self._send_waiting()
        elif call in self.waiting:
            self.waiting.remove(call)
        elif call in self.refused:
            self.refused.remove(call)

    @staticmethod
    def _finish(call: _Call, outcome: str | None) -> None:
        if not call.result.done():
            call.result.set_result(outcome)

    def window_too_small(self) -> bool:
        return self.stream_window < len(self.prebuilt.message)


class PeerWindowTooSmall(Exception):
    """The server's stream window cannot take the request in one DATA frame."""

    def __init__(self, window: int, needed: int) -> None:
        super().__init__(f"the server's HTTP/2 stream window ({window} bytes) is smaller than one request ({needed})")


class PrebuiltGrpcChannel:
    """Sends the one prebuilt request to ``host:port`` over one HTTP/2 connection, reconnecting when it is lost.

    ``connect`` and ``call`` raise ``PeerWindowTooSmall`` when the peer's stream window cannot take the
    request in one frame (shoal-load then uses grpc.aio), and go on raising it: a server that said so once
    is not asked again.
    """

    def __init__(self, target: str, path: str, request: bytes) -> None:
        if not fits(request):
            raise ValueError(f"a request of {len(request)} bytes does not fit one HTTP/2 frame")
        host, _, port = target.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.prebuilt = Prebuilt.build(target, path, request)
        self.connection: _Connection | None = None
        self.retiring: set[_Connection] = set()  # earlier connections still open (answers after a GOAWAY)
        self.opening: asyncio.Task[_Connection] | None = None
        self.resending: set[asyncio.Task[None]] = set()
        self.too_small: PeerWindowTooSmall | None = None
        self.closed = False

    async def connect(self) -> _Connection:
        if self.too_small is not None:
            raise self.too_small
        if self.connection is not None and not self.connection.closed:
            return self.connection
        if self.opening is None:
            self.opening = asyncio.ensure_future(self._open())
            # a caller that timed out leaves the task behind: its failure is read here, not logged as unretrieved
            self.opening.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            return await asyncio.shield(self.opening)
        finally:
            if self.opening is not None and self.opening.done():
                self.opening = None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(
            lambda: _Connection(self.prebuilt, self._redirect), self.host, self.port
        )
        try:
            await asyncio.wait_for(asyncio.shield(connection.settled), HANDSHAKE_S)
        except TimeoutError:
            connection.end("UNAVAILABLE")
            raise ConnectionError(f"no HTTP/2 SETTINGS from the server within {HANDSHAKE_S:.0f} s") from None
        except BaseException:
            connection.end("UNAVAILABLE")
            raise
        if connection.window_too_small():
            connection.end("UNAVAILABLE")
            self.too_small = PeerWindowTooSmall(connection.stream_window, len(self.prebuilt.message))
            raise self.too_small
        if self.connection is not None:
            self.retiring.add(self.connection)
        self.retiring = {c for c in self.retiring if c.transport is not None and not c.transport.is_closing()}
        self.connection = connection
        return connection

    def _redirect(self, calls: list[_Call]) -> None:
        """Give requests the server never processed to the next connection, as grpc's transparent retry does."""
        again = []
        for call in calls:
            call.retries += 1
            if call.result.done():
                continue
            if self.closed or call.retries > MAX_RETRIES:
                _Connection._finish(call, "CANCELLED" if self.closed else "UNAVAILABLE")
            else:
                again.append(call)
        if again:
            task = asyncio.ensure_future(self._resend(again))
            self.resending.add(task)
            task.add_done_callback(self.resending.discard)

    async def _resend(self, calls: list[_Call]) -> None:
        try:
            connection = await self.connect()
        except asyncio.CancelledError:  # the channel closed
            for call in calls:
                _Connection._finish(call, "CANCELLED")
            raise
        except PeerWindowTooSmall as exc:
            for call in calls:
                if not call.result.done():
                    call.result.set_exception(exc)
            return
        except OSError:
            for call in calls:
                _Connection._finish(call, "UNAVAILABLE")
            return
        for call in calls:
            if not call.result.done():
                connection.start(call)

    async def call(self, timeout_s: float) -> str | None:
        """Send the request once; None on success, else the gRPC status name."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        connection = self.connection
        if connection is None or connection.closed:
            try:
                async with asyncio.timeout_at(deadline) as scope:
                    connection = await self.connect()
            except TimeoutError:  # ours, or the kernel's on connect (an OSError too)
                return "DEADLINE_EXCEEDED" if scope.expired() else "UNAVAILABLE"
            except OSError:  # refused, reset
                return "UNAVAILABLE"
        call = _Call(loop.create_future())
        connection.start(call)
        timer = loop.call_at(deadline, _Connection._finish, call, "DEADLINE_EXCEEDED")
        try:
            outcome = await call.result
        finally:
            timer.cancel()
            abandoned = call.result.cancelled() or (
                call.result.exception() is None and call.result.result() == "DEADLINE_EXCEEDED"
            )
            if abandoned and call.connection is not None:
                call.connection.abandon(call)
        return outcome

    async def close(self) -> None:
        """Close every connection; requests still waiting end CANCELLED."""
        self.closed = True
        if self.opening is not None:
            self.opening.cancel()
        for task in list(self.resending):
            task.cancel()
        for connection in [*self.retiring, *([self.connection] if self.connection else [])]:
            connection.end("CANCELLED")
        self.retiring.clear()
