"""THE table from Shoal's error codes to gRPC status, and the guard every RPC runs under."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from server.errors import ErrorCode, ShoalError

logger = logging.getLogger(__name__)

STATUS_BY_CODE: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.LOAD_FAILED: grpc.StatusCode.UNAVAILABLE,
}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status and message for any exception; unexpected ones are logged once with traceback."""
    if isinstance(exc, ShoalError):
        return STATUS_BY_CODE[exc.code], exc.message
    logger.error("unexpected error while serving an RPC", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


UnaryHandler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamHandler = Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]


def guard_unary(handler: UnaryHandler) -> UnaryHandler:
    @functools.wraps(handler)
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a clean status
            code, message = to_status(exc)
        await context.abort(code, message)

    guarded.__shoal_guarded__ = True  # type: ignore[attr-defined]
    return guarded


def guard_stream(handler: StreamHandler) -> StreamHandler:
    @functools.wraps(handler)
    async def guarded(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in handler(requests, context):
                yield response
            return
        except Exception as exc:  # noqa: BLE001
            code, message = to_status(exc)
        await context.abort(code, message)

    guarded.__shoal_guarded__ = True  # type: ignore[attr-defined]
    return guarded
