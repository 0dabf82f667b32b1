"""The two gRPC engines (``--grpc-engine native`` and ``grpcio``) alternated on one repository, for issue 24's choice
of the default.

    python bench/grpc_engines.py [--rounds 2] [--window-ms 1500] [--workers 0] [--compare-io-threads] [--label after]

Model: tiny (model_repository/simple: add/sub, INT32 [1,16]), max_batch_size 32, one instance, dynamic_batching {
max_queue_delay_microseconds: 200 }, 2 ONNX Runtime threads (bench/side_by_side.py's configuration). Each round starts
a server per engine in turn (same repository, same flags but ``--grpc-engine``) and measures with perf_analyzer 2.51
over gRPC, zero input: ModelInfer at concurrency 1 and 16, and ModelStreamInfer (``--streaming``) at 16, which
pygrpc-native sends to its grpc.aio fallback. CPU per request: CPU seconds (utime + stime, /proc) of the server's whole
process tree over the run divided by the requests its ModelStatistics counted over the same span. Prints a markdown
table (the median over rounds per engine, and native / grpcio) and writes bench/results/grpc_engines[_<label>].csv
(every round). A run whose windows never agree within 20% (the machine is shared) is measured again over exactly 3
windows (``stable`` 0 in the CSV). With ``--compare-io-threads`` the two servers are both native, with
``--grpc-io-threads 1`` and ``2`` (pygrpc-native's own default), instead of the two engines.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_tiny  # noqa: E402
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    _perf_command,
    _perf_figures,
    cpu_split,
    install_perf_analyzer,
    perf_timeout_s,
    requests_served,
    save_results,
    tree_cpu_seconds,
)
from bench._server import shoal_server  # noqa: E402

ENGINES = {"native": ("--grpc-engine", "native"), "grpcio": ("--grpc-engine", "grpcio")}
IO_THREADS = {
    "io1": ("--grpc-engine", "native", "--grpc-io-threads", "1"),
    "io2": ("--grpc-engine", "native", "--grpc-io-threads", "2"),
}
MAX_TRIALS = 6
WORKLOADS = (  # key, concurrency, perf_analyzer's extra arguments
    ("infer_c1", 1, ()),
    ("infer_c16", 16, ()),
    ("stream_c16", 16, ("--streaming",)),
)


def run_perf(
    url: str,
    concurrency: int,
    extra: tuple[str, ...],
    window_ms: int,
    out: Path,
    max_trials: int,
    stability_percent: float,
) -> None:
    command = [*_perf_command(url, "tiny", concurrency, window_ms, 1, out, max_trials, stability_percent), *extra]
    subprocess.run(command, check=True, capture_output=True, timeout=perf_timeout_s(window_ms, max_trials))


def measure(url: str, pid: int, concurrency: int, extra: tuple[str, ...], window_ms: int) -> dict[str, Any]:
    requests_before, cpu_before = requests_served(url, "tiny"), tree_cpu_seconds(pid)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pa.csv"
        stable = 1
        try:
            run_perf(url, concurrency, extra, window_ms, out, MAX_TRIALS, 20.0)
        except subprocess.CalledProcessError:  # its windows never agreed within 20% (a shared machine): 3 windows
            stable = 0
            run_perf(url, concurrency, extra, window_ms, out, 3, ANY_SPREAD)
        figures = _perf_figures(out)
    host_s, children_s = cpu_split(cpu_before, tree_cpu_seconds(pid), pid)
    requests = max(1, requests_served(url, "tiny") - requests_before)
    return {
        "throughput": round(figures["throughput"], 1),
        "p50_us": round(figures["p50_us"]),
        "cpu_us_per_request": round(1e6 * (host_s + children_s) / requests),
        "stable": stable,
    }


def table(rows: list[dict[str, Any]], first: str, second: str) -> str:
    def median(variant: str, key: str, field: str) -> float:
        values = [row[field] for row in rows if row["engine"] == variant and row["workload"] == key]
        return statistics.median(values) if values else float("nan")

    lines = [f"| workload | figure | {first} | {second} | {first} / {second} |", "|---|---|---|---|---|"]
    for key, _, _ in WORKLOADS:
        for field, title in (
            ("throughput", "requests/s"),
            ("p50_us", "p50 µs"),
            ("cpu_us_per_request", "server CPU µs per request"),
        ):
            a, b = median(first, key, field), median(second, key, field)
            lines.append(f"| {key} | {title} | {a:,.0f} | {b:,.0f} | {a / b:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=0, help="--grpc-workers of every server (default 0)")
    parser.add_argument(
        "--compare-io-threads",
        action="store_true",
        help="native with --grpc-io-threads 1 against 2, instead of the two engines",
    )
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    variants = IO_THREADS if args.compare_io_threads else ENGINES
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        repo.mkdir()
        write_tiny(repo)
        for round_number in range(1, args.rounds + 1):
            for engine, variant_flags in variants.items():
                flags = (*variant_flags, "--grpc-workers", str(args.workers))
                with shoal_server(repo, *flags) as (url, pid):
                    for key, concurrency, extra in WORKLOADS:
                        row = {
                            "round": round_number,
                            "engine": engine,
                            "workers": args.workers,
                            "workload": key,
                            **measure(url, pid, concurrency, extra, args.window_ms),
                        }
                        print(row, flush=True)
                        rows.append(row)
    suffix = f"_{args.label}" if args.label else ""
    compared = " --compare-io-threads" if args.compare_io_threads else ""
    print(f"\nbench/grpc_engines.py --rounds {args.rounds} --workers {args.workers}{compared}: median of the rounds\n")
    print(table(rows, *variants))
    save_results(rows, f"grpc_engines{suffix}.csv")


if __name__ == "__main__":
    main()
