"""Issue 15's table in one run: HTTP/REST beside gRPC, for Shoal and for Triton 2.51, on this machine.

    python bench/http_side_by_side.py [--rounds 2] [--window-ms 1500] [--workers 0 ...] [--skip-triton]

Workloads: tiny (add/sub, INT32 [1,16]) and mlp (FP32, 4 × 1024²) at concurrency 1 and 16, the same models and
configuration as bench/side_by_side.py (max_batch_size 32, one instance, dynamic_batching
{ max_queue_delay_microseconds: 200 }, 2 ONNX Runtime threads; Triton runs the ONNX file through its Python
backend, ../shared/tools/triton_peer).
Load: perf_analyzer 2.51, ``-i grpc`` and ``-i http`` (perf_analyzer sends HTTP inputs as binary tensor data),
--input-data zero. Each round starts every server afresh and measures both protocols against it; the table shows the
median over rounds, and the two ratios the issue asks for: Shoal's HTTP against Triton's HTTP at c=16, and Shoal's
HTTP against Shoal's own gRPC. Writes bench/results/http_side_by_side.csv (every round) and .md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import ANY_SPREAD, RESULTS, install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._triton import triton_server  # noqa: E402
from bench.side_by_side import write_models  # noqa: E402
from shoal.tools import local_server  # noqa: E402

MAX_TRIALS = 6
WORKLOADS = (("tiny", 1), ("tiny", 16), ("mlp", 1), ("mlp", 16))
PROTOCOLS = ("grpc", "http")


@dataclass(frozen=True)
class Urls:
    grpc: str
    http: str

    def of(self, protocol: str) -> str:
        return self.grpc if protocol == "grpc" else self.http


def measure(urls: Urls, server: str, round_number: int, window_ms: int) -> list[dict[str, Any]]:
    """Every workload over both protocols against one running server."""
    rows = []
    for model, concurrency in WORKLOADS:
        for protocol in PROTOCOLS:
            row: dict[str, Any] = {
                "round": round_number,
                "server": server,
                "protocol": protocol,
                "model": model,
                "concurrency": concurrency,
            }
            row.update(run_perf(urls.of(protocol), model, concurrency, window_ms, protocol))
            rows.append(row)
            print(progress_line(row), flush=True)
    return rows


def run_perf(url: str, model: str, concurrency: int, window_ms: int, protocol: str) -> dict[str, Any]:
    """perf_analyzer's figures; a run whose windows never agree within 20% keeps its last three (stable 0)."""
    message = ""
    for stable, spread in ((1, 20.0), (0, ANY_SPREAD)):
        try:
            figures = perf_analyzer(url, model, concurrency, window_ms, 1, MAX_TRIALS, spread, protocol)
            return {**figures, "stable": stable}
        except subprocess.CalledProcessError as error:
            lines = (error.stderr or b"").decode(errors="replace").strip().splitlines()
            message = f"perf_analyzer exit {error.returncode}: {lines[-1] if lines else ''}"
            if "stable" not in message:
                return {"error": message}
        except subprocess.TimeoutExpired:
            return {"error": "perf_analyzer timed out"}
    return {"error": message}


def progress_line(row: dict[str, Any]) -> str:
    head = f"round {row['round']} {row['server']:<14} {row['protocol']:<4} {row['model']:<4} c={row['concurrency']:<2}"
    if "error" in row:
        return f"{head} FAILED: {row['error']}"
    return f"{head} {row['throughput']:>8,.0f}/s  p50 {row['p50_us']:>7,.0f} µs"


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str, int], dict[str, float]]:
    grouped: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            grouped.setdefault((row["server"], row["protocol"], row["model"], row["concurrency"]), []).append(row)
    return {
        key: {name: statistics.median(r[name] for r in group) for name in ("throughput", "p50_us")}
        for key, group in grouped.items()
    }


def markdown_table(rows: list[dict[str, Any]], servers: list[str]) -> str:
    figures = medians(rows)
    columns = [(server, protocol) for server in servers for protocol in PROTOCOLS]
    lines = ["| workload | " + " | ".join(f"{s} {p}" for s, p in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for model, concurrency in WORKLOADS:
        cells = []
        for server, protocol in columns:
            mine = figures.get((server, protocol, model, concurrency))
            cells.append("—" if mine is None else f"{mine['throughput']:,.0f}/s, p50 {mine['p50_us']:,.0f} µs")
        lines.append(f"| {model}, c={concurrency} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(ratio_lines(figures, servers))


def ratio_lines(figures: dict[tuple[str, str, str, int], dict[str, float]], servers: list[str]) -> list[str]:
    lines = []
    for server in servers:
        if not server.startswith("Shoal"):
            continue
        for model, concurrency in WORKLOADS:
            http = figures.get((server, "http", model, concurrency))
            grpc = figures.get((server, "grpc", model, concurrency))
            triton = figures.get(("Triton 2.51", "http", model, concurrency))
            parts = []
            if http and grpc:
                parts.append(f"{http['throughput'] / grpc['throughput']:.2f}× its own gRPC")
            if http and triton and concurrency > 1:
                parts.append(f"{http['throughput'] / triton['throughput']:.2f}× Triton's HTTP")
            if parts:
                lines.append(f"- {server} HTTP, {model} c={concurrency}: " + ", ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1500)
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[0],
        help="Shoal --frontend-workers values, one column each (0: gRPC and HTTP in the process that "
        "holds the models; N: N front-end processes, each serving both)",
    )
    parser.add_argument("--skip-triton", action="store_true")
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    servers = ([] if args.skip_triton else ["Triton 2.51"]) + [f"Shoal w{n}" for n in args.workers]
    with tempfile.TemporaryDirectory() as folder:
        repos = write_models(Path(folder))
        for round_number in range(1, args.rounds + 1):
            if not args.skip_triton:
                with triton_server(repos.triton, log_path=Path(folder) / f"triton-{round_number}.log") as triton:
                    urls = Urls(triton.url, triton.http_url)
                    rows += measure(urls, "Triton 2.51", round_number, args.window_ms)
            for workers in args.workers:
                with local_server.running(repos.shoal, "--frontend-workers", str(workers)) as server:
                    urls = Urls(server.url, server.http_url)
                    rows += measure(urls, f"Shoal w{workers}", round_number, args.window_ms)
    table = markdown_table(rows, servers)
    failed = sorted({f"{r['server']} {r['protocol']} {r['model']} c={r['concurrency']}" for r in rows if "error" in r})
    notes = f"{args.rounds} round(s), median shown; window {args.window_ms} ms; perf_analyzer 2.51, zero inputs."
    if failed:
        notes += f" Failed in some round (see the CSV): {', '.join(failed)}."
    print("\n" + table + "\n\n" + notes)
    save_results(rows, "http_side_by_side.csv")
    (RESULTS / "http_side_by_side.md").write_text(table + "\n\n" + notes + "\n")
    print(f"wrote {RESULTS / 'http_side_by_side.md'}")


if __name__ == "__main__":
    main()
