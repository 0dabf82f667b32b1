"""One HTTP/1.1 connection of the HTTP endpoint: httptools parses it, ``HttpApp`` answers each request.

Shoal's own protocol, not uvicorn's (which served until session 43): the endpoint serves one
application, so the ASGI layer between them (a scope and message dicts per request, a receive and
two sends through awaited calls, a request-response object with its own event) was pure cost.
Measured with the same route and client (``bench/http_stacks.py``, uvloop): 16 against 32 µs of
server CPU per request. HTTP's semantics stay what they were: keep-alive and HTTP/1.0, requests
pipelined on a connection answered in order (reading pauses while one waits), ``Expect:
100-continue``, chunked bodies, percent-decoded paths, one write per answer, reading paused while
the client does not take what was written.

Bounds, as a reverse proxy in front of it would set them (defaults in ``HttpSettings``, each a
``--http-*`` option): the line and headers within 30 s of the first byte or the accept (nginx's
client_header_timeout is 60 s, Apache's mod_reqtimeout 20-40 s, HAProxy's usual ``timeout
http-request`` 10 s: headers are a few hundred bytes) and at most ``MAX_HEAD_BYTES`` (431: httptools
keeps a header it is still reading in memory whole); the body with no byte for 60 s (nginx's
client_body_timeout, also counted between reads) and whole within 300 s (Node.js's requestTimeout:
64 MiB at 220 kB/s); a body past ``--http-max-input-size`` is refused when its Content-Length says
so, before it is read, or as it passes the bound (413); the bodies being received at once by all
connections at most ``--http-max-pending-body-mb`` (503: without it, slow uploads on many
connections could hold 64 MiB each); an idle kept-alive connection 75 s (nginx's
keepalive_timeout, longer than load balancers' usual 60 s, so that the balancer closes first); and
4,096 open connections per process (nginx's worker_connections is 512 per worker; past the bound a
503 at once). Refusals are Triton's ``{"error": ...}`` bodies sent with ``connection: close``.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import time
import urllib.parse
from dataclasses import dataclass, field

import httptools

from shoal.http.app import Answer, HttpApp, too_large
from shoal.http.status import error_body
from shoal.settings import HttpSettings

logger = logging.getLogger(__name__)

# A request's line and headers, at most: httptools keeps a header it is still reading in memory
# whole, so without a bound one endless header line grows the server until it runs out of memory.
MAX_HEAD_BYTES = 2**20
REFUSED_LINGER_S = 2.0  # a refused connection reads (and drops) what its client still sends, this long
MAX_LINGERING = 256  # refused connections lingering at once; past it one is closed at once (its answer may be lost)
REFUSALS_LOG_INTERVAL_S = 60.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Header names as they were sent -> as requests carry them (lower case): the same few names come
# with every request. Bounded in count and in each name's length: a client sending new names, or names
# as long as a head may be (MAX_HEAD_BYTES), would otherwise make the server keep them for good.
_HEADER_NAMES: dict[bytes, str] = {}
MAX_HEADER_NAMES_KEPT = 512
MAX_HEADER_NAME_KEPT_BYTES = 64
_STATUS_LINES = {status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode() for status in http.HTTPStatus}


@dataclass(eq=False)
class ConnectionGuard:
    """What the connections of one endpoint share: the limits, the open connections, the body bytes
    being received in all, how many refused connections still linger, and the refusals not yet
    reported (at most one line per ``REFUSALS_LOG_INTERVAL_S``)."""

    settings: HttpSettings
    max_connections: int
    connections: set[HttpConnection] = field(default_factory=set)
    pending_body_bytes: int = 0
    lingering: int = 0
    unreported: int = 0
    reported_at: float = -REFUSALS_LOG_INTERVAL_S

    def count_refusal(self, now: float) -> None:
        self.unreported += 1
        if now - self.reported_at < REFUSALS_LOG_INTERVAL_S:
            return
        logger.warning(
            "refused %d HTTP connection(s) since the last report: %d are open, the most "
            "--http-max-connections allows here (reported at most every %.0f s)",
            self.unreported,
            self.max_connections,
            REFUSALS_LOG_INTERVAL_S,
        )
        self.unreported, self.reported_at = 0, now

    def reserve(self, size: int) -> str | None:
        """Count ``size`` more bytes of bodies being received; the refusal's message past the bound,
        unless nothing else is being received (one body up to ``--http-max-input-size`` is always taken)."""
        bound = self.settings.max_pending_body_bytes
        if self.pending_body_bytes and self.pending_body_bytes + size > bound:
            return (
                f"the server is receiving {self.pending_body_bytes} bytes of request bodies already, and "
                f"{size} more would pass its limit of {bound} (--http-max-pending-body-mb); try again later"
            )
        self.pending_body_bytes += size
        return None


class _Request:
    """A request as it is read: its head, its body's chunks, and whether it is whole."""

    __slots__ = (
        "method",
        "path",
        "headers",
        "chunks",
        "size",
        "reserved",
        "complete",
        "keep_alive",
        "expects_continue",
        "refusal",
        "started_ns",
    )

    def __init__(self) -> None:
        self.method = ""
        self.path = ""
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0  # body bytes received
        self.reserved = 0  # of the guard's pending body bytes, until the body is whole
        self.complete = False
        self.keep_alive = True
        self.expects_continue = False
        self.refusal: tuple[int, str] | None = None  # answered so, then the connection closes
        self.started_ns = 0  # time.monotonic_ns() when the head was read: a trace's HTTP_RECV_START


class HttpConnection(asyncio.Protocol):
    """One client connection: requests parsed in turn, each answered by ``app`` in order."""

    def __init__(self, app: HttpApp, guard: ConnectionGuard) -> None:
        self.app = app
        self.guard = guard
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._parsing: _Request | None = None  # the request whose head or body is being read
        self._queue: collections.deque[_Request] = collections.deque()  # read, not yet answered; [0] is next
        self._answering = False
        self._closing = False  # the endpoint is stopping: close after the answer being written
        self._refused = False
        self._refusal_after: tuple[int, str] | None = None  # refused while an answer was computed: sent after it
        self._lingering = False
        self._reading_paused = False
        self._writing_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._in_head = True  # reading a request's line and headers (or waiting for the next request's)
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_callback: collections.abc.Callable[[], None] | None = None
        self._body_started = 0.0  # loop time when the headers were complete
        self._last_read = 0.0  # loop time of the last bytes received

    # asyncio's protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's are not subclasses)
        guard = self.guard
        if len(guard.connections) >= guard.max_connections:
            guard.count_refusal(self.loop.time())
            self._refuse(
                503,
                f"the server has {guard.max_connections} open HTTP connections, the most it serves "
                "(--http-max-connections); try again later",
            )
            return
        guard.connections.add(self)
        self._arm(guard.settings.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.connections.discard(self)
        if self._lingering:
            self._lingering = False
            self.guard.lingering -= 1
        for request in (self._parsing, *self._queue):
            if request is not None:
                self._release(request)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what the client still sends after a refusal is dropped
        self._last_read = self.loop.time()
        if self._in_head:
            if self._timer_callback == self._idle_timed_out:
                self._disarm()  # the keep-alive wait ends; the head's deadline is armed below
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An Upgrade (h2c, websocket) or a CONNECT is not served: the parser reads nothing past
            # its head, so the request is answered as HTTP/1.1 if it has no body (and refused if it
            # has one: it was not read), and the connection closes after it.
            upgrade = self._parsing if self._parsing is not None else (self._queue[-1] if self._queue else None)
            if upgrade is not None:
                upgrade.keep_alive = False
            if self._parsing is not None and self._parsing in self._queue:
                headers = self._parsing.headers
                if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
                    self._parsing.refusal = (400, "a request that asks for an Upgrade may not have a body here")
                    self._release(self._parsing)
                self.on_message_complete()
        except httptools.HttpParserError:
            self._refuse(400, "Invalid HTTP request received.")
            return
        if self._timer is None and not self._refused and not self._closed():
            self._arm_for_the_rest()

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._parsing = _Request()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._parsing is not None
        if not self._in_head:
            return  # a chunked body's trailer: never a header of the request (a restriction's key, say)
        key = _HEADER_NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
            if len(name) <= MAX_HEADER_NAME_KEPT_BYTES and len(_HEADER_NAMES) < MAX_HEADER_NAMES_KEPT:
                _HEADER_NAMES[name] = key
        # llhttp keeps trailing whitespace, which RFC 9110 (5.5) excludes from the value.
        self._parsing.headers[key] = value.rstrip(b" \t").decode("latin-1")

    def on_headers_complete(self) -> None:
        request = self._parsing
        assert request is not None
        self._in_head = False
        self._disarm()
        self._body_started = self.loop.time()
        request.started_ns = time.monotonic_ns()
        request.method = self.parser.get_method().decode("ascii", "replace")
        request.keep_alive = self.parser.should_keep_alive()
        try:
            path = httptools.parse_url(self._url).path.decode("ascii")
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            request.refusal = (400, "the request's URL is not valid")
        else:
            request.path = urllib.parse.unquote(path) if "%" in path else path
        headers = request.headers
        request.expects_continue = headers.get("expect", "").lower() == "100-continue"
        declared = headers.get("content-length", "")
        if request.refusal is None and declared.isdigit():
            if int(declared) > self.app.max_body_bytes:
                request.refusal = (413, too_large(int(declared), self.app.max_body_bytes))
            else:
                self._reserve(request, int(declared))
        self._queue.append(request)
        if len(self._queue) > 1:
            self._pause_reading()  # pipelined: read on once the requests before it are answered
        elif not self._answering:
            self._start_next()

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        assert request is not None
        if request.refusal is not None:
            return
        request.size += len(body)
        if request.size > self.app.max_body_bytes:
            request.refusal = (413, too_large(request.size, self.app.max_body_bytes))
            self._release(request)
            request.chunks.clear()
            if request is self._queue[0] and not self._answering:
                self._start_next()
            return
        if request.size > request.reserved:  # no Content-Length (chunked), or more than it said
            self._reserve(request, request.size - request.reserved)
            if request.refusal is not None:
                if request is self._queue[0] and not self._answering:
                    self._start_next()
                return
        request.chunks.append(body)

    def on_message_complete(self) -> None:
        request = self._parsing
        assert request is not None
        self._parsing = None
        self._in_head, self._head_bytes = True, 0  # the next request's head, on a kept-alive connection
        self._disarm()
        request.complete = True
        self._release(request)
        if request is self._queue[0] and not self._answering:
            self._start_next()

    # answering

    def _start_next(self) -> None:
        """Answer the first request in the queue if it can be now: whole, or refused."""
        if not self._queue or self._closed():
            return
        request = self._queue[0]
        if request.refusal is not None:
            self._refuse(*request.refusal)
        elif request.complete:
            self._answering = True
            self.loop.create_task(self._answer(request))
        elif request.expects_continue:
            request.expects_continue = False
            assert self.transport is not None
            self.transport.write(_CONTINUE)

    async def _answer(self, request: _Request) -> None:
        chunks = request.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        request.chunks = []
        answer = await self.app.respond(request.method, request.path, request.headers, body, request.started_ns)
        close = not request.keep_alive or self._closing
        sent_ns = 0
        if not self._gone():
            assert self.transport is not None
            self.transport.write(_serialised(answer, close, with_body=request.method != "HEAD"))
            if answer.trace_id:
                sent_ns = time.monotonic_ns()
        if answer.trace_id:
            self.app.sent(answer, sent_ns)
        self._queue.popleft()
        if close:
            if not self._gone():
                self.transport.close()  # type: ignore[union-attr]
            return
        if self._writing_paused and not self._gone():  # the client is not reading: wait before the next
            self._drained = self.loop.create_future()
            await self._drained
            self._drained = None
        self._answering = False
        if self._gone():
            return
        if self._refusal_after is not None:  # the connection was refused while this was answered
            following = self._queue[0] if self._queue else None
            if following is not None and following.complete and following.refusal is None:
                self._answering = True  # parsed whole before the refusal: answered first, in order
                self.loop.create_task(self._answer(following))
            else:
                self._write_refusal(*(following.refusal if following and following.refusal else self._refusal_after))
            return
        if self._refused:
            return
        if self._reading_paused and len(self._queue) <= 1:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        if self._queue:
            self._start_next()
        elif self._timer is None and not self._head_bytes:
            self._arm(self.guard.settings.keep_alive_timeout_s, self._idle_timed_out)

    def shutdown(self) -> None:
        """The endpoint stops: an idle connection closes now, one being answered after its answer."""
        if self._answering or self._queue:
            self._closing = True
        elif self.transport is not None and not self._closed():
            self.transport.close()

    # bounds

    def _reserve(self, request: _Request, size: int) -> None:
        refused = self.guard.reserve(size)
        if refused is None:
            request.reserved += size
        else:
            request.refusal = (503, refused)
            self._release(request)
            request.chunks.clear()

    def _release(self, request: _Request) -> None:
        self.guard.pending_body_bytes -= request.reserved
        request.reserved = 0

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self._closed():
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def _gone(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def _closed(self) -> bool:
        """Gone, or refused: nothing more is read or answered."""
        return self._gone() or self._refused

    def _arm_for_the_rest(self) -> None:
        """A deadline for what this request has still to send, if anything: most requests come whole in
        one read, and arm no timer at all."""
        if not self._in_head:
            self._arm(self._body_check_delay(), self._check_body)
        elif self._head_bytes or self._parsing is not None:  # part of the next request's head
            self._arm(self.guard.settings.header_timeout_s, self._head_timed_out)

    def _arm(self, delay_s: float, callback: collections.abc.Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)
        self._timer_callback = callback

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_callback = None

    def _idle_timed_out(self) -> None:
        self._timer = self._timer_callback = None
        if not self._queue and not self._head_bytes and not self._closed():
            assert self.transport is not None
            self.transport.close()  # as an idle keep-alive connection is closed: quietly

    def _head_timed_out(self) -> None:
        self._timer = self._timer_callback = None
        if self._queue:  # the next request, pipelined: it waits for the answers before it
            self._arm(self.guard.settings.header_timeout_s, self._head_timed_out)
            return
        if self._head_bytes == 0:  # nothing sent: closed quietly, as an idle keep-alive connection is
            self._refused = True
            if self.transport is not None:
                self.transport.close()
            return
        self._refuse(
            408,
            f"the request line and headers did not arrive within "
            f"{self.guard.settings.header_timeout_s:g} s (--http-header-timeout-secs)",
        )

    def _body_check_delay(self) -> float:
        """Seconds until the body's next deadline: its idle time or its whole time, whichever comes first."""
        settings = self.guard.settings
        idle_end = self._last_read + settings.body_idle_timeout_s
        return max(0.0, min(idle_end, self._body_started + settings.body_timeout_s) - self.loop.time())

    def _check_body(self) -> None:
        self._timer = self._timer_callback = None
        settings, now = self.guard.settings, self.loop.time()
        if self._reading_paused:
            self._last_read = now  # the server does not read yet (pipelined): the client is not idle
        if now >= self._body_started + settings.body_timeout_s:
            self._refuse(
                408, f"the request body did not arrive within {settings.body_timeout_s:g} s (--http-body-timeout-secs)"
            )
        elif now >= self._last_read + settings.body_idle_timeout_s:
            self._refuse(
                408,
                f"no byte of the request body arrived for {settings.body_idle_timeout_s:g} s "
                "(--http-body-idle-timeout-secs)",
            )
        else:
            self._arm(self._body_check_delay(), self._check_body)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` (unless another answer is being written), then close only the sending
        side for a while: closing a socket that still has unread bytes resets the connection, and the
        client would lose the answer."""
        if self._closed():
            return
        self._refused = True
        self._disarm()
        for request in (self._parsing, *self._queue):
            if request is not None:
                self._release(request)
        if self._answering:  # the answer before it is being computed: the refusal follows it
            self._refusal_after = (status, message)
            if not self._reading_paused and self.transport is not None:
                self._reading_paused = True
                self.transport.pause_reading()
            return
        self._write_refusal(status, message)

    def _write_refusal(self, status: int, message: str) -> None:
        transport = self.transport
        assert transport is not None
        body = error_body(message)
        transport.write(
            _STATUS_LINES.get(status, f"HTTP/1.1 {status} \r\n".encode())
            + b"content-type: application/json\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        guard = self.guard
        if transport.can_write_eof() and guard.lingering < MAX_LINGERING:
            guard.lingering += 1
            self._lingering = True
            if self._reading_paused:
                self._reading_paused = False
                transport.resume_reading()  # read on, and drop, what the client still sends
            transport.write_eof()
            self.loop.call_later(REFUSED_LINGER_S, transport.close)
        else:
            transport.close()


def _serialised(answer: Answer, close: bool, with_body: bool = True) -> bytes:
    """The status line, the headers and the body (not for HEAD, whose Content-Length is the body's a
    GET would get): one write."""
    head = [
        _STATUS_LINES.get(answer.status) or f"HTTP/1.1 {answer.status} \r\n".encode(),
        b"content-type: ",
        answer.content_type.encode("latin-1"),
        b"\r\n",
    ]
    for name, value in answer.headers:
        head += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    head += (b"content-length: ", str(len(answer.body)).encode(), b"\r\n")
    if close:
        head.append(b"connection: close\r\n")
    head.append(b"\r\n")
    if with_body:
        head.append(answer.body)
    return b"".join(head)
