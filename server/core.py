"""The one facade every transport calls: health, metadata, config, inference, index.

``Core`` is the interface: exactly what the transports (``grpc/``, ``metrics``) and the wiring
(``app``) call, in plain dataclasses and numpy, with no gRPC or protobuf. ``LocalCore`` is its
implementation in the process that holds the models; a remote one (a front-end worker talking to
that process) can satisfy the same interface later, and the transports stay the same code.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from shoal import __version__
from shoal.errors import ErrorCode, ShoalError
from shoal.lifecycle.manager import IndexEntry, ModelManager
from shoal.lifecycle.state import ModelState
from shoal.protocol.types import ModelMetadata, ServerMetadata, TensorMetadata
from shoal.statistics import ModelStatistics
from shoal.types import InferRequest, InferResponse

__all__ = [
    "Core", "IndexEntry", "LocalCore", "ModelMetadata", "ModelState", "ServerMetadata", "StatisticsRow",
    "TensorMetadata",
]

SERVER_NAME = "shoal"
# Only what is implemented end to end; clients gate features on these strings.
EXTENSIONS = (
    "model_configuration",
    "statistics",
    "schedule_policy",
    "model_repository",
    "model_repository(unload_dependents)",
    "classification",
)


@dataclass(frozen=True)
class StatisticsRow:
    name: str
    version: str
    statistics: ModelStatistics
    memory_bytes: dict[tuple[str, int], int]  # (CPU|GPU, device id) -> bytes
    pending: int  # requests queued, waiting for an executor
    instances: int


class Core(Protocol):
    """What a transport may ask of the server; errors are ``ShoalError`` with an ``ErrorCode``."""

    def live(self) -> bool: ...

    def ready(self) -> bool: ...

    @property
    def accepting(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    def stop_accepting(self) -> None: ...

    async def drain(self, timeout_s: float) -> bool: ...

    def server_metadata(self) -> ServerMetadata: ...

    def model_names(self) -> list[str]: ...

    def model_ready(self, name: str, version: str) -> bool: ...

    def model_metadata(self, name: str, version: str) -> ModelMetadata: ...

    def model_config(self, name: str, version: str) -> dict[str, Any]: ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def model_statistics(self, name: str, version: str) -> list[StatisticsRow]: ...

    def repository_index(self, ready_only: bool = False) -> list[IndexEntry]: ...

    async def load_model(self, name: str, config_override: dict[str, Any] | None) -> None: ...

    async def unload_model(self, name: str) -> None: ...


class LocalCore:
    """``Core`` over the models this process holds (its ``ModelManager``)."""

    def __init__(self, manager: ModelManager, strict_readiness: bool = True) -> None:
        self.manager = manager
        self.strict_readiness = strict_readiness
        self._accepting = True
        self._in_flight = 0  # inference requests accepted and not yet answered
        self._idle = asyncio.Event()
        self._idle.set()

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Triton's strict readiness: ready only while every model loaded fine."""
        return self._accepting and (self.manager.all_ready() or not self.strict_readiness)

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no inference request is in flight, at most ``timeout_s``; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(SERVER_NAME, __version__, EXTENSIONS)

    def model_names(self) -> list[str]:
        return self.manager.names()

    def model_ready(self, name: str, version: str) -> bool:
        return self.manager.is_ready(name, version)

    def model_metadata(self, name: str, version: str) -> ModelMetadata:
        served = self.manager.resolve(name, version)
        spec = served.spec
        batch = (-1,) if spec.max_batch_size > 0 else ()
        versions = (
            tuple(str(v) for v in self.manager.entry(name).ready_versions()) if not version else (version,)
        )
        return ModelMetadata(
            name=spec.name,
            versions=versions,
            platform=spec.platform or spec.backend,
            inputs=tuple(TensorMetadata(t.name, t.datatype.value, batch + t.dims) for t in spec.inputs),
            outputs=tuple(TensorMetadata(t.name, t.datatype.value, batch + t.dims) for t in spec.outputs),
        )

    def model_config(self, name: str, version: str) -> dict[str, Any]:
        """The normalized config as proto3 JSON (field names as in model_config.proto)."""
        return self.manager.resolve(name, version).spec.config_json

    async def infer(self, request: InferRequest) -> InferResponse:
        if not self._accepting:
            raise ShoalError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        self._in_flight += 1
        self._idle.clear()
        try:
            served = self.manager.resolve(request.model_name, request.model_version)
            return await served.infer(request)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def model_statistics(self, name: str, version: str) -> list[StatisticsRow]:
        """One row per model version; name ``""`` means every model."""
        return [
            StatisticsRow(served.spec.name, str(served.version), served.statistics,
                          {(d.kind.upper(), d.index): b for d, b in served.memory_bytes.items()},
                          served.scheduler.queued, len(served.pool.instances))
            for served in self.manager.statistics(name, version)
        ]

    async def load_model(self, name: str, config_override: dict[str, Any] | None) -> None:
        self._require_explicit()
        await self.manager.load(name, config_override)

    async def unload_model(self, name: str) -> None:
        self._require_explicit()
        await self.manager.unload(name)

    def _require_explicit(self) -> None:
        if self.manager.control_mode == "poll":
            raise ShoalError(ErrorCode.UNAVAILABLE, "explicit model load / unload is not allowed if polling is enabled")
        if self.manager.control_mode != "explicit":
            raise ShoalError(
                ErrorCode.UNAVAILABLE,
                "explicit model load / unload is not allowed: start the server with --model-control-mode explicit",
            )

    def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        return self.manager.index(ready_only)
