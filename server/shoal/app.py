"""Wiring only: load models, start gRPC (with health and reflection), HTTP and metrics, stop in bounded time.

Start: every port is checked before the models load, so a port in use is a clear error at once
(``StartupError``, exit 1); gRPC and HTTP never share their ports unless ``--reuse-grpc-port`` /
``--reuse-http-port`` say so. A model that fails to load at start (every one tried, each failure
logged) is a ``StartupError`` too, after the loaded ones are unloaded, unless ``--exit-on-error``
is false: Triton's ``error: creating server: Internal - failed to load all models``, exit 1.

Stop (SIGTERM/SIGINT), all within ``--exit-timeout-secs``:

1. stop accepting inference; ServerReady and health turn NOT_SERVING;
2. wait for the requests in flight while gRPC still answers, so a client sees NOT_SERVING;
3. stop HTTP and gRPC (open streams get ``STREAM_GRACE_S``), unload the models, exit 0.

If the bound passes first, the worker processes are killed and the process exits with
``EXIT_FORCED`` (3): a watchdog thread does it even if the event loop is stuck. After "stopped", a
second watchdog bounds what is left (``HELD_EXIT_GRACE_S`` at least): a thread a thread-instance
model started as a non-daemon would otherwise hold the interpreter's exit for ever.
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
from typing import Protocol

import grpc

from shoal.core.local import LocalCore
from shoal.descriptors import AcceptFailureLog
from shoal.errors import StartupError
from shoal.frontend.supervisor import WorkerSupervisor
from shoal.grpc import engine
from shoal.grpc.health import HealthReporter
from shoal.grpc.server import build_server
from shoal.grpc.servicer import InferenceServicer
from shoal.http.app import HttpApp
from shoal.http.server import HttpServer
from shoal.lifecycle.manager import ModelManager
from shoal.lifecycle.response_cache import ResponseCache
from shoal.scheduling.rate_limiter import Declared, RateLimiter
from shoal.settings import EXIT_FORCED, ServerSettings
from shoal.tracing.tracer import Tracer

logger = logging.getLogger(__name__)

STREAM_GRACE_S = 1.0  # after the drain, for RPCs that are open but carry no request
HELD_EXIT_GRACE_S = 5.0  # after "stopped", what is left of the exit gets at least this (see the docstring)


async def serve(settings: ServerSettings) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0, or EXIT_FORCED from the watchdog)."""
    AcceptFailureLog().install()
    refuse_used_ports(settings)
    if settings.allow_metrics:
        refuse_used_port("metrics", settings.metrics_address, settings.metrics_port, reuse_port=False)
    front: FrontEnd | None = None
    limiter = RateLimiter([Declared(*d) for d in settings.rate_limit_resources]) if settings.rate_limit else None
    if limiter is not None:
        logger.info(
            "Rate limiter: execution_count, resources %s",
            ", ".join(
                f"{d.name}={d.count}" + ("" if d.device < 0 else f" on device {d.device}") for d in limiter.declared
            )
            or "as large as the largest claim on each",
        )
    cache = None if settings.response_cache_bytes is None else ResponseCache(settings.response_cache_bytes)
    if cache is not None:
        logger.info("Response cache: local, %d bytes", cache.capacity)
    manager = ModelManager(
        settings.model_repository,
        settings.strict_model_config,
        settings.control_mode,
        on_change=lambda: front.health_changed() if front is not None else None,
        memory_budgets=dict(settings.memory_budgets),
        rate_limiter=limiter,
        response_cache=cache,
        summary_latencies=settings.metrics.summary_latencies,
    )
    core = LocalCore(
        manager,
        strict_readiness=settings.strict_readiness,
        max_shared_memory_bytes=settings.shared_memory_max_bytes,
        max_shared_memory_regions=settings.shared_memory_max_regions,
        tracer=Tracer(settings.trace),
    )
    failures = await manager.start(settings.startup_models)
    if failures and settings.exit_on_error:
        await manager.close()  # the models that did load, and their worker processes
        raise StartupError(
            f"failed to load all models: {', '.join(sorted(failures))} (logged above; "
            "--exit-on-error=false serves the others)"
        )
    logger.info("Front-end layout: %s", settings.grpc_workers_choice or f"{settings.grpc_workers} front-end workers")
    logger.info("Event loop: %s", settings.event_loop)
    front = WorkerFrontEnd(core, settings) if settings.grpc_workers else InProcessFrontEnd(core, settings)
    try:
        port, http_port = await front.start()
        metrics_port = 0
        if settings.allow_metrics:
            from shoal.metrics import start_metrics_server

            metrics_port = start_metrics_server(
                core.statistics_rows, settings.metrics_address, settings.metrics_port, settings.metrics
            )
    except BaseException:
        await front.stop(grace_s=0, deadline=time.monotonic())
        await manager.close()
        raise
    background: set[asyncio.Task[None]] = set()
    if settings.control_mode == "poll":
        background.add(asyncio.create_task(manager.poll_forever(settings.poll_interval_s)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    os.register_at_fork(after_in_child=_forget_server_signals)
    # Written once the handlers are in: a script that signals as soon as it reads the ports gets the
    # drain, not asyncio.run's KeyboardInterrupt (a Ctrl-C test sent SIGINT in between, on a busy CI).
    if settings.port_file is not None:
        settings.port_file.write_text(f"{port}\n{metrics_port}\n{http_port}\n")  # 0: disabled
    await stop.wait()

    deadline = time.monotonic() + settings.exit_timeout_s
    watchdog = threading.Timer(settings.exit_timeout_s, force_exit, args=(core, front, settings.exit_timeout_s))
    watchdog.daemon = True
    watchdog.start()
    logger.info("shutting down: %d requests in flight, up to %.0f s to finish", core.in_flight, settings.exit_timeout_s)
    core.stop_accepting()
    await front.health_synced()
    for task in background:
        task.cancel()
    if not await core.drain(deadline - time.monotonic()):
        force_exit(core, front, settings.exit_timeout_s)
    # Nothing is in flight now: what is left open (health Watch streams, idle inference streams)
    # would otherwise hold the stop until the deadline.
    await front.stop(grace_s=min(STREAM_GRACE_S, max(0.0, deadline - time.monotonic())), deadline=deadline)
    await manager.close()
    core.regions.close()  # clients' shared memory: unmapped, never unlinked (theirs)
    await close_tracer(core, deadline)
    watchdog.cancel()
    held = threading.Timer(max(HELD_EXIT_GRACE_S, deadline - time.monotonic()), exit_held)
    held.daemon = True  # a normal exit does not wait for it
    held.start()
    logger.info("stopped")
    return 0


def exit_held() -> None:
    """The server stopped but the process did not end: threads still running hold the interpreter's exit
    (a model's thread that is no daemon). Name them, and leave with EXIT_FORCED."""
    running = sorted(
        thread.name
        for thread in threading.enumerate()
        if thread.is_alive() and not thread.daemon and thread is not threading.main_thread()
    )
    logger.error(
        "stopped, but threads still running held the exit past the exit timeout (%s): exiting with code %d",
        ", ".join(running) or "none",
        EXIT_FORCED,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_FORCED)


async def close_tracer(core: LocalCore, deadline: float) -> None:
    """Write the trace file and export the spans still held, on a thread: a collector that does not
    answer costs at most what is left of the exit deadline (then they are lost, and the log says so)."""
    core.tracer.stop_waiting()
    closed = threading.Event()

    def close() -> None:
        try:
            core.tracer.close()
        finally:
            closed.set()

    # A daemon thread, not the loop's executor: asyncio.run would wait for that one on the way out.
    threading.Thread(target=close, name="shoal-trace-close", daemon=True).start()
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, closed.wait, max(0.5, deadline - time.monotonic() - 1.0)):
        logger.warning("traces still being written or exported at the exit deadline are lost")


class FrontEnd(Protocol):
    """Where gRPC and HTTP are served: in this process, or in front-end worker processes."""

    async def start(self) -> tuple[int, int]: ...  # the bound gRPC and HTTP ports (HTTP 0: off)

    def health_changed(self) -> None: ...

    async def health_synced(self) -> None: ...  # health is being brought in line with the core's state

    async def stop(self, grace_s: float, deadline: float) -> None: ...

    def kill(self) -> None: ...  # the forced exit: end other processes at once


class InProcessFrontEnd:
    """gRPC (with health and reflection) and HTTP in the host process, over its ``LocalCore``."""

    def __init__(self, core: LocalCore, settings: ServerSettings) -> None:
        self.core = core
        self.settings = settings
        self.health = HealthReporter()
        self.server: grpc.aio.Server | None = None
        self.http: HttpServer | None = None
        self._syncs: set[asyncio.Task[None]] = set()

    async def start(self) -> tuple[int, int]:
        await self.health.sync(self.core)
        self.server, port, choice = build_server(
            InferenceServicer(self.core),
            self.health,
            self.settings.grpc_address,
            self.settings.grpc_port,
            self.settings.tls,
            self.settings.grpc,
        )
        http_port = 0
        if self.settings.allow_http:
            http = self.settings.http
            app = HttpApp(self.core, http.max_input_bytes, http.restrictions)
            self.http = HttpServer(app, http)
            http_port = await self.http.start()
            logger.info("Started HTTPService at %s:%d", http.address, http_port)
        await self.server.start()
        logger.info("Started GRPCInferenceService at %s:%d (%s)", self.settings.grpc_address, port, choice.describe())
        return port, http_port

    def health_changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self.health.sync(self.core))
        self._syncs.add(task)
        task.add_done_callback(self._syncs.discard)

    async def health_synced(self) -> None:
        await self.health.sync(self.core)

    async def stop(self, grace_s: float, deadline: float) -> None:
        for task in self._syncs:
            task.cancel()
        if self.http is not None:
            await self.http.stop(grace_s)
        if self.server is not None:
            await self.server.stop(grace=grace_s)

    def kill(self) -> None:
        pass


class WorkerFrontEnd:
    """gRPC and HTTP in ``settings.grpc_workers`` front-end processes sharing the ports (``shoal.frontend``)."""

    def __init__(self, core: LocalCore, settings: ServerSettings) -> None:
        self.supervisor = WorkerSupervisor(core, settings)

    async def start(self) -> tuple[int, int]:
        settings = self.supervisor.settings
        # Checked again now that the models are loaded: the workers bind with SO_REUSEPORT, so a
        # server that took a port meanwhile would otherwise share it silently.
        refuse_used_ports(settings)
        choice = engine.choose(settings.grpc.engine, settings.tls is not None)  # what each worker chooses too
        port, http_port = await self.supervisor.start()
        logger.info(
            "Started GRPCInferenceService at %s:%d in %d front-end worker processes (%s)",
            settings.grpc_address,
            port,
            len(self.supervisor.workers),
            choice.describe(),
        )
        if settings.allow_http:
            logger.info("Started HTTPService at %s:%d in the same processes", settings.http.address, http_port)
        return port, http_port

    def health_changed(self) -> None:
        self.supervisor.notify_health()

    async def health_synced(self) -> None:
        self.supervisor.notify_health()  # each worker reads it again; RPCs ask the host anyway

    async def stop(self, grace_s: float, deadline: float) -> None:
        await self.supervisor.stop(grace_s, deadline)

    def kill(self) -> None:
        self.supervisor.kill()


def _forget_server_signals() -> None:
    """In a process a model forks from the server (``multiprocessing``'s fork start method, ``os.fork``
    in a thread instance): the loop's signal handling is the server's, not the child's. The child
    inherits the loop's wakeup descriptor, so the SIGTERM that ``Pool.terminate`` sends its workers
    would reach the server's loop and stop the server; and asyncio's handlers would keep the child
    from ending. The child gets the default handlers and no wakeup descriptor instead."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def force_exit(core: LocalCore, front: FrontEnd, timeout_s: float) -> None:
    """The exit timeout has passed: kill the worker processes and leave at once with EXIT_FORCED."""
    try:
        front.kill()
    finally:
        _kill_children_and_exit(core, timeout_s)


def _kill_children_and_exit(core: LocalCore, timeout_s: float) -> None:
    children = multiprocessing.active_children()
    logger.error(
        "exit timeout of %.0f s passed with %d requests in flight: killing %d worker processes, exiting with code %d",
        timeout_s,
        core.in_flight,
        len(children),
        EXIT_FORCED,
    )
    for child in children:
        child.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
    for child in children:
        child.join(timeout=1.0)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_FORCED)  # instance threads still executing must not hold the exit


def refuse_used_ports(settings: ServerSettings) -> None:
    """StartupError if the gRPC port, or the HTTP port when HTTP is served, is taken."""
    refuse_used_port("gRPC", settings.grpc_address, settings.grpc_port, settings.grpc.reuse_port)
    if settings.allow_http:
        refuse_used_port("HTTP", settings.http.address, settings.http.port, settings.http.reuse_port)


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
                flag = {"gRPC": "--reuse-grpc-port", "HTTP": "--reuse-http-port"}.get(what)
                hint = f"; pass {flag} to share it on purpose" if flag else ""
                raise StartupError(
                    f"cannot serve {what} on {address}:{port}: {exc.strerror} (another server?){hint}"
                ) from None
