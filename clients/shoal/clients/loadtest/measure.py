"""The parent of a load test: runs steps on the worker processes, decides when a step is stable.

A step starts once every load process reports ``Ready`` (a process still importing would
otherwise leave the warm-up and the first windows empty); it measures windows of ``window_s``
after a warm-up until the last three windows agree
within ``stability`` (throughput and mean latency: max/min − 1), or ``max_windows`` pass, or
— with ``request_count`` — until that many requests completed. The step's throughput and
latencies are those of its last three windows (all measured windows with ``request_count``);
its ``requests``, ``errors`` and ``seconds`` count the whole step after the warm-up: every
window, and the requests still in flight when it ended. The server-side breakdown comes from
ModelStatistics snapshots taken at window boundaries, when the server offers statistics.

Ctrl-C (KeyboardInterrupt) during a step stops it: ``run_step`` returns what was measured so
far, marked ``interrupted``.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.clients.loadtest.control import CONTROL_ERRORS, connect
from shoal.clients.loadtest.engine import Ready, Start, Step, WindowReport, worker_main
from shoal.clients.loadtest.http import HttpRequest

STABLE_WINDOWS = 3
STATISTICS = ("queue", "compute_input", "compute_infer", "compute_output", "success")
READY_TIMEOUT_S = 60.0  # load processes import and connect in seconds, even on a busy machine
READY_SLACK_S = 5.0  # a ready process waits this much longer for its Start than the parent waits for Ready
START_MARGIN_S = 0.05  # from sending Start to start_at: the Start must reach every process first


@dataclass(frozen=True)
class Settings:
    url: str
    model: str
    version: str
    request: bytes | HttpRequest  # one serialized ModelInferRequest, or an HTTP infer body
    batch_size: int
    processes: int = 1
    workers_per_channel: int = 8
    warmup_s: float = 1.0
    window_s: float = 2.0
    stability: float = 0.10
    max_windows: int = 10
    request_count: int = 0
    poisson: bool = False
    protocol: str = "grpc"  # or "http"


@dataclass
class StepResult:
    concurrency: int
    request_rate: float
    throughput: float  # inferences/s: successful requests/s × batch size
    requests: int
    latency_us: dict[str, float]  # avg, p50, p90, p95, p99, max
    errors: dict[str, int]
    stable: bool
    windows: int
    server_us: dict[str, float] | None = None  # per request: queue, compute_input/infer/output, request
    window_throughputs: list[float] = field(default_factory=list)
    seconds: float = 0.0  # the time ``requests`` and ``errors`` cover: from the warm-up's end to the step's end
    # The load processes' own CPU per answered request over the whole step (warm-up included): what the load
    # generator took from a machine it shares with the server.
    client_cpu_us: float = 0.0
    interrupted: bool = False  # stopped by Ctrl-C: what was measured until then


@dataclass
class WindowStats:
    index: int
    latencies_us: np.ndarray
    errors: Counter[str]
    seconds: float

    @property
    def throughput(self) -> float:
        return len(self.latencies_us) / self.seconds

    @property
    def mean_us(self) -> float:
        return float(self.latencies_us.mean()) if len(self.latencies_us) else 0.0


class _Totals:
    """Every request of a step after the warm-up, whichever window it fell in."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors: Counter[str] = Counter()
        self.finished_workers = 0
        self.ended_at = 0.0  # monotonic time the last worker finished the step
        self.completed = 0  # every request of the step that completed, warm-up included
        self.cpu_s = 0.0  # the load processes' CPU while sending them

    def add(self, message: object, step_index: int) -> WindowReport | None:
        """Count one message from a worker; returns it when it is a window of this step."""
        if isinstance(message, WindowReport) and message.step == step_index:
            self.requests += len(message.latencies_us)
            self.errors.update(message.errors)
            return message
        if isinstance(message, tuple) and message[0] == "done" and message[2] == step_index:
            self.finished_workers += 1
            self.ended_at = max(self.ended_at, message[3])
            self.cpu_s += message[4]
            self.completed += message[5]
        return None  # a late message of an earlier step, or "done"


class LoadTester:
    """Owns the worker processes; ``run_step`` measures one concurrency or request rate."""

    def __init__(self, settings: Settings, on_window: Callable[[StepResult, int], None] | None = None) -> None:
        self.settings = settings
        self.on_window = on_window
        context = multiprocessing.get_context("spawn")  # no fork: grpc does not survive it
        self._results: Any = context.Queue()
        self._stop = context.Event()
        self._commands = [context.Queue() for _ in range(settings.processes)]
        self._processes = [
            context.Process(
                target=worker_main,
                args=(
                    index,
                    settings.url,
                    settings.request,
                    settings.workers_per_channel,
                    self._commands[index],
                    self._results,
                    self._stop,
                ),
                daemon=True,
            )
            for index in range(settings.processes)
        ]
        self._step_index = 0
        self._active = settings.processes  # processes taking part in the current step
        self._client = connect(settings.protocol, settings.url)
        self._has_statistics = self._server_has_statistics()

    def __enter__(self) -> LoadTester:
        # The load processes are born with SIGINT blocked (the mask survives fork and exec), so a Ctrl-C
        # while one still imports prints no KeyboardInterrupt traceback; each ignores SIGINT, then unblocks
        # it. Here a Ctrl-C meanwhile stays pending and is raised once they started: ignoring SIGINT here
        # instead lost it (the tuner then ran to its end and exited 0).
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            try:
                for process in self._processes:
                    process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        for command in self._commands:
            command.put(None)
        for process in self._processes:
            if process.pid is None:  # never started: a Ctrl-C came first
                continue
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        self._client.close()

    def _server_has_statistics(self) -> bool:
        try:
            return "statistics" in self._client.server_metadata().extensions
        except CONTROL_ERRORS:
            return False

    def _snapshot(self) -> dict[str, tuple[int, int]] | None:
        """Summed (count, ns) per statistic over this model's versions, or None without statistics."""
        if not self._has_statistics:
            return None
        try:
            rows = self._client.statistics(self.settings.model, self.settings.version)
        except CONTROL_ERRORS:
            return None
        totals = {key: (0, 0) for key in STATISTICS}
        for row in rows:
            stats = row.get("inference_stats", {})
            for key in STATISTICS:
                entry = stats.get(key, {})
                count, ns = totals[key]
                totals[key] = (count + int(entry.get("count", 0)), ns + int(entry.get("ns", 0)))
        return totals

    # -- one step ----------------------------------------------------------------------------------

    def run_step(self, concurrency: int = 0, request_rate: float = 0.0, deadline: float | None = None) -> StepResult:
        """Measure one step; ``deadline`` (monotonic) bounds it, on top of ``max_windows``."""
        s = self.settings
        self._stop.clear()
        step_index = self._step_index
        self._step_index += 1
        # Closed loop: no more processes than requests in flight; open loop: the rate is split.
        active = min(s.processes, concurrency) if concurrency else s.processes
        self._active = active
        ready_until = min(time.monotonic() + READY_TIMEOUT_S, deadline or math.inf)
        for index, command in enumerate(self._commands[:active]):
            command.put(
                Step(
                    step_index,
                    _share(concurrency, active, index),
                    request_rate / active,
                    s.poisson,
                    s.warmup_s,
                    s.window_s,
                    ready_until + READY_SLACK_S,
                )
            )
        windows: list[WindowStats] = []
        totals = _Totals()
        snapshots: list[Any] = []
        measure_from = None
        interrupted = False
        try:
            start = self._start(step_index, ready_until, deadline)
            measure_from = start.start_at + s.warmup_s
            wait = measure_from - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            snapshots.append(self._snapshot())
            self._measure(step_index, start.deadline, concurrency, request_rate, windows, totals, snapshots)
        except KeyboardInterrupt:
            interrupted = True
        self._stop.set()
        self._drain(step_index, totals, timeout_s=10 if interrupted else 30)
        result = _summarize(concurrency, request_rate, windows, s, snapshots, totals)
        if measure_from is not None:
            result.seconds = max(0.0, (totals.ended_at or time.monotonic()) - measure_from)
        result.client_cpu_us = totals.cpu_s / totals.completed * 1e6 if totals.completed else 0.0
        result.interrupted = interrupted
        return result

    def _start(self, step_index: int, ready_until: float, deadline: float | None) -> Start:
        """Wait (until ``ready_until``) for every active process to be Ready, then start them all at once:
        the warm-up and the windows count from when the load really starts."""
        ready: set[int] = set()
        while len(ready) < self._active and time.monotonic() < ready_until:
            try:
                message = self._results.get(timeout=max(0.05, ready_until - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(message, Ready) and message.step == step_index:
                ready.add(message.worker)
        s = self.settings
        start_at = time.monotonic() + START_MARGIN_S
        budget = s.warmup_s + s.window_s * (s.max_windows + 1) + 5
        start = Start(step_index, start_at, min(start_at + budget, deadline or math.inf))
        for command in self._commands[: self._active]:
            command.put(start)
        return start

    def _measure(
        self,
        step_index: int,
        step_deadline: float,
        concurrency: int,
        request_rate: float,
        windows: list[WindowStats],
        totals: _Totals,
        snapshots: list[Any],
    ) -> None:
        """Collect windows until the step is finished or its deadline passes."""
        s = self.settings
        pending: dict[int, list[WindowReport]] = {}
        while time.monotonic() < step_deadline:
            try:
                message = self._results.get(timeout=max(0.05, step_deadline - time.monotonic()))
            except queue.Empty:
                break
            report = totals.add(message, step_index)
            if report is None:
                continue
            pending.setdefault(report.window, []).append(report)
            if len(pending[report.window]) < self._active or report.window != len(windows):
                continue
            parts = pending.pop(report.window)
            errors: Counter[str] = Counter()
            for part in parts:
                errors.update(part.errors)
            windows.append(
                WindowStats(report.window, np.concatenate([p.latencies_us for p in parts]), errors, s.window_s)
            )
            snapshots.append(self._snapshot())
            result = _summarize(concurrency, request_rate, windows, s, snapshots, totals)
            if self.on_window:
                self.on_window(result, len(windows))
            if self._finished(windows, result):
                return

    def _finished(self, windows: list[WindowStats], result: StepResult) -> bool:
        s = self.settings
        if s.request_count:
            return sum(len(w.latencies_us) + sum(w.errors.values()) for w in windows) >= s.request_count
        return result.stable or len(windows) >= s.max_windows

    def _drain(self, step_index: int, totals: _Totals, timeout_s: float) -> None:
        """Count the step's last windows until every process finished it, so the next one starts clean."""
        deadline = time.monotonic() + timeout_s
        while totals.finished_workers < self._active and time.monotonic() < deadline:
            try:
                totals.add(self._results.get(timeout=0.5), step_index)
            except queue.Empty:
                continue


def _share(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)


def _summarize(
    concurrency: int,
    request_rate: float,
    windows: list[WindowStats],
    s: Settings,
    snapshots: list[Any] | None,
    totals: _Totals,
) -> StepResult:
    used = windows if s.request_count else windows[-STABLE_WINDOWS:]
    latencies = np.concatenate([w.latencies_us for w in used]) if used else np.empty(0)
    seconds = sum(w.seconds for w in used) or 1.0
    stable = len(used) >= STABLE_WINDOWS and not s.request_count and _agree(used, s.stability)
    latency = {"avg": float(latencies.mean()) if len(latencies) else 0.0}
    for name, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("max", 100)):
        latency[name] = float(np.percentile(latencies, q)) if len(latencies) else 0.0
    server = None
    if snapshots and len(snapshots) > len(used) and snapshots[-1] and snapshots[-1 - len(used)]:
        server = _server_breakdown(snapshots[-1 - len(used)], snapshots[-1])
    return StepResult(
        concurrency=concurrency,
        request_rate=request_rate,
        throughput=len(latencies) * s.batch_size / seconds,
        requests=totals.requests,
        latency_us=latency,
        errors=dict(totals.errors),
        stable=stable,
        windows=len(windows),
        server_us=server,
        window_throughputs=[w.throughput * s.batch_size for w in windows],
    )


def _agree(windows: list[WindowStats], tolerance: float) -> bool:
    for values in ([w.throughput for w in windows], [w.mean_us for w in windows]):
        low, high = min(values), max(values)
        if low <= 0 or high / low - 1 > tolerance:
            return False
    return True


def _server_breakdown(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Average µs per request of each server-side phase between two snapshots."""
    result = {}
    for key in STATISTICS:
        count = after[key][0] - before[key][0]
        average_us = (after[key][1] - before[key][1]) / count / 1000 if count else 0.0
        result["request" if key == "success" else key] = average_us
    return result
