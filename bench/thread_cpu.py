"""Where a Python model's requests spend the server's CPU, thread by thread (issue 24's unmet goals).

    python bench/thread_cpu.py [--instances thread process] [--concurrency 1 16] [--window-ms 2000]

Serves bench/python_backend.py's model (the same ``model.py`` and config) on a Shoal thread instance
and on a process instance, drives it with perf_analyzer 2.51 over gRPC (zero inputs, three windows),
and divides the CPU each thread of the server used over the run (utime + stime from
/proc/PID/task/TID/stat) by the requests its statistics counted; an instance's worker process is one
row. Threads are named by their Python names when ``py-spy`` is installed (``py-spy dump``: the
event loop is ``MainThread``, the model's thread ``<model>:<instance>``, pygrpc-native's hand-over
thread ``pygrpc-native-dispatch``), else by the kernel's (``grpc-native-io`` is pygrpc-native's
HTTP/2 thread, in Rust). Prints a markdown table and writes bench/results/thread_cpu.csv.

A second table says how the instance's time went, from the model's statistics over the same run
(``batch_stats``): requests per batch, the time a batch spent in the instance (its ``compute_infer``:
from the executor's start to its answer, the hops and the worker's pipe included), and the share of
the run the instance was so busy (that time x batches per second, batches per second being
perf_analyzer's throughput over requests per batch). An instance busy well under 100% while 16
clients wait is a server whose requests wait elsewhere: in the event loop, on the way in and out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    CLOCK_TICKS,
    cpu_seconds,
    descendants,
    install_perf_analyzer,
    perf_analyzer,
    requests_served,
    save_results,
)
from bench._server import shoal_server  # noqa: E402
from bench.python_backend import MODEL, write_repository  # noqa: E402

THREAD_INSTANCE = 'parameters { key: "process_instances" value: { string_value: "false" } }\n'
_PY_SPY_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "(.*)"$')


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of ``pid``: (its kernel name, utime + stime in seconds)."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # it ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        threads[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return threads


def python_thread_names(pid: int) -> dict[int, str]:
    """Thread id -> its Python name, from ``py-spy dump`` ({} without py-spy)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(py_spy, os.X_OK):
        return {}
    dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    return {int(m[1]): m[2] for line in dump.splitlines() if (m := _PY_SPY_THREAD.match(line))}


def batches_so_far(url: str) -> tuple[int, int, int]:
    """The model's (requests, batches, ns its batches spent in the instance), summed over batch sizes."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:  # closed again: no connection left during a run
        stats = client.get_inference_statistics(model_name=MODEL).model_stats
    sizes = [row for model in stats for row in model.batch_stats]
    return (
        sum(row.batch_size * row.compute_infer.count for row in sizes),
        sum(row.compute_infer.count for row in sizes),
        sum(row.compute_infer.ns for row in sizes),
    )


def measure(url: str, pid: int, concurrency: int, window_ms: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """perf_analyzer's figures with the batches' (``batch_*``), and (thread or worker process, CPU µs
    per request) over its run."""
    workers = descendants(pid)
    threads_before, workers_before = thread_cpu_seconds(pid), {w: cpu_seconds(w) for w in workers}
    requests_before, batches_before = requests_served(url, MODEL), batches_so_far(url)
    figures = perf_analyzer(url, MODEL, concurrency, window_ms, max_trials=3, stability_percent=ANY_SPREAD)
    requests = max(1, requests_served(url, MODEL) - requests_before)
    after = batches_so_far(url)
    batched, batches, in_instance_ns = (now - then for now, then in zip(after, batches_before, strict=True))
    per_batch = batched / max(1, batches)
    figures["batch_requests"] = per_batch
    figures["batch_in_instance_us"] = in_instance_ns / max(1, batches) / 1e3
    figures["batch_busy"] = figures["batch_in_instance_us"] / 1e6 * figures["throughput"] / max(per_batch, 1e-9)
    names = python_thread_names(pid)
    rows = []
    for tid, (kernel_name, seconds) in thread_cpu_seconds(pid).items():
        spent = seconds - threads_before.get(tid, (kernel_name, 0.0))[1]
        if spent > 0:
            rows.append((names.get(tid, kernel_name), 1e6 * spent / requests))
    for worker, before in workers_before.items():
        try:
            rows.append((f"worker process {worker}", 1e6 * (cpu_seconds(worker) - before) / requests))
        except OSError:
            continue
    return figures, sorted(rows, key=lambda row: -row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", nargs="+", choices=("thread", "process"), default=["thread", "process"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--window-ms", type=int, default=2000)
    args = parser.parse_args()
    install_perf_analyzer()
    results: list[dict[str, Any]] = []
    lines = ["| instance | c | infer/s | thread | CPU µs per request |", "|---|---|---|---|---|"]
    batch_lines = [
        "| instance | c | infer/s | requests per batch | µs per batch in the instance | instance busy |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for instance in args.instances:
            repo = Path(folder) / instance
            repo.mkdir()
            write_repository(repo, THREAD_INSTANCE if instance == "thread" else "")
            with shoal_server(repo) as (url, pid):
                perf_analyzer(url, MODEL, 16, 500, max_trials=3, stability_percent=ANY_SPREAD)  # warm up
                for concurrency in args.concurrency:
                    figures, rows = measure(url, pid, concurrency, args.window_ms)
                    total = sum(cpu for _, cpu in rows)
                    batch_lines.append(
                        f"| {instance} | {concurrency} | {figures['throughput']:.0f} | {figures['batch_requests']:.1f} "
                        f"| {figures['batch_in_instance_us']:.0f} | {figures['batch_busy']:.0%} |"
                    )
                    for thread, cpu in [*rows, ("all", total)]:
                        if cpu >= 1.0 or thread == "all":
                            results.append(
                                {"instance": instance, "concurrency": concurrency, "thread": thread, "cpu_us": cpu}
                                | figures
                            )
                            lines.append(
                                f"| {instance} | {concurrency} | {figures['throughput']:.0f} | {thread} | {cpu:.1f} |"
                            )
                    print(lines[-1], flush=True)
    print("\n".join(lines))
    print()
    print("\n".join(batch_lines))
    save_results(results, "thread_cpu.csv")


if __name__ == "__main__":
    main()
