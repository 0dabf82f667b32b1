"""What a request costs the server process: perf_analyzer on `simple` with dynamic batching.

    python bench/request_path.py [--concurrency 1 16] [--window-ms 2000] [--rounds 2] [--label after]
                                 [--against REVISION]

`simple` (the Triton quick-start add/sub model, INT32 [1,16]) with max_batch_size 32, one
instance, `dynamic_batching { max_queue_delay_microseconds: 200 }` and 2 ONNX Runtime threads,
as in issue 12. Two copies of it are served side by side, differing only in ONNX Runtime's
intra-op spinning: `simple` (the default: spinning, see docs/benchmarks.md) and `simple_no_spin` with
`parameters { key: "allow_spinning" value: { string_value: "false" } }`. For each round, model
and concurrency: perf_analyzer over gRPC with zero inputs gives throughput and p50; the server
process's CPU time (utime + stime from /proc/<pid>/stat) over the measurement, divided by the
requests the model's statistics counted over the same span, gives CPU µs per request. Prints a
table, writes bench/results/request_path[_<label>].csv.

With ``--against REVISION`` (a commit, e.g. ``main~3``) each round runs two servers in turn, alternating which
goes first: ``server/shoal/`` as it was at REVISION ("before", from ``git archive``) and as it is in this checkout
("after"); the table gives both and after / before, the medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_simple  # noqa: E402
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    cpu_seconds,
    install_perf_analyzer,
    perf_analyzer,
    requests_served,
    save_results,
)
from bench._server import checked_out_server, shoal_server  # noqa: E402

MODELS = {"simple": None, "simple_no_spin": "false"}  # name -> allow_spinning (None: the default)


def write_models(repository: Path) -> None:
    for name, spinning in MODELS.items():
        extra = "\ndynamic_batching { max_queue_delay_microseconds: 200 }\n"
        extra += 'parameters { key: "intra_op_thread_count" value: { string_value: "2" } }\n'
        if spinning is not None:
            extra += f'parameters {{ key: "allow_spinning" value: {{ string_value: "{spinning}" }} }}\n'
        write_simple(repository, name, extra)


def measure(url: str, pid: int, model: str, concurrency: int, window_ms: int) -> dict[str, float]:
    requests_before, cpu_before = requests_served(url, model), cpu_seconds(pid)
    try:
        figures = perf_analyzer(url, model, concurrency, window_ms)
    except subprocess.CalledProcessError:  # its windows never agreed within 20% (a shared machine): 3 windows
        figures = perf_analyzer(url, model, concurrency, window_ms, max_trials=3, stability_percent=ANY_SPREAD)
    cpu, requests = cpu_seconds(pid) - cpu_before, requests_served(url, model) - requests_before
    return {
        "throughput": figures["throughput"],
        "p50_us": figures["p50_us"],
        "cpu_us_per_request": 1e6 * cpu / max(1, requests),
        "requests": requests,
    }


def compare(rows: list[dict[str, Any]]) -> str:
    """Medians over rounds, before against after, per model and concurrency."""

    def median(variant: str, model: str, concurrency: int, field: str) -> float:
        return float(
            statistics.median(
                row[field]
                for row in rows
                if (row["server"], row["model"], row["concurrency"]) == (variant, model, concurrency)
            )
        )

    lines = [
        "| model, concurrency | infer/s before | after | after / before | p50 µs before | after "
        "| CPU µs/request before | after | after / before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, concurrency in dict.fromkeys((row["model"], row["concurrency"]) for row in rows):
        cells = {
            field: (median("before", model, concurrency, field), median("after", model, concurrency, field))
            for field in ("throughput", "p50_us", "cpu_us_per_request")
        }
        (tb, ta), (pb, pa), (cb, ca) = cells.values()
        lines.append(
            f"| {model}, {concurrency} | {tb:,.0f} | {ta:,.0f} | {ta / tb:.2f}× | {pb:,.0f} | {pa:,.0f} "
            f"| {cb:,.0f} | {ca:,.0f} | {ca / cb:.2f}× |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--window-ms", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--label", default="", help="suffix of the CSV name, e.g. before / after")
    parser.add_argument(
        "--against", metavar="REVISION", help="also serve server/shoal/ as it was at REVISION, alternating"
    )
    args = parser.parse_args()
    install_perf_analyzer()
    rows = []
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        write_models(Path(folder))
        servers: dict[str, Path | None] = {"after": None}
        if args.against:
            servers = {"before": stack.enter_context(checked_out_server(args.against)), "after": None}
        for round_number in range(1, args.rounds + 1):
            order = list(servers) if round_number % 2 else list(reversed(servers))
            for variant in order:
                with shoal_server(Path(folder), python_path=servers[variant]) as (url, pid):
                    for model in args.models:
                        for concurrency in args.concurrency:
                            row = {
                                "round": round_number,
                                "server": variant,
                                "model": model,
                                "concurrency": concurrency,
                                **measure(url, pid, model, concurrency, args.window_ms),
                            }
                            rows.append(row)
                            print(
                                f"round {row['round']} {variant:>6} {model:>11} c={concurrency:<3} "
                                f"{row['throughput']:>7.0f} infer/s  p50 {row['p50_us']:>6.0f} µs  "
                                f"CPU {row['cpu_us_per_request']:>5.0f} µs/request",
                                flush=True,
                            )
    if args.against:
        print(f"\nbench/request_path.py --against {args.against} --rounds {args.rounds}: medians\n")
        print(compare(rows))
    save_results(rows, f"request_path{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
