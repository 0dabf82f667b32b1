"""One sampled request: its timestamps by Triton's names, and the traces of the requests it made.

Timestamps are ``time.monotonic_ns`` (one clock for every process of the server on Linux, so a
front-end worker's receive time is comparable): ``<PROTOCOL>_RECV_END`` / ``GRPC_WAITREAD_END``
when the transport had the request, ``REQUEST_START`` when the core took it, ``QUEUE_START`` when
its model's scheduler queued it, ``COMPUTE_START``, ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``
and ``COMPUTE_END`` of the batch that ran it, ``REQUEST_END`` and ``INFER_RESPONSE_COMPLETE`` when
its response was ready (a decoupled model's request: ``INFER_RESPONSE_COMPLETE`` at its first
response, ``REQUEST_END`` when its execution ended). The scheduler reports the batch's times through ``executed``
(``statistics.TRACED`` carries the trace to it); an ensemble's steps are child traces.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from shoal.statistics import Phases

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

    def stamp(self, name: str, ns: int | None = None) -> None:
        self.stamps.append((name, time.monotonic_ns() if ns is None else ns))

    def executed(self, queued_ns: int, started_ns: int, phases: Phases) -> None:
        """Its batch's times, from the scheduler that ran it."""
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
        step = RequestTrace(model_name, model_version, "", None, parent=self)
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


def received_stamp(origin: Origin) -> str:
    """Triton's name for the time the transport had the whole request."""
    return "GRPC_WAITREAD_END" if origin.protocol == "GRPC" else f"{origin.protocol}_RECV_END"


Exporter = Callable[[RequestTrace], None]
