"""The server's tracer: the settings, the sampling, and the mode's exporter, in the host process."""

from __future__ import annotations

import logging

from shoal.settings import TraceConfig
from shoal.tracing.export import OpenTelemetrySpans, TraceFile
from shoal.tracing.settings import TraceSettings
from shoal.tracing.trace import Origin, RequestTrace

logger = logging.getLogger(__name__)


class Tracer:
    def __init__(self, config: TraceConfig) -> None:
        self.settings = TraceSettings(config)
        self._export: TraceFile | OpenTelemetrySpans
        if config.mode == "opentelemetry":
            self._export = OpenTelemetrySpans(config)
        else:
            self._export = TraceFile(config.file, config.log_frequency)

    def start(self, model_name: str, model_version: str, request_id: str, origin: Origin | None) -> RequestTrace | None:
        """A trace for this request if the settings sample it, else None (one check while tracing is off)."""
        if not self.settings.on:
            return None
        if not self.settings.sample(model_name, origin is not None and bool(origin.traceparent)):
            return None
        trace = RequestTrace(model_name, model_version, request_id, origin)
        trace.stamp("REQUEST_START")
        return trace

    def finish(self, trace: RequestTrace, error: str = "") -> None:
        """The request's response is ready (or it failed): stamp its end and hand it to the exporter."""
        trace.stamp("REQUEST_END")
        if error:
            trace.error = error
        else:
            trace.stamp("INFER_RESPONSE_COMPLETE")
        try:
            self._export(trace)
        except Exception:  # a trace is never worth a request: the request's answer goes out regardless
            logger.exception("could not export the trace of a request to model %s", trace.model_name)

    def close(self) -> None:
        """Write or export what is still held (at shutdown)."""
        self._export.close()
