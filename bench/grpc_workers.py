"""Front-end worker counts on the native gRPC engine, and what they project to on a bigger host (issue 24, item 3).

    python bench/grpc_workers.py [--workers 0 1 2] [--rounds 1] [--window-ms 1500] [--channel-share 1]
                                 [--project-cores 16] [--label after]

Model: tiny (model_repository/simple: add/sub, INT32 [1,16]), max_batch_size 32, one instance, dynamic_batching {
max_queue_delay_microseconds: 200 }, 2 ONNX Runtime threads (bench/grpc_engines.py's configuration). Each round starts
a server per worker count in turn (``--grpc-engine native --grpc-workers N``) and measures ModelInfer at concurrency 16
with perf_analyzer 2.51 over gRPC, zero input, every context on its own TCP connection (``--channel-share 1``:
SO_REUSEPORT spreads connections, not requests, over workers).

CPU per request: CPU seconds (utime + stime, /proc) over the run divided by the requests the server's ModelStatistics
counted, split by process: the host (the process that holds the models; all of the server in the one-process
layout), of which its event-loop thread (the scheduler and the core) and pygrpc-native's I/O threads, and the
front-end workers together. Batch size: inferences per execution over the run, from the same statistics.

Projection to ``--project-cores`` cores (clients elsewhere), from the medians: the server does at most
min(1e6 / host serial µs, N × 1e6 / workers µs, cores × 1e6 / (host + workers) µs) requests/s with N workers (the
second bound left out for N = 0). Host serial: the host's CPU per request but its pygrpc-native I/O threads' (which
run outside the GIL); the rest (event loop, instance threads, ONNX Runtime's threads) is taken as one core's worth of
work that more cores do not spread, which overstates it by ONNX Runtime's share. Each worker is at most one core. N
beyond those measured takes the split of the largest N measured. It assumes the CPU per request and the batch sizes
stay what they were here, which a busier host changes (bigger batches cost the host less per request): a projection,
not a measurement.

Prints the tables (markdown) and writes bench/results/grpc_workers[_<label>].csv (every round) and .json (medians,
projection, what ``--grpc-workers auto`` picks on ``--project-cores``).
"""

from __future__ import annotations

import argparse
import json
import os
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
    CLOCK_TICKS,
    RESULTS,
    _perf_command,
    _perf_figures,
    cpu_split,
    install_perf_analyzer,
    perf_timeout_s,
    save_results,
    tree_cpu_seconds,
)
from bench._server import shoal_server  # noqa: E402
from shoal.frontend.worker_count import RULE, workers_for_cores  # noqa: E402

MAX_TRIALS = 6
CONCURRENCY = 16
PROJECTED_WORKERS = range(0, 9)
ENGINE_IO_THREAD = "grpc-native"  # how pygrpc-native names its I/O threads (/proc/<pid>/task/<tid>/comm)


def counts(url: str) -> tuple[int, int]:
    """(inferences, executions) the server's ModelStatistics counted for ``tiny``."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(model_name="tiny")
    inferences = sum(s.inference_stats.success.count + s.inference_stats.fail.count for s in stats.model_stats)
    return inferences, sum(s.execution_count for s in stats.model_stats)


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of the process's event-loop thread (its first: "loop") and of pygrpc-native's I/O threads
    ("engine_io": HTTP/2 in Rust, outside the GIL)."""
    spent = {"loop": 0.0, "engine_io": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        if task.name == str(pid):
            spent["loop"] += seconds
        elif name.startswith(ENGINE_IO_THREAD):
            spent["engine_io"] += seconds
    return spent


def run_perf(url: str, window_ms: int) -> tuple[dict[str, float], int]:
    """perf_analyzer's figures and 1, or, when its windows never agree within 20% (a shared machine), those of exactly
    3 windows and 0."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pa.csv"
        for stable, trials, spread in ((1, MAX_TRIALS, 20.0), (0, 3, ANY_SPREAD)):
            try:
                subprocess.run(
                    _perf_command(url, "tiny", CONCURRENCY, window_ms, 1, out, trials, spread),
                    check=True,
                    capture_output=True,
                    timeout=perf_timeout_s(window_ms, trials),
                )
                return _perf_figures(out), stable
            except subprocess.CalledProcessError:
                if not stable:
                    raise
    raise AssertionError("unreachable")


def measure(url: str, pid: int, window_ms: int) -> dict[str, Any]:
    (inferences_before, executions_before), cpu_before = counts(url), tree_cpu_seconds(pid)
    threads_before = thread_cpu_seconds(pid)
    figures, stable = run_perf(url, window_ms)
    threads = {name: seconds - threads_before[name] for name, seconds in thread_cpu_seconds(pid).items()}
    host_s, workers_s = cpu_split(cpu_before, tree_cpu_seconds(pid), pid)
    inferences, executions = counts(url)
    requests = max(1, inferences - inferences_before)
    return {
        "throughput": round(figures["throughput"], 1),
        "p50_us": round(figures["p50_us"]),
        "requests": requests,
        "batch": round(requests / max(1, executions - executions_before), 2),
        "host_cpu_us": round(1e6 * host_s / requests),
        "host_loop_cpu_us": round(1e6 * threads["loop"] / requests),
        "host_engine_io_cpu_us": round(1e6 * threads["engine_io"] / requests),
        "workers_cpu_us": round(1e6 * workers_s / requests),
        "stable": stable,
    }


def medians(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    grouped: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(row["workers"], []).append(row)
    return {
        workers: {key: statistics.median(r[key] for r in group) for key in group[0] if key != "round"}
        for workers, group in sorted(grouped.items())
    }


def project(measured: dict[int, dict[str, float]], cores: int) -> list[dict[str, Any]]:
    """Requests/s each worker count would reach on ``cores`` cores, and what bounds it (the module's docstring)."""
    with_workers = [n for n in measured if n > 0]
    projected = []
    for workers in PROJECTED_WORKERS:
        if workers == 0 and 0 in measured:
            split = measured[0]
        elif workers > 0 and with_workers:
            split = measured[workers if workers in measured else max(with_workers)]
        else:
            continue
        host_us, workers_us = split["host_cpu_us"], split["workers_cpu_us"]
        serial_us = host_us - split["host_engine_io_cpu_us"]  # what one process cannot spread over more cores
        bounds = {"host": 1e6 / serial_us, "cores": cores * 1e6 / (host_us + workers_us)}
        if workers:
            bounds["workers"] = workers * 1e6 / workers_us
        limit = min(bounds, key=lambda name: bounds[name])
        projected.append(
            {
                "workers": workers,
                "requests_per_s": round(bounds[limit]),
                "bound": limit,
                "host_serial_cpu_us": serial_us,
                "host_cpu_us": host_us,
                "workers_cpu_us": workers_us,
                "cores_busy": round(bounds[limit] * (host_us + workers_us) / 1e6, 2),
            }
        )
    return projected


def tables(measured: dict[int, dict[str, float]], projected: list[dict[str, Any]], cores: int) -> str:
    lines = [
        "| --grpc-workers | requests/s | p50 µs | batch | host CPU µs/request | of which loop thread / "
        "engine I/O threads | workers CPU µs/request | total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers, m in measured.items():
        lines.append(
            f"| {workers} | {m['throughput']:,.0f} | {m['p50_us']:,.0f} | {m['batch']:.2f} | "
            f"{m['host_cpu_us']:,.0f} | {m['host_loop_cpu_us']:,.0f} / {m['host_engine_io_cpu_us']:,.0f} | "
            f"{m['workers_cpu_us']:,.0f} | {m['host_cpu_us'] + m['workers_cpu_us']:,.0f} |"
        )
    zero = next((p["requests_per_s"] for p in projected if p["workers"] == 0), None)
    lines += [
        "",
        f"Projection to {cores} cores, clients elsewhere (not measured): --grpc-workers auto picks "
        f"{workers_for_cores(cores)} there ({RULE})",
        "",
        "| --grpc-workers | host serial µs/request | projected requests/s | against 0 workers | bound by | "
        "cores busy |",
        "|---|---|---|---|---|---|",
    ]
    for p in projected:
        ratio = f"{p['requests_per_s'] / zero:.2f}×" if zero else "—"
        lines.append(
            f"| {p['workers']} | {p['host_serial_cpu_us']:,.0f} | {p['requests_per_s']:,} | {ratio} | "
            f"{p['bound']} | {p['cores_busy']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--window-ms", type=int, default=1500)
    parser.add_argument("--channel-share", type=int, default=1, help="perf_analyzer contexts per TCP connection")
    parser.add_argument("--project-cores", type=int, default=16)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    os.environ["TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"] = str(args.channel_share)  # read by perf_analyzer
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        repo.mkdir()
        write_tiny(repo)
        for round_number in range(1, args.rounds + 1):
            for workers in dict.fromkeys(args.workers):
                with shoal_server(repo, "--grpc-engine", "native", "--grpc-workers", str(workers)) as (url, pid):
                    row = {"round": round_number, "workers": workers, **measure(url, pid, args.window_ms)}
                print(row, flush=True)
                rows.append(row)
    measured = medians(rows)
    projected = project(measured, args.project_cores)
    print(
        f"\nbench/grpc_workers.py --rounds {args.rounds}, tiny c={CONCURRENCY}, {len(os.sched_getaffinity(0))} "
        f"usable cores, load average {os.getloadavg()[0]:.1f}: median of the rounds\n"
    )
    print(tables(measured, projected, args.project_cores))
    suffix = f"_{args.label}" if args.label else ""
    save_results(rows, f"grpc_workers{suffix}.csv")
    summary = {
        "cores_here": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "measured": measured,
        "projection": {
            "cores": args.project_cores,
            "auto_picks": workers_for_cores(args.project_cores),
            "rule": RULE,
            "rows": projected,
        },
    }
    path = RESULTS / f"grpc_workers{suffix}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
