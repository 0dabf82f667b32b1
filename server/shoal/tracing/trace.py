"""One sampled request: its timestamps by Triton's names, and the traces of the requests it made.

Timestamps are ``time.monotonic_ns`` (one clock for every process of the server on Linux, so a
front-end worker's receive time is comparable): ``HTTP_RECV_START`` when the HTTP transport began
reading the request (its head was parsed) and ``HTTP_RECV_END`` when it had its body;
``GRPC_WAITREAD_START`` and ``GRPC_WAITREAD_END`` both when the gRPC handler got the decoded request
(the engine reads it before: Triton's ``GRPC_WAITREAD_START`` is when it posted its handler state,
often seconds before the request); ``REQUEST_START`` when the core took it, ``QUEUE_START`` when
its model's scheduler queued it, ``COMPUTE_START``, ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``
and ``COMPUTE_END`` of the batch that ran it, ``REQUEST_END`` and ``INFER_RESPONSE_COMPLETE`` when
its response was ready (a decoupled model's request: ``INFER_RESPONSE_COMPLETE`` at its first
response, ``REQUEST_END`` when its execution ended); then ``<PROTOCOL>_SEND_START`` and
``<PROTOCOL>_SEND_END`` around each response the transport wrote (reported through ``Core.sent``;
a decoupled model's request has a pair per response written). The scheduler reports the batch's
times through ``executed`` (``statistics.TRACED`` carries the trace to it); an ensemble's steps are
child traces.

At the ``TENSORS`` level a trace also keeps its request's tensors, as Triton's trace file writes
them: ``TENSOR_QUEUE_INPUT`` per input and ``TENSOR_BACKEND_OUTPUT`` per output of each response,
each element written as Triton writes it (C++ ``ostream``: integers in decimal, floats with 6
significant digits, BOOL as 1/0, BYTES each in quotes), comma-separated. Where Shoal differs on
purpose: INT8/UINT8 are numbers (Triton writes them as characters), FP16/BF16 have their values
(Triton writes ""), and a string's quotes and backslashes are escaped and a byte that is not
UTF-8 is written \\xNN (Triton writes them raw: its file is then not JSON).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from shoal.protocol.types import DataType
from shoal.statistics import Phases

logger = logging.getLogger(__name__)

_ids = itertools.count(1)  # Triton's trace ids: one counter for the process, an ensemble's steps included
# The traces of requests still running, by id: a Python model's BLS call names its request's trace by id
# (InferenceRequest(trace=...)), from its own process. Used from the serving loop only.
_live: dict[int, RequestTrace] = {}


def live_trace(trace_id: int) -> RequestTrace | None:
    return _live.get(trace_id)


class Origin(NamedTuple):
    """Where a request came from, as its transport saw it: ``protocol`` GRPC or HTTP, when it had the
    whole request, and the client's W3C trace context (``traceparent``/``tracestate``; "" if none).
    A tuple: the one thing a transport makes per request for tracing, on or off."""

    protocol: str
    received_ns: int
    traceparent: str = ""
    tracestate: str = ""
    started_ns: int = 0  # when the transport began reading it (0: when it had it, ``received_ns``)


class TensorRecord(NamedTuple):
    """One tensor as Triton's trace file writes it (``activity``, then ``tensor``'s four strings)."""

    activity: str  # TENSOR_QUEUE_INPUT or TENSOR_BACKEND_OUTPUT
    name: str
    data: str
    shape: str
    dtype: str


def tensor_record(activity: str, name: str, array: np.ndarray) -> TensorRecord:
    """``array`` as a trace record: its elements in row-major order, as Triton writes them."""
    datatype = DataType.from_numpy(array.dtype)
    flat = np.asarray(array).reshape(-1)
    if datatype is DataType.BYTES:
        # Quotes and backslashes escaped, then a byte that is not UTF-8 as \xNN: each element reads back.
        raw = (v if isinstance(v, bytes) else str(v).encode() for v in flat)
        escaped = (v.replace(b"\\", b"\\\\").replace(b'"', b'\\"').decode("utf-8", "backslashreplace") for v in raw)
        data = ",".join(f'"{text}"' for text in escaped)
    elif datatype is DataType.BOOL:
        data = ",".join("1" if v else "0" for v in flat.tolist())
    elif datatype.value.startswith(("FP", "BF")):
        data = ",".join(format(v, "g") for v in flat.astype(np.float64).tolist())
    else:
        data = ",".join(str(v) for v in flat.tolist())
    return TensorRecord(activity, name, data, ",".join(str(d) for d in array.shape), datatype.value)


@dataclass
class RequestTrace:
    model_name: str
    model_version: str
    request_id: str
    origin: Origin | None  # None: a step of another request
    parent: RequestTrace | None = None
    id: int = field(default_factory=lambda: next(_ids))
    stamps: list[tuple[str, int]] = field(default_factory=list)
    children: list[RequestTrace] = field(default_factory=list)
    computed: bool = False  # a batch ran it (an ensemble's own trace has none)
    error: str = ""
    timestamps: bool = True  # the level has TIMESTAMPS (at TENSORS alone Triton writes no timestamps)
    tensors: list[TensorRecord] | None = None  # the level has TENSORS: the request's tensors
    _queued: bool = field(default=False, repr=False)  # its inputs were recorded (the first queue only)
    # OpenTelemetry mode: the ids its spans will have, chosen at its start so that a Python model can
    # continue the trace while it runs (``pb_utils`` ``trace().get_context()``); 0: none chosen.
    otel_trace_id: int = 0
    span_id: int = 0  # the model span's
    sent_all: bool = False  # its transport reported its last response's send (or that none goes out)

    def stamp(self, name: str, ns: int | None = None) -> None:
        self.stamps.append((name, time.monotonic_ns() if ns is None else ns))

    def record_tensors(self, activity: str, arrays: Mapping[str, Any]) -> None:
        """At the TENSORS level: ``arrays`` (name -> array) as records of ``activity``; else nothing. A
        tensor that cannot be written (a dtype no request carries, no memory for its text) drops the
        trace's tensors and is logged: a trace is never worth its request."""
        if self.tensors is None:
            return
        try:
            self.tensors += [tensor_record(activity, name, np.asarray(array)) for name, array in arrays.items()]
        except Exception:  # noqa: BLE001 - whatever it is, the request goes on
            self.tensors = None
            logger.exception("model %s: could not trace a request's tensors; its trace keeps none", self.model_name)

    def queued(self, inputs: Mapping[str, Any]) -> None:
        """Its scheduler queued it with ``inputs`` (recorded at the TENSORS level). Once: a scheduler that
        queues it again inside another (the oldest sequence strategy's lane) queues a built feed."""
        if not self._queued:
            self._queued = True
            self.record_tensors("TENSOR_QUEUE_INPUT", inputs)

    def executed(self, queued_ns: int, started_ns: int, phases: Phases, outputs: Any) -> None:
        """Its batch's times, from the scheduler that ran it, and (TENSORS) its outputs (a decoupled
        model's request has none here: its responses are recorded as they are sent)."""
        if isinstance(outputs, Mapping):
            self.record_tensors("TENSOR_BACKEND_OUTPUT", outputs)
        input_end = started_ns + phases.input_ns
        output_start = input_end + phases.infer_ns
        self.stamps += [
            ("QUEUE_START", queued_ns),
            ("COMPUTE_START", started_ns),
            ("COMPUTE_INPUT_END", input_end),
            ("COMPUTE_OUTPUT_START", output_start),
            ("COMPUTE_END", output_start + phases.output_ns),
        ]
        self.computed = True

    def child(self, model_name: str, model_version: str) -> RequestTrace:
        """The trace of a request this one makes (an ensemble's step, a BLS call), live until the top one ends."""
        step = RequestTrace(
            model_name,
            model_version,
            "",
            None,
            parent=self,
            timestamps=self.timestamps,
            tensors=None if self.tensors is None else [],
            otel_trace_id=self.otel_trace_id,
            span_id=random_span_id() if self.span_id else 0,
        )
        step.stamp("REQUEST_START")
        self.children.append(step)
        _live[step.id] = step
        return step

    def begin(self) -> None:
        """Live: a BLS call may name it until ``end``."""
        _live[self.id] = self

    def end(self) -> None:
        """Neither it nor the traces under it can be named any more."""
        _live.pop(self.id, None)
        for step in self.children:
            step.end()

    def when(self, name: str) -> int | None:
        return next((ns for stamp, ns in self.stamps if stamp == name), None)

    def context(self) -> str:
        """Triton's trace context of its model span, as a Python model's ``trace().get_context()`` gives
        it: ``{"traceparent": ...}`` (and the client's ``tracestate``) in OpenTelemetry mode; "" else."""
        if not self.span_id:
            return ""
        carrier = {"traceparent": f"00-{self.otel_trace_id:032x}-{self.span_id:016x}-01"}
        top = self
        while top.parent is not None:
            top = top.parent
        origin = top.origin
        if origin is not None and valid_traceparent(origin.traceparent):
            if tracestate := clients_tracestate(origin.tracestate):
                carrier["tracestate"] = tracestate
        return json.dumps(carrier, separators=(",", ":"))


# W3C's bound on a tracestate header; a longer one is dropped (the trace still continues the client's).
MAX_TRACESTATE_CHARS = 512
# W3C trace context: version-traceid-parentid-flags, lower-case hex; all-zero ids are invalid.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def valid_traceparent(text: str) -> bool:
    """A client's trace context the spans continue (a malformed one is ignored, as Triton's): the one
    test that decides it, for sampling, for the ids a trace chooses and for its spans."""
    return bool(text) and _TRACEPARENT.fullmatch(text) is not None and not text.startswith("ff")


def clients_tracestate(tracestate: str) -> str:
    """The client's ``tracestate`` as the spans carry it: "" when over-long or malformed (the SDK's
    parse, which drops a malformed one; its warning is silenced in ``export``)."""
    if not tracestate or len(tracestate) > MAX_TRACESTATE_CHARS:
        return ""
    from opentelemetry.trace.span import TraceState  # OpenTelemetry mode only

    return str(TraceState.from_header([tracestate]).to_header())


def random_span_id() -> int:
    return random.getrandbits(64) or 1


def random_trace_id() -> int:
    return random.getrandbits(128) or 1


def transport_stamps(origin: Origin) -> list[tuple[str, int]]:
    """When the transport began reading the request and when it had it, by Triton's names."""
    started, received = ("WAITREAD_START", "WAITREAD_END") if origin.protocol == "GRPC" else ("RECV_START", "RECV_END")
    return [
        (f"{origin.protocol}_{started}", origin.started_ns or origin.received_ns),
        (f"{origin.protocol}_{received}", origin.received_ns),
    ]


Exporter = Callable[[RequestTrace], None]
