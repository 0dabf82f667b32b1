"""Serve ``http.app`` over ``http.connection``'s HTTP/1.1 protocol in the event loop the process already runs.

The socket is bound here: a port in use is a ``StartupError`` at once, port 0 gives the port the
kernel chose, and front-end workers share one port with SO_REUSEPORT. It is created with
IPPROTO_TCP, because asyncio sets TCP_NODELAY only on such sockets (without it, a keep-alive
client waits 40 ms on each answer sent in two writes; uvloop sets it on every TCP socket). Signals
stay with Shoal's loop: the server is stopped by ``stop``, after the core has drained. The bounds
on reading a request and on connections are ``http.connection``'s. With TLS, the loop bounds the
handshake (60 s) before any of them starts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

from shoal.descriptors import open_file_limit
from shoal.errors import StartupError
from shoal.http.app import HttpApp
from shoal.http.connection import ConnectionGuard, HttpConnection
from shoal.settings import HttpSettings, TlsSettings

logger = logging.getLogger(__name__)

BACKLOG = 2048
DESCRIPTOR_SHARE = 2  # HTTP connections take at most 1/2 of the process's descriptors, whatever the option says


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


def tls_context(tls: TlsSettings) -> ssl.SSLContext:
    """The server's TLS: its certificate and key; with ``mutual``, clients must present one signed by ``root_cert``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tls.server_cert), str(tls.server_key))
    if tls.root_cert:
        context.load_verify_locations(str(tls.root_cert))
    context.verify_mode = ssl.CERT_REQUIRED if tls.mutual else ssl.CERT_NONE
    return context


class HttpServer:
    """The HTTP endpoint over one ``HttpApp``: ``start`` binds and serves, ``stop`` ends it."""

    def __init__(self, app: HttpApp, settings: HttpSettings, reuse_port: bool | None = None) -> None:
        self.app = app
        self.settings = settings
        self.reuse_port = settings.reuse_port if reuse_port is None else reuse_port
        self._server: asyncio.Server | None = None
        self._guard: ConnectionGuard | None = None

    async def start(self) -> int:
        """The bound port, once the server accepts connections."""
        sock = bind(self.settings.address, self.settings.port, self.reuse_port)
        port: int = sock.getsockname()[1]
        guard = ConnectionGuard(self.settings, connection_bound(self.settings.max_connections))
        try:
            context = tls_context(self.settings.tls) if self.settings.tls else None
            self._server = await asyncio.get_running_loop().create_server(
                lambda: HttpConnection(self.app, guard), sock=sock, backlog=BACKLOG, ssl=context
            )
        except (OSError, ssl.SSLError) as exc:  # SSLError is an OSError; named for the reader
            sock.close()
            why = f"{type(exc).__name__}: {exc}"
            raise StartupError(f"cannot serve HTTP on {self.settings.address}:{port}: {why}") from None
        self._guard = guard
        return port

    async def stop(self, grace_s: float) -> None:
        """Close the listener and idle connections; answers being computed get ``grace_s``, then the
        connections still open are cut."""
        if self._server is None or self._guard is None:
            return
        self._server.close()
        connections = self._guard.connections
        for connection in list(connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.1, grace_s)
        while connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(connections):
            if connection.transport is not None:
                connection.transport.abort()
        self._server = None
