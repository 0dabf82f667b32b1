"""Per model-version inference statistics, with Triton's meaning (ModelStatistics RPC).

- ``success``/``fail``: count of requests and the sum of their end-to-end durations
  (from arrival at the model to the response being ready);
- ``queue``: per successful request, time from enqueue to the start of its batch;
- ``compute_input``/``compute_infer``/``compute_output``: per successful request, the
  durations of its batch's phases (gather inputs, execute, scatter outputs);
- ``inference_count``: batch elements inferred; ``execution_count``: executions;
- ``batch_stats``: per executed batch size, the count of executions and their phase times;
- ``cache_hit``/``cache_miss``: requests the response cache answered (their lookup time), and
  successful ones it did not (their lookup and insertion time); a hit is also a success, with its
  queue time, but no execution, inference or compute time;
- ``executing`` (Shoal's own, a gauge): requests whose batch is executing now;
- ``failures``: failed requests by ``FailureReason`` (Triton's ``reason`` label of
  ``nv_inference_request_failure``); they sum to ``fail.count``.

Durations are nanoseconds from ``time.monotonic_ns``; ``last_inference`` is milliseconds
since the epoch. Updated from the event loop only, so no lock is needed, except by ``latencies``
(``--metrics-config summary_latencies=true``): the latencies of the last minute, whose quantiles
the metrics thread reads while the loop adds to them.
"""

from __future__ import annotations

import contextvars
import enum
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddsketch import DDSketch


class FailureReason(enum.Enum):
    """Why a request failed, in Triton's words (the ``reason`` label of its failure counter)."""

    REJECTED = "REJECTED"  # turned away by the scheduler: its queue was full, or its queue timeout expired
    CANCELED = "CANCELED"  # the client went away while the request waited in the queue
    BACKEND = "BACKEND"  # the execution of its batch failed
    OTHER = "OTHER"  # anything else: a request the model refused (inputs, parameters)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(frozen=True)
class Phases:
    """Phase durations of one executed batch, in nanoseconds."""

    input_ns: int
    infer_ns: int
    output_ns: int


@dataclass
class PhaseTotals:
    """Compute phases summed over the requests one caller made, whichever models ran them: Triton's
    secondary stats aggregator, through which an ensemble reports its steps' compute time as its own."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0

    def add(self, phases: Phases) -> None:
        self.input_ns += phases.input_ns
        self.infer_ns += phases.infer_ns
        self.output_ns += phases.output_ns

    def phases(self) -> Phases:
        return Phases(self.input_ns, self.infer_ns, self.output_ns)


class Traced(Protocol):
    """A sampled request's trace (``shoal.tracing.trace.RequestTrace``), as a scheduler sees it."""

    def queued(self, inputs: Mapping[str, Any]) -> None: ...

    def executed(self, queued_ns: int, started_ns: int, phases: Phases, outputs: Any) -> None: ...


# The trace of the request being submitted (set by the core, and by an ensemble for each step), which the
# scheduler keeps with the queued request and tells its batch's times; None for a request not traced.
TRACED: contextvars.ContextVar[Traced | None] = contextvars.ContextVar("traced", default=None)


# Set by a caller (an ensemble) around the requests it makes; a scheduler adds each of those requests'
# phases to it as well as to its own model's statistics. A context variable, so that it follows the
# request into the composing model's scheduler without a parameter on every call in between.
ALSO_COUNT_PHASES: contextvars.ContextVar[PhaseTotals | None] = contextvars.ContextVar(
    "also_count_phases", default=None
)


# Triton's summaries (prometheus-cpp's Summary): quantiles over the last minute, kept in five buckets
# of 12 s, so an observation leaves them 48 to 60 s after it was made.
WINDOW_S = 60.0
WINDOW_BUCKETS = 5
# Each quantile is within 1% of a latency observed in the window (DDSketch's guarantee, on the value;
# Triton's CKMS bounds the rank instead). A sketch takes ~1 µs per latency here.
RELATIVE_ACCURACY = 0.01


class WindowedQuantiles:
    """Quantiles of the values added in the last ``WINDOW_S`` seconds.

    Each value goes into the sketch of its 12 s bucket only (one add); a reader merges the buckets
    still in the window. ``clock`` is ``time.monotonic``, a test's own clock in tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._bucket_s = WINDOW_S / WINDOW_BUCKETS
        self._buckets: dict[int, DDSketch] = {}  # bucket number (time // bucket_s) -> its sketch
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        number = int(self._clock() // self._bucket_s)
        with self._lock:
            sketch = self._buckets.get(number)
            if sketch is None:
                sketch = self._buckets[number] = DDSketch(RELATIVE_ACCURACY)
                for old in [n for n in self._buckets if n <= number - WINDOW_BUCKETS]:
                    del self._buckets[old]
            sketch.add(value)

    def quantiles(self, qs: tuple[float, ...]) -> list[float]:
        """The value at each quantile in ``qs``; NaN for each when the window holds nothing."""
        newest = int(self._clock() // self._bucket_s)
        merged = DDSketch(RELATIVE_ACCURACY)
        with self._lock:
            for number, sketch in self._buckets.items():
                if number > newest - WINDOW_BUCKETS:
                    merged.merge(sketch)
        if merged.count == 0:
            return [math.nan] * len(qs)
        return [float(merged.get_quantile_value(q) or 0.0) for q in qs]


@dataclass
class LatencyWindows:
    """The latencies (µs) of the last minute behind Triton's five ``nv_inference_*_summary_us``: each
    successful request's duration and queue time (cache hits too), and its batch's compute phases;
    each named as the ModelStatistics duration that counts and sums the same latencies."""

    success: WindowedQuantiles = field(default_factory=WindowedQuantiles)
    queue: WindowedQuantiles = field(default_factory=WindowedQuantiles)
    compute_input: WindowedQuantiles = field(default_factory=WindowedQuantiles)
    compute_infer: WindowedQuantiles = field(default_factory=WindowedQuantiles)
    compute_output: WindowedQuantiles = field(default_factory=WindowedQuantiles)

    def add(self, total_ns: int, queue_ns: int, phases: Phases | None) -> None:
        self.success.add(total_ns / 1000)
        self.queue.add(queue_ns / 1000)
        if phases is not None:
            self.compute_input.add(phases.input_ns / 1000)
            self.compute_infer.add(phases.infer_ns / 1000)
            self.compute_output.add(phases.output_ns / 1000)


# The durations of Triton's InferStatistics, in its order (both transports' statistics answers).
INFER_DURATIONS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


@dataclass
class ModelStatistics:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batch_stats: dict[int, BatchStats] = field(default_factory=dict)
    executing: int = 0
    failures: dict[FailureReason, int] = field(default_factory=lambda: dict.fromkeys(FailureReason, 0))
    # The config's model_warmup at load: runs per copy and the wall time (not in Triton's ModelStatistics,
    # which has no such field: shoal_model_warmup_* metrics).
    warmup: Duration = field(default_factory=Duration)
    # The response cache (lifecycle/response_cache.py): lookups that found an answer, and those that did not
    # (their ns: the lookup and the insertion of the answer the execution gave).
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    # --metrics-config summary_latencies=true: set by the manager before the version takes traffic.
    latencies: LatencyWindows | None = None

    def record_execution(self, batch_size: int, phases: Phases, inferences: int | None = None) -> None:
        """One successful execution of ``batch_size`` elements, ``inferences`` of them real (default: all);
        the sequence batcher's null rows count in the batch size but, as in Triton, not as inferences."""
        self.execution_count += 1
        self.inference_count += batch_size if inferences is None else inferences
        self.last_inference_ms = time.time_ns() // 1_000_000
        stats = self.batch_stats.setdefault(batch_size, BatchStats())
        stats.compute_input.add(phases.input_ns)
        stats.compute_infer.add(phases.infer_ns)
        stats.compute_output.add(phases.output_ns)

    def record_success(self, total_ns: int, queue_ns: int, phases: Phases) -> None:
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(phases.input_ns)
        self.compute_infer.add(phases.infer_ns)
        self.compute_output.add(phases.output_ns)
        if self.latencies is not None:
            self.latencies.add(total_ns, queue_ns, phases)

    def record_cache_hit(self, total_ns: int, queue_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache: a success, with no execution or compute."""
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.cache_hit.add(lookup_ns)
        if self.latencies is not None:
            self.latencies.add(total_ns, queue_ns, None)

    def record_cache_miss(self, ns: int) -> None:
        """A successful request the cache did not have (already counted a success): its lookup and
        insertion, added to its duration too, as Triton's UpdateSuccessCacheMiss does."""
        self.success.ns += ns
        self.cache_miss.add(ns)

    def record_failure(self, total_ns: int, reason: FailureReason) -> None:
        self.fail.add(total_ns)
        self.failures[reason] += 1
