"""Issue 12's table in one run on this machine: in-process ONNX Runtime, Triton 2.51, Shoal per front-end layout.

    python bench/side_by_side.py [--workers 0 1 2] [--clients 1] [--channel-share N] [--window-ms 1500]
                                 [--rounds 2] [--label after] [--skip-triton]

Workloads: tiny (model_repository/simple: add/sub, INT32 [1,16]) at concurrency 1 and 16; mlp (an FP32 MLP of
4 × 1024², built at run time like bench/throughput.py) at 1 and 16; mlp with `-b 8` at 16 (samples/s). Every server
gets the same model configuration: max_batch_size 32, one instance, dynamic_batching { max_queue_delay_microseconds:
200 }, 2 ONNX Runtime intra-op threads (ORT's own default for spinning, on, in every column: Shoal's,
Triton's onnx_model.py and the in-process loop; Shoal's column had it off before session 42). Load:
perf_analyzer 2.51 over gRPC, --input-data zero; with --clients K the concurrency is split over K perf_analyzer
processes at once (throughputs summed, the worst p50 kept; each then measures exactly 3 windows so that they
overlap). Connections, as measured here: one perf_analyzer opens
ceil((c + 1) / 6) TCP connections (c=1 and 2: 1, c=6 and 7: 2, c=12 to 16: 3), its gRPC client library sharing one
channel among at most 6 clients (TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT). SO_REUSEPORT spreads connections, not
requests, over front-end workers, so 3 connections can land unevenly on 2 workers; --channel-share 1 gives every
context its own connection (17 at c=16). Columns:
- in-process ORT: threads calling one session in this process (bench/_perf.py in_process), no server running;
- Triton 2.51: tritonserver with its Python backend running the ONNX file (../shared/tools/triton_peer);
- Shoal --grpc-workers N for each N of --workers (0: gRPC served by the process that holds the models; N >= 1: N
  front-end worker processes, children of the host).
CPU per request, at concurrency 16: CPU seconds (utime + stime from /proc) of the server's process tree over the
perf_analyzer run divided by the requests its ModelStatistics counted over the same span; split into the server
process (the host; tritonserver) and its child processes (the front-end workers; Triton's Python-backend stubs).
In-process ORT: CPU of this process per session.run call. "conns" is the most server-side ESTABLISHED TCP connections
seen on the server's port during a run. Each round starts every server afresh, in turn; the table shows the median
over rounds. Prints the table (markdown), writes bench/results/side_by_side[_<label>].csv (every round) and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import BATCHING, ORT_THREADS, ORT_THREADS_PARAMETER, write_mlp, write_tiny  # noqa: E402
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    RESULTS,
    connection_watch,
    cpu_split,
    in_process,
    install_perf_analyzer,
    perf_analyzers,
    requests_served,
    save_results,
    split_concurrency,
    tree_cpu_seconds,
)
from bench._triton import triton_server, write_onnx_model  # noqa: E402
from shoal.tools import local_server  # noqa: E402

WIDTH, LAYERS = 1024, 4
MAX_TRIALS = 6  # windows per perf_analyzer run at most (it stops earlier once 3 agree within 20%)
ONE_INSTANCE = "instance_group [ { count: 1, kind: KIND_CPU } ]"  # model_repository/simple has this line already
TINY_IO = "max_batch_size: 32\n" + "\n".join(
    f'{kind} [ {{ name: "{kind.upper()}0" data_type: TYPE_INT32 dims: [ 16 ] }}, '
    f'{{ name: "{kind.upper()}1" data_type: TYPE_INT32 dims: [ 16 ] }} ]'
    for kind in ("input", "output")
)
MLP_IO = f"""max_batch_size: 32
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]"""


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    model: str  # "tiny" or "mlp"
    concurrency: int
    batch: int = 1


WORKLOADS = (
    Workload("tiny_c1", "tiny (add/sub [1,16]), c=1", "tiny", 1),
    Workload("tiny_c16", "tiny, c=16", "tiny", 16),
    Workload("mlp_c1", f"mlp ({LAYERS}×{WIDTH}², FP32), c=1", "mlp", 1),
    Workload("mlp_c16", "mlp, c=16", "mlp", 16),
    Workload("mlp_b8_c16", "mlp `-b 8`, c=16 (samples/s)", "mlp", 16, 8),
)
CPU_WORKLOADS = ("tiny_c16", "mlp_c16", "mlp_b8_c16")


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    workers: int | None = None  # Shoal's --grpc-workers


@dataclass(frozen=True)
class Repositories:
    shoal: Path
    triton: Path
    onnx_files: dict[str, Path]  # model name -> the file every server and the in-process loop run
    folder: Path  # for logs


def write_models(folder: Path) -> Repositories:
    """Shoal's repository and Triton's, with the same ONNX files and the same batching configuration."""
    shoal_repo, triton_repo = folder / "shoal", folder / "triton"
    shoal_repo.mkdir()
    triton_repo.mkdir()
    write_tiny(shoal_repo)
    write_mlp(
        shoal_repo, "mlp", WIDTH, LAYERS, f"{ONE_INSTANCE}\n{BATCHING}\n{ORT_THREADS_PARAMETER}", max_batch_size=32
    )
    files = {"tiny": shoal_repo / "tiny" / "1" / "model.onnx", "mlp": shoal_repo / "mlp" / "1" / "model.onnx"}
    for name, io_config in (("tiny", TINY_IO), ("mlp", MLP_IO)):
        write_onnx_model(triton_repo, name, files[name], io_config, f"{ONE_INSTANCE}\n{BATCHING}", ORT_THREADS)
    return Repositories(shoal_repo, triton_repo, files, folder)


def load_figures(url: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """perf_analyzer's figures; when its windows never agree within 20% (this machine is shared), the last 3 windows
    of a second run that does not ask them to (``stable`` 0); {"error": ...} when it fails or times out."""
    load = (url, workload.model, workload.concurrency, args.clients, args.window_ms, workload.batch)
    several = len(split_concurrency(workload.concurrency, args.clients)) > 1  # fixed windows: no stability stop
    for stable, stability_percent in ((1, 20.0), (0, ANY_SPREAD)):
        try:
            figures = perf_analyzers(*load, max_trials=MAX_TRIALS, stability_percent=stability_percent)
            return figures if several else {**figures, "stable": stable}
        except subprocess.CalledProcessError as error:
            detail = (error.stderr or b"").decode(errors="replace").strip().splitlines()
            message = f"perf_analyzer exit {error.returncode}: {detail[-1] if detail else ''}"
            if "stable" not in message:
                break
        except subprocess.TimeoutExpired:
            message = "perf_analyzer timed out"
            break
    return {"error": message}


def measure_request_load(url: str, pid: int, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """perf_analyzer figures, CPU per request of the server's tree (host / children) and the connections seen."""
    port = int(url.rsplit(":", 1)[1])
    requests_before, cpu_before = requests_served(url, workload.model), tree_cpu_seconds(pid)
    with connection_watch(port) as connections:
        figures = load_figures(url, workload, args)
    host_s, children_s = cpu_split(cpu_before, tree_cpu_seconds(pid), pid)
    requests = max(1, requests_served(url, workload.model) - requests_before)
    return {
        **figures,
        "requests": requests,
        "connections": connections["max"],
        "cpu_us_per_request": 1e6 * (host_s + children_s) / requests,
        "host_cpu_us_per_request": 1e6 * host_s / requests,
        "children_cpu_us_per_request": 1e6 * children_s / requests,
    }


def measure_server(
    column: Column, url: str, pid: int, round_number: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for workload in WORKLOADS:
        row: dict[str, Any] = {"round": round_number, "column": column.key, "workload": workload.key}
        try:
            row.update(measure_request_load(url, pid, workload, args))
        except Exception as error:  # the server died, statistics failed...: record it and go on
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
        print(progress_line(row), flush=True)
    return rows


def ort_feed(workload: Workload) -> dict[str, np.ndarray]:
    """Zero inputs of ``workload``'s model and batch, as the in-process loop feeds its session."""
    if workload.model == "tiny":
        return {name: np.zeros((workload.batch, 16), np.int32) for name in ("INPUT0", "INPUT1")}
    return {"INPUT0": np.zeros((workload.batch, WIDTH), np.float32)}


def measure_in_process(files: dict[str, Path], round_number: int, window_ms: int) -> list[dict[str, Any]]:
    rows = []
    for workload in WORKLOADS:
        figures = in_process(
            files[workload.model], ort_feed(workload), workload.concurrency, window_ms / 1000, ORT_THREADS
        )
        row = {"round": round_number, "column": "ort", "workload": workload.key, **figures}
        rows.append(row)
        print(progress_line(row), flush=True)
    return rows


def progress_line(row: dict[str, Any]) -> str:
    head = f"round {row['round']} {row['column']:<9} {row['workload']:<11}"
    if "error" in row:
        return f"{head} FAILED: {row['error']}"
    text = f"{head} {row['throughput']:>8,.0f}/s  p50 {row['p50_us']:>7,.0f} µs  CPU {row['cpu_us_per_request']:>6,.0f}"
    if "host_cpu_us_per_request" not in row:
        return f"{text} µs/call"
    return (
        f"{text} (host {row['host_cpu_us_per_request']:,.0f} + children "
        f"{row['children_cpu_us_per_request']:,.0f}) µs/request  conns {row['connections']}"
    )


def failed_rows(column: Column, round_number: int, error: str) -> list[dict[str, Any]]:
    print(f"round {round_number} {column.key}: FAILED: {error}", flush=True)
    return [{"round": round_number, "column": column.key, "workload": w.key, "error": error} for w in WORKLOADS]


def run_triton(
    column: Column, repo: Path, log_path: Path, round_number: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    try:
        with triton_server(repo, log_path=log_path) as server:
            return measure_server(column, server.url, server.pid, round_number, args)
    except RuntimeError as error:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:]) if log_path.exists() else ""
        return failed_rows(column, round_number, f"{error}\n{tail}")


def run_shoal(column: Column, repo: Path, round_number: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        with local_server.running(repo, "--grpc-workers", str(column.workers)) as server:
            return measure_server(column, server.url, server.pid, round_number, args)
    except RuntimeError as error:
        return failed_rows(column, round_number, str(error))


Figures = dict[tuple[str, str], dict[str, float]]  # (column, workload) -> figure name -> value


def median_figures(rows: list[dict[str, Any]]) -> Figures:
    """(column, workload) -> the median over rounds of every figure, from the rounds that did not fail."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            grouped.setdefault((row["column"], row["workload"]), []).append(row)
    return {
        key: {
            name: statistics.median(r[name] for r in group)
            for name, value in group[0].items()
            if isinstance(value, int | float) and name != "round"
        }
        for key, group in grouped.items()
    }


def load_cell(figures: Figures, column: Column, workload: Workload) -> str:
    mine = figures.get((column.key, workload.key))
    if mine is None:
        return "—"
    text = f"{mine['throughput']:,.0f}/s"
    if workload.concurrency == 1:
        text += f", p50 {mine['p50_us']:,.0f} µs"
    triton, ort = figures.get(("triton", workload.key)), figures.get(("ort", workload.key))
    if workload.batch > 1 and column.key != "ort" and ort:
        text += f" ({mine['throughput'] / ort['throughput']:.2f} of ORT)"
    elif workload.concurrency > 1 and column.workers is not None and triton:
        text += f" ({mine['throughput'] / triton['throughput']:.2f}× Triton)"
    return text


def cpu_cell(figures: Figures, column: Column) -> str:
    mine = [figures[(column.key, key)] for key in CPU_WORKLOADS if (column.key, key) in figures]
    if len(mine) < len(CPU_WORKLOADS):
        return "—"

    def joined(name: str) -> str:
        return " / ".join(f"{m[name]:,.0f}" for m in mine)

    text = f"{joined('cpu_us_per_request')} µs"
    if column.key == "triton":
        text += f" (server {joined('host_cpu_us_per_request')} + stubs {joined('children_cpu_us_per_request')})"
    elif column.workers:
        text += f" (host {joined('host_cpu_us_per_request')} + workers {joined('children_cpu_us_per_request')})"
    return text


def markdown_table(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    """The table (medians over rounds); a cell with no successful round shows —, the errors are in the CSV."""
    figures = median_figures(rows)
    lines = ["| workload | " + " | ".join(c.title for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for workload in WORKLOADS:
        lines.append(f"| {workload.label} | " + " | ".join(load_cell(figures, c, workload) for c in columns) + " |")
    lines.append(
        "| CPU/request, c=16: tiny / mlp / mlp -b 8 | " + " | ".join(cpu_cell(figures, c) for c in columns) + " |"
    )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="Shoal --grpc-workers values")
    parser.add_argument("--clients", type=int, default=1, help="perf_analyzer processes sharing each load")
    parser.add_argument("--window-ms", type=int, default=1500, help="perf_analyzer measurement window")
    parser.add_argument("--rounds", type=int, default=2, help="every server measured this many times, in turn")
    parser.add_argument("--label", default="", help="suffix of the result files, e.g. before / after")
    parser.add_argument("--skip-triton", action="store_true", help="leave Triton out (it installs on first use)")
    parser.add_argument(
        "--channel-share",
        type=int,
        metavar="N",
        help="perf_analyzer contexts per TCP connection (TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT; "
        "the client's default, 6, gives 3 connections at c=16; 1: one connection per context)",
    )
    args = parser.parse_args()
    if args.clients < 1 or args.rounds < 1 or args.window_ms < 100 or min(args.workers) < 0:
        parser.error("--clients and --rounds must be >= 1, --window-ms >= 100, --workers >= 0")
    return args


def run_round(
    round_number: int, columns: list[Column], repos: Repositories, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = measure_in_process(repos.onnx_files, round_number, args.window_ms)  # first: no server on the cores
    for column in columns:
        if column.key == "triton":
            log_path = repos.folder / f"triton-{round_number}.log"
            rows += run_triton(column, repos.triton, log_path, round_number, args)
        elif column.workers is not None:
            rows += run_shoal(column, repos.shoal, round_number, args)
    return rows


def main() -> None:
    args = parse_args()
    if args.channel_share:  # read by perf_analyzer's gRPC client library; the servers ignore it
        os.environ["TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"] = str(args.channel_share)
    install_perf_analyzer()
    columns = [Column("ort", "in-process ORT")]
    if not args.skip_triton:
        columns.append(Column("triton", "Triton 2.51"))
    columns += [Column(f"shoal_w{n}", f"Shoal --grpc-workers {n}", n) for n in dict.fromkeys(args.workers)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repos = write_models(Path(folder))
        for round_number in range(1, args.rounds + 1):
            rows += run_round(round_number, columns, repos, args)
    unstable = sum(1 for row in rows if row.get("stable") == 0)
    failed = sorted({f"{row['column']} {row['workload']}" for row in rows if "error" in row})
    notes = [
        f"{args.rounds} round(s), median shown; window {args.window_ms} ms; {args.clients} perf_analyzer "
        f"process(es) per load; contexts per connection: {args.channel_share or 'client default (6)'}; "
        f"{unstable} run(s) never within 20% (their last 3 windows kept)."
    ]
    if failed:
        notes.append(f"Failed in some round (see the CSV's error column): {', '.join(failed)}.")
    table = markdown_table(rows, columns) + "\n\n" + "\n".join(notes)
    print("\n" + table + "\n")
    suffix = f"_{args.label}" if args.label else ""
    save_results(rows, f"side_by_side{suffix}.csv")
    (RESULTS / f"side_by_side{suffix}.md").write_text(table + "\n")
    print(f"wrote {RESULTS / f'side_by_side{suffix}.md'}")


if __name__ == "__main__":
    main()
