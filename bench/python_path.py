"""What a Python model's request costs in Shoal, against its floors and the figures recorded here.

    python bench/python_path.py [--rounds 3] [--window-ms 1000] [--label NAME] [--record] [--other-grpcio DIR]

Three servers, started once each and measured alternately (perf_analyzer 2.51 over gRPC, zero
inputs, c=16 then c=1, every round in the other order), and one in-process figure:

- ``floor``: ``bench/_grpc_floor.py``, a grpc.aio server that answers without doing anything,
  its service registered as Shoal's is: the installed grpcio's own cost per call;
- ``thread`` / ``process``: Shoal serving bench/python_backend.py's ``model.py`` and config on an
  instance thread (``process_instances: false``) and in an instance process (the default);
- ``in-process``: ``ModelRunner.execute`` of the same ``model.py`` on one request, in this process
  (CPU µs per call): the model's own cost, which no gRPC library and no server change moves.

Per server and concurrency: throughput, p50, CPU per request (the server's whole process tree,
utime + stime from /proc, over the requests its statistics counted) and voluntary context switches
per request (every thread of the tree; on a shared machine this one barely moves with the load).
The CPU figures are compared as ratios, so the machine's speed mostly cancels out: to the
in-process call measured just before each measurement (what moves with grpcio and Shoal alike)
and, for Shoal, to the floor's in the same round (what moves with Shoal's own path). Each ratio
and each context-switch count is checked against ``bench/python_path_recorded.json``
(``--record`` rewrites it): a figure over 1.2× its recorded value is marked REGRESSED. A grpcio
1.84+ install, or a Shoal change that adds per-request work, shows there (docs/benchmarks.md, "The Python
path: where last month's ratio went").
The in-process ratios are printed but not judged: on this shared machine the in-process call
itself moved between 23 and 46 µs from run to run. What settles a grpcio question is
``--other-grpcio DIR`` (``pip install --target DIR grpcio==X``): a second floor importing that
grpcio, measured alternately with the installed one in the same run.
Prints a table and writes bench/results/python_path[_<label>].csv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    descendants,
    install_perf_analyzer,
    perf_analyzer,
    requests_served,
    save_results,
    tree_cpu_seconds,
)
from bench._server import REPO_ROOT, shoal_server  # noqa: E402
from bench.python_backend import MODEL, write_repository  # noqa: E402
from shoal.backends.python import runner  # noqa: E402
from shoal.protocol import InferenceStub, service_pb2  # noqa: E402

RECORDED = REPO_ROOT / "bench" / "python_path_recorded.json"
TOLERANCE = 1.2  # a figure past this many times its recorded value is a regression
CONCURRENCIES = (16, 1)
THREAD_PARAMETER = 'parameters { key: "process_instances" value: { string_value: "false" } }\n'


@contextmanager
def floor_server(work: Path, grpcio_path: Path | None = None) -> Iterator[tuple[str, int]]:
    """(url, pid) of bench/_grpc_floor.py once it answers (importing grpc from ``grpcio_path`` if given);
    stopped afterwards."""
    port_file = work / f"floor-port-{'other' if grpcio_path else 'installed'}"
    env = {**os.environ, "PYTHONPATH": str(grpcio_path)} if grpcio_path else None
    process = subprocess.Popen(
        [sys.executable, "-m", "bench._grpc_floor", "--port-file", str(port_file)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the floor server did not start")
            time.sleep(0.05)
        url = f"127.0.0.1:{int(port_file.read_text())}"
        with grpc.insecure_channel(url) as channel:
            InferenceStub(channel).ServerLive(service_pb2.ServerLiveRequest(), timeout=10)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def voluntary_switches(pid: int) -> int:
    """voluntary_ctxt_switches summed over every thread of ``pid`` and its descendants."""
    total = 0
    for process in (pid, *descendants(pid)):
        try:
            tasks = list(Path(f"/proc/{process}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                status = (task / "status").read_text()
            except OSError:
                continue
            total += next(
                (int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")), 0
            )
    return total


def measure(url: str, pid: int, concurrency: int, window_ms: int) -> dict[str, float]:
    requests_before, cpu_before, switches_before = (
        requests_served(url, MODEL),
        tree_cpu_seconds(pid),
        voluntary_switches(pid),
    )
    figures = perf_analyzer(url, MODEL, concurrency, window_ms, max_trials=3, stability_percent=ANY_SPREAD)
    cpu_s = sum(tree_cpu_seconds(pid).values()) - sum(cpu_before.values())
    requests = max(1, requests_served(url, MODEL) - requests_before)
    return {
        "throughput": figures["throughput"],
        "p50_us": figures["p50_us"],
        "cpu_us_per_request": 1e6 * cpu_s / requests,
        "switches_per_request": (voluntary_switches(pid) - switches_before) / requests,
    }


class InProcess:
    """``ModelRunner.execute`` of the model on one [1, 256] request, in this process."""

    def __init__(self, repo: Path) -> None:
        model_file = repo / MODEL / "1" / "model.py"
        config = {"name": MODEL, "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}]}
        args = runner.model_args(config, model_file, f"{MODEL}_0", "CPU", 0, 1)
        self.model = runner.ModelRunner(config, model_file, args)
        self.items = [runner.RequestData({"INPUT0": np.zeros((1, 256), np.float32)}, ("OUTPUT0",))]
        self.cpu_us(200)

    def cpu_us(self, calls: int = 2000) -> float:
        """CPU µs per call, the least of three loops (one another process interrupted says less about the model)."""
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            for _ in range(calls):
                self.model.execute(self.items)
            best = min(best, (time.process_time() - start) / calls * 1e6)
        return best


def figures_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The medians the recorded file holds, per server and c: CPU per request ÷ the in-process call measured
    just before it, Shoal's CPU per request ÷ the floor's of the same round, voluntary context switches per request."""

    def cell(server: str, concurrency: int) -> list[dict[str, Any]]:
        return sorted(
            (row for row in rows if row["server"] == server and row["concurrency"] == concurrency),
            key=lambda row: row["round"],
        )

    figures = {}
    for concurrency in CONCURRENCIES:
        floor = cell("floor", concurrency)
        other = cell("floor_other", concurrency)
        if other:  # not recorded: it says what another grpcio costs beside the installed one, in this run
            figures[f"floor_other_c{concurrency}_cpu_per_floor"] = statistics.median(
                row["cpu_us_per_request"] / under["cpu_us_per_request"] for row, under in zip(other, floor, strict=True)
            )
        for server in ("floor", "thread", "process"):
            mine = cell(server, concurrency)
            figures[f"{server}_c{concurrency}_cpu_per_model_call"] = statistics.median(
                row["cpu_us_per_request"] / row["model_us"] for row in mine
            )
            if server != "floor":
                figures[f"{server}_c{concurrency}_cpu_per_floor"] = statistics.median(
                    row["cpu_us_per_request"] / under["cpu_us_per_request"]
                    for row, under in zip(mine, floor, strict=True)
                )
            figures[f"{server}_c{concurrency}_switches"] = statistics.median(
                row["switches_per_request"] for row in mine
            )
    return figures


def compare(figures: dict[str, float]) -> list[str]:
    """Lines saying each figure against the recorded one; REGRESSED past TOLERANCE."""
    if not RECORDED.exists():
        return [f"nothing recorded yet ({RECORDED.name}): run with --record"]
    recorded = json.loads(RECORDED.read_text())
    lines = [
        f"recorded at {recorded.get('commit', '?')} with grpcio {recorded.get('grpcio', '?')}; "
        f"installed grpcio {grpc.__version__}"
    ]
    for key, value in figures.items():
        before = recorded["figures"].get(key)
        if before is None:
            continue
        ratio = value / before if before else float("inf")
        judged = not key.endswith("_cpu_per_model_call")  # shown only: the in-process call is too noisy here
        mark = ("REGRESSED" if ratio > TOLERANCE else "ok") if judged else "(not judged)"
        lines.append(f"{key}: {value:.2f} (recorded {before:.2f}, ×{ratio:.2f}) {mark}")
    return lines


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-ms", type=int, default=1000)
    parser.add_argument("--label", default="")
    parser.add_argument("--record", action="store_true", help=f"write this run's figures to {RECORDED.name}")
    parser.add_argument(
        "--other-grpcio",
        type=Path,
        default=None,
        help="a folder holding another grpcio (pip install --target DIR grpcio==X): a second floor "
        "imports it, measured alternately with the installed one",
    )
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        root = Path(folder)
        thread_repo, process_repo = root / "thread", root / "process"
        for repo, extra in ((thread_repo, THREAD_PARAMETER), (process_repo, "")):
            repo.mkdir()
            write_repository(repo, extra)
        in_process = InProcess(thread_repo)
        servers = {
            "floor": stack.enter_context(floor_server(root)),
            **(
                {"floor_other": stack.enter_context(floor_server(root, args.other_grpcio))} if args.other_grpcio else {}
            ),
            "thread": stack.enter_context(shoal_server(thread_repo)),
            "process": stack.enter_context(shoal_server(process_repo)),
        }
        for round_number in range(args.rounds):
            order = list(servers) if round_number % 2 == 0 else list(reversed(servers))
            for concurrency in CONCURRENCIES:
                for name in order:
                    url, pid = servers[name]
                    model_us = in_process.cpu_us()  # right before: the two figures see the same machine
                    figures = measure(url, pid, concurrency, args.window_ms)
                    rows.append(
                        {
                            "round": round_number,
                            "server": name,
                            "concurrency": concurrency,
                            **figures,
                            "model_us": model_us,
                            "grpcio": grpc.__version__,
                        }
                    )
                    print(
                        f"round {round_number} {name} c={concurrency}: {figures['throughput']:.0f}/s, p50 "
                        f"{figures['p50_us']:.0f} µs, {figures['cpu_us_per_request']:.0f} µs CPU and "
                        f"{figures['switches_per_request']:.1f} context switches per request (in-process call "
                        f"{model_us:.1f} µs)",
                        flush=True,
                    )
    model_us = statistics.median(row["model_us"] for row in rows)
    print(f"\ngrpcio {grpc.__version__}, {args.rounds} round(s), medians; in-process call {model_us:.1f} µs CPU\n")
    print(
        "| server | c | throughput (infer/s) | p50 (µs) | CPU per request (µs) | ÷ in-process call | "
        "context switches per request |\n|---|---|---|---|---|---|---|"
    )
    for name in servers:
        for concurrency in CONCURRENCIES:
            mine = [row for row in rows if row["server"] == name and row["concurrency"] == concurrency]
            cpu = statistics.median(row["cpu_us_per_request"] for row in mine)
            print(
                f"| {name} | {concurrency} | {statistics.median(row['throughput'] for row in mine):,.0f} | "
                f"{statistics.median(row['p50_us'] for row in mine):,.0f} | {cpu:,.0f} | {cpu / model_us:.1f} | "
                f"{statistics.median(row['switches_per_request'] for row in mine):.1f} |"
            )
    figures = figures_of(rows)
    print()
    for line in compare(figures):
        print(line)
    for key, value in figures.items():
        if key.startswith("floor_other"):
            print(f"{key}: {value:.2f} (grpcio from {args.other_grpcio} ÷ grpcio {grpc.__version__}, same run)")
    save_results(rows, f"python_path{'_' + args.label if args.label else ''}.csv")
    if args.record:
        kept = {key: value for key, value in figures.items() if not key.startswith("floor_other")}
        RECORDED.write_text(
            json.dumps(
                {
                    "commit": commit(),
                    "grpcio": grpc.__version__,
                    "rounds": args.rounds,
                    "window_ms": args.window_ms,
                    "model_us": model_us,
                    "figures": kept,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {RECORDED}")
    if os.environ.get("PYTHON_PATH_STRICT") == "1" and any("REGRESSED" in line for line in compare(figures)):
        sys.exit(1)


if __name__ == "__main__":
    main()
