"""The thin servicer: protobuf in on the first line, one core call, protobuf out on the last.

One method per RPC of ``inference.GRPCInferenceService``; ``server.grpc.server``
registers each under the guard that maps errors to status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from shoal.core import Core
from shoal.errors import unsupported
from shoal.grpc import convert
from shoal.grpc.status import to_status
from shoal.protocol import service_pb2 as pb

Context: TypeAlias = grpc.aio.ServicerContext


class InferenceServicer:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.core.live())

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.core.model_ready(request.name, request.version))

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return convert.server_metadata(self.core.server_metadata())

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        return convert.model_metadata(self.core.model_metadata(request.name, request.version))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        return convert.model_config(self.core.model_config(request.name, request.version))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        return convert.infer_response(await self.core.infer(convert.infer_request(request)))

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request gets one response; a failed one carries ``error_message`` and the stream goes on."""
        async for request in requests:
            try:
                response = convert.infer_response(await self.core.infer(convert.infer_request(request)))
            except Exception as exc:  # noqa: BLE001 - reported in-stream, as Triton does
                _, message = to_status(exc)
                yield pb.ModelStreamInferResponse(
                    error_message=message, infer_response=pb.ModelInferResponse(id=request.id)
                )
                continue
            yield pb.ModelStreamInferResponse(infer_response=response)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        return convert.model_statistics(self.core.model_statistics(request.name, request.version))

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        return convert.repository_index(self.core.repository_index(ready_only=request.ready))

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        await self.core.load_model(request.model_name, convert.load_parameters(request))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        # unload_dependents is accepted; Shoal has no ensembles, so there are no dependents.
        await self.core.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # RPCs of extensions Shoal does not implement (yet) answer UNIMPLEMENTED.

    async def SystemSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        raise unsupported("system shared memory")

    async def SystemSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        raise unsupported("system shared memory")

    async def SystemSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        raise unsupported("system shared memory")

    async def CudaSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        raise unsupported("CUDA shared memory")

    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        raise unsupported("CUDA shared memory")

    async def CudaSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        raise unsupported("CUDA shared memory")

    async def TraceSetting(self, request: Any, context: Context) -> Any:
        raise unsupported("TraceSetting")

    async def LogSettings(self, request: Any, context: Context) -> Any:
        raise unsupported("LogSettings")
