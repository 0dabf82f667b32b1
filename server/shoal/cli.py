"""The ``shoal`` command (also ``python -m shoal``): argument parsing and logging setup."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from shoal import event_loops, logs
from shoal.descriptors import raise_open_file_limit
from shoal.errors import ShoalError, StartupError
from shoal.frontend.worker_count import AUTO, RULE, resolve
from shoal.lifecycle.response_cache import parse_cache_config
from shoal.logs import FORMATS, LogSettings
from shoal.repository.instance_defaults import DEFAULT_INSTANCE_COUNT_RULE
from shoal.scheduling.rate_limiter import Declared
from shoal.settings import (
    EXIT_STARTUP_FAILED,
    GrpcLimits,
    HttpSettings,
    ServerSettings,
    TlsSettings,
    parse_metrics_config,
    parse_restriction,
    parse_trace_config,
)
from shoal.tracing.settings import check_start

MAX_GRPC_WORKERS = 64


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _OneRepository(argparse.Action):
    """--model-repository or its alias --model-store, once: Triton serves every repository it is
    given, Shoal serves one, so a second is refused rather than silently replacing the first."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(
                f"{option_string}: Shoal serves one model repository; --model-repository or "
                "--model-store was given more than once"
            )
        setattr(namespace, self.dest, values)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def _count(text: str) -> int:
    count = int(text)
    if not 0 <= count <= MAX_GRPC_WORKERS:
        raise argparse.ArgumentTypeError(f"expected 0..{MAX_GRPC_WORKERS}, got {count}")
    return count


def _worker_count(text: str) -> int | str:
    """``--grpc-workers``: ``auto``, or a count of 0..MAX_GRPC_WORKERS."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return _count(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"expected auto or an integer in 0..{MAX_GRPC_WORKERS}, got {text!r}"
        ) from None


def _at_least_one(text: str) -> int:
    """An integer of 1 or more (``int`` alone takes 0 and negatives)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def _positive(text: str) -> float:
    """A finite number above 0 (``float`` alone takes nan, inf and negatives)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. 1,4,16, got {text!r}")
    return values


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME:D1,D2,...``, as ``shoal-load --shape`` and perf_analyzer's ``--shape``."""
    from shoal.clients.loadtest.inputs import InputError, parse_shape

    try:
        return parse_shape(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).removeprefix(f'--shape {text!r}: ')}, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Shoal model server")
    parser.add_argument("--version", action="version", version=f"shoal {version('shoal')}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model repository over gRPC and HTTP (KServe v2 / Triton)")
    serve.add_argument(
        "--model-repository",
        "--model-store",
        dest="model_repository",
        type=Path,
        required=True,
        action=_OneRepository,
        help="folder of model folders (--model-store: Triton's alias, as kserve-tritonserver passes)",
    )
    serve.add_argument("--grpc-address", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    serve.add_argument("--grpc-port", type=_port, default=8001, help="port (default 8001; 0 = any free)")
    serve.add_argument(
        "--allow-grpc",
        type=_bool,
        default=True,
        help="serve gRPC (default true; Triton's flag, which KServe passes: only true is taken)",
    )
    serve.add_argument(
        "--log-verbose",
        type=_count,
        default=0,
        metavar="N",
        help="verbose (debug) lines when 1 or more (default 0); all log settings can change "
        "while serving: /v2/logging, gRPC LogSettings",
    )
    serve.add_argument("--log-info", type=_bool, default=True, help="log INFO lines (default true)")
    serve.add_argument("--log-warning", type=_bool, default=True, help="log WARNING lines (default true)")
    serve.add_argument("--log-error", type=_bool, default=True, help="log ERROR lines (default true)")
    serve.add_argument(
        "--log-format",
        choices=FORMATS,
        default="default",
        help="default: local time, level, logger; ISO8601: UTC time first (as Triton's flag)",
    )
    serve.add_argument(
        "--log-file", default="", help="append every process's log (all of standard error) to this file instead"
    )
    serve.add_argument(
        "--strict-readiness",
        type=_bool,
        default=True,
        help="ServerReady is true only while every model is ready (default true, as Triton)",
    )
    serve.add_argument(
        "--strict-model-config",
        type=_bool,
        default=False,
        help="require complete config.pbtxt files; false (default) completes them from the model file",
    )
    serve.add_argument(
        "--exit-timeout-secs",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish",
    )
    serve.add_argument(
        "--port-file",
        type=Path,
        help="once serving, write the bound gRPC port (line 1), metrics port (line 2) and HTTP port "
        "(line 3) here; 0 for an endpoint that is off",
    )
    serve.add_argument(
        "--model-control-mode",
        choices=["none", "poll", "explicit"],
        default="none",
        help="none: load all at start; poll: also follow repository changes; explicit: load on request",
    )
    serve.add_argument("--repository-poll-secs", type=float, default=15.0, help="poll interval (default 15)")
    serve.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: load NAME at start (repeatable; '*' for all)",
    )
    serve.add_argument(
        "--exit-on-error",
        type=_bool,
        default=True,
        help="a model that fails to load at start ends the server (exit 1) after logging why; "
        "false serves the others (default true, as Triton)",
    )
    serve.add_argument("--allow-metrics", type=_bool, default=True, help="serve Prometheus metrics (default true)")
    serve.add_argument("--metrics-address", help="address of the metrics endpoint (default: --grpc-address)")
    serve.add_argument("--metrics-port", type=_port, default=8002, help="metrics port (default 8002; 0 = any free)")
    serve.add_argument(
        "--allow-gpu-metrics",
        type=_bool,
        default=True,
        help="Triton's nv_gpu_* families (utilization, memory, power, energy per GPU) through NVML, "
        "where a driver is (default true)",
    )
    serve.add_argument(
        "--metrics-config",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="summary_latencies=true: Triton's nv_inference_*_summary_us over the last minute; "
        "summary_quantiles=Q:E[,Q:E...] (default 0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,"
        "0.999:0.001); counter_latencies=false drops the *_duration_us counters (repeatable)",
    )
    serve.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="CATEGORIES:KEY=VALUE",
        help="require header KEY=VALUE for these RPC categories, e.g. model-repository:admin-key=s3cret",
    )
    serve.add_argument(
        "--grpc-max-message-mb",
        type=float,
        default=2048.0,
        help="largest request or reply in MiB (default 2048, as Triton)",
    )
    serve.add_argument(
        "--trace-config",
        action="append",
        default=[],
        metavar="[MODE,]SETTING=VALUE",
        help="Triton's tracing: level=TIMESTAMPS, rate=N, count=N, mode=triton|opentelemetry, "
        "triton,file=PATH, triton,log-frequency=N, opentelemetry,url=HOST:PORT/v1/traces, "
        "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_*=N (repeatable; default off)",
    )
    serve.add_argument(
        "--rate-limit",
        type=str.lower,
        choices=["off", "execution_count"],
        default="off",
        help="execution_count: an instance executes only when the resources its instance group's "
        "rate_limiter names are free, across all models (default off, as Triton)",
    )
    serve.add_argument(
        "--rate-limit-resource",
        action="append",
        default=[],
        metavar="NAME:COUNT[:DEVICE]",
        help="how many of a resource a device has (no device: each device); without any, each "
        "resource has as many as the largest claim on it (repeatable)",
    )
    serve.add_argument(
        "--cache-config",
        action="append",
        default=[],
        metavar="local,size=BYTES",
        help="a response cache of BYTES for the models whose config sets response_cache "
        "{ enable: true } (Triton's format, <cache name>,<setting>=<value>; default none)",
    )
    serve.add_argument(
        "--memory-budget-mb",
        action="append",
        default=[],
        metavar="DEVICE=MB",
        help="memory all models may hold on a device (cpu, gpu:0, ...); loads beyond it are refused",
    )
    serve.add_argument(
        "--grpc-max-concurrent-streams",
        type=int,
        default=100,
        help="concurrent RPCs per client connection (default 100; 0 = the engine's own: unbounded "
        "on grpcio, which leaves the server open to HTTP/2 rapid reset, 1024 on native)",
    )
    serve.add_argument(
        "--reuse-grpc-port",
        type=_bool,
        default=False,
        help="let other servers bind the gRPC port too (SO_REUSEPORT); default false: a port in use is an error",
    )
    serve.add_argument(
        "--grpc-engine",
        choices=("auto", "native", "grpcio"),
        default="auto",
        help="what serves gRPC: native = pygrpc-native (HTTP/2 in Rust, the faster), grpcio = "
        "grpc.aio (TLS); auto (default) = native unless TLS is on or it does not import here",
    )
    serve.add_argument(
        "--event-loop",
        choices=event_loops.CHOICES,
        default="auto",
        help="the asyncio event loop of every serving process: auto (default) = uvloop where it is "
        "installed (less CPU per request, bench/event_loops.py), else asyncio's own",
    )
    serve.add_argument(
        "--grpc-io-threads",
        type=_count,
        default=0,
        metavar="N",
        help="threads pygrpc-native (the native engine) runs HTTP/2 on, in each process that serves "
        "gRPC; 0 (default) = 1 below 4 usable cores, else 2",
    )
    serve.add_argument(
        "--grpc-workers",
        "--frontend-workers",
        dest="grpc_workers",
        type=_worker_count,
        default=0,
        metavar="N|auto",
        help="front-end processes serving gRPC and HTTP on their ports, beside the process that holds "
        "the models; 0 serves both in that process (default 0: the fastest measured, on 2 "
        f"cores); auto = from the cores this process may use (affinity and cgroup CPU quota): "
        f"{RULE} (a projection past 2 cores, see docs/operations.md)",
    )
    serve.add_argument(
        "--grpc-worker-pool-mb",
        type=float,
        default=1024.0,
        help="shared memory per front-end worker and direction, which bounds the tensor bytes it "
        "has in flight (default 1024)",
    )
    serve.add_argument(
        "--grpc-worker-liveness-secs",
        type=float,
        default=5.0,
        help="ping each front-end worker this often; one that does not answer in time (stopped, "
        "hung) is killed and started again (default 5; 0 = off)",
    )
    serve.add_argument(
        "--shared-memory-max-mb",
        type=float,
        default=65536.0,
        help="the most shared memory clients may register in all, in MiB (default 65536); "
        "the memory stays the client's",
    )
    serve.add_argument(
        "--shared-memory-max-regions",
        type=int,
        default=4096,
        metavar="N",
        help="the most shared-memory regions (system and CUDA) registered at once (default 4096)",
    )
    _add_http_arguments(serve)
    tls = serve.add_argument_group("TLS (Triton's flag names)")
    tls.add_argument("--grpc-use-ssl", type=_bool, default=False, help="serve gRPC over TLS")
    tls.add_argument("--grpc-server-cert", type=Path, help="PEM certificate chain of the server")
    tls.add_argument("--grpc-server-key", type=Path, help="PEM private key of the server")
    tls.add_argument("--grpc-root-cert", type=Path, help="PEM CA that signs client certificates (for mTLS)")
    tls.add_argument("--grpc-use-ssl-mutual", type=_bool, default=False, help="require client certificates")
    _add_config_commands(commands)
    return parser


def _add_http_arguments(serve: argparse.ArgumentParser) -> None:
    http = serve.add_argument_group("HTTP/REST (Triton's flag names)")
    http.add_argument("--allow-http", type=_bool, default=True, help="serve KServe v2 REST (default true)")
    http.add_argument("--http-address", help="address of the HTTP endpoint (default: --grpc-address)")
    http.add_argument("--http-port", type=_port, default=8000, help="HTTP port (default 8000; 0 = any free)")
    http.add_argument(
        "--reuse-http-port",
        type=_bool,
        default=False,
        help="let other servers bind the HTTP port too (SO_REUSEPORT); default false",
    )
    http.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="CATEGORIES:KEY=VALUE",
        help="require header KEY=VALUE for these API categories (as --grpc-restricted-protocol)",
    )
    http.add_argument(
        "--http-max-input-size",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="largest request body, also once decompressed (default 67108864, as Triton)",
    )
    http.add_argument(
        "--http-header-timeout-secs",
        type=_positive,
        default=30.0,
        metavar="SECONDS",
        help="close a connection whose request line and headers are not in within this long (default 30)",
    )
    http.add_argument(
        "--http-body-idle-timeout-secs",
        type=_positive,
        default=60.0,
        metavar="SECONDS",
        help="close a connection that sends no byte of a request body for this long (default 60)",
    )
    http.add_argument(
        "--http-body-timeout-secs",
        type=_positive,
        default=300.0,
        metavar="SECONDS",
        help="close a connection whose request body is not in whole within this long (default 300)",
    )
    http.add_argument(
        "--http-keep-alive-timeout-secs",
        type=_positive,
        default=75.0,
        metavar="SECONDS",
        help="close a connection idle between requests this long (default 75)",
    )
    http.add_argument(
        "--http-max-connections",
        type=int,
        default=4096,
        metavar="N",
        help="open HTTP connections per process; past it a new one is answered 503 and closed "
        "(default 4096, at most half the process's descriptors)",
    )
    http.add_argument(
        "--http-max-pending-body-mb",
        type=_positive,
        default=2048.0,
        metavar="MB",
        help="request bodies being received at once, per process; past it a request is answered 503 (default 2048)",
    )
    http.add_argument("--http-use-ssl", type=_bool, default=False, help="serve HTTP over TLS (HTTPS)")
    http.add_argument("--http-server-cert", type=Path, help="PEM certificate chain of the HTTP server")
    http.add_argument("--http-server-key", type=Path, help="PEM private key of the HTTP server")
    http.add_argument("--http-root-cert", type=Path, help="PEM CA that signs client certificates (for mTLS)")
    http.add_argument("--http-use-ssl-mutual", type=_bool, default=False, help="require client certificates")


def _add_config_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    config = commands.add_parser("config", help="generate, check and tune model configs")
    actions = config.add_subparsers(dest="action", required=True)
    generate = actions.add_parser("generate", help="write a config.pbtxt completed from the model file")
    generate.add_argument(
        "path",
        type=Path,
        help="a model folder, a bare model.onnx (the folder is created), or a "
        "version folder or model file in one (repo/m/1/model.onnx: repo/m)",
    )
    generate.add_argument("--name", help="model name (default: the folder or file name)")
    generate.add_argument("--max-batch-size", type=int, help="instead of Triton's default of 4 when batching")
    generate.add_argument(
        "--instance-count", type=_at_least_one, help=f"executors per device (default: {DEFAULT_INSTANCE_COUNT_RULE})"
    )
    generate.add_argument("--kind", choices=["KIND_AUTO", "KIND_CPU", "KIND_GPU"])
    generate.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME:DTYPE:DIMS",
        help="an input of a TorchScript model (one sample's dims), e.g. INPUT__0:FP32:3,224,224",
    )
    generate.add_argument("--output", help="where to write (default <folder>/config.pbtxt; - for stdout)")
    generate.add_argument("--force", action="store_true", help="overwrite an existing config.pbtxt")
    check = actions.add_parser("check", help="validate every config of a repository without serving")
    check.add_argument("repository", type=Path)
    check.add_argument("--strict-model-config", type=_bool, default=False)
    tune = actions.add_parser("tune", help="search instance count and batching for the best throughput in a p99 budget")
    tune.add_argument("model_dir", type=Path)
    tune.add_argument("--latency-budget-ms", type=_positive, required=True, help="p99 latency budget")
    tune.add_argument("--max-minutes", type=_positive, default=10.0, help="time bound of the search (default 10)")
    tune.add_argument(
        "--concurrency",
        type=_concurrencies,
        default="1,4,16",
        help="client concurrencies measured per candidate (default 1,4,16)",
    )
    tune.add_argument("--window-s", type=_positive, default=1.0, help="measurement window (default 1 s)")
    tune.add_argument(
        "--shape",
        type=_shape,
        action="append",
        default=[],
        metavar="NAME:D1,D2,...",
        help="one sample's dims of an input with variable dims (no batch dim), as shoal-load's and "
        "perf_analyzer's --shape, e.g. INPUT:1,16 (repeatable)",
    )
    tune.add_argument("--output-dir", type=Path, help="CSV and PNG (default <model_dir>/tuning)")


def _tls_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str = "grpc"
) -> TlsSettings | None:
    """``--grpc-*`` or ``--http-*`` TLS flags, checked the same way."""
    use, mutual = getattr(args, f"{prefix}_use_ssl"), getattr(args, f"{prefix}_use_ssl_mutual")
    cert, key, root = (getattr(args, f"{prefix}_{name}") for name in ("server_cert", "server_key", "root_cert"))
    if not (use or mutual):
        return None
    if not cert or not key:
        parser.error(f"--{prefix}-use-ssl needs --{prefix}-server-cert and --{prefix}-server-key")
    if mutual and not root:
        parser.error(f"--{prefix}-use-ssl-mutual needs --{prefix}-root-cert")
    for path in (cert, key, root):
        if path is not None and not path.is_file():
            parser.error(f"TLS file {path} does not exist")
    return TlsSettings(cert, key, root, mutual)


def _http_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> HttpSettings:
    try:
        restrictions = tuple(parse_restriction(text) for text in args.http_restricted_api)
    except ValueError as exc:
        parser.error(f"--http-restricted-api {exc}")
    if args.http_max_input_size < 1 or args.http_max_connections < 1:
        parser.error("--http-max-input-size and --http-max-connections must be at least 1")
    return HttpSettings(
        address=args.http_address or args.grpc_address,
        port=args.http_port,
        max_input_bytes=args.http_max_input_size,
        restrictions=restrictions,
        reuse_port=args.reuse_http_port,
        tls=_tls_settings(parser, args, "http"),
        header_timeout_s=args.http_header_timeout_secs,
        body_idle_timeout_s=args.http_body_idle_timeout_secs,
        body_timeout_s=args.http_body_timeout_secs,
        keep_alive_timeout_s=args.http_keep_alive_timeout_secs,
        max_connections=args.http_max_connections,
        max_pending_body_bytes=int(min(args.http_max_pending_body_mb, 2**40 / 2**20) * 2**20),
    )


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0].startswith("--") and args_list[0] not in {"--help", "--version"}:
        args_list.insert(0, "serve")  # `python -m shoal --model-repository ...` means serve
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "config":
        logging.basicConfig(level=logging.WARNING, format="%(levelname).1s %(name)s: %(message)s")
        return _config(parser, args)
    if not args.allow_grpc:
        parser.error("--allow-grpc=false: Shoal always serves gRPC (--grpc-port=0 takes any free port)")
    tls = _tls_settings(parser, args)
    try:
        restrictions = tuple(parse_restriction(text) for text in args.grpc_restricted_protocol)
    except ValueError as exc:
        parser.error(f"--grpc-restricted-protocol {exc}")
    budgets = []
    for text in args.memory_budget_mb:
        device, _, megabytes = text.partition("=")
        try:
            budgets.append((device, int(float(megabytes) * 2**20)))
        except ValueError:
            parser.error(f"--memory-budget-mb {text!r}: expected DEVICE=MB, e.g. cpu=4096")
        if device != "cpu" and not device.startswith("gpu:"):
            parser.error(f"--memory-budget-mb {text!r}: the device is cpu or gpu:N")
    try:
        declared = tuple(Declared.parse(text) for text in args.rate_limit_resource)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        cache_bytes = parse_cache_config(args.cache_config) if args.cache_config else None
        metrics = parse_metrics_config(args.metrics_config)
        trace = parse_trace_config(args.trace_config)
        check_start(trace)
    except ValueError as exc:
        parser.error(str(exc))
    except ShoalError as exc:
        parser.error(f"--trace-config: {exc.message}")
    try:
        loop = event_loops.resolve(args.event_loop)
    except StartupError as exc:
        parser.error(str(exc))
    if declared and args.rate_limit == "off":
        parser.error("--rate-limit-resource needs --rate-limit execution_count")
    if args.load_model and args.model_control_mode != "explicit":
        parser.error("--load-model needs --model-control-mode explicit")
    if not (
        args.repository_poll_secs > 0
        and args.grpc_max_message_mb > 0
        and args.grpc_worker_pool_mb >= 1
        and args.shared_memory_max_mb >= 0
        and args.grpc_worker_liveness_secs >= 0
        and args.shared_memory_max_regions >= 0
    ):
        parser.error(
            "--repository-poll-secs and --grpc-max-message-mb must be positive, "
            "--grpc-worker-pool-mb at least 1, --shared-memory-max-mb, --shared-memory-max-regions and "
            "--grpc-worker-liveness-secs at least 0"
        )
    try:
        logs.start(
            LogSettings(
                args.log_verbose, args.log_info, args.log_warning, args.log_error, args.log_format, args.log_file
            )
        )
    except OSError as exc:
        parser.error(f"--log-file {args.log_file}: {exc.strerror}")
    raise_open_file_limit()
    if not args.model_repository.is_dir():
        print(f"shoal: error: model repository {args.model_repository} is not a folder", file=sys.stderr)
        return 2
    from shoal.repository.scanner import model_folder_problem

    if problem := model_folder_problem(args.model_repository):
        print(f"shoal: error: {problem}", file=sys.stderr)
        return 2
    workers = resolve(args.grpc_workers)
    settings = ServerSettings(
        # Absolute once: a thread-instance model's os.chdir (the process's own folder) must not move it.
        model_repository=Path(os.path.abspath(args.model_repository)),
        grpc_address=args.grpc_address,
        grpc_port=args.grpc_port,
        strict_readiness=args.strict_readiness,
        strict_model_config=args.strict_model_config,
        exit_timeout_s=args.exit_timeout_secs,
        port_file=args.port_file,
        tls=tls,
        control_mode=args.model_control_mode,
        poll_interval_s=args.repository_poll_secs,
        startup_models=tuple(args.load_model),
        exit_on_error=args.exit_on_error,
        allow_metrics=args.allow_metrics,
        metrics_address=args.metrics_address or args.grpc_address,
        metrics_port=args.metrics_port,
        metrics=replace(metrics, gpu_metrics=args.allow_gpu_metrics),
        trace=trace,
        memory_budgets=tuple(budgets),
        rate_limit=args.rate_limit == "execution_count",
        rate_limit_resources=tuple((d.name, d.count, d.device) for d in declared),
        response_cache_bytes=cache_bytes,
        grpc_workers=workers.count,
        grpc_workers_choice=workers.describe(),
        grpc_worker_pool_bytes=int(min(args.grpc_worker_pool_mb, 2**40 / 2**20) * 2**20),
        shared_memory_max_bytes=int(min(args.shared_memory_max_mb, 2**50 / 2**20) * 2**20),
        shared_memory_max_regions=args.shared_memory_max_regions,
        grpc_worker_liveness_s=args.grpc_worker_liveness_secs,
        allow_http=args.allow_http,
        http=_http_settings(parser, args),
        event_loop=loop,
        grpc=GrpcLimits(
            max_message_bytes=min(2**31 - 1, int(args.grpc_max_message_mb * 2**20)),
            max_concurrent_streams=args.grpc_max_concurrent_streams,
            restrictions=restrictions,
            reuse_port=args.reuse_grpc_port,
            engine=args.grpc_engine,
            io_threads=args.grpc_io_threads,
        ),
    )
    return event_loops.run(_serve(settings), settings.event_loop)


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from shoal.configuring import commands as config_commands

    try:
        if args.action == "check":
            if not args.repository.is_dir():
                parser.error(f"model repository {args.repository} is not a folder")
            return config_commands.run_check(args.repository, args.strict_model_config)
        if args.action == "generate":
            folder = config_commands.prepare_folder(args.path, args.name)
            target = folder / "config.pbtxt" if args.output is None else Path(args.output)
            if args.output != "-" and target.exists() and not args.force:
                parser.error(f"{target} exists; pass --force to overwrite it or --output - to print")
            options = config_commands.GenerateOptions(
                args.max_batch_size, args.instance_count, args.kind, args.name, tuple(args.input)
            )
            text = config_commands.generate(folder, options)
            if args.output == "-":
                sys.stdout.write(text)
            else:
                target.write_text(text)
                print(f"wrote {target}")
            return 0
        from shoal.tools.tune import run_tune  # the tuner drives a server with the load tester

        return run_tune(args)
    except ShoalError as exc:
        print(f"shoal config {args.action}: error: {exc.message}", file=sys.stderr)
        return 1


async def _serve(settings: ServerSettings) -> int:
    from shoal.app import serve  # imported late so --help stays fast

    try:
        return await serve(settings)
    except StartupError as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
