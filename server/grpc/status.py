"""THE table from Shoal's error codes to gRPC status, and the guard every RPC runs under."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shoal.errors import ErrorCode, ShoalError, bounded, invalid
from shoal.protocol import wire_names

logger = logging.getLogger(__name__)

STATUS_BY_CODE: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.LOAD_FAILED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status and a bounded message for any exception; unexpected ones are logged once with traceback."""
    if isinstance(exc, ShoalError):
        return STATUS_BY_CODE[exc.code], bounded(exc.message)
    logger.error("unexpected error while serving an RPC", exc_info=exc)
    return grpc.StatusCode.INTERNAL, bounded(wire_names(f"internal error: {type(exc).__name__}: {exc}"))


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
