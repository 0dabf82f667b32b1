"""THE table from Shoal's error codes to gRPC status, and the guard every RPC runs under."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shoal.errors import ErrorCode, ShoalError, bounded, internal_error, invalid
from shoal.protocol import wire_names

logger = logging.getLogger(__name__)

STATUS_BY_CODE: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.MODEL_NOT_FOUND: grpc.StatusCode.NOT_FOUND,  # as Triton 2.51's gRPC answers an unknown model
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.LOAD_FAILED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.UNAVAILABLE,  # Triton's answer to a restricted call
}


SHUTTING_DOWN = "the server is shutting down"


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status and a bounded message for any exception; unexpected ones are logged once with traceback.

    grpc's own errors (``grpc.aio.BaseError``) that reach a handler come from reading its requests:
    the server stopped under the RPC (``Server already stopped.``: a stream still sending as the
    server shuts down) or the RPC is already over. That is UNAVAILABLE, as Triton's clients expect of
    a server going away, and no server error.
    """
    if isinstance(exc, ShoalError):
        return STATUS_BY_CODE[exc.code], bounded(exc.message)
    if isinstance(exc, grpc.aio.BaseError) and not isinstance(exc, grpc.aio.AbortError):
        logger.debug("an RPC ended as grpc stopped serving it: %s: %s", type(exc).__name__, exc)
        return grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN
    return grpc.StatusCode.INTERNAL, internal_error(exc, "serving an RPC")


# grpc's aio server logs here, among others, an answer it failed to send.
GRPC_SERVER_LOGGER = "grpc._cython.cygrpc"
_NOT_SENT = re.compile(r"ExecuteBatchError raised in core by servicer method \[(?P<method>[^\]]*)\]")


class AnswerNotSentFilter(logging.Filter):
    """One debug line instead of grpc's traceback for an answer the client was no longer there to take.

    When a client cancels, its deadline passes or its connection closes, grpc's aio server cancels
    the RPC quietly (a debug line, "RPC cancelled"), but only once it has seen the cancellation: an
    answer (a response, an error status, a stream message) sent in the moment before fails in grpc
    core, and grpc logs that ``ExecuteBatchError`` at ERROR with a traceback (``_handle_exceptions``
    in its ``aio/server.pyx.pxi``). About one cancelled call in a few hundred hit that window, more on
    a loaded host. Nothing was wrong on the server's side, so such a record becomes the debug line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        found = _NOT_SENT.fullmatch(record.getMessage())
        if found is None or type(error).__name__ != "ExecuteBatchError":
            return True
        record.msg, record.args = (
            "%s: the answer was not sent: the client cancelled, its deadline passed or it disconnected",
            (found["method"],),
        )
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info, record.exc_text = None, None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_answers_not_sent() -> None:
    """Install ``AnswerNotSentFilter`` on grpc's server logger (once per process)."""
    grpc_logger = logging.getLogger(GRPC_SERVER_LOGGER)
    if not any(isinstance(f, AnswerNotSentFilter) for f in grpc_logger.filters):
        grpc_logger.addFilter(AnswerNotSentFilter())


UnaryHandler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamHandler = Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]


def parse(request_type: Any, raw: bytes) -> Any:
    """Decode a request inside the guard, so a malformed message is INVALID_ARGUMENT, not UNKNOWN.
    The message names the type as Triton's users know it (``inference.ModelInferRequest``)."""
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise invalid(wire_names(f"malformed {request_type.DESCRIPTOR.full_name} message: {exc}")) from exc


def guard_unary(handler: UnaryHandler, request_type: Any) -> Callable[[bytes, Any], Awaitable[Any]]:
    """Wrap a unary RPC: the request arrives as bytes and every failure becomes a clean status."""

    @functools.wraps(handler)
    async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(parse(request_type, raw), context)
        except grpc.aio.AbortError:
            raise  # the handler chose its status itself
        except Exception as exc:  # noqa: BLE001 - every failure becomes a clean status
            code, message = to_status(exc)
        finally:
            # The abort below raises an exception whose traceback holds this frame until the
            # cyclic collector runs: the request's bytes must not be in it.
            del raw
        await context.abort(code, message)

    guarded.__shoal_guarded__ = True  # type: ignore[attr-defined]
    return guarded


def guard_stream(handler: StreamHandler, request_type: Any) -> Callable[[Any, Any], AsyncIterator[Any]]:
    """Wrap a bidirectional-streaming RPC the same way; a malformed message ends the stream."""

    async def parsed(raw_requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for raw in raw_requests:
            yield parse(request_type, raw)

    @functools.wraps(handler)
    async def guarded(raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in handler(parsed(raw_requests), context):
                yield response
            return
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            code, message = to_status(exc)
        await context.abort(code, message)

    guarded.__shoal_guarded__ = True  # type: ignore[attr-defined]
    return guarded
