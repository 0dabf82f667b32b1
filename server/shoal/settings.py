"""Server settings, filled by the CLI (Triton's flag names where one exists)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Exit codes of ``shoal serve`` (2 is argparse's for a bad command line).
EXIT_STARTUP_FAILED = 1  # the server cannot start as asked: a port in use, a model that fails to load
EXIT_FORCED = 3  # --exit-timeout-secs passed before the drain ended: workers killed


# Triton's categories for --grpc-restricted-protocol (which RPC is in which: shoal.grpc.restrict).
RESTRICTION_CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "model-config",
    "statistics",
    "model-repository",
    "shared-memory",
    "trace",
    "logging",
)


@dataclass(frozen=True)
class Restriction:
    """Calls in ``categories`` need the header ``key`` with ``value``."""

    categories: frozenset[str]
    key: str
    value: str


def parse_restriction(text: str) -> Restriction:
    """``CATEGORY[,CATEGORY...]:KEY=VALUE``; raises ValueError with a message for the user."""
    categories, _, header = text.partition(":")
    key, _, value = header.partition("=")
    names = frozenset(c.strip() for c in categories.split(",") if c.strip())
    unknown = names - set(RESTRICTION_CATEGORIES)
    if not names or not key or not value or unknown:
        raise ValueError(
            f"{text!r}: expected CATEGORY[,CATEGORY]:KEY=VALUE with categories from "
            f"{sorted(RESTRICTION_CATEGORIES)}" + (f"; unknown {sorted(unknown)}" if unknown else "")
        )
    return Restriction(names, key.lower(), value)


@dataclass(frozen=True)
class GrpcLimits:
    # Triton and tritonclient accept messages up to INT32_MAX bytes; grpc's default is 4 MiB.
    max_message_bytes: int = 2**31 - 1
    max_concurrent_streams: int = 100  # per connection; 0 = the engine's (grpcio: unbounded, open to rapid reset)
    restrictions: tuple[Restriction, ...] = ()
    reuse_port: bool = False  # SO_REUSEPORT: let other servers bind this port too (Triton's --reuse-grpc-port)
    engine: str = "auto"  # --grpc-engine: auto | native | grpcio (shoal.grpc.engine)
    io_threads: int = 0  # --grpc-io-threads: pygrpc-native's HTTP/2 threads; 0 = from the usable cores


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP/REST endpoint (Triton's ``--http-*`` flags)."""

    address: str = "0.0.0.0"
    port: int = 8000
    max_input_bytes: int = 64 << 20  # a request body, before and after decompression (Triton's default)
    restrictions: tuple[Restriction, ...] = ()  # --http-restricted-api
    reuse_port: bool = False  # SO_REUSEPORT for other servers; Shoal's own workers always share it
    tls: TlsSettings | None = None
    # Reading a request, as a reverse proxy bounds it (shoal.http.server says why these values).
    header_timeout_s: float = 30.0  # the request line and headers, from the first byte (or the accept)
    body_idle_timeout_s: float = 60.0  # no byte of the body for this long
    body_timeout_s: float = 300.0  # the whole body
    keep_alive_timeout_s: float = 75.0  # an idle connection between requests
    max_connections: int = 4096  # open connections per process; past it a new one gets 503
    max_pending_body_bytes: int = 2 << 30  # request bodies being received at once, per process; past it 503


# Triton's default summary quantiles and their error bounds (metrics.cc), as summary_quantiles writes them.
DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))


@dataclass(frozen=True)
class MetricsSettings:
    """Triton's ``--metrics-config`` settings that Shoal honours (shoal.metrics)."""

    summary_latencies: bool = False  # the five nv_inference_*_summary_us families, over the last minute
    # (quantile, Triton's rank error): Shoal takes the quantiles; its own bound is 1% of the value (shoal.statistics)
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    counter_latencies: bool = True  # the five nv_inference_*_duration_us counters
    gpu_metrics: bool = True  # --allow-gpu-metrics: Triton's nv_gpu_* families through NVML, where a driver is


def parse_metrics_config(texts: list[str]) -> MetricsSettings:
    """``--metrics-config SETTING=VALUE`` (repeatable); a ValueError says what is wrong. Triton takes
    any setting name and value without a word; Shoal refuses what it would not honour."""
    fields: dict[str, Any] = {}
    for text in texts:
        name, equals, value = text.partition("=")
        if not equals or not name or not value:
            raise ValueError(f"--metrics-config option format is <setting>=<value>. Got {text}")
        if name in ("summary_latencies", "counter_latencies"):
            if value not in ("true", "false"):
                raise ValueError(f"--metrics-config {text}: {name} is true or false")
            fields[name] = value == "true"
        elif name == "summary_quantiles":
            fields[name] = _quantiles(text, value)
        else:
            raise ValueError(
                f"--metrics-config {text}: Shoal takes summary_latencies, summary_quantiles and "
                f"counter_latencies (histogram_latencies is Triton 2.52's, not 2.51's)"
            )
    return MetricsSettings(**fields)


def _quantiles(text: str, value: str) -> tuple[tuple[float, float], ...]:
    """``QUANTILE:ERROR[,QUANTILE:ERROR...]``, each in [0, 1]."""
    pairs = []
    for part in value.split(","):
        quantile, colon, error = part.partition(":")
        try:
            pair = (float(quantile), float(error))
        except ValueError:
            pair = (math.nan, math.nan)
        if not colon or not all(0.0 <= x <= 1.0 for x in pair):
            raise ValueError(
                f"--metrics-config {text}: expected <quantile>:<error>[,<quantile>:<error>...], each "
                f"from 0 to 1, got {part!r}"
            )
        pairs.append(pair)
    return tuple(pairs)


# --trace-config (shoal.tracing), as Triton 2.51 takes it: ``SETTING=VALUE`` for the global settings (``level``,
# ``rate``, ``count``, ``mode``) and ``MODE,SETTING=VALUE`` for a mode's own (``triton,file=PATH``,
# ``triton,log-frequency=N``; ``opentelemetry,url=URL``, ``opentelemetry,resource=KEY=VALUE``,
# ``opentelemetry,bsp_schedule_delay=MS``, ``bsp_max_export_batch_size``, ``bsp_max_queue_size``).
#
# Triton takes an unknown setting without a word (and echoes it in the settings); Shoal refuses it at
# start, so a misspelt one cannot leave tracing other than the operator meant.
MODES = ("triton", "opentelemetry")
LEVELS = ("TIMESTAMPS", "TENSORS")  # and OFF: none of them
BSP_DEFAULTS = {"bsp_schedule_delay": 5000, "bsp_max_export_batch_size": 512, "bsp_max_queue_size": 2048}
DEFAULT_URL = "http://localhost:4318/v1/traces"  # the OTLP/HTTP exporter's own default, as Triton's
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TraceConfig:
    mode: str = "triton"
    level: frozenset[str] = frozenset()  # empty: OFF
    rate: int = 1000  # one request traced in every ``rate``
    count: int = -1  # traces left to take; -1: no bound
    file: str = ""  # triton mode: where the JSON goes
    log_frequency: int = 0  # triton mode: write every this many traces to file.N; 0: at shutdown
    url: str = ""  # opentelemetry mode: the OTLP/HTTP endpoint ("": DEFAULT_URL)
    resource: tuple[tuple[str, str], ...] = ()  # opentelemetry mode: resource attributes
    bsp: dict[str, int] = field(default_factory=lambda: dict(BSP_DEFAULTS))  # the batch span processor's


def parse_trace_config(texts: list[str]) -> TraceConfig:
    """The flags in order (a later one wins); a ValueError says what is wrong, in Triton's words where
    it has them."""
    config = TraceConfig()
    changes: dict[str, Any] = {}
    bsp = dict(BSP_DEFAULTS)
    resource: list[tuple[str, str]] = []
    for text in texts:
        head, equals, value = text.partition("=")
        mode, comma, name = head.rpartition(",") if "," in head else ("", "", head)
        if not equals or not name:
            raise ValueError(
                f"--trace-config option format is <mode>,<setting>=<value> or <setting>=<value>. Got {text}"
            )
        if comma and mode not in MODES:
            raise ValueError(f"--trace-config {text}: the mode is triton or opentelemetry")
        if not comma:
            changes.update(_global(text, name, value, changes))
        elif mode == "triton" and name == "file":
            changes["file"] = value
        elif mode == "triton" and name == "log-frequency":
            changes["log_frequency"] = _integer(text, value, 0, UINT32_MAX)
        elif mode == "opentelemetry" and name == "url":
            changes["url"] = value
        elif mode == "opentelemetry" and name == "resource":
            key, has_value, attribute = value.partition("=")
            if not has_value or not key:
                raise ValueError(f"--trace-config {text}: a resource is KEY=VALUE")
            resource.append((key, attribute))
        elif mode == "opentelemetry" and name in BSP_DEFAULTS:
            bsp[name] = _integer(text, value, 1 if name != "bsp_schedule_delay" else 0, UINT32_MAX)
        else:
            raise ValueError(
                f"--trace-config {text}: unknown setting; Shoal takes level, rate, count, mode, "
                "triton,file, triton,log-frequency, opentelemetry,url, opentelemetry,resource and "
                f"opentelemetry,{', opentelemetry,'.join(BSP_DEFAULTS)}"
            )
    return replace(config, **changes, bsp=bsp, resource=tuple(resource))


def _global(text: str, name: str, value: str, changes: dict[str, Any]) -> dict[str, Any]:
    if name == "level":
        if value == "OFF":
            return {"level": frozenset()}
        if value not in LEVELS:
            raise ValueError(f"--trace-config {text}: the level is OFF, TIMESTAMPS or TENSORS")
        return {"level": changes.get("level", frozenset()) | {value}}  # repeatable, as Triton's
    if name == "rate":
        return {"rate": _integer(text, value, 0, UINT32_MAX)}
    if name == "count":
        return {"count": _integer(text, value, -1, INT32_MAX)}
    if name == "mode":
        if value not in MODES:
            raise ValueError(f"--trace-config {text}: the mode is triton or opentelemetry")
        return {"mode": value}
    raise ValueError(f"--trace-config {text}: the global settings are level, rate, count and mode")


def _integer(text: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--trace-config {text}: expected an integer") from None
    if not low <= number <= high:
        raise ValueError(f"--trace-config {text}: expected {low} to {high}")
    return number


@dataclass(frozen=True)
class ServerSettings:
    model_repository: Path
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    strict_readiness: bool = True
    strict_model_config: bool = False
    exit_timeout_s: float = 30.0
    # Written with the bound port once serving: lets a caller start on port 0 without a race.
    port_file: Path | None = None
    tls: TlsSettings | None = None
    control_mode: str = "none"  # none | poll | explicit
    poll_interval_s: float = 15.0
    startup_models: tuple[str, ...] = ()  # explicit mode; "*" for all
    exit_on_error: bool = True  # a model that fails to load at start ends the server (Triton's default)
    allow_metrics: bool = True
    metrics_address: str = "0.0.0.0"  # the CLI defaults it to --grpc-address
    metrics_port: int = 8002
    grpc: GrpcLimits = GrpcLimits()
    memory_budgets: tuple[tuple[str, int], ...] = ()  # (device, bytes): "cpu", "gpu:0"
    rate_limit: bool = False  # --rate-limit execution_count (shoal.scheduling.rate_limiter)
    rate_limit_resources: tuple[tuple[str, int, int], ...] = ()  # (name, count, device; -1: every device)
    response_cache_bytes: int | None = None  # --cache-config local,size=BYTES (lifecycle/response_cache.py)
    metrics: MetricsSettings = MetricsSettings()  # --metrics-config
    trace: TraceConfig = TraceConfig()  # --trace-config (shoal.tracing)
    # Front-end worker processes serving gRPC; 0 serves it in this process (see shoal.frontend).
    grpc_workers: int = 0
    grpc_workers_choice: str = ""  # the count and why (--grpc-workers auto: the cores seen, the rule), for the log
    grpc_worker_pool_bytes: int = 1 << 30  # each worker's shared memory, per direction
    grpc_worker_liveness_s: float = 5.0  # ping each worker this often; one that misses a ping is replaced (0: off)
    shared_memory_max_bytes: int = 64 << 30  # clients' registered shared-memory regions, in all
    shared_memory_max_regions: int = 4096  # system and CUDA regions registered at once
    allow_http: bool = True
    http: HttpSettings = HttpSettings()
    event_loop: str = "asyncio"  # what --event-loop resolved to here: uvloop | asyncio (shoal.event_loops)


@dataclass(frozen=True)
class TlsSettings:
    """PEM files: the server's certificate and key; with ``mutual``, clients must present a
    certificate signed by ``root_cert``."""

    server_cert: Path
    server_key: Path
    root_cert: Path | None = None
    mutual: bool = False
