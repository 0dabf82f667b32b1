"""The thin servicer: protobuf in on the first line, one core call, protobuf out on the last.

ModelStreamInfer hands its requests to the core's ``InferStream``, which orders the answers (arrival
order; a decoupled model's responses as they come); the servicer only translates them.

One method per RPC of ``inference.GRPCInferenceService``; ``server.grpc.server``
registers each under the guard that maps errors to status.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc

from shoal.core import Core
from shoal.core.stream import InferStream, Route
from shoal.grpc import convert, offload
from shoal.grpc.status import to_status
from shoal.protocol import service_pb2 as pb
from shoal.tracing.trace import Origin

Context: TypeAlias = grpc.aio.ServicerContext

# Triton's request and response parameters for decoupled models on a stream.
EMPTY_FINAL_PARAMETER, FINAL_PARAMETER = "triton_enable_empty_final_response", "triton_final_response"


class InferenceServicer:
    """``encoded_bytes``: hand the core raw BYTES inputs as the wire carries them (``EncodedTensor``),
    for a core that decodes them itself: a front-end worker's ``RemoteCore``, whose host decodes once."""

    def __init__(self, core: Core, encoded_bytes: bool = False) -> None:
        self.core = core
        self.encoded_bytes = encoded_bytes

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=await self.core.live())

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.core.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self.core.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return convert.server_metadata(await self.core.server_metadata())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        return convert.model_metadata(await self.core.model_metadata(request.name, request.version))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        return convert.model_config(await self.core.model_config(request.name, request.version))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        origin = Origin("GRPC", time.monotonic_ns(), *_trace_context(context))
        inference = await offload.infer_request(request, self.encoded_bytes)
        return await offload.infer_response(await self.core.infer(inference, origin))

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request starts as it is read; the core's ``InferStream`` orders the answers as Triton's
        stream handler does. A failed request gets ``error_message`` and its id, and the stream goes on."""
        stream = InferStream(
            self.core,
            _route,
            functools.partial(self._stream_answer, context=context),
            functools.partial(self._stream_decoupled, context=context),
        )
        async with contextlib.aclosing(stream.answers(requests)) as answers:  # closed with this RPC
            async for answer in answers:
                yield answer

    async def _stream_decoupled(
        self, request: pb.ModelInferRequest, put: Callable[[pb.ModelStreamInferResponse], None], context: Context
    ) -> None:
        """A decoupled model's responses, each written as it comes, as Triton's stream handler does:
        each names its request, carries ``triton_final_response``, and a FINAL flag without a
        response is written only when the client asked (``triton_enable_empty_final_response``)."""
        empty_final = _bool_parameter(request, EMPTY_FINAL_PARAMETER)
        origin = Origin("GRPC", time.monotonic_ns(), *_trace_context(context))
        try:
            inference = await offload.infer_request(request, self.encoded_bytes)
            async for part in self.core.infer_stream(inference, origin):
                if part.response is not None:
                    message = await offload.infer_response(part.response)
                elif part.error or empty_final:
                    message = pb.ModelInferResponse(
                        model_name=request.model_name, model_version=request.model_version, id=request.id
                    )
                else:
                    continue  # a bare FINAL flag the client did not ask to see
                message.parameters[FINAL_PARAMETER].bool_param = part.final
                put(pb.ModelStreamInferResponse(error_message=part.error, infer_response=message))
        except Exception as exc:  # noqa: BLE001 - reported in-stream; the stream goes on
            _, text = to_status(exc)
            put(pb.ModelStreamInferResponse(error_message=text, infer_response=pb.ModelInferResponse(id=request.id)))

    async def _stream_answer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelStreamInferResponse:
        """One request's answer on a stream; a failure is reported in-stream, as Triton does."""
        try:
            return pb.ModelStreamInferResponse(infer_response=await self.ModelInfer(request, context))
        except Exception as exc:  # noqa: BLE001 - reported in-stream; the stream goes on
            _, message = to_status(exc)
            failed = pb.ModelInferResponse(id=request.id)  # so the client knows which request failed
            return pb.ModelStreamInferResponse(error_message=message, infer_response=failed)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        return convert.model_statistics(await self.core.model_statistics(request.name, request.version))

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        return convert.repository_index(await self.core.repository_index(ready_only=request.ready))

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        await self.core.load_model(request.model_name, convert.load_parameters(request))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        await self.core.unload_model(request.model_name, convert.unload_dependents(request))
        return pb.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        return convert.system_shared_memory_status(await self.core.system_shared_memory_status(request.name))

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        await self.core.register_system_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await self.core.unregister_system_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        return convert.cuda_shared_memory_status(await self.core.cuda_shared_memory_status(request.name))

    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        await self.core.register_cuda_shared_memory(
            request.name, request.raw_handle, request.device_id, request.byte_size
        )
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        await self.core.unregister_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        """No settings: read them; some: change those (Triton answers every setting either way)."""
        changes = convert.log_settings_changes(request)
        settings = await (self.core.update_log_settings(changes) if changes else self.core.log_settings())
        return convert.log_settings(settings)

    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Context) -> pb.TraceSettingResponse:
        """No settings: read them; some: change those (an empty value clears one); the model's when named."""
        changes = {name: list(value.value) or None for name, value in request.settings.items()}
        if changes:
            settings = await self.core.update_trace_settings(request.model_name, changes)
        else:
            settings = await self.core.trace_settings(request.model_name)
        return convert.trace_settings(settings)


def _trace_context(context: Context) -> tuple[str, str]:
    """The client's W3C ``traceparent`` and ``tracestate`` metadata ("" each when absent)."""
    traceparent = tracestate = ""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            traceparent = value if isinstance(value, str) else ""
        elif key == "tracestate":
            tracestate = value if isinstance(value, str) else ""
    return traceparent, tracestate


def _route(request: pb.ModelInferRequest) -> Route:
    """The request's model and version, and its sequence: the correlation id of one that has one."""
    sequence = None
    if "sequence_id" in request.parameters:
        value = convert.parameter_value(request.parameters["sequence_id"])
        sequence = None if value in (None, 0, "") else value
    return Route(request.model_name, request.model_version, sequence)


def _bool_parameter(request: pb.ModelInferRequest, name: str) -> bool:
    return name in request.parameters and convert.parameter_value(request.parameters[name]) is True
