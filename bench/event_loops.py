"""Shoal on asyncio's event loop and on uvloop's, one run: what ``--event-loop`` changes.

    python bench/event_loops.py [--rounds 2] [--window-ms 1000] [--label NAME]

One repository: bench/side_by_side.py's ``tiny`` and ``mlp`` (ONNX, max_batch_size 32, dynamic
batching with a 200 µs queue delay, 2 ONNX Runtime threads) and bench/python_backend.py's
``numpy_op`` Python model twice, on a process instance (``numpy_op``) and on a thread instance
(``numpy_op_thread``). Shoal serves it with ``--event-loop asyncio`` and with ``--event-loop
uvloop``, taking turns (every other round in the reverse order), on its other defaults.
perf_analyzer 2.51, zero inputs, three 1 s windows per workload, over gRPC and HTTP. Figures:
throughput, p50 latency, and server CPU per request (the whole process tree's utime + stime
from /proc over the run, divided by the requests its statistics counted). Prints the medians over
rounds and uvloop's ratio to asyncio for each; writes bench/results/event_loops[_<label>].csv.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    cpu_split,
    install_perf_analyzer,
    perf_analyzer,
    requests_served,
    save_results,
    tree_cpu_seconds,
)
from bench.python_backend import MODEL as PYTHON_MODEL  # noqa: E402
from bench.python_backend import write_repository as write_python_model  # noqa: E402
from bench.side_by_side import write_models  # noqa: E402
from shoal.tools import local_server  # noqa: E402

LOOPS = ("asyncio", "uvloop")
THREAD_MODEL = f"{PYTHON_MODEL}_thread"
THREAD_INSTANCE = 'parameters { key: "process_instances" value: { string_value: "false" } }\n'
# (model, protocol, concurrency)
WORKLOADS = (
    ("tiny", "grpc", 1),
    ("tiny", "grpc", 16),
    ("mlp", "grpc", 16),
    ("tiny", "http", 16),
    ("mlp", "http", 16),
    (PYTHON_MODEL, "grpc", 1),
    (PYTHON_MODEL, "grpc", 16),
    (THREAD_MODEL, "grpc", 1),
    (THREAD_MODEL, "grpc", 16),
)


def write_repository(root: Path) -> Path:
    """tiny, mlp, numpy_op (process instance) and numpy_op_thread in one repository."""
    repo = write_models(root).shoal
    write_python_model(repo)
    scratch = root / "thread"
    write_python_model(scratch, THREAD_INSTANCE)
    shutil.move(scratch / PYTHON_MODEL, repo / THREAD_MODEL)
    return repo


def measure(
    grpc_url: str, url: str, pid: int, model: str, protocol: str, concurrency: int, window_ms: int
) -> dict[str, float]:
    requests_before, cpu_before = requests_served(grpc_url, model), tree_cpu_seconds(pid)
    figures = perf_analyzer(
        url, model, concurrency, window_ms, max_trials=3, stability_percent=ANY_SPREAD, protocol=protocol
    )
    host_s, children_s = cpu_split(cpu_before, tree_cpu_seconds(pid), pid)
    requests = max(1, requests_served(grpc_url, model) - requests_before)
    return {**figures, "cpu_us_per_request": 1e6 * (host_s + children_s) / requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = write_repository(Path(folder))
        for round_number in range(args.rounds):
            for loop in LOOPS if round_number % 2 == 0 else LOOPS[::-1]:
                with local_server.running(repo, "--event-loop", loop, timeout_s=120.0) as server:
                    for model, protocol, concurrency in WORKLOADS:
                        url = server.http_url if protocol == "http" else server.url
                        figures = measure(server.url, url, server.pid, model, protocol, concurrency, args.window_ms)
                        row = {"round": round_number, "loop": loop, "model": model, "protocol": protocol}
                        rows.append({**row, "concurrency": concurrency, **figures})
                        print(
                            f"round {round_number} {loop:8s} {model} {protocol} c={concurrency}: "
                            f"{figures['throughput']:.0f}/s p50 {figures['p50_us']:.0f} µs, "
                            f"{figures['cpu_us_per_request']:.0f} µs CPU/request",
                            flush=True,
                        )
    print(table(rows, args.rounds))
    save_results(rows, f"event_loops_{args.label}.csv" if args.label else "event_loops.csv")


def table(rows: list[dict[str, Any]], rounds: int) -> str:
    def median(loop: str, model: str, protocol: str, concurrency: int, key: str) -> float:
        return float(
            statistics.median(
                r[key]
                for r in rows
                if (r["loop"], r["model"], r["protocol"], r["concurrency"]) == (loop, model, protocol, concurrency)
            )
        )

    lines = [
        f"Medians of {rounds} round(s).",
        "| workload | asyncio infer/s | uvloop infer/s | ratio | asyncio p50 µs | uvloop p50 µs "
        "| asyncio CPU µs/req | uvloop CPU µs/req | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, protocol, concurrency in WORKLOADS:
        figures = {
            (loop, key): median(loop, model, protocol, concurrency, key)
            for loop in LOOPS
            for key in ("throughput", "p50_us", "cpu_us_per_request")
        }
        throughput = figures["uvloop", "throughput"] / figures["asyncio", "throughput"]
        cpu = figures["uvloop", "cpu_us_per_request"] / figures["asyncio", "cpu_us_per_request"]
        lines.append(
            f"| {model} {protocol} c={concurrency} | {figures['asyncio', 'throughput']:,.0f} "
            f"| {figures['uvloop', 'throughput']:,.0f} | {throughput:.2f}× | {figures['asyncio', 'p50_us']:,.0f} "
            f"| {figures['uvloop', 'p50_us']:,.0f} | {figures['asyncio', 'cpu_us_per_request']:.0f} "
            f"| {figures['uvloop', 'cpu_us_per_request']:.0f} | {cpu:.2f}× |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
