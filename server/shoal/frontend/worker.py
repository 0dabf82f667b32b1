"""One front-end worker process: the same gRPC and HTTP transports as the host's, over a ``RemoteCore``.

Started by the host (``frontend.supervisor``) as ``python -m shoal.frontend FD``, where FD is
its end of a socketpair. The first thing on it is the ``WorkerConfig``; then it serves until the
host says STOP, or exits when the host is gone (the kernel kills it with the host: PDEATHSIG).
Signals from a terminal reach the whole process group; the host alone decides, so the worker
ignores SIGINT and SIGTERM.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import signal
import socket
import struct
import sys
from dataclasses import dataclass

from shoal import event_loops, logs
from shoal.core.remote import RemoteCore
from shoal.dataplane.arena import Arena
from shoal.descriptors import AcceptFailureLog, raise_open_file_limit
from shoal.errors import StartupError
from shoal.grpc.health import HealthReporter
from shoal.grpc.server import build_server
from shoal.grpc.servicer import InferenceServicer
from shoal.http.app import HttpApp
from shoal.http.server import HttpServer
from shoal.settings import GrpcLimits, HttpSettings, TlsSettings

logger = logging.getLogger(__name__)

_CONFIG_LENGTH = struct.Struct("<I")
_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 1.0  # for the RPCs grpc cancels as it stops


@dataclass(frozen=True)
class WorkerConfig:
    index: int
    address: str
    port: int
    tls: TlsSettings | None
    limits: GrpcLimits
    requests_fd: int  # this worker's arena (it allocates inputs there)
    responses_fd: int  # the host's arena for this worker (outputs)
    pool_bytes: int  # the size of each arena
    log_fd: int  # the log settings' page (shoal.logs)
    log_file: str
    http: HttpSettings | None = None  # None: no HTTP endpoint; its port is shared with the other workers
    event_loop: str = "asyncio"  # the host's (shoal.event_loops)


def send_config(sock: socket.socket, config: WorkerConfig) -> None:
    payload = pickle.dumps(config)
    sock.sendall(_CONFIG_LENGTH.pack(len(payload)) + payload)


def _receive_config(sock: socket.socket) -> WorkerConfig:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise EOFError("the host closed the channel before sending the worker's configuration")
            data += chunk
        return data

    (size,) = _CONFIG_LENGTH.unpack(exactly(_CONFIG_LENGTH.size))
    config = pickle.loads(exactly(size))
    assert isinstance(config, WorkerConfig)
    return config


def _die_with_parent() -> None:
    """SIGKILL this process when the host dies, however it dies."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the host died before the line above
        os._exit(1)


async def serve(sock: socket.socket, config: WorkerConfig) -> int:
    """Serve gRPC (and HTTP) until the host says stop or goes away; the exit code."""
    AcceptFailureLog().install()
    requests = Arena(config.requests_fd, config.pool_bytes)
    responses = Arena(config.responses_fd, config.pool_bytes)
    requests.close_fd()
    responses.close_fd()
    health = HealthReporter()
    stop = asyncio.Event()
    grace_s = [0.0]
    background: set[asyncio.Task[None]] = set()

    def refresh_health() -> None:
        task = asyncio.get_running_loop().create_task(health.sync(core))
        background.add(task)
        task.add_done_callback(background.discard)

    def stop_serving(grace: float) -> None:
        grace_s[0] = grace
        stop.set()

    core = RemoteCore(requests, responses, on_health=refresh_health, on_stop=stop_serving)
    await core.connect(sock)
    await health.sync(core)
    http: HttpServer | None = None
    http_port = 0
    try:
        servicer = InferenceServicer(core, encoded_bytes=True)  # the host decodes BYTES: see RemoteCore
        server, port, engine = build_server(servicer, health, config.address, config.port, config.tls, config.limits)
        if config.http is not None:
            http = HttpServer(
                HttpApp(
                    core,
                    config.http.max_input_bytes,
                    config.http.restrictions,
                    encoded_bytes=True,
                ),
                config.http,
                reuse_port=True,
            )
            http_port = await http.start()
    except StartupError as exc:
        core.started(str(exc))
        return 1
    await server.start()
    logger.info(
        "front-end worker %d serves gRPC on %s:%d (%s); event loop %s",
        config.index,
        config.address,
        port,
        engine.describe(),
        config.event_loop,
    )
    core.started((port, http_port))
    host_gone = asyncio.create_task(core.closed.wait())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((host_gone, stopping), return_when=asyncio.FIRST_COMPLETED)
    if core.closed.is_set() and not stop.is_set():
        logger.error("front-end worker %d: the host process is gone; exiting", config.index)
    if http is not None:
        await http.stop(grace_s[0])
    await server.stop(grace=grace_s[0])
    for task in (host_gone, stopping, *background):
        task.cancel()
    # grpc cancels the RPCs still open (health Watch streams) as it stops; let them end here, or
    # asyncio.run would cancel them again on the way out and grpc logs each as an unhandled error.
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=STOP_TIMEOUT_S)
    return 0


def main() -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    config = _receive_config(sock)
    logs.install(
        logs.LogShare.attach(config.log_fd, config.log_file),
        logs.LOG_LINE.replace("%(name)s", f"worker{config.index} %(name)s"),
    )
    raise_open_file_limit(logging.DEBUG)  # the host raised it already; a worker started otherwise raises its own
    return event_loops.run(serve(sock, config), config.event_loop)
