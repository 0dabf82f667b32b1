"""Wiring only: load the repository, start the gRPC server, stop on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from server.core import InferenceCore
from server.grpc.server import build_server
from server.grpc.servicer import InferenceServicer
from server.lifecycle.manager import ModelManager
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


async def serve(settings: ServerSettings) -> None:
    manager = ModelManager(settings.model_repository, settings.strict_model_config)
    await asyncio.to_thread(manager.load_all)
    core = InferenceCore(manager, strict_readiness=settings.strict_readiness)
    server, port = build_server(InferenceServicer(core), settings.grpc_address, settings.grpc_port, settings.tls)
    await server.start()
    logger.info("Started GRPCInferenceService at %s:%d", settings.grpc_address, port)
    if settings.port_file is not None:
        settings.port_file.write_text(f"{port}\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    logger.info("shutting down: finishing in-flight requests (up to %.0f s)", settings.exit_timeout_s)
    core.stop_accepting()
    await server.stop(grace=settings.exit_timeout_s)
    await manager.close()
    logger.info("stopped")
