"""The load-generating worker process: asyncio, pre-serialized requests over gRPC or HTTP.

A worker process receives steps on a command queue. For each it opens its channels, reports
``Ready`` and waits for the parent's ``Start``: the parent fixes the start once every process
is ready, so a process still importing (seconds on a busy machine) never eats into the warm-up
or the first windows. From ``start_at`` on it sends requests (closed loop: ``concurrency``
coroutines each waiting for its reply; open loop: sends on a constant or Poisson schedule).
Requests completing after the warm-up are
counted in fixed windows and each window is reported to the parent on a result queue:
(worker index, step index, window index, latencies in µs, errors by status).
Everything runs until the parent sets the step's stop event or its deadline passes; requests
then in flight get ``STOP_GRACE_S`` to complete (and are counted), the rest are cancelled. The
``done`` message carries the CPU the process spent sending (``time.process_time``, all threads) and
how many requests completed meanwhile.

A closed-loop coroutine whose requests fail backs off exponentially (``BACKOFF_FIRST_S``
doubling up to ``BACKOFF_MAX_S``, reset by a success): a dead server costs a few failures
per second per coroutine, not a busy loop. The open loop keeps its schedule (its rate bounds it).
A load process ignores SIGINT (the parent stops it) and exits when its parent is gone. It is
born with SIGINT blocked (see ``measure.LoadTester.__enter__``) and ignores it before unblocking.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import queue
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from shoal.clients.loadtest import grpc_h2
from shoal.clients.loadtest.grpc_h2 import PrebuiltGrpcChannel
from shoal.clients.loadtest.http import ConnectionPool, HttpRequest
from shoal.protocol import METHODS

INFER_PATH = METHODS["ModelInfer"].path
MAX_MESSAGE_BYTES = 2**31 - 1
OPEN_LOOP_MAX_OUTSTANDING = 10_000
# An open loop's requests go round-robin over this many channels: a server refuses streams past its
# limit per connection (Shoal's --grpc-max-concurrent-streams, 100), and a stall piles requests up.
OPEN_LOOP_CHANNELS = 8
BACKOFF_FIRST_S = 0.001
BACKOFF_MAX_S = 0.5
STOP_GRACE_S = 2.0
CONNECT_WAIT_S = 2.0  # bound on opening the channels before a step starts


@dataclass(frozen=True)
class Step:
    index: int
    concurrency: int  # closed loop: coroutines in this process (0 in open loop)
    request_rate: float  # open loop: requests/s from this process (0 in closed loop)
    poisson: bool
    warmup_s: float
    window_s: float
    ready_by: float  # monotonic time after which a process stops waiting for its Start


@dataclass(frozen=True)
class Ready:
    """A process has its channels open and waits for the step's Start."""

    worker: int
    step: int


@dataclass(frozen=True)
class Start:
    """When every process of a step starts sending, and when the step ends regardless."""

    step: int
    start_at: float  # time.monotonic() value, shared by all processes on the machine
    deadline: float


@dataclass(frozen=True)
class WindowReport:
    worker: int
    step: int
    window: int
    latencies_us: np.ndarray
    errors: dict[str, int]


class _Windows:
    """Counts completions into windows by completion time; flushes whole windows to the parent."""

    def __init__(self, worker: int, step: Step, start: Start, results: Any) -> None:
        self.worker, self.step, self.results = worker, step, results
        self.measure_from = start.start_at + step.warmup_s
        self.current = 0
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.completed = 0  # every request answered (or failed), warm-up included

    def record(self, finished: float, latency_s: float, error: str | None) -> None:
        self.completed += 1
        if finished < self.measure_from:
            return
        window = int((finished - self.measure_from) / self.step.window_s)
        while window > self.current:
            self.flush()
        if error is None:
            self.latencies.append(latency_s * 1e6)
        else:
            self.errors[error] += 1

    def flush(self) -> None:
        self.results.put(
            WindowReport(
                self.worker,
                self.step.index,
                self.current,
                np.asarray(self.latencies, dtype=np.float64),
                dict(self.errors),
            )
        )
        self.current += 1
        self.latencies = []
        self.errors = Counter()

    def flush_until(self, now: float) -> None:
        """Report windows that ended without a completion (a stalled server must still show up)."""
        if now >= self.measure_from:
            while int((now - self.measure_from) / self.step.window_s) > self.current:
                self.flush()


class _Senders:
    """Where a worker's coroutines send: gRPC channels shared by ``workers_per_channel`` coroutines, or
    a pool of keep-alive HTTP/1.1 connections (one per request in flight, as HTTP cannot multiplex).

    A gRPC channel is a ``PrebuiltGrpcChannel`` (the request as ready-made HTTP/2 frames, a third of
    grpc.aio's CPU per request: ``grpc_h2``'s docstring) when the request fits one HTTP/2 frame, and a
    grpc.aio channel otherwise or where the server's stream window is too small for it.

    ``send(index, timeout_s)`` returns None on success, else the error's name: the gRPC status, or
    ``HTTP_<status>`` / ``CONNECTION_ERROR`` / ``DEADLINE_EXCEEDED`` over HTTP.
    """

    def __init__(self, url: str, request: bytes | HttpRequest, coroutines: int, workers_per_channel: int) -> None:
        self.url = url
        self.request = request
        self.workers_per_channel = workers_per_channel
        self.coroutines = coroutines
        if isinstance(request, HttpRequest):
            self.pool = ConnectionPool(url, request)
            return
        count = -(-coroutines // workers_per_channel)
        self.channels: list[PrebuiltGrpcChannel | _AioChannel] = [
            PrebuiltGrpcChannel(url, INFER_PATH, request) if grpc_h2.fits(request) else _AioChannel(url, request)
            for _ in range(count)
        ]

    async def send(self, index: int, timeout_s: float) -> str | None:
        if isinstance(self.request, HttpRequest):
            return await self.pool.send(timeout_s)
        which = (index // self.workers_per_channel) % len(self.channels)
        channel = self.channels[which]
        try:
            return await channel.call(timeout_s)
        except grpc_h2.PeerWindowTooSmall:  # said on a reconnection: grpc.aio from here on, this request too
            if self.channels[which] is channel:
                assert isinstance(self.request, bytes)
                self.channels[which] = _AioChannel(self.url, self.request)
                await channel.close()
            return await self.channels[which].call(timeout_s)

    async def connect(self, timeout_s: float) -> None:
        """Open the gRPC channels, or an HTTP connection per coroutine, before the start; a server that
        does not answer within ``timeout_s`` is left to the load to report."""
        if isinstance(self.request, HttpRequest):
            opening: Awaitable[Any] = self.pool.connect(self.coroutines)
        else:
            opening = asyncio.gather(*(self._open(i) for i in range(len(self.channels))))
        try:
            await asyncio.wait_for(opening, timeout_s)
        except TimeoutError:
            return

    async def _open(self, index: int) -> None:
        try:
            await self.channels[index].connect()
        except grpc_h2.PeerWindowTooSmall:
            assert isinstance(self.request, bytes)
            self.channels[index] = _AioChannel(self.url, self.request)
            await self.channels[index].connect()
        except OSError:
            return  # left to the load to report

    async def close(self) -> None:
        if isinstance(self.request, HttpRequest):
            await self.pool.close()
            return
        for channel in self.channels:
            await channel.close()


class _AioChannel:
    """A grpc.aio channel sending the serialized request: for requests ``PrebuiltGrpcChannel`` cannot carry."""

    def __init__(self, url: str, request: bytes) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self.request = request
        self.channel = grpc.aio.insecure_channel(url, options)
        self.infer = self.channel.unary_unary(INFER_PATH, request_serializer=None, response_deserializer=None)

    async def connect(self) -> None:
        await self.channel.channel_ready()

    async def call(self, timeout_s: float) -> str | None:
        try:
            await self.infer(self.request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        return None

    async def close(self) -> None:
        await self.channel.close()


async def _run_step(
    worker: int,
    url: str,
    request: bytes | HttpRequest,
    step: Step,
    workers_per_channel: int,
    commands: Any,
    stop: multiprocessing.synchronize.Event,
    results: Any,
) -> None:
    senders = _Senders(url, request, step.concurrency or OPEN_LOOP_CHANNELS * workers_per_channel, workers_per_channel)
    await senders.connect(min(CONNECT_WAIT_S, max(0.0, step.ready_by - time.monotonic())))
    results.put(Ready(worker, step.index))
    start = await asyncio.to_thread(_wait_for_start, commands, step, stop)
    cpu_s, completed = 0.0, 0
    if start is not None:
        before = time.process_time()  # the whole process: its grpc threads too
        completed = await _send_load(worker, senders, step, start, stop, results)
        cpu_s = time.process_time() - before
    results.put(("done", worker, step.index, time.monotonic(), cpu_s, completed))
    await senders.close()


def _wait_for_start(commands: Any, step: Step, stop: multiprocessing.synchronize.Event) -> Start | None:
    """The parent's Start of ``step``; None when the step was stopped or ``step.ready_by`` passed first."""
    while not stop.is_set() and time.monotonic() < step.ready_by:
        try:
            message = commands.get(timeout=0.1)
        except queue.Empty:
            continue
        if message is None:  # the parent is closing: leave its None for worker_main
            commands.put(None)
            return None
        if isinstance(message, Start) and message.step == step.index:
            return message
    return None


async def _send_load(
    worker: int, senders: _Senders, step: Step, start: Start, stop: multiprocessing.synchronize.Event, results: Any
) -> int:
    """Send from ``start.start_at`` until stopped or the deadline, counting completions in windows; returns
    how many requests completed (warm-up included)."""
    windows = _Windows(worker, step, start, results)

    def running() -> bool:
        return not stop.is_set() and time.monotonic() < start.deadline

    async def send(index: int) -> bool:
        sent = time.monotonic()
        error = await senders.send(index, max(1.0, start.deadline - sent))
        finished = time.monotonic()
        windows.record(finished, finished - sent, error)
        return error is None

    async def closed_loop(index: int) -> None:
        failures = 0
        while running():
            if await send(index):
                failures = 0
                continue
            failures += 1
            await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(failures - 1, 20)))

    in_flight: set[asyncio.Task[bool]] = set()  # open loop: sent, not yet answered

    async def open_loop() -> None:
        next_send = start.start_at
        rng = random.Random(worker)
        turn = 0
        while running():
            delay = next_send - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= OPEN_LOOP_MAX_OUTSTANDING:
                windows.record(time.monotonic(), 0.0, "CLIENT_OVERLOADED")
            else:
                task = asyncio.create_task(send(turn * senders.workers_per_channel))  # the next channel each time
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            turn += 1
            gap = 1.0 / step.request_rate
            next_send += rng.expovariate(1.0 / gap) if step.poisson else gap

    delay = start.start_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    loops = (
        [asyncio.create_task(closed_loop(i)) for i in range(step.concurrency)]
        if step.concurrency > 0
        else [asyncio.create_task(open_loop())]
    )
    while running() and not all(task.done() for task in loops):
        await asyncio.wait(loops, timeout=step.window_s / 4)
        windows.flush_until(time.monotonic())
    # Requests in flight get STOP_GRACE_S to complete (and are counted); the rest are cancelled.
    tasks = [*loops, *in_flight]
    _, unfinished = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
    for task in unfinished:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    windows.flush()
    return windows.completed


def worker_main(
    worker: int,
    url: str,
    request: bytes | HttpRequest,
    workers_per_channel: int,
    commands: Any,
    results: Any,
    stop: multiprocessing.synchronize.Event,
) -> None:
    """Entry point of a load process: run steps from ``commands`` until it sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # born blocked; now ignored instead
    parent = multiprocessing.parent_process()
    while True:
        try:
            step = commands.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if step is None:
            return
        if isinstance(step, Step):  # a Start left over from a step this process did not reach is dropped
            asyncio.run(_run_step(worker, url, request, step, workers_per_channel, commands, stop, results))
