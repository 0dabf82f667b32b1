"""perf_analyzer against Shoal's `simple` model beside in-process ONNX Runtime, one run.

    python bench/perf_simple.py [--concurrency 1 2 4 8 16] [--window-ms 2000]

Installs perf_analyzer itself (bench/install_perf_analyzer.sh, into .bench-venv), starts
Shoal on model_repository/ on a free loopback port, and for each concurrency prints
throughput and p50/p99 latency from perf_analyzer (gRPC), then the same model run
in-process with onnxruntime by as many threads (the cost floor without a server).
Writes bench/results/perf_simple.csv and, when matplotlib is installed, perf_simple.png.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._server import REPO_ROOT, shoal_server  # noqa: E402

PERF_ANALYZER = REPO_ROOT / ".bench-venv" / "bin" / "perf_analyzer"
RESULTS = REPO_ROOT / "bench" / "results"


def install_perf_analyzer() -> Path:
    subprocess.run(["bash", str(REPO_ROOT / "bench" / "install_perf_analyzer.sh")], check=True)
    return PERF_ANALYZER


def perf_analyzer(url: str, concurrency: int, window_ms: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pa.csv"
        subprocess.run(
            [str(PERF_ANALYZER), "-m", "simple", "-u", url, "-i", "grpc", "--input-data", "zero",
             "--concurrency-range", f"{concurrency}:{concurrency}", "-p", str(window_ms),
             "--max-trials", "10", "--stability-percentage", "20", "-f", str(out)],
            check=True, capture_output=True, timeout=300,
        )
        row = next(csv.DictReader(out.read_text().splitlines()))
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
    }


def in_process(concurrency: int, seconds: float) -> dict[str, float]:
    import onnxruntime as ort

    session = ort.InferenceSession(
        str(REPO_ROOT / "model_repository" / "simple" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    feed = {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": np.zeros((1, 16), np.int32)}
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

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    begin = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - begin
    us = np.array(latencies) * 1e6
    return {"throughput": len(latencies) / elapsed, "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99))}


def plot(rows: list[dict[str, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    c = [r["concurrency"] for r in rows]
    left.plot(c, [r["shoal_throughput"] for r in rows], "o-", label="Shoal over gRPC (perf_analyzer)")
    left.plot(c, [r["ort_throughput"] for r in rows], "s--", label="ONNX Runtime in-process")
    left.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="inferences / s", title="simple: throughput")
    left.legend()
    right.plot(c, [r["shoal_p50_us"] for r in rows], "o-", label="Shoal p50")
    right.plot(c, [r["shoal_p99_us"] for r in rows], "o:", label="Shoal p99")
    right.plot(c, [r["ort_p50_us"] for r in rows], "s--", label="ONNX Runtime in-process p50")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="latency (µs)", title="simple: latency")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--window-ms", type=int, default=2000)
    args = parser.parse_args()
    install_perf_analyzer()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with shoal_server(REPO_ROOT / "model_repository") as (url, _):
        for concurrency in args.concurrency:
            shoal = perf_analyzer(url, concurrency, args.window_ms)
            rows.append({"concurrency": concurrency, **{f"shoal_{k}": v for k, v in shoal.items()}})
    for row in rows:  # after the server has stopped, so the two never share the cores
        ort = in_process(int(row["concurrency"]), args.window_ms / 1000)
        row.update({f"ort_{k}": v for k, v in ort.items()})
    header = f"{'conc':>4} | {'Shoal infer/s':>13} {'p50 µs':>8} {'p99 µs':>8} | {'ORT infer/s':>11} " \
             f"{'p50 µs':>7} {'p99 µs':>7} | Shoal/ORT"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['concurrency']:>4} | {r['shoal_throughput']:>13.0f} {r['shoal_p50_us']:>8.0f} "
              f"{r['shoal_p99_us']:>8.0f} | {r['ort_throughput']:>11.0f} {r['ort_p50_us']:>7.0f} "
              f"{r['ort_p99_us']:>7.0f} | {r['shoal_throughput'] / r['ort_throughput']:.3f}")
    with (RESULTS / "perf_simple.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {RESULTS / 'perf_simple.csv'}")
    if plot(rows, RESULTS / "perf_simple.png"):
        print(f"wrote {RESULTS / 'perf_simple.png'}")


if __name__ == "__main__":
    main()
