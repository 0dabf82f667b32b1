"""Python models' custom metrics (``pb_utils.MetricFamily`` and ``Metric``), one registry per server.

Triton keeps them in its server's registry and writes them on /metrics beside its own; a model's
``Metric`` objects (in a stub process, or here in a worker process or on a thread of the server)
act on it through the server, each call answered there, so two instances that make the same metric
(family name and labels) share one series, and ``value()`` reads the shared value. What it refuses,
it refuses in the words of Triton 2.51's core (run with ``run_triton.sh``, session 53): a family name
taken by another kind, a counter decremented, an operation the kind has not. A family keeps the
first description it was made with, as Triton's does.

A series lives while something holds it: each ``Metric`` made is one hold, given back when the
object is collected (``release``, deferred: a collection may run inside this registry's own lock),
or, for a worker process's, all at once when the worker ends (``release_all``).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

COUNTER, GAUGE, HISTOGRAM = 0, 1, 2  # pb_utils.MetricFamily's kinds
KIND_NAMES = {COUNTER: "COUNTER", GAUGE: "GAUGE", HISTOGRAM: "HISTOGRAM"}
_TYPES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}


class CustomMetricError(Exception):
    """A request the registry refuses, in Triton's core's words (``str(error)``)."""


def _unsupported(kind: int, operation: str) -> CustomMetricError:
    return CustomMetricError(f"TRITONSERVER_METRIC_KIND_{KIND_NAMES[kind]} does not support {operation}")


@dataclass
class _Series:
    kind: int
    labels: tuple[tuple[str, str], ...]  # sorted by name, as prometheus-cpp writes them
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, ascending
    value: float = 0.0  # a counter's or a gauge's; a histogram's sum
    counts: list[int] = field(default_factory=list)  # a histogram's observations per bucket, then past the last
    holds: int = 0


@dataclass
class _Family:
    name: str
    description: str
    kind: int
    series: dict[tuple[tuple[str, str], ...], int] = field(default_factory=dict)  # labels -> series id


class CustomMetrics:
    """The server's custom metric families and their series, safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._series: dict[int, _Series] = {}
        self._family_of: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._released: collections.deque[int] = collections.deque()  # holds given back, not yet counted

    def family(self, name: str, description: str, kind: int) -> None:
        """Make the family, or find it (the first description stays): refused if the name has another kind."""
        if kind not in KIND_NAMES:
            raise CustomMetricError(f"Unknown metric family kind: {kind}")
        with self._lock:
            self._count_releases()
            found = self._families.get(name)
            if found is None:
                self._families[name] = _Family(name, description, kind)
            elif found.kind != kind:
                raise CustomMetricError("Family name already exists with different type")

    def metric(self, name: str, labels: Mapping[str, str], buckets: Sequence[float] | None = None) -> int:
        """A hold on the series of family ``name`` with ``labels`` (made if new); its id."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._count_releases()
            family = self._families.get(name)
            if family is None:
                raise CustomMetricError(f"Unknown metric family: {name}")
            series_id = family.series.get(key)
            if series_id is None:
                series_id = next(self._ids)
                bounds = tuple(sorted(float(b) for b in buckets)) if family.kind == HISTOGRAM and buckets else ()
                counts = [0] * (len(bounds) + 1) if family.kind == HISTOGRAM else []
                self._series[series_id] = _Series(family.kind, key, bounds, 0.0, counts)
                self._family_of[series_id] = name
                family.series[key] = series_id
            self._series[series_id].holds += 1
            return series_id

    def increment(self, series_id: int, value: float) -> None:
        with self._lock:
            series = self._live(series_id)
            if series.kind == HISTOGRAM:
                raise _unsupported(series.kind, "Increment")
            if series.kind == COUNTER and not value >= 0:
                raise CustomMetricError(
                    "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values."
                )
            series.value += value

    def set(self, series_id: int, value: float) -> None:
        with self._lock:
            series = self._live(series_id)
            if series.kind != GAUGE:
                raise _unsupported(series.kind, "Set")
            series.value = value

    def observe(self, series_id: int, value: float) -> None:
        with self._lock:
            series = self._live(series_id)
            if series.kind != HISTOGRAM:
                raise _unsupported(series.kind, "Observe")
            series.counts[bisect.bisect_left(series.buckets, value)] += 1  # a bucket counts values <= its bound
            series.value += value

    def value(self, series_id: int) -> float:
        with self._lock:
            series = self._live(series_id)
            if series.kind == HISTOGRAM:
                raise _unsupported(series.kind, "Value")
            return series.value

    def release(self, series_id: int) -> None:
        """Give back one hold (from a finalizer: counted at the next call, never under the caller's feet)."""
        self._released.append(series_id)

    def release_all(self, series_ids: Iterable[int]) -> None:
        self._released.extend(series_ids)

    def _live(self, series_id: int) -> _Series:
        self._count_releases()
        series = self._series.get(series_id)
        if series is None:
            raise CustomMetricError("Metric has been cleared")
        return series

    def _count_releases(self) -> None:
        """Lock held: a series no longer held leaves its family, and a family with no series goes."""
        while self._released:
            series_id = self._released.popleft()
            series = self._series.get(series_id)
            if series is None:
                continue
            series.holds -= 1
            if series.holds > 0:
                continue
            del self._series[series_id]
            family = self._families[self._family_of.pop(series_id)]
            del family.series[series.labels]
            if not family.series:
                del self._families[family.name]

    def text(self) -> str:
        """The families in Prometheus' text format, as Triton writes them (HELP, TYPE, then each series;
        a histogram's as ``_count``, ``_sum`` and one ``_bucket`` per bound, ``le`` last, then +Inf)."""
        with self._lock:
            self._count_releases()
            families = [
                (f.name, f.description, f.kind, [self._series[i] for i in f.series.values()])
                for f in self._families.values()
            ]
            lines = []
            for name, description, kind, all_series in families:
                lines += [f"# HELP {name} {_escape_help(description)}", f"# TYPE {name} {_TYPES[kind]}"]
                for series in all_series:
                    if kind != HISTOGRAM:
                        lines.append(f"{name}{_labels(series.labels)} {_number(series.value)}")
                        continue
                    lines.append(f"{name}_count{_labels(series.labels)} {sum(series.counts)}")
                    lines.append(f"{name}_sum{_labels(series.labels)} {_number(series.value)}")
                    running = 0
                    for bound, count in zip((*series.buckets, math.inf), series.counts, strict=True):
                        running += count
                        le = "+Inf" if bound == math.inf else _number(bound)
                        lines.append(f"{name}_bucket{_labels((*series.labels, ('le', le)))} {running}")
        return "".join(line + "\n" for line in lines)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Sequence[tuple[str, str]]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in labels) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    """Whole numbers without a decimal point, as Triton writes them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class InstanceMetrics:
    """A thread instance's way to the registry, named for the errors Triton words with the instance's
    name. It counts the holds its ``Metric`` objects took: each collected one gives its own back, and
    ``close`` (the instance's unload) gives back the rest, so an unloaded model's series leave /metrics
    then, not whenever a garbage collection frees its objects."""

    def __init__(self, registry: CustomMetrics, instance_name: str) -> None:
        self._registry, self.instance_name = registry, instance_name
        self._held: collections.Counter[int] = collections.Counter()
        self._released: collections.deque[int] = collections.deque()  # from finalizers: counted at the next call
        self._lock = threading.Lock()
        self._closed = False

    def family(self, name: str, description: str, kind: int) -> None:
        self._registry.family(name, description, kind)

    def metric(self, name: str, labels: dict[str, str], buckets: list[float] | None) -> int:
        series_id = self._registry.metric(name, labels, buckets)
        with self._lock:
            self._count_releases()
            if self._closed:  # made after the unload (a thread the model left): not this instance's to keep
                self._registry.release(series_id)
            else:
                self._held[series_id] += 1
        return series_id

    def increment(self, series_id: int, value: float) -> None:
        self._registry.increment(series_id, value)

    def set(self, series_id: int, value: float) -> None:
        self._registry.set(series_id, value)

    def observe(self, series_id: int, value: float) -> None:
        self._registry.observe(series_id, value)

    def value(self, series_id: int) -> float:
        return self._registry.value(series_id)

    def release(self, series_id: int) -> None:
        self._released.append(series_id)

    def close(self) -> None:
        """Give back every hold still taken (the instance is unloaded)."""
        with self._lock:
            self._count_releases()
            self._closed = True
            self._registry.release_all(self._held.elements())
            self._held.clear()

    def _count_releases(self) -> None:
        while self._released:
            series_id = self._released.popleft()
            if self._held[series_id] > 0:
                self._held[series_id] -= 1
                self._registry.release(series_id)


REGISTRY = CustomMetrics()  # the server's: its models' metrics, written on its /metrics page
