"""Serve ``http.app`` with uvicorn (httptools) inside the event loop the process already runs.

Chosen by measuring (bench/http_stacks.py, docs/http.md): uvicorn's httptools protocol with
a raw ASGI application costs less server CPU per request than aiohttp's server here. The socket is
bound here, not by uvicorn: a port in use is a ``StartupError`` at once, port 0 gives the port the
kernel chose, and front-end workers share one port with SO_REUSEPORT. It is created with
IPPROTO_TCP, because asyncio sets TCP_NODELAY only on such sockets (without it, a keep-alive
client waits 40 ms on each answer sent in two writes). Signals stay with Shoal's loop: the server
is stopped by ``stop``, after the core has drained.

uvicorn bounds only the idle time between requests; ``_Guarded`` bounds reading a request the way
a reverse proxy in front of it would (defaults in ``HttpSettings``, each a ``--http-*`` option):
the line and headers within 30 s of the first byte or the accept (nginx's client_header_timeout
is 60 s, Apache's mod_reqtimeout 20-40 s, HAProxy's usual ``timeout http-request`` 10 s: headers
are a few hundred bytes); the body with no byte for 60 s (nginx's client_body_timeout, which is
also counted between reads) and whole within 300 s (Node.js's requestTimeout: 64 MiB at 220 kB/s);
an idle kept-alive connection 75 s (nginx's keepalive_timeout, longer than load balancers' usual
60 s so that the balancer closes first); and 4,096 open connections per process (nginx's
worker_connections is 512 per worker; past the bound a 503 at once). Without them, 3,000
connections that sent half a request stayed open, and 1,100 took every descriptor of a process at
a soft limit of 1,024. With TLS, asyncio bounds the handshake (60 s) before any of this starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shoal.descriptors import open_file_limit
from shoal.errors import StartupError
from shoal.http.app import HttpApp
from shoal.http.status import error_body
from shoal.settings import HttpSettings

logger = logging.getLogger(__name__)

BACKLOG = 2048
START_TIMEOUT_S = 10.0
# A request's line and headers, at most: httptools keeps a header it is still reading in memory
# whole, so without a bound one endless header line grows the server until it runs out of memory.
MAX_HEAD_BYTES = 2**20
REFUSED_LINGER_S = 2.0  # a refused connection reads (and drops) what its client still sends, this long
MAX_LINGERING = 256  # refused connections lingering at once; past it one is closed at once (its answer may be lost)
REFUSALS_LOG_INTERVAL_S = 60.0
DESCRIPTOR_SHARE = 2  # HTTP connections take at most 1/2 of the process's descriptors, whatever the option says


@dataclass
class _Guard:
    """What the connections of one server share: its limits, how many refused ones still linger,
    and the refusals not yet reported (at most one line per ``REFUSALS_LOG_INTERVAL_S``)."""

    settings: HttpSettings
    max_connections: int
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


class _GuardedConfig(uvicorn.Config):
    """uvicorn's configuration, carrying the ``_Guard`` to each connection's protocol."""

    def __init__(self, app: HttpApp, guard: _Guard, **options: Any) -> None:
        super().__init__(app, **options)
        self.guard = guard


class _Guarded(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds a reverse proxy would put in front of it.

    uvicorn bounds only the idle time between requests (``timeout_keep_alive``, armed once an
    answer is sent). This adds: the number of open connections (503 at once past it, before the
    client sends anything, so no handler ever runs); the time to send a request's line and headers
    and their size (408, 431); and the time to send its body, both without a byte and in all (408).
    Refusals are Triton's ``{"error": ...}`` bodies, sent with ``connection: close``.
    """

    _in_head = True  # reading a request's line and headers (or waiting for the next request's)
    _head_bytes = 0
    _refused = False
    _lingering = False
    _timer: asyncio.TimerHandle | None = None
    _body_started = 0.0  # loop time when the headers were complete
    _last_read = 0.0  # loop time of the last bytes received

    @property
    def _guard(self) -> _Guard:
        return cast(_GuardedConfig, self.config).guard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        guard = self._guard
        if len(self.connections) >= guard.max_connections:
            self.transport = transport  # uvicorn's state stays unset: this connection is never served
            guard.count_refusal(self.loop.time())
            self._refuse(
                503,
                f"the server has {guard.max_connections} open HTTP connections, the most it serves "
                "(--http-max-connections); try again later",
            )
            return
        super().connection_made(transport)
        self._arm(guard.settings.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingering:
            self._lingering = False
            self._guard.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what the client still sends after a refusal is dropped
        self._last_read = self.loop.time()
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
                return
        super().data_received(data)
        if self._timer is None and not self._refused and not self.transport.is_closing():
            self._arm_for_the_rest()

    def _arm_for_the_rest(self) -> None:
        """A deadline for what this request has still to send, if anything: most requests come whole in
        one read, and arm no timer at all."""
        if not self._in_head:
            self._arm(self._body_check_delay(), self._check_body)
        elif self._head_bytes:  # part of the next request's head, on a kept-alive connection
            self._arm(self._guard.settings.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        self._body_started = self.loop.time()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0  # the next request's head, on a kept-alive connection
        self._disarm()
        super().on_message_complete()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.cycle is not None and not self.cycle.response_complete:  # the next request, pipelined
            self._arm(self._guard.settings.header_timeout_s, self._head_timed_out)  # waits for this answer
            return
        if self._head_bytes == 0:  # nothing sent: closed quietly, as an idle keep-alive connection is
            self._refused = True
            self.transport.close()
            return
        self._refuse(
            408,
            f"the request line and headers did not arrive within "
            f"{self._guard.settings.header_timeout_s:g} s (--http-header-timeout-secs)",
        )

    def _body_check_delay(self) -> float:
        """Seconds until the body's next deadline: its idle time or its whole time, whichever comes first."""
        settings = self._guard.settings
        idle_end = self._last_read + settings.body_idle_timeout_s
        return max(0.0, min(idle_end, self._body_started + settings.body_timeout_s) - self.loop.time())

    def _check_body(self) -> None:
        self._timer = None
        settings, now = self._guard.settings, self.loop.time()
        if self.flow.read_paused:
            self._last_read = now  # the application has not taken what was read: the client is not idle
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
        self._refused = True
        self._disarm()
        if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
            body = error_body(message)
            self.transport.write(
                f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()
                + b"content-type: application/json\r\nconnection: close\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
        guard = self._guard
        if self.transport.can_write_eof() and guard.lingering < MAX_LINGERING:
            guard.lingering += 1
            self._lingering = True
            self.transport.write_eof()
            self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
        else:
            self.transport.close()


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGINT and SIGTERM belong to Shoal's loop (app.serve), which stops this server itself


def bind(address: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket; StartupError if the port is taken (unless shared) or the address is not ours."""
    try:
        family, _, _, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise StartupError(f"cannot serve HTTP on {address}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(where)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot serve HTTP on {address}:{port}: {exc.strerror} (another server?)") from None
    sock.setblocking(False)
    return sock


def connection_bound(wanted: int) -> int:
    """``wanted``, or less if the process's descriptors are few: HTTP leaves most of them to gRPC,
    models and shared memory, so a flood of connections to one endpoint does not stop the others."""
    limit = open_file_limit()
    if limit is None or wanted <= limit // DESCRIPTOR_SHARE:
        return wanted
    bound = max(1, limit // DESCRIPTOR_SHARE)
    logger.warning(
        "--http-max-connections %d lowered to %d: this process may open %d descriptors, and HTTP takes "
        "at most 1/%d of them",
        wanted,
        bound,
        limit,
        DESCRIPTOR_SHARE,
    )
    return bound


class HttpServer:
    """The HTTP endpoint over one ``HttpApp``: ``start`` binds and serves, ``stop`` ends it."""

    def __init__(self, app: HttpApp, settings: HttpSettings, reuse_port: bool | None = None) -> None:
        self.app = app
        self.settings = settings
        self.reuse_port = settings.reuse_port if reuse_port is None else reuse_port
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """The bound port, once the server accepts connections."""
        sock = bind(self.settings.address, self.settings.port, self.reuse_port)
        port: int = sock.getsockname()[1]
        tls = self.settings.tls
        config = _GuardedConfig(
            self.app,
            _Guard(self.settings, connection_bound(self.settings.max_connections)),
            http=_Guarded,
            ws="none",
            lifespan="off",
            interface="asgi3",
            access_log=False,
            log_config=None,
            server_header=False,
            proxy_headers=False,
            backlog=BACKLOG,
            ssl_certfile=tls.server_cert if tls else None,
            ssl_keyfile=tls.server_key if tls else None,
            ssl_ca_certs=str(tls.root_cert) if tls and tls.root_cert else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.mutual else ssl.CERT_NONE,
        )
        config.timeout_keep_alive = self.settings.keep_alive_timeout_s  # type: ignore[assignment]  # call_later's
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start and stop lines: ours say it
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done() or asyncio.get_running_loop().time() > deadline:
                sock.close()
                failed = self._task.done() and not self._task.cancelled() and self._task.exception()
                why = f"{type(failed).__name__}: {failed}" if failed else "the server did not start"
                self._task.cancel()
                self._server = self._task = None  # nothing to stop
                raise StartupError(f"cannot serve HTTP on {self.settings.address}:{port}: {why}")
            await asyncio.sleep(0.005)
        return port

    async def stop(self, grace_s: float) -> None:
        """Close the listener and idle connections; answers being written get ``grace_s``."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(0.1, grace_s)  # type: ignore[assignment]
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=grace_s + 1.0)
        except TimeoutError:
            self._task.cancel()
