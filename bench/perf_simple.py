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
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import RESULTS, in_process, install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._server import REPO_ROOT, shoal_server  # noqa: E402
from shoal.clients.loadtest.plot import pyplot  # noqa: E402

SIMPLE = REPO_ROOT / "model_repository" / "simple" / "1" / "model.onnx"
ZEROS = {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": np.zeros((1, 16), np.int32)}


def plot(rows: list[dict[str, float]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
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
    rows = []
    with shoal_server(REPO_ROOT / "model_repository") as (url, _):
        for concurrency in args.concurrency:
            shoal = perf_analyzer(url, "simple", concurrency, args.window_ms)
            rows.append({"concurrency": concurrency, **{f"shoal_{k}": v for k, v in shoal.items()}})
    for row in rows:  # after the server has stopped, so the two never share the cores
        ort = in_process(SIMPLE, ZEROS, int(row["concurrency"]), args.window_ms / 1000)
        row.update({f"ort_{k}": v for k, v in ort.items()})
    header = (
        f"{'conc':>4} | {'Shoal infer/s':>13} {'p50 µs':>8} {'p99 µs':>8} | {'ORT infer/s':>11} "
        f"{'p50 µs':>7} {'p99 µs':>7} | Shoal/ORT"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['concurrency']:>4} | {r['shoal_throughput']:>13.0f} {r['shoal_p50_us']:>8.0f} "
            f"{r['shoal_p99_us']:>8.0f} | {r['ort_throughput']:>11.0f} {r['ort_p50_us']:>7.0f} "
            f"{r['ort_p99_us']:>7.0f} | {r['shoal_throughput'] / r['ort_throughput']:.3f}"
        )
    save_results(rows, "perf_simple.csv")
    if plot(rows, RESULTS / "perf_simple.png"):
        print(f"wrote {RESULTS / 'perf_simple.png'}")


if __name__ == "__main__":
    main()
