"""Prometheus metrics over HTTP, with Triton's metric names so existing dashboards work.

Read from the same statistics ModelStatistics reports, at scrape time (nothing is added to
the request path). Counters as Triton's: ``nv_inference_request_success``,
``nv_inference_request_failure``, ``nv_inference_count``, ``nv_inference_exec_count``, and
cumulative durations in µs: ``nv_inference_request_duration_us``,
``nv_inference_queue_duration_us``, ``nv_inference_compute_input_duration_us``,
``nv_inference_compute_infer_duration_us``, ``nv_inference_compute_output_duration_us``;
gauge ``nv_inference_pending_request_count``. Shoal's own: ``shoal_model_memory_bytes``
(measured at load, per device), ``shoal_model_instances`` and ``shoal_model_executing_requests``,
plus the process collector's ``process_resident_memory_bytes``. Labels: ``model`` and ``version``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shoal.core import Core
from shoal.errors import StartupError

logger = logging.getLogger(__name__)

_DURATIONS = {
    "nv_inference_request_duration_us": ("success", "Cumulative inference request duration in microseconds"),
    "nv_inference_queue_duration_us": ("queue", "Cumulative inference queuing duration in microseconds"),
    "nv_inference_compute_input_duration_us": ("compute_input", "Cumulative compute input duration in microseconds"),
    "nv_inference_compute_infer_duration_us": (
        "compute_infer", "Cumulative compute inference duration in microseconds"
    ),
    "nv_inference_compute_output_duration_us": (
        "compute_output", "Cumulative inference compute output duration in microseconds"
    ),
}


class ModelCollector(Collector):
    def __init__(self, core: Core) -> None:
        self.core = core

    def collect(self) -> Iterator[Any]:
        labels = ["model", "version"]
        success = CounterMetricFamily("nv_inference_request_success", "Number of successful inference requests",
                                      labels=labels)
        failure = CounterMetricFamily("nv_inference_request_failure", "Number of failed inference requests",
                                      labels=labels)
        count = CounterMetricFamily("nv_inference_count", "Number of inferences performed (batch rows)",
                                    labels=labels)
        executions = CounterMetricFamily("nv_inference_exec_count", "Number of model executions performed",
                                         labels=labels)
        durations = {name: CounterMetricFamily(name, text, labels=labels) for name, (_, text) in _DURATIONS.items()}
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting execution", labels=labels)
        memory = GaugeMetricFamily("shoal_model_memory_bytes", "Bytes of weights a model version holds on a device",
                                   labels=[*labels, "device"])
        instances = GaugeMetricFamily("shoal_model_instances", "Executors of a model version", labels=labels)
        executing = GaugeMetricFamily("shoal_model_executing_requests", "Requests whose batch is executing now",
                                      labels=labels)
        for row in self.core.model_statistics("", ""):
            stats = row.statistics
            values = [row.name, row.version]
            success.add_metric(values, stats.success.count)
            failure.add_metric(values, stats.fail.count)
            count.add_metric(values, stats.inference_count)
            executions.add_metric(values, stats.execution_count)
            for metric_name, (field, _) in _DURATIONS.items():
                durations[metric_name].add_metric(values, getattr(stats, field).ns / 1000)
            pending.add_metric(values, row.pending)
            instances.add_metric(values, row.instances)
            executing.add_metric(values, stats.executing)
            for (kind, index), byte_size in row.memory_bytes.items():
                memory.add_metric([*values, "cpu" if kind == "CPU" else f"gpu:{index}"], byte_size)
        yield from (success, failure, count, executions, *durations.values(), pending, memory, instances, executing)


def start_metrics_server(core: Core, address: str, port: int) -> int:
    """Serve /metrics on a background thread; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(ModelCollector(core))
    ProcessCollector(registry=registry)
    try:
        server, _thread = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {address}:{port}: {exc.strerror}") from None
    bound = int(server.server_port)
    logger.info("Started Metrics Service at %s:%d", address, bound)
    return bound
