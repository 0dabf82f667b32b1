"""The host's side of the front-end workers: start N on one port, restart one that dies, stop all.

Each worker serves every transport: gRPC, and HTTP unless ``--allow-http false``; both ports are
shared by all workers the same way.

Each worker gets a socketpair for control messages and two arenas (``dataplane.arena``): its own
for inputs and one of the host's for outputs, passed as inherited memfd descriptors. Worker 0
binds the configured port first (port 0: a free one), the others join it with SO_REUSEPORT, and
the kernel spreads new connections across them. A worker that dies is started again on the same
port; only the requests it held fail (their clients' connections drop), and the host finishes the
ones it had accepted from it.

Each worker's temporary files (pygrpc-native's fallback socket folder) go in a folder of its own
(its ``TMPDIR``), which the host removes once the worker has exited: a worker that is killed, by the
liveness check, the exit deadline or an operator, cleans nothing itself, and one left behind per
restart would pile up in /tmp for as long as the server runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

from shoal import logs
from shoal.core import messages
from shoal.core.host import CoreHost
from shoal.core.local import LocalCore
from shoal.dataplane.arena import Arena
from shoal.errors import StartupError
from shoal.frontend.worker import WorkerConfig, send_config
from shoal.settings import ServerSettings

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = 1.0  # a worker that dies this soon after starting is started again this much later
MISSED_PINGS = 3  # liveness checks a worker may leave unanswered before it is replaced


class WorkerProcess:
    """A front-end worker's process, started with ``subprocess.Popen`` and awaited through a thread of its own.

    Not ``asyncio.create_subprocess_exec``: on uvloop that spawns through libuv, which resets every
    signal the host ignores to its default (under ``nohup`` a SIGHUP to the process group then
    killed the workers and the requests they held) and closes no inherited descriptor (uvloop has no
    ``close_fds``). ``Popen`` keeps POSIX's rules on either loop: ignored signals stay ignored, only
    ``pass_fds`` cross. The thread only waits for the exit (the default executor's few threads are
    for work, not for waiting on processes that live as long as the server).
    """

    def __init__(self, args: list[str], pass_fds: tuple[int, ...], env: dict[str, str]) -> None:
        self._popen = subprocess.Popen(args, pass_fds=pass_fds, env=env)
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        threading.Thread(target=self._reap, args=(loop,), name=f"shoal-reap-{self.pid}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def kill(self) -> None:
        """SIGKILL, unless it was reaped already (its pid may be another process's by now)."""
        self._popen.kill()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self._popen.wait()
        if not loop.is_closed():  # closed: the server has ended, and nobody waits any more
            with contextlib.suppress(RuntimeError):  # it closed just now
                loop.call_soon_threadsafe(self._settle, code)

    def _settle(self, code: int) -> None:
        if not self._exited.done():
            self._exited.set_result(code)


@dataclass
class Worker:
    index: int
    process: WorkerProcess
    host: CoreHost
    scratch: str  # the worker's TMPDIR, removed once it has exited
    started_at: float = field(default_factory=time.monotonic)


class WorkerSupervisor:
    """N front-end worker processes serving ``settings``'s gRPC address over the host's ``core``."""

    def __init__(self, core: LocalCore, settings: ServerSettings) -> None:
        self.core = core
        self.settings = settings
        self.port = settings.grpc_port
        self.http_port = settings.http.port
        self.workers: dict[int, Worker] = {}
        self._stopping = False
        self._watchers: set[asyncio.Task[None]] = set()

    async def start(self) -> tuple[int, int]:
        """Start every worker; the bound (gRPC, HTTP) ports, HTTP 0 when off. StartupError if a worker cannot
        serve."""
        self.port, self.http_port = await self._start_worker(0)
        await asyncio.gather(*(self._start_worker(i) for i in range(1, self.settings.grpc_workers)))
        return self.port, self.http_port

    def notify_health(self) -> None:
        """Model or server state changed: each worker reads health again."""
        for worker in self.workers.values():
            worker.host.send(messages.Health())

    async def stop(self, grace_s: float, deadline: float) -> None:
        """Stop every worker (open RPCs get ``grace_s``); kill those still running at ``deadline``."""
        self._stopping = True
        for worker in self.workers.values():
            worker.host.send(messages.Stop(grace_s))
        waits = [asyncio.create_task(w.process.wait()) for w in self.workers.values()]
        if waits:
            await asyncio.wait(waits, timeout=max(0.1, deadline - time.monotonic()))
        self.kill()  # SIGKILLed, a worker writes nothing more: its scratch folder can go
        for worker in self.workers.values():
            worker.host.close()
            shutil.rmtree(worker.scratch, ignore_errors=True)
        for watcher in self._watchers:
            watcher.cancel()

    def kill(self) -> None:
        """SIGKILL every worker still running (the forced exit)."""
        for worker in list(self.workers.values()):  # also called from the watchdog thread
            if worker.process.returncode is None:
                try:
                    os.kill(worker.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def _start_worker(self, index: int) -> tuple[int, int]:
        pool_bytes = self.settings.grpc_worker_pool_bytes
        requests = Arena.create(f"shoal-worker{index}-requests", pool_bytes)
        responses = Arena.create(f"shoal-worker{index}-responses", pool_bytes)
        try:
            return await self._start_worker_with(index, requests, responses)
        except BaseException:
            requests.close()  # a worker that did not start (killed while starting, say): no mapping stays
            responses.close()
            raise

    async def _start_worker_with(self, index: int, requests: Arena, responses: Arena) -> tuple[int, int]:
        pool_bytes = self.settings.grpc_worker_pool_bytes
        scratch = tempfile.mkdtemp(prefix=f"shoal-worker{index}-")
        log_share = logs.current()
        host_end, worker_end = socket.socketpair()
        try:
            process = WorkerProcess(
                # -P: no working directory on sys.path (a stray ssl.py there must not shadow a module)
                [sys.executable, "-P", "-m", "shoal.frontend", str(worker_end.fileno())],
                pass_fds=(worker_end.fileno(), requests.fd, responses.fd, log_share.fd),
                env={**os.environ, "TMPDIR": scratch},
            )
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            worker_end.close()
        config = WorkerConfig(
            index=index,
            address=self.settings.grpc_address,
            port=self.port,
            tls=self.settings.tls,
            limits=replace(self.settings.grpc, reuse_port=True),
            requests_fd=requests.fd,
            responses_fd=responses.fd,
            pool_bytes=pool_bytes,
            log_fd=log_share.fd,
            log_file=log_share.log_file,
            http=replace(self.settings.http, port=self.http_port) if self.settings.allow_http else None,
            event_loop=self.settings.event_loop,
        )
        host = CoreHost(self.core, requests, responses)
        try:
            send_config(host_end, config)
            requests.close_fd()  # the worker has its own descriptors now; the mappings stay
            responses.close_fd()
            await host.connect(host_end)
            worker = Worker(index, process, host, scratch)
            self.workers[index] = worker
            ports = await self._wait_started(worker)
        except BaseException:
            host.close()
            host_end.close()
            if process.returncode is None:
                process.kill()
            await process.wait()
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        for watch in (self._watch(worker), self._check_liveness(worker)):
            watcher = asyncio.create_task(watch)
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
        logger.info(
            "front-end worker %d (pid %d) serves gRPC on %s:%d%s",
            index,
            process.pid,
            self.settings.grpc_address,
            ports[0],
            f" and HTTP on {self.settings.http.address}:{ports[1]}" if self.settings.allow_http else "",
        )
        return ports

    async def _wait_started(self, worker: Worker) -> tuple[int, int]:
        exited = asyncio.create_task(worker.process.wait())
        try:
            await asyncio.wait(
                (exited, worker.host.started), timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            exited.cancel()
        result = worker.host.started.result() if worker.host.started.done() else None
        if isinstance(result, tuple):
            return result
        if worker.process.returncode is None:
            worker.process.kill()
        raise StartupError(
            result or f"front-end worker {worker.index} did not start (exit code {worker.process.returncode})"
        )

    async def _check_liveness(self, worker: Worker) -> None:
        """Kill a worker that answers no PING for ``MISSED_PINGS`` intervals (stopped, or its loop
        stuck): it would keep its listening socket and take connections it never serves. ``_watch``
        then starts it again. Several intervals, so a loop busy for a while (a huge message) is spared."""
        interval_s = self.settings.grpc_worker_liveness_s
        while interval_s > 0 and worker.process.returncode is None and not self._stopping:
            worker.host.send(messages.Ping())
            await asyncio.sleep(interval_s)
            silent_s = time.monotonic() - max(worker.host.answered_ping_at, worker.started_at)
            if silent_s > MISSED_PINGS * interval_s and worker.process.returncode is None and not self._stopping:
                logger.error(
                    "front-end worker %d (pid %d) answered no liveness check for %.1f s; killing it",
                    worker.index,
                    worker.process.pid,
                    silent_s,
                )
                worker.process.kill()
                return

    async def _watch(self, worker: Worker) -> None:
        """Start the worker again if it dies while the server is not stopping."""
        code = await worker.process.wait()
        worker.host.close()
        shutil.rmtree(worker.scratch, ignore_errors=True)
        if self._stopping:
            return
        logger.error(
            "front-end worker %d (pid %d) exited with code %s; the host finishes the %d requests it "
            "had accepted from it, their answers are dropped; starting it again",
            worker.index,
            worker.process.pid,
            code,
            worker.host.in_flight,
        )
        if time.monotonic() - worker.started_at < RESTART_BACKOFF_S:
            await asyncio.sleep(RESTART_BACKOFF_S)
        while not self._stopping:
            try:
                await self._start_worker(worker.index)
                return
            except Exception as exc:  # noqa: BLE001 - out of descriptors or memory: keep trying, never give up silently
                logger.error("front-end worker %d could not start again: %s", worker.index, exc)
                await asyncio.sleep(RESTART_BACKOFF_S)
