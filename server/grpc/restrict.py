"""Triton's ``--grpc-restricted-protocol``: RPC categories that need a header key and value.

    --grpc-restricted-protocol model-repository,statistics:admin-key=s3cret

A call in a restricted category without that metadata is refused with PERMISSION_DENIED.
``grpc.health.v1.Health`` (per-model status) falls under ``health``, as ModelReady does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

from shoal.errors import ErrorCode, ShoalError
from shoal.settings import Restriction

CATEGORIES: dict[str, str] = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config", "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


def restricted(
    category: str, handler: Callable[..., Any], restrictions: tuple[Restriction, ...]
) -> Callable[..., Any]:
    """``handler`` behind the check for ``category``, or ``handler`` itself if unrestricted."""
    rules = [r for r in restrictions if category in r.categories]
    if not rules:
        return handler

    def check(context: grpc.aio.ServicerContext) -> None:
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        for rule in rules:
            if metadata.get(rule.key) != rule.value:
                message = f"this protocol is restricted, expecting header '{rule.key}'"
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
