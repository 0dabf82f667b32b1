"""The ASGI application: route, check the restriction, read the body, one handler, answer.

Everything a handler needs is done here once for every endpoint: the path and method are matched
(404 and 405 otherwise, in Triton's words), ``--http-restricted-api`` is enforced (403), the body
is read up to ``max_body_bytes`` (413 past it, checked against Content-Length before reading) and
decompressed (``Content-Encoding`` gzip or deflate, bounded the same way; others 501, as Triton),
the bodies being received at once are bounded by ``max_pending_body_bytes`` (503 past it: without
it, slow uploads on many connections could hold up to 64 MiB each),
and a successful inference answer is compressed when its request accepts it (``Accept-Encoding``),
as Triton's is; no other answer ever is. Every failure,
expected or not, becomes Triton's ``{"error": "..."}`` with the status from ``http.status``.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.core import Core
from shoal.errors import ErrorCode, ShoalError
from shoal.http.handlers import ROUTES, Handler, Reply, Request
from shoal.http.status import HttpError, error_body, to_http
from shoal.off_loop import OFF_LOOP_BYTES, OFF_LOOP_COMPRESS_BYTES
from shoal.settings import HttpSettings, Restriction

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_WBITS = {"gzip": 31, "deflate": 15, "x-gzip": 31}  # zlib's window bits: 31 reads the gzip wrapper, 15 zlib's
# Compressing costs ~65 ms per MiB at level 6: past 16 KiB (~1 ms, off_loop.OFF_LOOP_COMPRESS_BYTES) it
# runs on a worker thread.
COMPRESS_LEVEL = 6
_MAX_INFLATION = 1032  # deflate's largest ratio: what a compressed body can grow to, at most


class HttpApp:
    """Triton's HTTP API over ``core``; the same object serves in the host and in front-end workers."""

    def __init__(
        self,
        core: Core,
        max_body_bytes: int,
        restrictions: tuple[Restriction, ...] = (),
        max_pending_body_bytes: int = HttpSettings.max_pending_body_bytes,
        encoded_bytes: bool = False,
    ) -> None:
        self.core = core
        self.encoded_bytes = encoded_bytes  # see handlers.Request
        self.max_body_bytes = max_body_bytes
        self.restrictions = restrictions
        self.max_pending_body_bytes = max_pending_body_bytes
        self._pending_body_bytes = 0  # of the bodies being received now: their Content-Length, or what came

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        started_ns = time.monotonic_ns()  # the head was parsed: a traced request's HTTP_RECV_START
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            handler, path, category = route(scope["method"], scope["path"])
            self._check_restriction(category, headers)
            body = await self._read_body(receive, headers)
            reply = await handler(self.core, Request(path, headers, body, self.encoded_bytes, started_ns))
        except Exception as exc:  # noqa: BLE001 - every failure becomes Triton's error body
            status, message = to_http(exc)
            reply = Reply(status=status, body=error_body(message))
        if not reply.trace_id:
            await _send(send, reply, headers.get("accept-encoding", ""))
            return
        sending_ns, sent_ns = time.monotonic_ns(), 0  # a traced answer: its send is reported, however it ends
        try:
            await _send(send, reply, headers.get("accept-encoding", ""))
            sent_ns = time.monotonic_ns()
        finally:
            self.core.sent(reply.trace_id, sending_ns, sent_ns)

    def _check_restriction(self, category: str, headers: dict[str, str]) -> None:
        for rule in self.restrictions:
            if category in rule.categories and headers.get(rule.key) != rule.value:
                raise ShoalError(ErrorCode.PERMISSION_DENIED, f"This API is restricted, expecting header '{rule.key}'")

    async def _read_body(self, receive: Receive, headers: dict[str, str]) -> bytes:
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        reserved = self._reserve(int(declared) if declared.isdigit() else 0)
        try:
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise HttpError(400, "the client closed the connection before sending the whole request")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise self._too_large(size)
                if size > reserved:  # no Content-Length (chunked), or more than it said
                    reserved += self._reserve(size - reserved)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        finally:
            self._pending_body_bytes -= reserved
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding == "identity" or not body:
            return body
        if encoding not in _WBITS:
            raise HttpError(501, "Unsupported compression type")
        if len(body) * _MAX_INFLATION > OFF_LOOP_BYTES:  # a few KiB can inflate to many MiB
            return await asyncio.to_thread(self._decompress, body, encoding)
        return self._decompress(body, encoding)

    def _reserve(self, size: int) -> int:
        """Count ``size`` more bytes of bodies being received; 503 past the bound, unless nothing else
        is being received (one body up to ``max_body_bytes`` is always taken)."""
        if self._pending_body_bytes and self._pending_body_bytes + size > self.max_pending_body_bytes:
            raise ShoalError(
                ErrorCode.UNAVAILABLE,
                (
                    f"the server is receiving {self._pending_body_bytes} bytes of request bodies already, and "
                    f"{size} more would pass its limit of {self.max_pending_body_bytes} "
                    "(--http-max-pending-body-mb); try again later"
                ),
            )
        self._pending_body_bytes += size
        return size

    def _decompress(self, body: bytes, encoding: str) -> bytes:
        """At most ``max_body_bytes`` out, so a small compressed body cannot take the server's memory."""
        decompressor = zlib.decompressobj(_WBITS[encoding])
        try:
            data = decompressor.decompress(body, self.max_body_bytes + 1)
        except zlib.error as exc:
            raise HttpError(400, f"the request body is not valid {encoding} data: {exc}") from None
        if len(data) > self.max_body_bytes:
            raise self._too_large(len(data), decompressed=True)
        if not decompressor.eof:
            raise HttpError(400, f"the request body is not valid {encoding} data: it ends early")
        if decompressor.unused_data:  # Triton ignores them; they could be a second body, or data lost
            raise HttpError(
                400,
                f"the request body is not valid {encoding} data: "
                f"{len(decompressor.unused_data)} bytes follow the end of the compressed data",
            )
        return data

    def _too_large(self, size: int, decompressed: bool = False) -> HttpError:
        what = "decompressed request body" if decompressed else "request body"
        return HttpError(
            413,
            f"the {what} of {size} bytes or more exceeds the maximum allowed value of "
            f"{self.max_body_bytes} bytes; use --http-max-input-size to increase the limit",
        )


def route(method: str, path: str) -> tuple[Handler, dict[str, str], str]:
    """The handler, the path's named parts and the restriction category; 404 or 405 as Triton words them."""
    allowed = False
    for pattern, methods, handler, category in ROUTES:
        found = pattern.fullmatch(path)
        if found is None:
            continue
        if method in methods.split("|"):
            return handler, {k: v for k, v in found.groupdict().items() if v is not None}, category
        allowed = True
    if allowed:
        raise HttpError(405, "Method Not Allowed")
    raise HttpError(404, "Not Found")


def _accepted_encoding(accept: str) -> str | None:
    """gzip or deflate if the client prefers one, else None (identity), as Triton's
    CompressionTypeUsed: the highest weight above 0 wins, the first listed among equals."""
    chosen, best = "identity", 0.0
    for item in accept.lower().split(","):
        name, _, weight = item.partition(";")
        quality = weight.strip().removeprefix("q=").strip() if weight.strip().startswith("q=") else "1"
        try:
            value = float(quality)
        except ValueError:
            continue  # a malformed weight: that coding is not offered
        if name.strip() in ("identity", "gzip", "deflate") and value > best:  # nan is never > best
            chosen, best = name.strip(), value
    return None if chosen == "identity" else chosen


def _compress(body: bytes, encoding: str) -> bytes:
    """zlib's default level, as Triton's: gzip's own default (9) took ~0.18 s for 1 MiB of JSON."""
    if encoding == "gzip":
        return gzip.compress(body, compresslevel=COMPRESS_LEVEL)
    return zlib.compress(body, COMPRESS_LEVEL)


async def _send(send: Send, reply: Reply, accept: str) -> None:
    body = reply.body
    headers = [(b"content-type", reply.content_type.encode())]
    headers += [(name.encode(), value.encode()) for name, value in reply.headers.items()]
    encoding = _accepted_encoding(accept) if accept and body and reply.compressible else None
    if encoding is not None:
        if len(body) > OFF_LOOP_COMPRESS_BYTES:
            body = await asyncio.to_thread(_compress, body, encoding)
        else:
            body = _compress(body, encoding)
        headers.append((b"content-encoding", encoding.encode()))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
