"""Where finished traces go: Triton's JSON trace file (``triton`` mode) or OTLP/HTTP spans
(``opentelemetry`` mode, through the OpenTelemetry SDK's batch processor and exporter).

Spans as Triton 2.51's OpenTelemetry mode makes them (captured from tritonserver 2.51), all of
kind SERVER: ``InferRequest`` (the root; a child of the client's span when the request carried a
``traceparent``, whose trace id it keeps and whose ``tracestate`` every span carries), with the
transport's receive events, ``INFER_RESPONSE_COMPLETE`` and a ``*_SEND_START``/``*_SEND_END`` pair per
response written, ending with the last; under it a span named after the model, with
``triton.model_name``, ``triton.model_version`` (int), ``triton.trace_id``,
``triton.trace_parent_id`` (0 at the top) and ``triton.request_id`` (when the request has an id),
and events ``REQUEST_START``, ``QUEUE_START``, ``REQUEST_END``; under it ``compute``, with the four
``COMPUTE_*`` events. An ensemble's span has no ``compute``; its steps' spans hang under it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.settings import DEFAULT_URL, TraceConfig
from shoal.tracing.trace import (
    RequestTrace,
    clients_tracestate,
    random_span_id,
    random_trace_id,
    transport_stamps,
    valid_traceparent,
)

logger = logging.getLogger(__name__)

# The SDK logs a WARNING with the whole header for each malformed tracestate member: a client could fill the
# log with them, so that logger says only errors (a malformed tracestate is dropped without a word).
logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
# One export's bound: a collector that does not answer costs the exporter's thread this long, never a request.
EXPORT_TIMEOUT_S = 5.0
COMPUTE_STAMPS = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")
# The root span's events besides the transport's receive: the response's completion and each send.
ROOT_STAMPS = ("INFER_RESPONSE_COMPLETE",)
SEND_STAMPS = ("_SEND_START", "_SEND_END")


class TraceFile:
    """Triton's trace file: a JSON array of one object per trace (its model) and one per timestamp.
    ``log_frequency()`` (the global setting, read at each trace) 0 writes everything to ``file`` at
    shutdown; N writes every N traces to ``file.0``, ``file.1``, ... (and what is left, at shutdown,
    to the next one). Files are written by a thread of their own, never on the serving loop; one that
    cannot be written is logged and its traces dropped (a full disk never slows or fails a request)."""

    def __init__(self, file: str, log_frequency: Callable[[], int]) -> None:
        self.file = file
        self.log_frequency = log_frequency
        self._pending: list[dict[str, Any]] = []
        self._traces = 0
        self._index = 0
        self._lock = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-trace-file")
        self._failed: set[str] = set()  # files already logged as not writable

    def __call__(self, trace: RequestTrace) -> None:
        frequency = self.log_frequency()
        with self._lock:
            self._pending += _records(trace)
            self._traces += 1
            if frequency and self._traces >= frequency:
                self._hand_over(f"{self.file}.{self._index}")
                self._index += 1

    def close(self) -> None:
        """Write what is held and wait for the writes (at shutdown)."""
        with self._lock:
            if self._pending:
                self._hand_over(f"{self.file}.{self._index}" if self.log_frequency() else self.file)
        self._writer.shutdown(wait=True)

    def _hand_over(self, path: str) -> None:
        """Lock held: the held records go to ``path`` on the writer thread."""
        records, self._pending, self._traces = self._pending, [], 0
        self._writer.submit(self._write, path, records)

    def _write(self, path: str, records: list[dict[str, Any]]) -> None:
        try:
            Path(path).write_text(json.dumps(records, separators=(",", ":")))
        except OSError as exc:
            if path not in self._failed:
                self._failed.add(path)
                logger.error(
                    "could not write the trace file %s: %s; its %d records are dropped",
                    path,
                    exc.strerror,
                    len(records),
                )


def _records(trace: RequestTrace) -> list[dict[str, Any]]:
    """Children first, as Triton writes them; then the trace's model line and its timestamps (at the
    TIMESTAMPS level), and its tensors (at the TENSORS level: alone, Triton writes nothing else)."""
    records = [record for child in trace.children for record in _records(child)]
    if trace.timestamps:
        model: dict[str, Any] = {"id": trace.id, "model_name": trace.model_name, "model_version": _version(trace)}
        if trace.request_id:
            model["request_id"] = trace.request_id
        if trace.parent is not None:
            model["parent_id"] = trace.parent.id
        records.append(model)
        records += [{"id": trace.id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in _all_stamps(trace)]
    for record in trace.tensors or ():
        tensor = {"name": record.name, "data": record.data, "shape": record.shape, "dtype": record.dtype}
        records.append({"id": trace.id, "activity": record.activity, "tensor": tensor})
    return records


def _all_stamps(trace: RequestTrace) -> list[tuple[str, int]]:
    if trace.origin is None:
        return trace.stamps
    return [*transport_stamps(trace.origin), *trace.stamps]


def _version(trace: RequestTrace) -> int:
    return int(trace.model_version) if trace.model_version.isdigit() else 0


class OpenTelemetrySpans:
    """Each trace as spans, handed to the SDK's batch processor (which exports on a thread of its own)."""

    def __init__(self, config: TraceConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        url = config.url or DEFAULT_URL
        if "://" not in url:
            url = f"http://{url}"  # Triton takes host:port/path too
        attributes = {"service.name": "shoal", **dict(config.resource)}
        # The settings decided to trace: the SDK samples every span, a client's unsampled parent (flags 00) too.
        self._ids = _chosen_ids()
        self.provider = TracerProvider(resource=Resource.create(attributes), sampler=ALWAYS_ON, id_generator=self._ids)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S),
                max_queue_size=config.bsp["bsp_max_queue_size"],
                export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000),
                schedule_delay_millis=config.bsp["bsp_schedule_delay"],
                max_export_batch_size=config.bsp["bsp_max_export_batch_size"],
            )
        )
        self.tracer = self.provider.get_tracer("shoal")
        self._kind = SpanKind.SERVER
        self._in_context = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self._epoch_offset = time.time_ns() - time.monotonic_ns()  # monotonic stamps -> the epoch's

    def __call__(self, trace: RequestTrace) -> None:
        origin = trace.origin
        context = None
        if origin is not None and valid_traceparent(origin.traceparent):  # as the tracer decided at its start
            carrier = {"traceparent": origin.traceparent}
            if tracestate := clients_tracestate(origin.tracestate):
                carrier["tracestate"] = tracestate
            context = self._propagator.extract(carrier)
        start = (origin.started_ns or origin.received_ns) if origin is not None else trace.stamps[0][1]
        end = max(ns for _, ns in trace.stamps)  # a streamed request's first response is not its end
        # A client's trace keeps the client's id; else the one the trace chose (its model may have used it).
        self._ids.trace_id = trace.otel_trace_id if context is None else 0
        try:
            root = self.tracer.start_span(
                "InferRequest", context=context, kind=self._kind, start_time=self._epoch(start)
            )
        finally:
            self._ids.trace_id = 0
        if not trace.timestamps:  # TENSORS alone: Triton exports the bare root (it traces no tensors here)
            root.end(end_time=self._epoch(end))
            return
        if origin is not None:
            for name, ns in transport_stamps(origin):
                root.add_event(name, timestamp=self._epoch(ns))
        for name, ns in trace.stamps:
            if name in ROOT_STAMPS or name.endswith(SEND_STAMPS):
                root.add_event(name, timestamp=self._epoch(ns))
        self._model_span(trace, self._in_context(root))
        root.end(end_time=self._epoch(end))

    def _model_span(self, trace: RequestTrace, context: Any) -> None:
        attributes: dict[str, Any] = {
            "triton.model_name": trace.model_name,
            "triton.model_version": _version(trace),
            "triton.trace_id": trace.id,
            "triton.trace_parent_id": trace.parent.id if trace.parent else 0,
        }
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        start = trace.when("REQUEST_START") or trace.stamps[0][1]
        end = trace.when("REQUEST_END") or trace.stamps[-1][1]
        self._ids.span_id = trace.span_id  # the id get_context gave a Python model while it ran
        try:
            span = self.tracer.start_span(
                trace.model_name, context=context, kind=self._kind, start_time=self._epoch(start), attributes=attributes
            )
        finally:
            self._ids.span_id = 0
        for name in ("REQUEST_START", "QUEUE_START", "REQUEST_END"):
            ns = trace.when(name)
            if ns is not None:
                span.add_event(name, timestamp=self._epoch(ns))
        if trace.error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, trace.error))
        inner = self._in_context(span)
        if trace.computed:
            compute = self.tracer.start_span(
                "compute", context=inner, kind=self._kind, start_time=self._epoch(trace.when("COMPUTE_START") or start)
            )
            for name in COMPUTE_STAMPS:
                ns = trace.when(name)
                if ns is not None:
                    compute.add_event(name, timestamp=self._epoch(ns))
            compute.end(end_time=self._epoch(trace.when("COMPUTE_END") or end))
        for child in trace.children:
            self._model_span(child, inner)
        span.end(end_time=self._epoch(end))

    def _epoch(self, monotonic_ns: int) -> int:
        return monotonic_ns + self._epoch_offset

    def close(self) -> None:
        self.provider.shutdown()  # exports what the batch processor still holds


def _chosen_ids() -> Any:
    """The SDK's random id generator, but for the ids a trace chose at its start (a Python model may
    have continued the trace with them: ``RequestTrace.context``), set just before the span that takes
    them and cleared after; spans are built on the serving loop only. Made here: the SDK is imported
    only in OpenTelemetry mode."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class ChosenIds(RandomIdGenerator):
        def __init__(self) -> None:
            self.trace_id = 0
            self.span_id = 0

        def generate_span_id(self) -> int:
            return self.span_id or random_span_id()

        def generate_trace_id(self) -> int:
            return self.trace_id or random_trace_id()

    return ChosenIds()
