"""What latency summaries cost: one server with ``--metrics-config summary_latencies=true`` and one without,
alternated on one repository.

    python bench/latency_summaries.py [--rounds 2] [--window-ms 1500]

Model: tiny (model_repository/simple: add/sub, INT32 [1,16]), max_batch_size 32, one instance,
dynamic_batching { max_queue_delay_microseconds: 200 }, 2 ONNX Runtime threads (bench/grpc_engines.py's
configuration and measurement): perf_analyzer 2.51 over gRPC, zero input, ModelInfer at concurrency 1 and 16.
CPU per request: CPU seconds of the server's process tree over the run divided by the requests its
ModelStatistics counted. With summaries on, each successful request adds one latency to each of five
sketches (shoal.statistics.LatencyWindows); a scrape of /metrics (one per run here, after it) merges
them. Prints the median over rounds per setting and on / off, and writes
bench/results/latency_summaries.csv (every round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_tiny  # noqa: E402
from bench._perf import install_perf_analyzer, save_results  # noqa: E402
from bench.grpc_engines import measure  # noqa: E402
from shoal.tools import local_server  # noqa: E402

SETTINGS = {"off": (), "on": ("--metrics-config", "summary_latencies=true")}
WORKLOADS = (("infer_c1", 1), ("infer_c16", 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1500)
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        write_tiny(repo)
        for round_number in range(args.rounds):
            for setting, flags in SETTINGS.items():
                with local_server.running(repo, *flags) as server:
                    for key, concurrency in WORKLOADS:
                        figures = measure(server.url, server.pid, concurrency, (), args.window_ms)
                        rows.append({"round": round_number, "setting": setting, "workload": key, **figures})
                    page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read()
                    assert (b"nv_inference_request_summary_us" in page) == (setting == "on")
    print("| workload | setting | inferences/s | p50 µs | server CPU µs/request |")
    print("|---|---|---|---|---|")
    medians: dict[tuple[str, str], dict[str, float]] = {}
    for key, _ in WORKLOADS:
        for setting in SETTINGS:
            mine = [r for r in rows if (r["workload"], r["setting"]) == (key, setting)]
            medians[key, setting] = {
                f: statistics.median(r[f] for r in mine) for f in ("throughput", "p50_us", "cpu_us_per_request")
            }
            m = medians[key, setting]
            print(
                f"| {key} | {setting} | {m['throughput']:,.0f} | {m['p50_us']:,.0f} | {m['cpu_us_per_request']:,.0f} |"
            )
    for key, _ in WORKLOADS:
        on, off = medians[key, "on"], medians[key, "off"]
        print(
            f"{key}: on / off throughput {on['throughput'] / off['throughput']:.2f}x, CPU per request "
            f"{on['cpu_us_per_request'] - off['cpu_us_per_request']:+.0f} µs"
        )
    save_results(rows, "latency_summaries.csv")


if __name__ == "__main__":
    main()
