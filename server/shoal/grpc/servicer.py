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
from typing import NamedTuple, TypeAlias

import grpc

from shoal.core import Core
from shoal.core.stream import InferStream, Route
from shoal.errors import DecoupledRefused, bounded
from shoal.grpc import convert, offload
from shoal.grpc.status import to_status
from shoal.protocol import service_pb2 as pb
from shoal.request_types import InferResponse
from shoal.tracing.trace import Origin

Context: TypeAlias = grpc.aio.ServicerContext

# Triton's request and response parameters for decoupled models on a stream.
FINAL_PARAMETER = "triton_final_response"


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
        origin = Origin("GRPC", time.monotonic_ns(), *_trace_context(context))  # ``_response``, inline: per request
        response = await self.core.infer(await offload.infer_request(request, self.encoded_bytes), origin)
        if not response.trace_id:
            return await offload.infer_response(response)
        # Traced: its send is reported when the RPC ends (the engine wrote it by then), however it ends,
        # a failure to encode it included (then with no send).
        send = _Send(self.core, response.trace_id)
        context.add_done_callback(send.ended)
        message = await offload.infer_response(response)
        send.started_ns = time.monotonic_ns()
        return message

    async def _response(self, request: pb.ModelInferRequest, context: Context) -> InferResponse:
        """The core's answer to one request (a stream's; ModelInfer does the same inline)."""
        origin = Origin("GRPC", time.monotonic_ns(), *_trace_context(context))
        return await self.core.infer(await offload.infer_request(request, self.encoded_bytes), origin)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request starts as it is read; the core's ``InferStream`` orders the answers as Triton's
        stream handler does. A failed request gets ``error_message`` and its id, and the stream goes on.
        A traced answer's send is reported when the engine asks for the next one (it wrote this one)."""
        stream = InferStream(
            self.core,
            _route,
            functools.partial(self._stream_answer, context=context),
            functools.partial(self._stream_decoupled, context=context),
        )
        async with contextlib.aclosing(stream.answers(requests)) as answers:  # closed with this RPC
            async for answer in answers:
                if answer.message is None:  # a traced request's last answer, not written: after those before it
                    self.core.sent(answer.trace_id, 0, 0)
                    continue
                if not answer.trace_id:
                    yield answer.message
                    continue
                started_ns, ended_ns = time.monotonic_ns(), 0
                try:
                    yield answer.message
                    ended_ns = time.monotonic_ns()
                finally:
                    self.core.sent(answer.trace_id, started_ns, ended_ns, answer.last)

    async def _stream_decoupled(
        self, request: pb.ModelInferRequest, put: Callable[[Written], None], context: Context
    ) -> None:
        """A decoupled model's responses, each written as it comes, as Triton's stream handler does:
        each names its request, carries ``triton_final_response``, and a FINAL flag without a
        response is written only when the client asked (``triton_enable_empty_final_response``)."""
        empty_final = _bool_parameter(request, convert.EMPTY_FINAL_PARAMETER)
        origin = Origin("GRPC", time.monotonic_ns(), *_trace_context(context))
        trace_id, last_handed = 0, False  # the trace its sends are reported to; its last answer went out
        try:
            inference = await offload.infer_request(request, self.encoded_bytes)
            async for part in self.core.infer_stream(inference, origin):
                trace_id = part.trace_id
                if part.response is not None:
                    message = await offload.infer_response(part.response)
                elif part.error or empty_final:
                    message = pb.ModelInferResponse(
                        model_name=request.model_name, model_version=request.model_version, id=request.id
                    )
                else:
                    continue  # a bare FINAL flag the client did not ask to see
                message.parameters[FINAL_PARAMETER].bool_param = part.final
                put(
                    Written(
                        pb.ModelStreamInferResponse(
                            error_message=bounded(part.error) if part.error else "", infer_response=message
                        ),
                        trace_id,
                        part.final,
                    )
                )
                last_handed = part.final
        except Exception as exc:  # noqa: BLE001 - reported in-stream; the stream goes on
            _, text = to_status(exc)
            failed = pb.ModelInferResponse(id=request.id)
            put(Written(pb.ModelStreamInferResponse(error_message=text, infer_response=failed), trace_id))
            last_handed = True
        finally:
            if trace_id and not last_handed:  # its last answer is not written (a bare FINAL flag, or none)
                put(Written(None, trace_id))  # said in its place, once the answers queued before it went out

    async def _stream_answer(self, request: pb.ModelInferRequest, context: Context) -> Written:
        """One request's answer on a stream; a failure is reported in-stream, as Triton does."""
        try:
            response = await self._response(request, context)
            try:
                message = await offload.infer_response(response)
            except BaseException:
                if response.trace_id:  # no response goes out: the trace ends without a send
                    self.core.sent(response.trace_id, 0, 0)
                raise
            message.parameters[FINAL_PARAMETER].bool_param = True  # its only response, as Triton marks it
            return Written(pb.ModelStreamInferResponse(infer_response=message), response.trace_id)
        except DecoupledRefused:  # the model was reloaded as decoupled: the stream sends it down that path
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-stream; the stream goes on
            _, text = to_status(exc)
            failed = pb.ModelInferResponse(id=request.id)  # so the client knows which request failed
            return Written(pb.ModelStreamInferResponse(error_message=text, infer_response=failed))

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


class Written(NamedTuple):
    """One answer on a stream, and the trace its send is reported to (0: none); ``last``: that
    request's last answer. ``message`` None: nothing to write, only the trace's last send to report."""

    message: pb.ModelStreamInferResponse | None
    trace_id: int = 0
    last: bool = True


class _Send:
    """A traced unary response: reported sent when its RPC ends (the engine has written it by then)."""

    __slots__ = ("core", "trace_id", "started_ns")

    def __init__(self, core: Core, trace_id: int) -> None:
        self.core, self.trace_id, self.started_ns = core, trace_id, 0

    def ended(self, context: Context) -> None:
        written = self.started_ns and not context.cancelled()  # cancelled: the client went first
        self.core.sent(self.trace_id, self.started_ns, time.monotonic_ns() if written else 0)


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
