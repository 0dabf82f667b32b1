"""Python models' custom metrics (``pb_utils.MetricFamily`` and ``Metric``), one registry per server.

Triton keeps them in its server's registry and writes them on /metrics beside its own; a model's
objects (in a stub process, or here in a worker process or on a thread of the server) act on it
through the server, each call answered there, so two instances that make the same metric (family
name and labels) share one series, and ``value()`` reads the shared value. What it refuses, it
refuses in the words of Triton 2.51 (run with ``run_triton.sh``, session 53): a name that is no
Prometheus name, a family name taken by another kind, a counter decremented, buckets out of order,
an operation the kind has not. A family keeps the first description it was made with, as Triton's
does; a name of the server's own families (``nv_``, ``shoal_``, ``process_``) is refused, so a model
can neither fake the server's figures nor write a page with a family twice.

Lifetimes: a family lives while a ``MetricFamily`` object made for it lives (each is one hold, given
back when it is collected, ``release``: deferred, as a collection may run inside this registry's
lock) and while its maker does (``release_holder``: a worker process that ended, a thread instance
unloaded); its series live as long as the family, as Triton keeps a series whose ``Metric`` is gone.
An operation on a series whose family went raises Triton's words for it.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import re
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COUNTER, GAUGE, HISTOGRAM = 0, 1, 2  # pb_utils.MetricFamily's kinds
KIND_NAMES = {COUNTER: "COUNTER", GAUGE: "GAUGE", HISTOGRAM: "HISTOGRAM"}
_TYPES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# The server's own families: Triton's, Shoal's, and prometheus_client's process collector's.
SERVER_PREFIXES = ("nv_", "shoal_", "process_")
FAMILY_DELETED = (
    "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The 'MetricFamily' "
    "object should be deleted AFTER its corresponding 'Metric' objects have been deleted."
)


class CustomMetricError(Exception):
    """A request the registry refuses, in Triton's words (``str(error)``)."""


def _unsupported(kind: int, operation: str) -> CustomMetricError:
    return CustomMetricError(f"TRITONSERVER_METRIC_KIND_{KIND_NAMES[kind]} does not support {operation}")


@dataclass
class _Series:
    kind: int
    labels: tuple[tuple[str, str], ...]  # sorted by name, as prometheus-cpp writes them
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, ascending
    value: float = 0.0  # a counter's or a gauge's; a histogram's sum
    counts: list[int] = field(default_factory=list)  # a histogram's observations per bucket, then past the last


@dataclass
class _Family:
    name: str
    description: str
    kind: int
    series: dict[tuple[tuple[str, str], ...], int] = field(default_factory=dict)  # labels -> series id
    holds: collections.Counter[Hashable] = field(default_factory=collections.Counter)  # by holder


class CustomMetrics:
    """The server's custom metric families and their series, safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._series: dict[int, _Series] = {}
        self._ids = itertools.count(1)
        # Given back, not yet counted: (family name, holder), and holders gone with everything they held.
        self._released: collections.deque[tuple[str, Hashable]] = collections.deque()
        self._gone: collections.deque[Hashable] = collections.deque()

    def family(self, name: Any, description: Any, kind: Any, holder: Hashable = None) -> None:
        """A hold on the family, made if new (the first description stays): refused if the name is no
        Prometheus name, the server's own, or taken by another kind."""
        if not isinstance(name, str) or not isinstance(description, str) or kind not in KIND_NAMES:
            raise TypeError("a metric family is made of a name (str), a description (str) and a kind")
        if not _utf8(description):
            raise TypeError("a metric family's description must be text that UTF-8 can encode")
        if not _METRIC_NAME.fullmatch(name):
            raise CustomMetricError("Invalid metric name")
        if name.startswith(SERVER_PREFIXES):
            raise CustomMetricError(f"Invalid metric name: the server's own families start with {SERVER_PREFIXES}")
        with self._lock:
            self._count_releases()
            found = self._families.get(name)
            if found is None:
                found = self._families[name] = _Family(name, description, kind)
            elif found.kind != kind:
                raise CustomMetricError("Family name already exists with different type")
            found.holds[holder] += 1

    def metric(self, name: Any, labels: Any, buckets: Any = None) -> int:
        """The id of the series of family ``name`` with ``labels``, made if new (a histogram keeps the
        buckets it was made with, as Triton's)."""
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise CustomMetricError("attempt to access JSON non-string as string")
        if not all(_LABEL_NAME.fullmatch(key) and not key.startswith("__") for key in labels):
            raise CustomMetricError("Invalid label name")
        if not all(_utf8(value) for value in labels.values()):  # a page that cannot be encoded fails every scrape
            raise CustomMetricError("a label value must be text that UTF-8 can encode")
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._count_releases()
            family = self._families.get(name) if isinstance(name, str) else None
            if family is None:
                raise CustomMetricError(FAMILY_DELETED)
            series_id = family.series.get(key)
            if series_id is not None:
                return series_id
            bounds: tuple[float, ...] = ()
            if family.kind == HISTOGRAM:
                if "le" in labels:
                    raise CustomMetricError("Invalid label name")
                bounds = _buckets(buckets)
            series_id = next(self._ids)
            counts = [0] * (len(bounds) + 1) if family.kind == HISTOGRAM else []
            self._series[series_id] = _Series(family.kind, key, bounds, 0.0, counts)
            family.series[key] = series_id
            return series_id

    def increment(self, series_id: int, value: Any) -> None:
        value = _number_of(value)
        with self._lock:
            series = self._live(series_id)
            if series.kind == HISTOGRAM:
                raise _unsupported(series.kind, "Increment")
            if series.kind == COUNTER and value < 0:  # NaN passes, as Triton's core lets it
                raise CustomMetricError(
                    "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values."
                )
            series.value += value

    def set(self, series_id: int, value: Any) -> None:
        value = _number_of(value)
        with self._lock:
            series = self._live(series_id)
            if series.kind != GAUGE:
                raise _unsupported(series.kind, "Set")
            series.value = value

    def observe(self, series_id: int, value: Any) -> None:
        value = _number_of(value)
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

    def release(self, name: str, holder: Hashable = None) -> None:
        """Give back one hold on family ``name`` (from a finalizer: counted at the next call)."""
        if isinstance(name, str):  # anything else names no family (a worker's junk fails nobody's next call)
            self._released.append((name, holder))

    def release_holder(self, holder: Hashable) -> None:
        """Give back every hold ``holder`` has (its worker ended, its instance was unloaded)."""
        self._gone.append(holder)

    def _live(self, series_id: Any) -> _Series:
        self._count_releases()
        series = self._series.get(series_id) if isinstance(series_id, int) else None
        if series is None:
            raise CustomMetricError(FAMILY_DELETED)
        return series

    def _count_releases(self) -> None:
        """Lock held: a family no longer held goes, with its series."""
        while self._released:
            name, holder = self._released.popleft()
            family = self._families.get(name)
            if family is not None and family.holds[holder] > 0:
                family.holds[holder] -= 1
                self._drop_if_unheld(family)
        while self._gone:
            holder = self._gone.popleft()
            for family in list(self._families.values()):
                family.holds.pop(holder, None)
                self._drop_if_unheld(family)

    def _drop_if_unheld(self, family: _Family) -> None:
        if +family.holds:  # holds above zero remain
            return
        del self._families[family.name]
        for series_id in family.series.values():
            del self._series[series_id]

    def text(self) -> str:
        """The families in Prometheus' text format, as Triton writes them (HELP, TYPE, then each series;
        a histogram's as ``_count``, ``_sum`` and one ``_bucket`` per bound, ``le`` last, then +Inf)."""
        lines = []
        with self._lock:
            self._count_releases()
            for family in self._families.values():
                name, kind = family.name, family.kind
                lines += [f"# HELP {name} {_escape_help(family.description)}", f"# TYPE {name} {_TYPES[kind]}"]
                for series in (self._series[i] for i in family.series.values()):
                    if kind != HISTOGRAM:
                        lines.append(f"{name}{_labels(series.labels)} {_number(series.value)}")
                        continue
                    lines.append(f"{name}_count{_labels(series.labels)} {sum(series.counts)}")
                    lines.append(f"{name}_sum{_labels(series.labels)} {_number(series.value)}")
                    running = 0
                    for bound, count in zip((*series.buckets, math.inf), series.counts, strict=True):
                        running += count
                        lines.append(f"{name}_bucket{_labels((*series.labels, ('le', _number(bound))))} {running}")
        return "".join(line + "\n" for line in lines)


def _buckets(buckets: Any) -> tuple[float, ...]:
    if not isinstance(buckets, Sequence) or not all(isinstance(b, int | float) for b in buckets):
        raise CustomMetricError("Failed to create metric. Missing required buckets.")
    bounds = tuple(float(b) for b in buckets)
    if any(not low < high for low, high in itertools.pairwise(bounds)):
        raise CustomMetricError("Bucket Boundaries must be strictly sorted")
    return bounds


def _number_of(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a metric's value is a number, not {type(value).__name__}")
    return float(value)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Sequence[tuple[str, str]]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in labels) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate (a file name read as surrogateescape'd bytes)
        return False
    return True


def _number(value: float) -> str:
    """As Triton 2.51 writes a value on its page (``%.16g``, and ``Nan``, ``+Inf``, ``-Inf``): 4, 2.5,
    100000, 0.3 for 0.1 + 0.2, 1e+16 (the review of session 53 compared them with Triton's, value by value)."""
    if math.isnan(value):
        return "Nan"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.16g}"


class InstanceMetrics:
    """A thread instance's way to the registry, named for the errors Triton words with the instance's
    name; its holds are given back at the instance's unload (``close``), or, with ``holder`` None (a
    family made on a thread a model started, which no instance owns), only as its objects are collected."""

    def __init__(self, registry: CustomMetrics, instance_name: str, own_holds: bool = True) -> None:
        self._registry, self.instance_name = registry, instance_name
        self._holder: Hashable = object() if own_holds else None

    def family(self, name: str, description: str, kind: int) -> None:
        self._registry.family(name, description, kind, self._holder)

    def metric(self, name: str, labels: dict[str, str], buckets: list[float] | None) -> int:
        return self._registry.metric(name, labels, buckets)

    def increment(self, series_id: int, value: float) -> None:
        self._registry.increment(series_id, value)

    def set(self, series_id: int, value: float) -> None:
        self._registry.set(series_id, value)

    def observe(self, series_id: int, value: float) -> None:
        self._registry.observe(series_id, value)

    def value(self, series_id: int) -> float:
        return self._registry.value(series_id)

    def release(self, name: str) -> None:
        self._registry.release(name, self._holder)

    def close(self) -> None:
        """Give back every hold this instance's families have (its unload)."""
        if self._holder is not None:
            self._registry.release_holder(self._holder)


REGISTRY = CustomMetrics()  # the server's: its models' metrics, written on its /metrics page
