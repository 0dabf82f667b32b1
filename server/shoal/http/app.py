"""The HTTP application: route, check the restriction, decompress the body, one handler, answer.

``http.connection`` reads a request (its body bounded by ``max_body_bytes`` there) and hands it to
``HttpApp.respond``. Everything a handler needs is done here once for every endpoint: the path and
method are matched (404 and 405 otherwise, in Triton's words), ``--http-restricted-api`` is
enforced (403), the body is decompressed (``Content-Encoding`` gzip or deflate, bounded by
``max_body_bytes`` too; others 501, as Triton), and a successful inference answer is compressed
when its request accepts it (``Accept-Encoding``), as Triton's is; no other answer ever is. Every
failure, expected or not, becomes Triton's ``{"error": "..."}`` with the status from ``http.status``.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from dataclasses import dataclass

from shoal.core import Core
from shoal.errors import ErrorCode, ShoalError
from shoal.http.handlers import ROUTES, Handler, Reply, Request
from shoal.http.status import HttpError, error_body, to_http
from shoal.off_loop import OFF_LOOP_BYTES, OFF_LOOP_COMPRESS_BYTES
from shoal.settings import Restriction

_WBITS = {"gzip": 31, "deflate": 15, "x-gzip": 31}  # zlib's window bits: 31 reads the gzip wrapper, 15 zlib's
# Compressing costs ~65 ms per MiB at level 6: past 16 KiB (~1 ms, off_loop.OFF_LOOP_COMPRESS_BYTES) it
# runs on a worker thread.
COMPRESS_LEVEL = 6
_MAX_INFLATION = 1032  # deflate's largest ratio: what a compressed body can grow to, at most


@dataclass(slots=True)
class Answer:
    """What ``respond`` answers: the connection writes it as one HTTP/1.1 response (one request's, never
    shared: see ``http.handlers.Request``)."""

    status: int
    content_type: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    trace_id: int = 0  # a traced inference's: ``sent`` reports its send to the core
    sending_ns: int = 0  # when its encoding began (a traced answer's HTTP_SEND_START)


class HttpApp:
    """Triton's HTTP API over ``core``; the same object serves in the host and in front-end workers."""

    def __init__(
        self,
        core: Core,
        max_body_bytes: int,
        restrictions: tuple[Restriction, ...] = (),
        encoded_bytes: bool = False,
    ) -> None:
        self.core = core
        self.encoded_bytes = encoded_bytes  # see handlers.Request
        self.max_body_bytes = max_body_bytes
        self.restrictions = restrictions

    async def respond(self, method: str, path: str, headers: dict[str, str], body: bytes, started_ns: int) -> Answer:
        """The answer to one request (``headers``' names in lower case; ``started_ns``: when its head was read)."""
        try:
            handler, parts, category = route(method, path)
            self._check_restriction(category, headers)
            if body and "content-encoding" in headers:
                body = await self._decoded(body, headers)
            reply = await handler(self.core, Request(parts, headers, body, self.encoded_bytes, started_ns))
        except Exception as exc:  # noqa: BLE001 - every failure becomes Triton's error body
            status, message = to_http(exc)
            reply = Reply(status=status, body=error_body(message))
        sending_ns = time.monotonic_ns() if reply.trace_id else 0
        accept = headers.get("accept-encoding", "")
        encoding = _accepted_encoding(accept) if accept and reply.body and reply.compressible else None
        if encoding is None:  # the usual answer: written as the handler made it
            return Answer(
                reply.status, reply.content_type, tuple(reply.headers.items()), reply.body, reply.trace_id, sending_ns
            )
        try:
            return await _compressed(reply, encoding, sending_ns)
        except BaseException as exc:
            if reply.trace_id:  # its answer is lost: the trace ends without the response's send
                self.core.sent(reply.trace_id, sending_ns, 0)
            if not isinstance(exc, Exception):
                raise
            status, message = to_http(exc)
            return Answer(status, "application/json", (), error_body(message))

    def sent(self, answer: Answer, sent_ns: int) -> None:
        """A traced answer was written (``sent_ns``), or could not be (0): its trace ends."""
        self.core.sent(answer.trace_id, answer.sending_ns, sent_ns)

    def _check_restriction(self, category: str, headers: dict[str, str]) -> None:
        for rule in self.restrictions:
            if category in rule.categories and headers.get(rule.key) != rule.value:
                raise ShoalError(ErrorCode.PERMISSION_DENIED, f"This API is restricted, expecting header '{rule.key}'")

    async def _decoded(self, body: bytes, headers: dict[str, str]) -> bytes:
        encoding = headers["content-encoding"].strip().lower()
        if encoding == "identity":
            return body
        if encoding not in _WBITS:
            raise HttpError(501, "Unsupported compression type")
        if len(body) * _MAX_INFLATION > OFF_LOOP_BYTES:  # a few KiB can inflate to many MiB
            return await asyncio.to_thread(self._decompress, body, encoding)
        return self._decompress(body, encoding)

    def _decompress(self, body: bytes, encoding: str) -> bytes:
        """At most ``max_body_bytes`` out, so a small compressed body cannot take the server's memory."""
        decompressor = zlib.decompressobj(_WBITS[encoding])
        try:
            data = decompressor.decompress(body, self.max_body_bytes + 1)
        except zlib.error as exc:
            raise HttpError(400, f"the request body is not valid {encoding} data: {exc}") from None
        if len(data) > self.max_body_bytes:
            raise HttpError(413, too_large(len(data), self.max_body_bytes, decompressed=True))
        if not decompressor.eof:
            raise HttpError(400, f"the request body is not valid {encoding} data: it ends early")
        if decompressor.unused_data:  # Triton ignores them; they could be a second body, or data lost
            raise HttpError(
                400,
                f"the request body is not valid {encoding} data: "
                f"{len(decompressor.unused_data)} bytes follow the end of the compressed data",
            )
        return data


def too_large(size: int, bound: int, decompressed: bool = False) -> str:
    """413's message, in Triton's words."""
    what = "decompressed request body" if decompressed else "request body"
    return (
        f"the {what} of {size} bytes or more exceeds the maximum allowed value of "
        f"{bound} bytes; use --http-max-input-size to increase the limit"
    )


def route(method: str, path: str) -> tuple[Handler, dict[str, str], str]:
    """The handler, the path's named parts and the restriction category; 404 or 405 as Triton words them."""
    allowed = False
    for pattern, methods, handler, category in ROUTES:
        found = pattern.fullmatch(path)
        if found is None:
            continue
        if method in methods:
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


async def _compressed(reply: Reply, encoding: str, sending_ns: int) -> Answer:
    """``reply`` compressed as its request accepts (``encoding``: gzip or deflate)."""
    body = reply.body
    if len(body) > OFF_LOOP_COMPRESS_BYTES:
        body = await asyncio.to_thread(_compress, body, encoding)
    else:
        body = _compress(body, encoding)
    headers = (*reply.headers.items(), ("content-encoding", encoding))
    return Answer(reply.status, reply.content_type, headers, body, reply.trace_id, sending_ns)
