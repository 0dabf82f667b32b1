"""Prometheus metrics over HTTP, written as Triton 2.51 writes them, so its dashboards and alerts work unchanged.

Read from the same statistics ModelStatistics reports, at scrape time (nothing is added to the
request path but the summaries' latencies, when they are on). Triton's families, with its names,
TYPE and HELP lines and labels (checked against a capture of a real Triton in
``tests/data/triton_metrics.txt``):

- counters, labels ``model`` and ``version``: ``nv_inference_request_success``,
  ``nv_inference_count``, ``nv_inference_exec_count`` and the cumulative durations in µs
  ``nv_inference_{request,queue,compute_input,compute_infer,compute_output}_duration_us``;
- counter ``nv_inference_request_failure``, labels ``model``, ``reason``, ``version``: one sample per
  ``FailureReason`` (REJECTED, CANCELED, BACKEND, OTHER), all four from the first scrape, as Triton;
- gauge ``nv_inference_pending_request_count``;
- counters ``nv_cache_num_hits_per_model``, ``nv_cache_hit_duration_per_model``,
  ``nv_cache_num_misses_per_model``, ``nv_cache_miss_duration_per_model`` (µs), for the versions that
  use the response cache only, as Triton writes them;
- per GPU (label ``gpu_uuid``, through NVML where a driver is; ``--allow-gpu-metrics``):
  ``nv_gpu_utilization``, ``nv_gpu_memory_{total,used}_bytes``, ``nv_gpu_power_{usage,limit}``,
  ``nv_energy_consumption``;
- system-wide gauges, on Linux (from ``/proc``): ``nv_cpu_utilization`` (since the previous scrape),
  ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes`` (MemTotal - MemAvailable);
- with ``--metrics-config summary_latencies=true``, summaries ``nv_inference_{request,queue,
  compute_input,compute_infer,compute_output}_summary_us``: the quantiles of the last minute's
  latencies (``shoal.statistics.LatencyWindows``, the one thing this adds to the request path: one
  sketch add per family per successful request), ``_count`` and ``_sum`` those of the counters.

A counter's sample carries the family's own name, with no ``_total`` suffix (Triton's prometheus-cpp
writes them so; prometheus_client would add ``_total``), hence the small text writer here.
Shoal's own families follow: ``shoal_model_memory_bytes{device}`` (measured at load),
``shoal_model_instances``, ``shoal_model_executing_requests``, ``shoal_model_warmup_runs`` and
``shoal_model_warmup_duration_us`` (the config's model_warmup at load), then prometheus_client's process
collector (``process_resident_memory_bytes`` and the rest). The Python models' custom metrics
(``shoal.custom_metrics``) come between the two, written as Triton writes them.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from shoal import custom_metrics
from shoal.core import StatisticsRow
from shoal.errors import StartupError
from shoal.settings import MetricsSettings
from shoal.statistics import FailureReason

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; charset=utf-8"  # what Triton's metrics endpoint answers

Labels = dict[str, str]
DEFAULT_SETTINGS = MetricsSettings()


@dataclass
class Family:
    """One metric family: its TYPE and HELP lines and its samples, each named as the family."""

    name: str
    type: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)

    def add(self, labels: Labels, value: float) -> None:
        self.samples.append((labels, value))

    def text(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.type}"]
        lines += [f"{self.name}{_labels(labels)} {_number(value)}" for labels, value in self.samples]
        return "\n".join(lines) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    pairs = sorted(labels.items())  # prometheus-cpp sorts a sample's labels by name
    return "{" + ",".join(f'{name}="{_escape_label(value)}"' for name, value in pairs) + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    """Whole numbers without a decimal point, as Triton writes them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# Triton 2.51's families (metrics.cc): name -> (TYPE, HELP); the order is Triton's.
TRITON_MODEL_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_inference_request_success": ("counter", "Number of successful inference requests, all batch sizes"),
    "nv_inference_request_failure": ("counter", "Number of failed inference requests, all batch sizes"),
    "nv_inference_count": ("counter", "Number of inferences performed (does not include cached requests)"),
    "nv_inference_exec_count": ("counter", "Number of model executions performed (does not include cached requests)"),
    "nv_inference_request_duration_us": (
        "counter",
        "Cumulative inference request duration in microseconds (includes cached requests)",
    ),
    "nv_inference_queue_duration_us": (
        "counter",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
    ),
    "nv_inference_compute_input_duration_us": (
        "counter",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_compute_infer_duration_us": (
        "counter",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_compute_output_duration_us": (
        "counter",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_pending_request_count": (
        "gauge",
        "Instantaneous number of pending requests awaiting execution per-model.",
    ),
}
# Written only when a version uses the response cache (Triton creates them for those models only), between
# the durations and the pending count, as Triton 2.51 writes them (checked with run_triton.sh and
# --cache-config local,size=1048576).
TRITON_CACHE_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_cache_num_hits_per_model": ("counter", "Number of cache hits per model"),
    "nv_cache_hit_duration_per_model": ("counter", "Total cache hit duration per model, in microseconds"),
    "nv_cache_num_misses_per_model": ("counter", "Number of cache misses per model"),
    "nv_cache_miss_duration_per_model": (
        "counter",
        "Total cache miss (insert+lookup) duration per model, in microseconds",
    ),
}
# Per GPU, label gpu_uuid (Triton reads them from DCGM; Shoal from NVML, nvidia-ml-py), before the CPU's.
TRITON_GPU_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_gpu_utilization": ("gauge", "GPU utilization rate [0.0 - 1.0)"),
    "nv_gpu_memory_total_bytes": ("gauge", "GPU total memory, in bytes"),
    "nv_gpu_memory_used_bytes": ("gauge", "GPU used memory, in bytes"),
    "nv_gpu_power_usage": ("gauge", "GPU power usage in watts"),
    "nv_gpu_power_limit": ("gauge", "GPU power management limit in watts"),
    "nv_energy_consumption": ("counter", "GPU energy consumption in joules since the Triton Server started"),
}
TRITON_CPU_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_cpu_utilization": ("gauge", "CPU utilization rate [0.0 - 1.0]"),
    "nv_cpu_memory_total_bytes": ("gauge", "CPU total memory (RAM), in bytes"),
    "nv_cpu_memory_used_bytes": ("gauge", "CPU used memory (RAM), in bytes"),
}
# --metrics-config summary_latencies=true: Triton 2.51's summaries, after the CPU families, in Triton's order
# and words (captured with run_triton.sh); the ModelStatistics field that counts and sums each (its _count
# and _sum are those of the duration counter, as Triton's), which names the LatencyWindows of its quantiles too.
TRITON_SUMMARY_FAMILIES: dict[str, tuple[str, str]] = {
    "nv_inference_request_summary_us": (
        "success",
        "Summary of inference request duration in microseconds (includes cached requests)",
    ),
    "nv_inference_queue_summary_us": (
        "queue",
        "Summary of inference queuing duration in microseconds (includes cached requests)",
    ),
    "nv_inference_compute_input_summary_us": (
        "compute_input",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_compute_infer_summary_us": (
        "compute_infer",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    ),
    "nv_inference_compute_output_summary_us": (
        "compute_output",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    ),
}
# Duration families -> the ModelStatistics field they sum (ns there, whole µs here).
_DURATION_FIELDS = {
    "nv_inference_request_duration_us": "success",
    "nv_inference_queue_duration_us": "queue",
    "nv_inference_compute_input_duration_us": "compute_input",
    "nv_inference_compute_infer_duration_us": "compute_infer",
    "nv_inference_compute_output_duration_us": "compute_output",
}


def triton_family(name: str) -> Family:
    """An empty family with Triton's TYPE and HELP."""
    kind, text = {**TRITON_MODEL_FAMILIES, **TRITON_CACHE_FAMILIES, **TRITON_GPU_FAMILIES, **TRITON_CPU_FAMILIES}[name]
    return Family(name, kind, text)


@dataclass
class SummaryFamily:
    """A summary, as prometheus-cpp writes one: per label set its ``_count``, ``_sum``, then each
    quantile, the ``quantile`` label last (not sorted in), whole µs, ``Nan`` for an empty window."""

    name: str
    help: str
    samples: list[tuple[Labels, int, int, list[tuple[float, float]]]] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} summary"]
        for labels, count, total, quantiles in self.samples:
            inner = _labels(labels)[1:-1]
            lines += [f"{self.name}_count{{{inner}}} {count}", f"{self.name}_sum{{{inner}}} {total}"]
            lines += [f'{self.name}{{{inner},quantile="{_number(q)}"}} {_quantile_value(v)}' for q, v in quantiles]
        return "\n".join(lines) + "\n"


def _quantile_value(value: float) -> str:
    return "Nan" if math.isnan(value) else str(round(value))


def summary_families(rows: Iterable[StatisticsRow], quantiles: tuple[float, ...]) -> list[SummaryFamily]:
    """Triton's five latency summaries, for the versions that keep their latencies."""
    families = []
    for name, (stat, text) in TRITON_SUMMARY_FAMILIES.items():
        family = SummaryFamily(name, text)
        for row in rows:
            windows = row.statistics.latencies
            if windows is None:
                continue
            duration = getattr(row.statistics, stat)
            values = getattr(windows, stat).quantiles(quantiles)
            family.samples.append(
                (
                    {"model": row.name, "version": row.version},
                    duration.count,
                    duration.ns // 1000,
                    list(zip(quantiles, values, strict=True)),
                )
            )
        families.append(family)
    return families


def model_families(rows: Iterable[StatisticsRow], counter_latencies: bool = True) -> tuple[list[Family], list[Family]]:
    """Triton's per-model families and Shoal's own, from one ModelStatistics snapshot; without
    ``counter_latencies`` (``--metrics-config counter_latencies=false``), no duration counters."""
    families = {
        name: triton_family(name) for name in TRITON_MODEL_FAMILIES if counter_latencies or name not in _DURATION_FIELDS
    }
    cache = {name: triton_family(name) for name in TRITON_CACHE_FAMILIES}
    memory = Family("shoal_model_memory_bytes", "gauge", "Bytes of weights a model version holds on a device")
    instances = Family("shoal_model_instances", "gauge", "Executors of a model version")
    executing = Family("shoal_model_executing_requests", "gauge", "Requests whose batch is executing now")
    warmup_runs = Family("shoal_model_warmup_runs", "gauge", "model_warmup runs per copy at load")
    warmup_time = Family("shoal_model_warmup_duration_us", "gauge", "Wall time of the version's model_warmup at load")
    for row in rows:
        stats = row.statistics
        labels = {"model": row.name, "version": row.version}
        families["nv_inference_request_success"].add(labels, stats.success.count)
        for reason in FailureReason:
            families["nv_inference_request_failure"].add(
                {"model": row.name, "reason": reason.value, "version": row.version}, stats.failures[reason]
            )
        families["nv_inference_count"].add(labels, stats.inference_count)
        families["nv_inference_exec_count"].add(labels, stats.execution_count)
        for name, stat in _DURATION_FIELDS.items():
            if counter_latencies:
                families[name].add(labels, getattr(stats, stat).ns // 1000)
        families["nv_inference_pending_request_count"].add(labels, row.pending)
        if row.cached:
            cache["nv_cache_num_hits_per_model"].add(labels, stats.cache_hit.count)
            cache["nv_cache_hit_duration_per_model"].add(labels, stats.cache_hit.ns // 1000)
            cache["nv_cache_num_misses_per_model"].add(labels, stats.cache_miss.count)
            cache["nv_cache_miss_duration_per_model"].add(labels, stats.cache_miss.ns // 1000)
        instances.add(labels, row.instances)
        executing.add(labels, stats.executing)
        warmup_runs.add(labels, stats.warmup.count)
        warmup_time.add(labels, stats.warmup.ns // 1000)
        for (kind, index), byte_size in row.memory_bytes.items():
            memory.add({"device": "cpu" if kind == "CPU" else f"gpu:{index}", **labels}, byte_size)
    pending = families.pop("nv_inference_pending_request_count")  # Triton writes the cache's before it
    tritons = [*families.values(), *(family for family in cache.values() if family.samples), pending]
    return tritons, [memory, instances, executing, warmup_runs, warmup_time]


class GpuMetrics:
    """Triton's per-GPU families through NVML (``pynvml``, from nvidia-ml-py); none where NVML does not
    load (no driver: a CPU host) or with ``--allow-gpu-metrics false``. A reading a device does not
    support (power on some boards) is left out of its family for that device."""

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self._devices: list[tuple[str, Any]] = []  # (uuid, handle)
        self._energy_start: dict[str, float] = {}  # mJ at start, per uuid: Triton counts from its own start
        self._lock = threading.Lock()
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            for index in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = self._nvml.nvmlDeviceGetUUID(handle)
                self._devices.append((uuid.decode() if isinstance(uuid, bytes) else str(uuid), handle))
        except Exception as exc:  # noqa: BLE001 - any NVML failure means no GPU families, as Triton without DCGM
            logger.debug("no GPU metrics: %s", exc)
            self._devices = []
        for uuid, handle in self._devices:
            energy = self._read(self._nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy is not None:
                self._energy_start[uuid] = energy

    def families(self) -> list[Family]:
        if not self._devices:
            return []
        families = {name: triton_family(name) for name in TRITON_GPU_FAMILIES}
        nvml = self._nvml
        with self._lock:  # scrapes run on the metrics server's threads
            for uuid, handle in self._devices:
                labels = {"gpu_uuid": uuid}
                utilization = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
                if utilization is not None:
                    families["nv_gpu_utilization"].add(labels, utilization.gpu / 100)
                memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
                if memory is not None:
                    families["nv_gpu_memory_total_bytes"].add(labels, memory.total)
                    families["nv_gpu_memory_used_bytes"].add(labels, memory.used)
                power = self._read(nvml.nvmlDeviceGetPowerUsage, handle)  # mW
                if power is not None:
                    families["nv_gpu_power_usage"].add(labels, power / 1000)
                limit = self._read(nvml.nvmlDeviceGetPowerManagementLimit, handle)  # mW
                if limit is not None:
                    families["nv_gpu_power_limit"].add(labels, limit / 1000)
                energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # mJ since the driver loaded
                if energy is not None and uuid in self._energy_start:
                    families["nv_energy_consumption"].add(labels, (energy - self._energy_start[uuid]) / 1000)
        return [family for family in families.values() if family.samples]

    @staticmethod
    def _read(function: Callable[[Any], Any], handle: Any) -> Any:
        try:
            return function(handle)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported and the like: that reading is left out
            return None


class CpuMetrics:
    """Triton's system-wide CPU families from /proc; utilization over the time since the previous scrape."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._lock = threading.Lock()
        self._previous: tuple[int, int] | None = None  # (busy, total) jiffies

    def families(self) -> list[Family]:
        try:
            fields = [int(x) for x in (self.proc / "stat").read_text().splitlines()[0].split()[1:9]]
            meminfo = dict(line.split(":", 1) for line in (self.proc / "meminfo").read_text().splitlines())
            total_bytes = int(meminfo["MemTotal"].split()[0]) * 1024
            available_bytes = int(meminfo["MemAvailable"].split()[0]) * 1024
        except (OSError, ValueError, KeyError, IndexError):
            return []  # not Linux: Triton has no CPU metrics there either
        idle = fields[3] + fields[4]  # idle + iowait
        total = sum(fields)
        with self._lock:
            busy_before, total_before = self._previous or (0, 0)
            self._previous = (total - idle, total)
        elapsed = total - total_before
        utilization = triton_family("nv_cpu_utilization")
        utilization.add({}, (total - idle - busy_before) / elapsed if elapsed > 0 else 0.0)
        memory_total = triton_family("nv_cpu_memory_total_bytes")
        memory_total.add({}, total_bytes)
        memory_used = triton_family("nv_cpu_memory_used_bytes")
        memory_used.add({}, total_bytes - available_bytes)
        return [utilization, memory_total, memory_used]


class MetricsPage:
    """The whole /metrics text: Triton's families, Shoal's, then the process collector's."""

    def __init__(
        self,
        statistics_rows: Callable[[], list[StatisticsRow]],
        settings: MetricsSettings = DEFAULT_SETTINGS,
        gpu: GpuMetrics | None = None,
    ) -> None:
        self.statistics_rows = statistics_rows
        self.settings = settings
        self.gpu = gpu or (GpuMetrics() if settings.gpu_metrics else None)  # None: --allow-gpu-metrics false
        self.quantiles = tuple(q for q, _ in settings.summary_quantiles)
        self.cpu = CpuMetrics()
        self.process = CollectorRegistry()
        ProcessCollector(registry=self.process)

    def families(self) -> Iterator[Family | SummaryFamily]:
        rows = self.statistics_rows()
        tritons, shoals = model_families(rows, self.settings.counter_latencies)
        yield from tritons
        if self.gpu is not None:
            yield from self.gpu.families()
        yield from self.cpu.families()  # Triton's order: per-model families, CPU, then the summaries
        if self.settings.summary_latencies:
            yield from summary_families(rows, self.quantiles)
        yield from shoals

    def text(self) -> str:
        """Triton's and Shoal's families, the Python models' own (``pb_utils.MetricFamily``), the process's."""
        triton_and_shoal = "".join(family.text() for family in self.families())
        return triton_and_shoal + custom_metrics.REGISTRY.text() + generate_latest(self.process).decode()


def start_metrics_server(
    statistics_rows: Callable[[], list[StatisticsRow]],
    address: str,
    port: int,
    settings: MetricsSettings = DEFAULT_SETTINGS,
) -> int:
    """Serve /metrics on a background thread; returns the bound port. ``statistics_rows`` is called
    from that thread (the host's ``LocalCore.statistics_rows``)."""
    page = MetricsPage(statistics_rows, settings)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            try:
                body = page.text().encode()
            except Exception:
                logger.exception("a metrics scrape failed")
                self.send_error(500)
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            logger.debug("metrics: " + format, *args)

    try:
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (ThreadingHTTPServer,), {"address_family": family})
        server = server_class((address, port), Handler)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {address}:{port}: {exc.strerror}") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = int(server.server_port)
    logger.info("Started Metrics Service at %s:%d", address, bound)
    return bound
