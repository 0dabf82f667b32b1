"""Wiring only: load models, start gRPC (with health and reflection) and metrics, stop gracefully.

On SIGTERM/SIGINT: stop accepting requests (ServerReady and health turn false), let in-flight
and queued requests finish within the exit timeout, unload, exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from server.core import InferenceCore
from server.grpc.health import HealthReporter
from server.grpc.server import build_server
from server.grpc.servicer import InferenceServicer
from server.lifecycle.manager import ModelManager
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


async def serve(settings: ServerSettings) -> None:
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
    core = InferenceCore(manager, strict_readiness=settings.strict_readiness)
    await manager.start(settings.startup_models)
    await health.sync(core)
    server, port = build_server(
        InferenceServicer(core), health, settings.grpc_address, settings.grpc_port, settings.tls, settings.grpc
    )
    await server.start()
    logger.info("Started GRPCInferenceService at %s:%d", settings.grpc_address, port)
    metrics_port = 0
    if settings.allow_metrics:
        from server.metrics import start_metrics_server

        metrics_port = start_metrics_server(core, settings.metrics_address, settings.metrics_port)
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

    logger.info("shutting down: finishing in-flight requests (up to %.0f s)", settings.exit_timeout_s)
    core.stop_accepting()
    await health.sync(core)
    for task in background:
        task.cancel()
    await server.stop(grace=settings.exit_timeout_s)
    await manager.close()
    logger.info("stopped")
