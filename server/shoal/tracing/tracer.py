"""The server's tracer: the settings, the sampling, and the mode's exporter, in the host process."""

from __future__ import annotations

import logging
import re

from shoal.settings import TraceConfig
from shoal.tracing.export import OpenTelemetrySpans, TraceFile
from shoal.tracing.settings import TraceSettings
from shoal.tracing.trace import Origin, RequestTrace

logger = logging.getLogger(__name__)

# W3C trace context: version-traceid-parentid-flags, lower-case hex; all-zero ids are invalid.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def valid_traceparent(text: str) -> bool:
    """A client's trace context the spans can continue (a malformed one is ignored, as Triton's)."""
    return bool(text) and _TRACEPARENT.fullmatch(text) is not None and not text.startswith("ff")


class Tracer:
    def __init__(self, config: TraceConfig) -> None:
        self.settings = TraceSettings(config)
        self._mode = config.mode
        self._said_no_tensors = False
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
        trace.stamp("REQUEST_START")
        trace.begin()
        return trace

    def finish(self, trace: RequestTrace, error: str = "", responded: bool = True, ended_ns: int | None = None) -> None:
        """The request's response is ready (or it failed): stamp its end (``ended_ns``, else now) and
        hand it to the exporter. ``responded`` False: a streamed request, whose
        ``INFER_RESPONSE_COMPLETE`` marks its first response and was stamped then (as Triton's), if it
        had one."""
        trace.stamp("REQUEST_END", ended_ns)
        trace.end()
        if error:
            trace.error = error
        elif responded:
            trace.stamp("INFER_RESPONSE_COMPLETE")
        try:
            self._export(trace)
        except Exception:  # a trace is never worth a request: the request's answer goes out regardless
            logger.exception("could not export the trace of a request to model %s", trace.model_name)

    def close(self) -> None:
        """Write or export what is still held (at shutdown)."""
        self._export.close()
