"""The one facade every transport calls: health, metadata, config, inference, index.

``Core`` is the interface: exactly what the transports (``grpc/``) call, in plain dataclasses and
numpy, with no gRPC or protobuf. Every call is a coroutine, so it can be answered here or in
another process. Two implementations, and the transports never know which they hold:

- ``core.local.LocalCore`` in the process that holds the models (the host);
- ``core.remote.RemoteCore`` in each front-end worker process, which forwards calls to the host
  over a ``dataplane`` channel (tensor bytes in shared memory); ``core.host.CoreHost`` answers them
  there with the host's ``LocalCore``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.dataplane.cuda import CudaRegionStatus
from shoal.dataplane.regions import RegionStatus
from shoal.lifecycle.state import IndexEntry, ModelState
from shoal.protocol.types import ModelMetadata, ServerMetadata, TensorMetadata
from shoal.request_types import InferRequest, InferResponse
from shoal.statistics import ModelStatistics
from shoal.tracing.trace import Origin

__all__ = [
    "Core",
    "CudaRegionStatus",
    "HealthSnapshot",
    "StreamedResponse",
    "IndexEntry",
    "ModelMetadata",
    "ModelState",
    "RegionStatus",
    "ServerMetadata",
    "StatisticsRow",
    "TensorMetadata",
]


@dataclass(frozen=True)
class StatisticsRow:
    name: str
    version: str
    statistics: ModelStatistics
    memory_bytes: dict[tuple[str, int], int]  # (CPU|GPU, device id) -> bytes
    pending: int  # requests queued, waiting for an executor
    instances: int
    cached: bool = False  # answered from the response cache when it can (Triton's nv_cache_* families)


@dataclass(frozen=True)
class StreamedResponse:
    """One response of a streaming inference: outputs, or an error (``error``), or neither (a bare
    FINAL flag). ``final``: the request's last response."""

    response: InferResponse | None
    final: bool
    error: str = ""
    trace_id: int = 0  # the trace its transport reports its send to (``Core.sent``); 0: none


@dataclass(frozen=True)
class HealthSnapshot:
    """What grpc.health.v1 reports, read in one call: the server's readiness and each model's."""

    ready: bool
    models: dict[str, bool]  # model name -> serving (a version is ready and the server accepts requests)


class Core(Protocol):
    """What a transport may ask of the server; errors are ``ShoalError`` with an ``ErrorCode``."""

    async def live(self) -> bool: ...

    async def ready(self) -> bool: ...

    async def health(self) -> HealthSnapshot: ...

    async def server_metadata(self) -> ServerMetadata: ...

    async def model_ready(self, name: str, version: str) -> bool: ...

    async def model_metadata(self, name: str, version: str) -> ModelMetadata: ...

    async def model_config(self, name: str, version: str) -> dict[str, Any]: ...

    # Whether the model streams its responses (zero or more, then FINAL): ``infer`` refuses it with
    # ``errors.DecoupledRefused``, ``infer_stream`` serves it.
    async def model_decoupled(self, name: str, version: str) -> bool: ...

    # ``origin``: where the transport got it (for tracing: its receive time, the client's trace context).
    async def infer(self, request: InferRequest, origin: Origin | None = None) -> InferResponse: ...

    # A decoupled model's zero or more responses as it sends them, the last one final; any other
    # model's one response, final. A failure before the model ran raises, as ``infer`` does.
    def infer_stream(self, request: InferRequest, origin: Origin | None = None) -> AsyncIterator[StreamedResponse]: ...

    # A traced request's response (one whose ``trace_id`` is not 0) was written between ``started_ns``
    # and ``ended_ns`` (``time.monotonic_ns``; 0: it was not written); ``last``: the request's last
    # response. The transport that got the request with an ``origin`` reports each such response, in
    # every case (written, failed, abandoned): its trace is exported then.
    def sent(self, trace_id: int, started_ns: int, ended_ns: int, last: bool = True) -> None: ...

    async def model_statistics(self, name: str, version: str) -> list[StatisticsRow]: ...

    async def repository_index(self, ready_only: bool = False) -> list[IndexEntry]: ...

    async def load_model(self, name: str, config_override: dict[str, Any] | None) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None: ...

    async def unregister_system_shared_memory(self, name: str) -> None: ...  # "": every region

    async def system_shared_memory_status(self, name: str) -> list[RegionStatus]: ...  # "": every region

    # raw_handle: the 64 bytes of the client's cudaIpcMemHandle_t
    async def register_cuda_shared_memory(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int
    ) -> None: ...

    async def unregister_cuda_shared_memory(self, name: str) -> None: ...  # "": every CUDA region

    async def cuda_shared_memory_status(self, name: str) -> list[CudaRegionStatus]: ...  # "": every CUDA region

    # Triton's trace extension: one model's settings ("": the global ones), as Triton answers them.
    async def trace_settings(self, model: str) -> dict[str, list[str] | str]: ...

    # ``changes``: each named setting's values, None to clear it (shoal.tracing.settings).
    async def update_trace_settings(self, model: str, changes: dict[str, list[str] | None]) -> dict[str, Any]: ...

    # Triton's logging extension: every setting by its name (shoal.logs), for every process of the server.
    async def log_settings(self) -> dict[str, Any]: ...

    # Only the settings named change; a bad one is INVALID_ARGUMENT and changes nothing.
    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]: ...
