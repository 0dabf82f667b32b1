"""Wiring only: load models, start gRPC (with health and reflection) and metrics, stop in bounded time.

Start: both ports are checked before the models load, so a port in use is a clear error at once
(``StartupError``, exit 1); gRPC never shares its port unless ``--reuse-grpc-port`` says so.

Stop (SIGTERM/SIGINT), all within ``--exit-timeout-secs``:

1. stop accepting inference; ServerReady and health turn NOT_SERVING;
2. wait for the requests in flight while gRPC still answers, so a client sees NOT_SERVING;
3. stop gRPC (open streams get ``STREAM_GRACE_S``), unload the models, exit 0.

If the bound passes first, the worker processes are killed and the process exits with
``EXIT_FORCED`` (3): a watchdog thread does it even if the event loop is stuck.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

from shoal.core import Core, LocalCore
from shoal.errors import StartupError
from shoal.grpc.health import HealthReporter
from shoal.grpc.server import build_server
from shoal.grpc.servicer import InferenceServicer
from shoal.lifecycle.manager import ModelManager
from shoal.settings import EXIT_FORCED, ServerSettings

logger = logging.getLogger(__name__)

STREAM_GRACE_S = 1.0  # after the drain, for RPCs that are open but carry no request


async def serve(settings: ServerSettings) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0, or EXIT_FORCED from the watchdog)."""
    refuse_used_port("gRPC", settings.grpc_address, settings.grpc_port, settings.grpc.reuse_port)
    if settings.allow_metrics:
        refuse_used_port("metrics", settings.metrics_address, settings.metrics_port, reuse_port=False)
    health = HealthReporter()
    background: set[asyncio.Task[None]] = set()

    def refresh_health() -> None:
        task = asyncio.get_running_loop().create_task(health.sync(core))
        background.add(task)
        task.add_done_callback(background.discard)

    manager = ModelManager(
        settings.model_repository,
        settings.strict_model_config,
        settings.control_mode,
        on_change=refresh_health,
        memory_budgets=dict(settings.memory_budgets),
    )
    core: Core = LocalCore(manager, strict_readiness=settings.strict_readiness)
    await manager.start(settings.startup_models)
    await health.sync(core)
    try:
        server, port = build_server(
            InferenceServicer(core), health, settings.grpc_address, settings.grpc_port, settings.tls, settings.grpc
        )
        metrics_port = 0
        if settings.allow_metrics:
            from shoal.metrics import start_metrics_server

            try:
                metrics_port = start_metrics_server(core, settings.metrics_address, settings.metrics_port)
            except BaseException:
                await server.stop(None)
                raise
    except BaseException:
        await manager.close()
        raise
    await server.start()
    logger.info("Started GRPCInferenceService at %s:%d", settings.grpc_address, port)
    if settings.control_mode == "poll":
        poller = asyncio.create_task(manager.poll_forever(settings.poll_interval_s))
        background.add(poller)
    if settings.port_file is not None:
        settings.port_file.write_text(f"{port}\n{metrics_port}\n")  # metrics 0: disabled

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    deadline = time.monotonic() + settings.exit_timeout_s
    watchdog = threading.Timer(settings.exit_timeout_s, force_exit, args=(core, settings.exit_timeout_s))
    watchdog.daemon = True
    watchdog.start()
    logger.info("shutting down: %d requests in flight, up to %.0f s to finish", core.in_flight,
                settings.exit_timeout_s)
    core.stop_accepting()
    await health.sync(core)
    for task in background:
        task.cancel()
    if not await core.drain(deadline - time.monotonic()):
        force_exit(core, settings.exit_timeout_s)
    # Nothing is in flight now: what is left open (health Watch streams, idle inference streams)
    # would otherwise hold the stop until the deadline.
    await server.stop(grace=min(STREAM_GRACE_S, max(0.0, deadline - time.monotonic())))
    await manager.close()
    watchdog.cancel()
    logger.info("stopped")
    return 0


def force_exit(core: Core, timeout_s: float) -> None:
    """The exit timeout has passed: kill the worker processes and leave at once with EXIT_FORCED."""
    children = multiprocessing.active_children()
    logger.error("exit timeout of %.0f s passed with %d requests in flight: killing %d worker processes, "
                 "exiting with code %d", timeout_s, core.in_flight, len(children), EXIT_FORCED)
    for child in children:
        child.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
    for child in children:
        child.join(timeout=1.0)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_FORCED)  # instance threads still executing must not hold the exit


def refuse_used_port(what: str, address: str, port: int, reuse_port: bool) -> None:
    """StartupError if something listens on ``address:port`` already (port 0 is always free).

    A plain bind, without SO_REUSEPORT, fails on a port that any socket listens on, even one that
    opted into sharing: so this check keeps holding when Shoal's own processes share one port.
    """
    if port == 0 or reuse_port:
        return
    try:
        addresses = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"cannot serve {what} on {address}:{port}: {exc.strerror}") from None
    for family, kind, protocol, _, where in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no user
            try:
                probe.bind(where)
            except OSError as exc:
                hint = "; pass --reuse-grpc-port to share it on purpose" if what == "gRPC" else ""
                raise StartupError(
                    f"cannot serve {what} on {address}:{port}: {exc.strerror} (another server?){hint}"
                ) from None
