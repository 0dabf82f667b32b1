"""Helpers shared by the benchmarks: perf_analyzer runs, in-process ONNX Runtime loops, and what a
server costs (CPU seconds of its process tree from /proc, requests from its ModelStatistics, its TCP connections)."""

from __future__ import annotations

import csv
import os
import resource
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench._server import REPO_ROOT

PERF_ANALYZER = REPO_ROOT / ".bench-venv" / "bin" / "perf_analyzer"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def install_perf_analyzer() -> Path:
    subprocess.run(["bash", str(REPO_ROOT / "bench" / "install_perf_analyzer.sh")], check=True)
    return PERF_ANALYZER


def _perf_command(
    url: str,
    model: str,
    concurrency: int,
    window_ms: int,
    batch: int,
    out: Path,
    max_trials: int,
    stability_percent: float,
    protocol: str = "grpc",
) -> list[str]:
    return [
        str(PERF_ANALYZER),
        "-m",
        model,
        "-u",
        url,
        "-i",
        protocol,
        "--input-data",
        "zero",
        "-b",
        str(batch),
        "--concurrency-range",
        f"{concurrency}:{concurrency}",
        "-p",
        str(window_ms),
        "--max-trials",
        str(max_trials),
        "--stability-percentage",
        str(stability_percent),
        "-f",
        str(out),
    ]


def _perf_figures(out: Path) -> dict[str, float]:
    row = next(csv.DictReader(out.read_text().splitlines()))
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
        "server_queue_us": float(row.get("Server Queue", 0) or 0),
        "server_infer_us": float(row.get("Server Compute Infer", 0) or 0),
    }


def perf_timeout_s(window_ms: int, max_trials: int) -> float:
    """A bound for one perf_analyzer run: every trial plus start-up and a margin."""
    return (max_trials + 2) * window_ms / 1000 + 30


def perf_analyzer(
    url: str,
    model: str,
    concurrency: int,
    window_ms: int = 2000,
    batch: int = 1,
    max_trials: int = 10,
    stability_percent: float = 20.0,
    protocol: str = "grpc",
) -> dict[str, float]:
    """One perf_analyzer measurement (zero inputs, over ``protocol``: grpc or http); throughput in inferences/s,
    latencies in µs.

    Stops after three windows within ``stability_percent`` of each other, or ``max_trials`` windows; raises
    subprocess.TimeoutExpired past perf_timeout_s."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pa.csv"
        subprocess.run(
            _perf_command(url, model, concurrency, window_ms, batch, out, max_trials, stability_percent, protocol),
            check=True,
            capture_output=True,
            timeout=perf_timeout_s(window_ms, max_trials),
        )
        return _perf_figures(out)


def split_concurrency(concurrency: int, clients: int) -> list[int]:
    """``concurrency`` spread as evenly as possible over at most ``clients`` clients (none with 0)."""
    count = max(1, min(clients, concurrency))
    return [concurrency // count + (1 if index < concurrency % count else 0) for index in range(count)]


ANY_SPREAD = 1e6  # a stability band no run can miss: perf_analyzer stops after exactly 3 windows


def perf_analyzers(
    url: str,
    model: str,
    concurrency: int,
    clients: int,
    window_ms: int = 2000,
    batch: int = 1,
    max_trials: int = 10,
    stability_percent: float = 20.0,
    windows: int = 3,
    protocol: str = "grpc",
) -> dict[str, float]:
    """``clients`` perf_analyzer processes at once, concurrency split between them; throughputs summed, the worst
    latency of any of them. Each measures exactly ``windows`` windows (no stability stop), so that they overlap.
    One client (or concurrency 1): perf_analyzer() with ``stability_percent`` and ``max_trials``."""
    shares = split_concurrency(concurrency, clients)
    if len(shares) == 1:
        return perf_analyzer(url, model, concurrency, window_ms, batch, max_trials, stability_percent, protocol)
    with tempfile.TemporaryDirectory() as folder:
        outs = [Path(folder) / f"pa{index}.csv" for index in range(len(shares))]
        processes = [
            subprocess.Popen(
                _perf_command(url, model, share, window_ms, batch, out, windows, ANY_SPREAD, protocol),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for share, out in zip(shares, outs, strict=True)
        ]
        deadline = time.monotonic() + perf_timeout_s(window_ms, windows)
        try:
            for process in processes:
                _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
                if process.returncode:
                    raise subprocess.CalledProcessError(process.returncode, process.args, stderr=stderr)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        figures = [_perf_figures(out) for out in outs]
    return {
        "throughput": sum(f["throughput"] for f in figures),
        **{key: max(f[key] for f in figures) for key in figures[0] if key != "throughput"},
    }


def closed_loop(
    callers: list[tuple[Callable[[], Any], Callable[[], None]]], seconds: float, pid: int | None = None
) -> dict[str, float]:
    """Back-to-back calls, one thread per ``(call, close)`` pair, for ``seconds`` (each warmed by one call
    first, closed after): requests, throughput, p50 and p99; with ``pid``, that process tree's CPU per request."""
    for call, _ in callers:
        call()  # warm: connection, first allocation
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def run(call: Callable[[], Any]) -> None:
        mine = []
        while time.monotonic() < deadline:
            start = time.perf_counter()
            call()
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run, args=(call,)) for call, _ in callers]
    cpu_before = sum(tree_cpu_seconds(pid).values()) if pid else 0.0
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 60)
    elapsed = time.monotonic() - started
    cpu = sum(tree_cpu_seconds(pid).values()) - cpu_before if pid else 0.0
    for _, close in callers:
        close()
    ordered = sorted(latencies)
    figures = {
        "infer_per_s": len(ordered) / elapsed,
        "p50_us": ordered[len(ordered) // 2] * 1e6 if ordered else 0.0,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6 if ordered else 0.0,
        "requests": len(ordered),
    }
    if pid:
        figures["server_cpu_us_per_request"] = cpu / max(1, len(ordered)) * 1e6
    return figures


def in_process(
    model: Path, feed: dict[str, np.ndarray], concurrency: int, seconds: float, threads: int = 0
) -> dict[str, float]:
    """``concurrency`` threads calling one ONNX Runtime session for ``seconds``; rows/s, latency, and the CPU of
    this process per call (``cpu_us_per_request``: ORT's own threads included, spinning too)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    session.run(None, feed)
    rows = next(iter(feed.values())).shape[0]
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def worker() -> None:
        local = []
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            session.run(None, feed)
            local.append(time.perf_counter() - start)
        with lock:
            latencies.extend(local)

    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    begin = time.monotonic()
    for worker_thread in workers:
        worker_thread.start()
    for worker_thread in workers:
        worker_thread.join()
    elapsed = time.monotonic() - begin
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime
    us = np.array(latencies) * 1e6
    return {
        "throughput": rows * len(latencies) / elapsed,
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "cpu_us_per_request": 1e6 * cpu_s / max(1, len(latencies)),
    }


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it exited meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], list(children.get(pid, []))
    while pending:
        child = pending.pop()
        found.append(child)
        pending.extend(children.get(child, []))
    return found


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and of each live descendant (a process that exits meanwhile is left out)."""
    figures = {}
    for process in (pid, *descendants(pid)):
        try:
            figures[process] = cpu_seconds(process)
        except (OSError, IndexError, ValueError):
            continue
    return figures


def cpu_split(before: dict[int, float], after: dict[int, float], root: int) -> tuple[float, float]:
    """(root, descendants) CPU seconds spent between two tree_cpu_seconds samples; new processes count from 0."""
    spent = {pid: seconds - before.get(pid, 0.0) for pid, seconds in after.items()}
    return spent.get(root, 0.0), sum(seconds for pid, seconds in spent.items() if pid != root)


def requests_served(url: str, model: str) -> int:
    """Requests (success + fail) the server's ModelStatistics counted for ``model``, all versions."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:  # closed again: no connection left during a run
        stats = client.get_inference_statistics(model_name=model)
    return sum(s.inference_stats.success.count + s.inference_stats.fail.count for s in stats.model_stats)


def established_connections(port: int) -> int:
    """Server-side TCP sockets in ESTABLISHED state whose local port is ``port`` (from /proc/net/tcp{,6})."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


@contextmanager
def connection_watch(port: int, interval_s: float = 0.5) -> Iterator[dict[str, int]]:
    """Samples established_connections(port) in a thread while the block runs; yields {"max": most seen}."""
    seen = {"max": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            seen["max"] = max(seen["max"], established_connections(port))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def shoal_load(
    url: str, model: str, concurrency: int, window_s: float = 2.0, processes: int = 1, stability_percent: float = 20.0
) -> float:
    """Throughput (inferences/s) that shoal-load measures for one closed-loop step."""
    import json
    import sys

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "r.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.clients.loadtest",
                "-m",
                model,
                "-u",
                url,
                "--concurrency",
                str(concurrency),
                "--processes",
                str(processes),
                "--input-data",
                "zeros",
                "--window-s",
                str(window_s),
                "--stability",
                str(stability_percent),
                "--max-windows",
                "10",
                "--json",
                str(out),
                "--no-progress",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        return float(json.loads(out.read_text())["steps"][0]["throughput"])


RESULTS = REPO_ROOT / "bench" / "results"


def save_results(rows: list[dict[str, Any]], filename: str) -> Path:
    """Write benchmark rows as CSV under bench/results/ and say where."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / filename
    with path.open("w", newline="") as handle:
        fields = list(dict.fromkeys(key for row in rows for key in row))  # rows may differ in their keys
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return path
