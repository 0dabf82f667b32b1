"""Issue 24's goals in one run beside Triton 2.51 and in-process ONNX Runtime: every goal marked met or not.

    python bench/goals.py [--rounds 3] [--window-ms 1500] [--clients 1] [--label NAME]
    python bench/goals.py --quick          # 500 ms windows, one round: proves it runs, figures are rough

Each figure is measured the way the script that owns it measures it, by that script's own functions:
- bench/side_by_side.py (gRPC, perf_analyzer 2.51, zero inputs; tiny = add/sub INT32 [1,16], mlp = FP32
  4 × 1024²; every server max_batch_size 32, one instance, dynamic_batching { max_queue_delay_microseconds: 200 },
  2 ONNX Runtime threads; Triton runs the ONNX files in its Python backend): tiny c=1 p50, tiny c=16
  throughput and server CPU per request (the server's whole process tree over the run divided by the requests its
  statistics counted), mlp c=16 throughput, mlp `-b 8` c=16 samples/s, and that last one for in-process ONNX
  Runtime (16 threads calling one session, no server running);
- bench/http_side_by_side.py (the same servers, perf_analyzer ``-i http``): tiny and mlp c=16 throughput;
- bench/python_backend.py (its ``numpy_op`` Python model, FP32 [256], 100 µs queue delay): throughput at c=1
  and c=16 on Triton (stub process) and on Shoal with its instance in a worker process and on a thread.
Shoal runs on its defaults (``--grpc-workers 0``, ``--grpc-engine auto``): no server option is passed.

A round: in-process ORT first (no server on the cores), then Triton and Shoal on the ONNX models (gRPC, then HTTP,
on one server start each), then the three Python-model servers; even rounds start the peers in the reverse order.
The table shows, per goal, the median over rounds of each side and the ratio of those medians. Writes
bench/results/goals[_<label>].csv (every measurement of every round) and .md (the table and the notes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import python_backend  # noqa: E402
from bench._models import ORT_THREADS  # noqa: E402
from bench._perf import RESULTS, in_process, install_perf_analyzer, save_results  # noqa: E402
from bench._triton import triton_server  # noqa: E402
from bench.http_side_by_side import run_perf  # noqa: E402
from bench.side_by_side import (  # noqa: E402
    WORKLOADS,
    Repositories,
    measure_request_load,
    ort_feed,
    write_models,
)
from shoal.tools import local_server  # noqa: E402

GRPC_LOADS = {w.key: w for w in WORKLOADS if w.key in ("tiny_c1", "tiny_c16", "mlp_c16", "mlp_b8_c16")}
HTTP_LOADS = (("tiny", 16), ("mlp", 16))
QUICK_WINDOW_MS = 500
# bench/python_backend.py's column titles, in the order servers() yields them
PY_TRITON, PY_PROCESS, PY_THREAD = ("Triton 2.51 (stub process)", "Shoal (instance process)", "Shoal (instance thread)")


@dataclass(frozen=True)
class Goal:
    label: str
    shoal: tuple[str, str]  # (server, measurement)
    peer: tuple[str, str]
    figure: str  # throughput, p50_us or cpu_us_per_request
    target: float  # on shoal / peer
    at_least: bool  # True: ratio >= target; False: ratio <= target

    @property
    def target_text(self) -> str:
        peer = "ORT" if self.peer[0] == "ort" else "Triton"
        if self.at_least:
            return f"≥ {self.target:.2f} of {peer}" if peer == "ORT" else f"≥ {self.target:.1f}× {peer}"
        return f"≤ {peer}" if self.target == 1.0 else f"≤ {self.target:.2f}× {peer}"

    def met(self, ratio: float) -> bool:
        return ratio >= self.target if self.at_least else ratio <= self.target


GOALS = (
    Goal("tiny c=16 throughput, gRPC", ("shoal", "tiny_c16"), ("triton", "tiny_c16"), "throughput", 1.0, True),
    Goal("mlp c=16 throughput, gRPC", ("shoal", "mlp_c16"), ("triton", "mlp_c16"), "throughput", 0.9, True),
    Goal(
        "mlp `-b 8` c=16 samples/s, gRPC, against in-process ORT",
        ("shoal", "mlp_b8_c16"),
        ("ort", "mlp_b8_c16"),
        "throughput",
        0.75,
        True,
    ),
    Goal("tiny c=1 p50 latency, gRPC", ("shoal", "tiny_c1"), ("triton", "tiny_c1"), "p50_us", 1.0, False),
    Goal(
        "server CPU per tiny request at c=16, whole process tree",
        ("shoal", "tiny_c16"),
        ("triton", "tiny_c16"),
        "cpu_us_per_request",
        1.0,
        False,
    ),
    Goal(
        "tiny c=16 throughput, HTTP", ("shoal", "http_tiny_c16"), ("triton", "http_tiny_c16"), "throughput", 1.0, True
    ),
    Goal("mlp c=16 throughput, HTTP", ("shoal", "http_mlp_c16"), ("triton", "http_mlp_c16"), "throughput", 1.0, True),
    *(
        Goal(
            f"Python model c={c} throughput, instance {kind}",
            (server, f"python_c{c}"),
            (PY_TRITON, f"python_c{c}"),
            "throughput",
            1.0,
            True,
        )
        for server, kind in ((PY_PROCESS, "process"), (PY_THREAD, "thread"))
        for c in python_backend.CONCURRENCIES
    ),
)


def measure_onnx_server(
    server: str, url: str, http_url: str, pid: int, round_number: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The gRPC loads (figures, CPU per request) and the HTTP loads against one running server."""
    rows = []
    for key, workload in GRPC_LOADS.items():
        rows.append(guarded(round_number, server, key, partial(measure_request_load, url, pid, workload, args)))
    for model, concurrency in HTTP_LOADS:
        rows.append(
            guarded(
                round_number,
                server,
                f"http_{model}_c{concurrency}",
                partial(run_perf, http_url, model, concurrency, args.window_ms, "http"),
            )
        )
    return rows


def guarded(round_number: int, server: str, measurement: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One measurement as a row; a failure (the server died, perf_analyzer failed) is recorded, not raised."""
    row: dict[str, Any] = {"round": round_number, "server": server, "measurement": measurement}
    try:
        row.update(measure())
    except Exception as error:  # noqa: BLE001 - recorded in the row and the CSV
        row["error"] = f"{type(error).__name__}: {error}"
    print(progress_line(row), flush=True)
    return row


def progress_line(row: dict[str, Any]) -> str:
    head = f"round {row['round']} {row['server']:<26} {row['measurement']:<14}"
    if "error" in row:
        return f"{head} FAILED: {row['error']}"
    text = f"{head} {row['throughput']:>8,.0f}/s  p50 {row['p50_us']:>7,.0f} µs"
    if "cpu_us_per_request" in row:
        text += f"  CPU {row['cpu_us_per_request']:>6,.0f} µs/request"
    return text


def failed(round_number: int, server: str, measurements: list[str], error: Exception) -> list[dict[str, Any]]:
    print(f"round {round_number} {server}: FAILED to start: {error}", flush=True)
    return [
        {"round": round_number, "server": server, "measurement": m, "error": f"server start: {error}"}
        for m in measurements
    ]


@contextmanager
def triton_onnx(repos: Repositories, round_number: int) -> Iterator[tuple[str, str, int]]:
    with triton_server(repos.triton, log_path=repos.folder / f"triton-{round_number}.log") as server:
        yield server.url, server.http_url, server.pid


@contextmanager
def shoal_onnx(repos: Repositories) -> Iterator[tuple[str, str, int]]:
    with local_server.running(repos.shoal) as server:  # Shoal's defaults: no layout or engine option
        yield server.url, server.http_url, server.pid


def run_round(round_number: int, repos: Repositories, args: argparse.Namespace) -> list[dict[str, Any]]:
    mlp_b8 = GRPC_LOADS["mlp_b8_c16"]
    rows = [
        guarded(
            round_number,
            "ort",
            mlp_b8.key,
            lambda: in_process(
                repos.onnx_files["mlp"], ort_feed(mlp_b8), mlp_b8.concurrency, args.window_ms / 1000, ORT_THREADS
            ),
        )
    ]
    onnx_servers: list[tuple[str, Callable[[], AbstractContextManager[tuple[str, str, int]]]]] = [
        ("triton", lambda: triton_onnx(repos, round_number)),
        ("shoal", lambda: shoal_onnx(repos)),
    ]
    onnx_measurements = [*GRPC_LOADS, *(f"http_{m}_c{c}" for m, c in HTTP_LOADS)]
    for server, start in onnx_servers if round_number % 2 else reversed(onnx_servers):
        try:
            with start() as (url, http_url, pid):
                rows += measure_onnx_server(server, url, http_url, pid, round_number, args)
        except RuntimeError as error:
            rows += failed(round_number, server, onnx_measurements, error)
    python_folder = repos.folder / f"python-{round_number}"
    python_folder.mkdir()
    python_servers = list(python_backend.servers(python_folder))
    python_measurements = [f"python_c{c}" for c in python_backend.CONCURRENCIES]
    for server, start_python in python_servers if round_number % 2 else reversed(python_servers):
        try:
            with start_python() as (url, pid):
                for concurrency in python_backend.CONCURRENCIES:
                    rows.append(
                        guarded(
                            round_number,
                            server,
                            f"python_c{concurrency}",
                            partial(python_backend.measure, url, pid, concurrency, args.window_ms),
                        )
                    )
        except RuntimeError as error:
            rows += failed(round_number, server, python_measurements, error)
    return rows


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """(server, measurement) -> the median over the rounds that did not fail of every figure."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            grouped.setdefault((row["server"], row["measurement"]), []).append(row)
    return {
        key: {
            name: statistics.median(r[name] for r in group)
            for name, value in group[0].items()
            if isinstance(value, int | float) and name != "round"
        }
        for key, group in grouped.items()
    }


def figure_text(goal: Goal, value: float) -> str:
    if goal.figure == "throughput":
        return f"{value:,.0f}/s"
    return f"{value:,.0f} µs"


def goals_table(rows: list[dict[str, Any]]) -> tuple[str, int]:
    """The markdown table and how many goals are met; a side with no successful round shows — (not measured)."""
    figures = medians(rows)
    lines = ["| goal | Shoal | Triton / ORT | ratio | target | met |", "|---|---|---|---|---|---|"]
    met_count = 0
    for goal in GOALS:
        shoal, peer = figures.get(goal.shoal), figures.get(goal.peer)
        if shoal is None or peer is None or not peer[goal.figure]:
            cells = [
                figure_text(goal, shoal[goal.figure]) if shoal else "—",
                figure_text(goal, peer[goal.figure]) if peer else "—",
                "—",
                goal.target_text,
                "not measured",
            ]
        else:
            ratio = shoal[goal.figure] / peer[goal.figure]
            met = goal.met(ratio)
            met_count += met
            cells = [
                figure_text(goal, shoal[goal.figure]),
                figure_text(goal, peer[goal.figure]),
                f"{ratio:.2f}×",
                goal.target_text,
                "**met**" if met else "not met",
            ]
        lines.append(f"| {goal.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), met_count


def notes(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    load: list[tuple[float, float, float]],
    elapsed_s: float,
    met_count: int,
) -> str:
    unstable = sum(1 for row in rows if row.get("stable") == 0)
    failures = sorted({f"{row['server']} {row['measurement']}" for row in rows if "error" in row})
    text = (
        f"{met_count} of {len(GOALS)} goals met. {args.rounds} round(s){' (--quick)' if args.quick else ''}, "
        f"median shown, ratio = Shoal's median / the peer's median; perf_analyzer windows {args.window_ms} ms; "
        f"{args.clients} perf_analyzer process(es) per gRPC load; {unstable} ONNX-model run(s) never within 20% "
        f"(their last 3 windows kept; Python-model runs always take 3 windows); {os.cpu_count()} cores, "
        f"load average (1 min) {load[0][0]:.1f} at the start and "
        f"{load[1][0]:.1f} at the end; took {elapsed_s / 60:.1f} min."
    )
    if failures:
        text += f" Failed in some round (see the CSV's error column): {', '.join(failures)}."
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="every server measured this many times, in turn")
    parser.add_argument("--window-ms", type=int, default=1500, help="perf_analyzer measurement window")
    parser.add_argument("--clients", type=int, default=1, help="perf_analyzer processes sharing each gRPC load")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"one round of {QUICK_WINDOW_MS} ms windows (overrides --rounds and --window-ms)",
    )
    parser.add_argument("--label", default="", help="suffix of the result files, e.g. before / after")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.window_ms = 1, QUICK_WINDOW_MS
    if args.clients < 1 or args.rounds < 1 or args.window_ms < 100:
        parser.error("--clients and --rounds must be >= 1, --window-ms >= 100")
    return args


def main() -> None:
    args = parse_args()
    install_perf_analyzer()
    started, load = time.monotonic(), [os.getloadavg()]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repos = write_models(Path(folder))
        for round_number in range(1, args.rounds + 1):
            rows += run_round(round_number, repos, args)
    load.append(os.getloadavg())
    table, met_count = goals_table(rows)
    text = table + "\n\n" + notes(rows, args, load, time.monotonic() - started, met_count)
    print("\n" + text + "\n")
    suffix = f"_{args.label}" if args.label else ""
    save_results(rows, f"goals{suffix}.csv")
    (RESULTS / f"goals{suffix}.md").write_text(text + "\n")
    print(f"wrote {RESULTS / f'goals{suffix}.md'}")


if __name__ == "__main__":
    main()
