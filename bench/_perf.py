"""Helpers shared by the benchmarks: perf_analyzer runs and in-process ONNX Runtime loops."""

from __future__ import annotations

import csv
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._server import REPO_ROOT

PERF_ANALYZER = REPO_ROOT / ".bench-venv" / "bin" / "perf_analyzer"


def install_perf_analyzer() -> Path:
    subprocess.run(["bash", str(REPO_ROOT / "bench" / "install_perf_analyzer.sh")], check=True)
    return PERF_ANALYZER


def perf_analyzer(url: str, model: str, concurrency: int, window_ms: int = 2000, batch: int = 1) -> dict[str, float]:
    """One perf_analyzer measurement (gRPC, zero inputs); throughput in inferences/s, latencies in µs."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pa.csv"
        subprocess.run(
            [str(PERF_ANALYZER), "-m", model, "-u", url, "-i", "grpc", "--input-data", "zero",
             "-b", str(batch), "--concurrency-range", f"{concurrency}:{concurrency}", "-p", str(window_ms),
             "--max-trials", "10", "--stability-percentage", "20", "-f", str(out)],
            check=True, capture_output=True, timeout=600,
        )
        row = next(csv.DictReader(out.read_text().splitlines()))
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
        "server_queue_us": float(row.get("Server Queue", 0) or 0),
        "server_infer_us": float(row.get("Server Compute Infer", 0) or 0),
    }


def in_process(
    model: Path, feed: dict[str, np.ndarray], concurrency: int, seconds: float, threads: int = 0
) -> dict[str, float]:
    """``concurrency`` threads calling one ONNX Runtime session for ``seconds``; rows/s and latency."""
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
    begin = time.monotonic()
    for worker_thread in workers:
        worker_thread.start()
    for worker_thread in workers:
        worker_thread.join()
    elapsed = time.monotonic() - begin
    us = np.array(latencies) * 1e6
    return {"throughput": rows * len(latencies) / elapsed, "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99))}


def shoal_load(url: str, model: str, concurrency: int, window_s: float = 2.0, processes: int = 1,
               stability_percent: float = 20.0) -> float:
    """Throughput (inferences/s) that shoal-load measures for one closed-loop step."""
    import json
    import sys

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "r.json"
        subprocess.run(
            [sys.executable, "-m", "shoal.clients.loadtest", "-m", model, "-u", url, "--concurrency", str(concurrency),
             "--processes", str(processes), "--input-data", "zeros", "--window-s", str(window_s),
             "--stability", str(stability_percent), "--max-windows", "10", "--json", str(out), "--no-progress"],
            check=True, capture_output=True, timeout=600,
        )
        return float(json.loads(out.read_text())["steps"][0]["throughput"])


RESULTS = REPO_ROOT / "bench" / "results"


def save_results(rows: list[dict[str, Any]], filename: str) -> Path:
    """Write benchmark rows as CSV under bench/results/ and say where."""
    import csv

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / filename
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return path
