"""The server's tracer: the settings, the sampling, and the mode's exporter, in the host process."""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.settings import TraceConfig
from shoal.tracing.export import OpenTelemetrySpans, TraceFile
from shoal.tracing.settings import TraceSettings
from shoal.tracing.trace import (
    Origin,
    RequestTrace,
    live_trace,
    random_span_id,
    random_trace_id,
    valid_traceparent,
)

logger = logging.getLogger(__name__)


# How long an ended trace waits for its transport to say it sent the last response (``Tracer.sent``):
# a report that never comes (a front-end worker that died, a stream closed with answers still
# queued) costs the trace its send stamps, never the trace.
SEND_WAIT_S = 30.0


class Tracer:
    def __init__(self, config: TraceConfig) -> None:
        self.settings = TraceSettings(config)
        self._mode = config.mode
        self._said_no_tensors = False
        # Ended traces whose transport has not yet sent their last response: id -> (trace, export by)
        self._sending: dict[int, tuple[RequestTrace, float]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._export: TraceFile | OpenTelemetrySpans
        if config.mode == "opentelemetry":
            self._export = OpenTelemetrySpans(config)
        else:
            self._export = TraceFile(config.file, lambda: self.settings.effective().log_frequency)

    def start(self, model_name: str, model_version: str, request_id: str, origin: Origin | None) -> RequestTrace | None:
        """A trace for this request if the settings sample it, else None (one check while tracing is off)."""
        if not self.settings.on:
            return None
        level = self.settings.sample(model_name, origin is not None and valid_traceparent(origin.traceparent))
        if level is None:
            return None
        tensors = "TENSORS" in level
        if tensors and self._mode == "opentelemetry" and not self._said_no_tensors:
            self._said_no_tensors = True  # Triton logs it for every tensor of every request
            logger.error("Tensor level tracing is not supported by the mode: opentelemetry")
        trace = RequestTrace(
            model_name,
            model_version,
            request_id,
            origin,
            timestamps="TIMESTAMPS" in level,
            tensors=[] if tensors and self._mode == "triton" else None,
        )
        if self._mode == "opentelemetry" and trace.timestamps:  # its spans' ids, for get_context
            clients = origin.traceparent if origin is not None and valid_traceparent(origin.traceparent) else ""
            trace.otel_trace_id = int(clients[3:35], 16) if clients else random_trace_id()
            trace.span_id = random_span_id()
        trace.stamp("REQUEST_START")
        trace.begin()
        return trace

    def finish(
        self,
        trace: RequestTrace,
        error: str = "",
        responded: bool = True,
        ended_ns: int | None = None,
        sending: bool = False,
    ) -> None:
        """The request's response is ready (or it failed): stamp its end (``ended_ns``, else now) and
        hand it to the exporter. ``responded`` False: a streamed request, whose
        ``INFER_RESPONSE_COMPLETE`` marks its first response and was stamped then (as Triton's), if it
        had one. ``sending``: its transport writes the response and reports it (``sent``): the trace is
        exported then (within ``SEND_WAIT_S``)."""
        trace.stamp("REQUEST_END", ended_ns)
        trace.end()
        if error:
            trace.error = error
        elif responded:
            trace.stamp("INFER_RESPONSE_COMPLETE")
        if sending and not trace.sent_all:
            self._sending[trace.id] = (trace, time.monotonic() + SEND_WAIT_S)
            if self._sweep is None:
                self._sweep = asyncio.get_running_loop().call_later(SEND_WAIT_S, self._export_overdue)
            return
        self._export_now(trace)

    def sent(self, trace_id: int, started_ns: int, ended_ns: int, last: bool) -> None:
        """The transport wrote one of the trace's responses between ``started_ns`` and ``ended_ns``
        (0: it was not written: the client went, or it was a bare FINAL flag); ``last``: no more go out.
        A trace already exported (it waited too long) or unknown is let be."""
        held = self._sending.get(trace_id)
        trace = held[0] if held is not None else live_trace(trace_id)
        if trace is None:
            return
        if ended_ns and trace.origin is not None:
            protocol = trace.origin.protocol
            trace.stamps += [(f"{protocol}_SEND_START", started_ns), (f"{protocol}_SEND_END", ended_ns)]
        if last:
            trace.sent_all = True
            if held is not None:
                del self._sending[trace_id]
                self._export_now(trace)

    def _export_overdue(self) -> None:
        """Export the traces whose send was not reported in time; look again while any wait."""
        now = time.monotonic()
        for trace_id, (trace, deadline) in list(self._sending.items()):
            if deadline > now:
                break  # held in the order they ended: the rest are younger
            del self._sending[trace_id]
            self._export_now(trace)
        self._sweep = None
        if self._sending:
            wait = next(iter(self._sending.values()))[1] - now
            self._sweep = asyncio.get_running_loop().call_later(max(wait, 0.0), self._export_overdue)

    def _export_now(self, trace: RequestTrace) -> None:
        try:
            self._export(trace)
        except Exception:  # a trace is never worth a request: the request's answer goes out regardless
            logger.exception("could not export the trace of a request to model %s", trace.model_name)

    def stop_waiting(self) -> None:
        """Export the traces still waiting for their transport's send, as they are (at shutdown, on the
        serving loop, before ``close``)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for trace, _ in self._sending.values():
            self._export_now(trace)
        self._sending.clear()

    def close(self) -> None:
        """Write or export what is still held (at shutdown)."""
        self._export.close()
