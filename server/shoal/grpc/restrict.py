"""Triton's ``--grpc-restricted-protocol``: RPC categories that need a header key and value.

    --grpc-restricted-protocol model-repository,statistics:admin-key=s3cret

As in Triton 2.51 (checked against the real server), the client sends the header with Triton's
prefix, ``triton-grpc-protocol-admin-key: s3cret``; a call in a restricted category without it
(or with another value) is refused with UNAVAILABLE and "This protocol is restricted, expecting
header 'triton-grpc-protocol-admin-key'" (``ErrorCode.PERMISSION_DENIED``, mapped as Triton answers).
``grpc.health.v1.Health`` (per-model status) falls under ``health``, as ModelReady does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

from shoal.errors import ErrorCode, ShoalError
from shoal.settings import Restriction

HEADER_PREFIX = "triton-grpc-protocol-"  # what Triton's gRPC endpoint expects before the configured key

CATEGORIES: dict[str, str] = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def restricted(category: str, handler: Callable[..., Any], restrictions: tuple[Restriction, ...]) -> Callable[..., Any]:
    """``handler`` behind the check for ``category``, or ``handler`` itself if unrestricted."""
    rules = [r for r in restrictions if category in r.categories]
    if not rules:
        return handler

    def check(context: grpc.aio.ServicerContext) -> None:
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        for rule in rules:
            header = HEADER_PREFIX + rule.key
            if metadata.get(header) != rule.value:
                message = f"This protocol is restricted, expecting header '{header}'"
                raise ShoalError(ErrorCode.PERMISSION_DENIED, message)

    if inspect.isasyncgenfunction(handler):

        async def checked_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            check(context)
            async for response in handler(requests, context):
                yield response

        return checked_stream

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        check(context)
        return await handler(request, context)

    return checked
