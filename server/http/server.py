"""Serve ``http.app`` with uvicorn (httptools) inside the event loop the process already runs.

Chosen by measuring (bench/http_stacks.py, README "HTTP/REST"): uvicorn's httptools protocol with
a raw ASGI application costs less server CPU per request than aiohttp's server here. The socket is
bound here, not by uvicorn: a port in use is a ``StartupError`` at once, port 0 gives the port the
kernel chose, and front-end workers share one port with SO_REUSEPORT. It is created with
IPPROTO_TCP, because asyncio sets TCP_NODELAY only on such sockets (without it, a keep-alive
client waits 40 ms on each answer sent in two writes). Signals stay with Shoal's loop: the server
is stopped by ``stop``, after the core has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shoal.errors import StartupError
from shoal.http.app import HttpApp
from shoal.http.status import error_body
from shoal.settings import HttpSettings

logger = logging.getLogger(__name__)

BACKLOG = 2048
KEEP_ALIVE_S = 75  # idle keep-alive connections: longer than load balancers' usual 60 s
START_TIMEOUT_S = 10.0
# A request's line and headers, at most: httptools keeps a header it is still reading in memory
# whole, so without a bound one endless header line grows the server until it runs out of memory.
MAX_HEAD_BYTES = 2**20
REFUSED_LINGER_S = 2.0  # a refused connection reads (and drops) what its client still sends, this long


class _BoundedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol that answers 431 and closes once a request's head passes
    ``MAX_HEAD_BYTES`` (counted per chunk received: at most one chunk more is read)."""

    _in_head = True
    _head_bytes = 0
    _refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what the client still sends after the 431 is dropped
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse()
                return
        super().data_received(data)

    def _refuse(self) -> None:
        """Answer 431, then close only the sending side for a while: closing a socket that still has
        unread bytes resets the connection, and the client would lose the answer."""
        self._refused = True
        body = error_body(f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0  # the next request's head, on a kept-alive connection
        super().on_message_complete()


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGINT and SIGTERM belong to Shoal's loop (app.serve), which stops this server itself


def bind(address: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket; StartupError if the port is taken (unless shared) or the address is not ours."""
    try:
        family, _, _, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                    flags=socket.AI_PASSIVE)[0]
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
        config = uvicorn.Config(
            self.app, http=_BoundedHead, ws="none", lifespan="off", interface="asgi3", access_log=False,
            log_config=None, server_header=False, proxy_headers=False, backlog=BACKLOG, timeout_keep_alive=KEEP_ALIVE_S,
            ssl_certfile=tls.server_cert if tls else None, ssl_keyfile=tls.server_key if tls else None,
            ssl_ca_certs=str(tls.root_cert) if tls and tls.root_cert else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.mutual else ssl.CERT_NONE,
        )
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
