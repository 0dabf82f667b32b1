"""``Core`` over the models this process holds: the host process's implementation.

Besides the interface it has what only the host does: stop accepting and drain at shutdown, and
the statistics rows the metrics page reads from its own thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from importlib.metadata import version
from typing import Any

import numpy as np

from shoal import logs
from shoal.core import (
    CudaRegionStatus,
    HealthSnapshot,
    IndexEntry,
    ModelMetadata,
    RegionStatus,
    ServerMetadata,
    StatisticsRow,
    StreamedResponse,
    TensorMetadata,
    shared_memory,
)
from shoal.dataplane import cuda
from shoal.dataplane.regions import RegionRegistry
from shoal.errors import ErrorCode, ShoalError, internal_error, shown
from shoal.lifecycle import request_checks
from shoal.lifecycle.manager import ModelManager
from shoal.lifecycle.model import ModelVersion, refuse_unstreamed
from shoal.lifecycle.streaming import ENDED, ResponseSink
from shoal.request_types import InferRequest, InferResponse
from shoal.settings import ServerSettings, TraceConfig
from shoal.statistics import TRACED
from shoal.tracing.trace import Origin, RequestTrace
from shoal.tracing.tracer import Tracer

logger = logging.getLogger(__name__)

SERVER_NAME = "shoal"
SERVER_VERSION = version(SERVER_NAME)  # the installed distribution's, from pyproject.toml
# Only what is implemented end to end; clients gate features on these strings. Triton 2.51's list, in its order
# (its server metadata, run beside it).
EXTENSIONS = (
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",  # always listed, as Triton does; without GPUs registration says so
    "binary_tensor_data",  # HTTP's binary tensors (gRPC's raw contents need no extension)
    "parameters",  # request, input and output parameters (Shoal listed all but this until session 53)
    "statistics",
    "trace",
    "logging",
)


class LocalCore:
    """``Core`` over this process's ``ModelManager``."""

    def __init__(
        self,
        manager: ModelManager,
        strict_readiness: bool = True,
        max_shared_memory_bytes: int = ServerSettings.shared_memory_max_bytes,
        max_shared_memory_regions: int = ServerSettings.shared_memory_max_regions,
        tracer: Tracer | None = None,
    ) -> None:
        self.manager = manager
        self.tracer = tracer or Tracer(TraceConfig())  # tracing off: the default settings trace nothing
        self.strict_readiness = strict_readiness
        self.regions = RegionRegistry(max_shared_memory_bytes, max_shared_memory_regions)
        self._accepting = True
        self._in_flight = 0  # inference requests accepted and not yet answered
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the interface -----------------------------------------------------------------------------

    async def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        return self.is_ready()

    async def health(self) -> HealthSnapshot:
        ready_models = {name: self._accepting and self.manager.is_ready(name, "") for name in self.manager.names()}
        return HealthSnapshot(self.is_ready(), ready_models)

    async def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(SERVER_NAME, SERVER_VERSION, EXTENSIONS)

    async def model_ready(self, name: str, version: str) -> bool:
        return self.manager.is_ready(name, version)

    async def model_metadata(self, name: str, version: str) -> ModelMetadata:
        served = self.manager.resolve(name, version)
        spec = served.spec
        batch = (-1,) if spec.max_batch_size > 0 else ()
        versions = (
            tuple(str(v) for v in self.manager.entry(name).ready_versions()) if not version else (str(served.version),)
        )  # the number as read ('01', ' 2', '2abc' are versions 1 and 2), as Triton answers it
        return ModelMetadata(
            name=spec.name,
            versions=versions,
            platform=spec.platform or spec.backend,
            inputs=tuple(TensorMetadata(t.name, t.datatype.value, batch + t.dims) for t in spec.inputs),
            outputs=tuple(TensorMetadata(t.name, t.datatype.value, batch + t.dims) for t in spec.outputs),
        )

    async def model_config(self, name: str, version: str) -> dict[str, Any]:
        """The normalized config as proto3 JSON (field names as in model_config.proto)."""
        return self.manager.resolve(name, version).spec.config_json

    async def model_decoupled(self, name: str, version: str) -> bool:
        return self.manager.resolve(name, version).spec.decoupled

    async def infer(self, request: InferRequest, origin: Origin | None = None) -> InferResponse:
        # Off, that one check is all; a decoupled model's request (its responses go to a sink) is traced
        # by ``infer_stream``, which runs it through here.
        trace = None
        if self.tracer.settings.on and request.sink is None:
            trace = self.tracer.start(request.model_name, request.model_version, request.id, origin)
        if trace is None:
            return await self._infer(request)
        token = TRACED.set(trace)
        try:
            response = await self._infer(request)
        except ShoalError as exc:
            self.tracer.finish(trace, exc.message)
            raise
        except BaseException as exc:
            self.tracer.finish(trace, type(exc).__name__)
            raise
        finally:
            TRACED.reset(token)
        trace.model_version = response.model_version
        if origin is None:  # nobody writes it: the trace ends here
            self.tracer.finish(trace)
            return response
        self.tracer.finish(trace, sending=True)  # exported once its transport wrote the response
        return dataclasses.replace(response, trace_id=trace.id)

    def sent(self, trace_id: int, started_ns: int, ended_ns: int, last: bool = True) -> None:
        self.tracer.sent(trace_id, started_ns, ended_ns, last)

    async def _infer(self, request: InferRequest) -> InferResponse:
        if not self._accepting:
            raise ShoalError(ErrorCode.UNAVAILABLE, "the server is shutting down")
        self._in_flight += 1
        self._idle.clear()
        try:
            served = self.manager.resolve(request.model_name, request.model_version)
            refuse_unstreamed(served.spec, request)  # before its shared memory is read, as Triton
            if request.region_inputs:
                if shared_memory.costly(self.regions, request):
                    request = await asyncio.to_thread(shared_memory.with_region_inputs, self.regions, request)
                    # The version is chosen again: a reload may have retired the one chosen before the read
                    # (it then refused the request as unloading, while the new one served).
                    served = self.manager.resolve(request.model_name, request.model_version)
                else:
                    request = shared_memory.with_region_inputs(self.regions, request)
            if not request.output_regions:
                return await served.infer(request)
            windows = shared_memory.output_windows(self.regions, request)
            response = await served.infer(request)
            if shared_memory.costly_outputs(windows):
                return await asyncio.to_thread(shared_memory.write_region_outputs, windows, response)
            return shared_memory.write_region_outputs(windows, response)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def infer_stream(
        self, request: InferRequest, origin: Origin | None = None
    ) -> AsyncIterator[StreamedResponse]:
        """A decoupled model's responses as its instance puts them into the request's sink.

        Traced as Triton traces it: one trace for the request, its batch's times once, and
        ``INFER_RESPONSE_COMPLETE`` at its first response; it ends (``REQUEST_END``) when the
        execution does, which may be after the FINAL flag."""
        served = self.manager.resolve(request.model_name, request.model_version)
        if not served.spec.decoupled:
            response = await self.infer(request, origin)
            yield StreamedResponse(response, True, trace_id=response.trace_id)
            return
        if request.output_regions:
            raise ShoalError(
                ErrorCode.UNSUPPORTED,
                f"outputs in shared memory are not supported for decoupled model '{request.model_name}'",
            )
        sink = ResponseSink(asyncio.get_running_loop())
        trace = None
        if self.tracer.settings.on:
            trace = self.tracer.start(request.model_name, str(served.version), request.id, origin)
        # The task's context is a copy of this one: its scheduler reads the trace (nothing to set when off).
        token = TRACED.set(trace) if trace is not None else None
        try:
            task = asyncio.create_task(self.infer(dataclasses.replace(request, sink=sink)))
        finally:
            if token is not None:
                TRACED.reset(token)
        task.add_done_callback(lambda _: sink.queue.put_nowait((ENDED, True)))
        executed_ns: list[int] = []  # when the execution ended: the trace's REQUEST_END
        # Parts name the trace their transport reports its sends to (a transport's request only).
        trace_id = 0
        if trace is not None:
            task.add_done_callback(lambda _: executed_ns.append(time.monotonic_ns()))
            trace_id = trace.id if origin is not None else 0
        handed_out = False  # a part went to the transport: it reports the last one's send
        final_seen = False
        try:
            while True:
                item, final = await sink.queue.get()
                if item is ENDED:  # the execution ended (or failed) without its FINAL flag
                    error = task.exception() if not task.cancelled() else None
                    if error is None and not task.cancelled() and task.result().outputs:
                        # A version that is not decoupled answered it (a reload between the two choices of
                        # version): its one answer, final. A decoupled version's answer has no outputs.
                        handed_out = final_seen = True
                        yield StreamedResponse(task.result(), True, trace_id=trace_id)
                        return
                    message = error.message if isinstance(error, ShoalError) else ENDED.message
                    if error is not None and not isinstance(error, ShoalError):
                        message = internal_error(error, f"running a streaming request to model {request.model_name}")
                    handed_out = True
                    yield StreamedResponse(None, True, message, trace_id)
                    return
                if isinstance(item, dict) and trace is not None:
                    if trace.when("INFER_RESPONSE_COMPLETE") is None:
                        trace.stamp("INFER_RESPONSE_COMPLETE")
                    trace.record_tensors("TENSOR_BACKEND_OUTPUT", item)
                final_seen = final
                if item is not None or final:
                    handed_out = True
                    yield _streamed(served, request, item, final, trace_id)
                if final:
                    return
        finally:
            if not final_seen:  # read by a model still sending (sender.is_cancelled()) and by the instance's wait
                sink.cancel()
            if task.done():
                _retrieve(task)
            elif (
                final_seen
            ):  # its execution ends by itself (a process instance's within its timeout), its trace with it
                task.add_done_callback(_retrieve)
            else:  # the client went away first
                task.cancel()
            if trace is not None:  # ends once both the responses read here and the execution have
                finish = functools.partial(self._stream_traced, trace, executed_ns, bool(trace_id) and handed_out)
                if task.done():
                    finish(task)
                else:
                    task.add_done_callback(finish)

    def _stream_traced(
        self, trace: RequestTrace, executed_ns: list[int], sending: bool, task: asyncio.Task[InferResponse]
    ) -> None:
        """A streamed request's responses were all read and its execution ended: its trace ends (an error
        if the execution failed or was cancelled), ``REQUEST_END`` when the execution ended; exported
        once its transport wrote the last response (``sending``: it was handed some)."""
        if task.cancelled():
            error = "the request was cancelled"
        elif (exc := task.exception()) is not None:
            error = exc.message if isinstance(exc, ShoalError) else type(exc).__name__
        else:
            error = ""
        ended_ns = executed_ns[0] if executed_ns else None
        self.tracer.finish(trace, error, responded=False, ended_ns=ended_ns, sending=sending)

    async def model_statistics(self, name: str, version: str) -> list[StatisticsRow]:
        return self.statistics_rows(name, version)

    async def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        return self.manager.index(ready_only)

    async def load_model(self, name: str, config_override: dict[str, Any] | None) -> None:
        self._require_explicit()
        await self.manager.load(name, config_override, client=True)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._require_explicit()
        await self.manager.unload(name, unload_dependents, client=True)

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.regions.register(name, key, offset, byte_size)

    async def unregister_system_shared_memory(self, name: str) -> None:
        self.regions.unregister(name)

    async def system_shared_memory_status(self, name: str) -> list[RegionStatus]:
        return self.regions.status(name)

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        await asyncio.to_thread(cuda.runtime)  # the first call loads the CUDA runtime: slow, once, off the loop
        self.regions.register_cuda(name, raw_handle, device_id, byte_size)  # the registry changes on the loop only

    async def unregister_cuda_shared_memory(self, name: str) -> None:
        self.regions.unregister_cuda(name)

    async def trace_settings(self, model: str) -> dict[str, list[str] | str]:
        self._known_for_tracing(model)
        return self.tracer.settings.answer(model)

    async def update_trace_settings(self, model: str, changes: dict[str, list[str] | None]) -> dict[str, Any]:
        self._known_for_tracing(model)
        self.tracer.settings.update(model, changes)
        return self.tracer.settings.answer(model)

    def _known_for_tracing(self, model: str) -> None:
        """Triton's answer for a model it does not have (400 over HTTP, not the 404 of inference)."""
        if model and model not in self.manager.names():
            raise ShoalError(ErrorCode.INVALID_ARGUMENT, f"Request for unknown model : {shown(model)}")

    async def log_settings(self) -> dict[str, Any]:
        return logs.current().read().as_dict()

    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        settings = logs.current().update(changes)
        logger.info("log settings now %s", settings.as_dict())
        return settings.as_dict()

    async def cuda_shared_memory_status(self, name: str) -> list[CudaRegionStatus]:
        return self.regions.cuda_status(name)

    # -- the host's own ----------------------------------------------------------------------------

    def is_ready(self) -> bool:
        """Triton's strict readiness: ready only while every model loaded fine."""
        return self._accepting and (self.manager.all_ready() or not self.strict_readiness)

    def statistics_rows(self, name: str = "", version: str = "") -> list[StatisticsRow]:
        """One row per model version; name ``""`` means every model. Safe to call from the metrics thread."""
        return [
            StatisticsRow(
                served.spec.name,
                str(served.version),
                served.statistics,
                {(d.kind.upper(), d.index): b for d, b in served.memory_bytes.items()},
                served.queued,
                served.instance_count,
                served.cache is not None,
            )
            for served in self.manager.statistics(name, version)
        ]

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def stop_accepting(self) -> None:
        self._accepting = False

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no inference request is in flight, at most ``timeout_s``; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    def _require_explicit(self) -> None:
        if self.manager.control_mode == "poll":
            raise ShoalError(ErrorCode.UNAVAILABLE, "explicit model load / unload is not allowed if polling is enabled")
        if self.manager.control_mode != "explicit":
            raise ShoalError(
                ErrorCode.UNAVAILABLE,
                "explicit model load / unload is not allowed: start the server with --model-control-mode explicit",
            )


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A streamed request's execution task, ended: its failure, if any, was reported in-stream."""
    if not task.cancelled():
        task.exception()


def _streamed(
    served: ModelVersion,
    request: InferRequest,
    item: dict[str, np.ndarray] | ShoalError | None,
    final: bool,
    trace_id: int,
) -> StreamedResponse:
    """One item of a decoupled model's sink as a response, its outputs checked against the config as
    every reply's are (``request_checks.finish``)."""
    if isinstance(item, dict):
        try:
            outputs = request_checks.streamed_outputs(served.spec, request, item)
        except ShoalError as exc:
            return StreamedResponse(None, final, exc.message, trace_id)
        response = InferResponse(served.spec.name, str(served.version), request.id, outputs)
        return StreamedResponse(response, final, trace_id=trace_id)
    if isinstance(item, ShoalError):
        return StreamedResponse(None, final, item.message, trace_id)
    return StreamedResponse(None, True, trace_id=trace_id)  # the FINAL flag alone
