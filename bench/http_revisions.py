"""Shoal's HTTP endpoint at an earlier git revision against this checkout, one run.

    python bench/http_revisions.py --before REV [--rounds 2] [--concurrency 16] [--models tiny,mlp]

bench/side_by_side.py's models (tiny, mlp; max_batch_size 32, one instance, 200 µs queue delay, 2
ONNX Runtime threads), served by Shoal as it was at REV (``bench._server.checked_out_server``) and by
this checkout, taking turns (every other round in the reverse order). perf_analyzer 2.51 over HTTP
(``-i http``, zero inputs, three 2 s windows after a warm-up). Prints each round, then the medians and
this checkout's ratios to REV: throughput and server CPU per request (the server's process tree's
utime + stime from /proc over the run, divided by the requests its statistics counted). Writes
bench/results/http_revisions.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import ANY_SPREAD, install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._server import checked_out_server  # noqa: E402
from bench.event_loops import measure as measure_load  # noqa: E402
from bench.side_by_side import write_models  # noqa: E402
from shoal.tools import local_server  # noqa: E402


def measure(server: local_server.LocalServer, model: str, concurrency: int) -> dict[str, float]:
    """After a warm-up, as bench/event_loops.py measures: throughput, latencies, server CPU per request."""
    perf_analyzer(server.http_url, model, concurrency, 500, max_trials=3, stability_percent=ANY_SPREAD, protocol="http")
    return measure_load(server.url, server.http_url, server.pid, model, "http", concurrency, 2000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, metavar="REV")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--models", default="tiny,mlp")
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder, checked_out_server(args.before) as before:
        repo = write_models(Path(folder)).shoal
        sides: list[tuple[str, Path | None]] = [(args.before, before), ("this checkout", None)]
        for round_number in range(args.rounds):
            for side, python_path in sides if round_number % 2 == 0 else sides[::-1]:
                with local_server.running(repo, python_path=python_path) as server:
                    for model in args.models.split(","):
                        figures = measure(server, model, args.concurrency)
                        rows.append({"round": round_number, "server": side, "model": model, **figures})
                        print(
                            f"round {round_number} {side}: {model} c={args.concurrency} "
                            f"{figures['throughput']:.0f}/s, {figures['cpu_us_per_request']:.0f} µs CPU/request",
                            flush=True,
                        )
    for model in args.models.split(","):
        medians = {
            side: {
                key: statistics.median(r[key] for r in rows if r["server"] == side and r["model"] == model)
                for key in ("throughput", "cpu_us_per_request")
            }
            for side, _ in sides
        }
        old, new = medians[args.before], medians["this checkout"]
        print(
            f"{model} c={args.concurrency}: {old['throughput']:,.0f} -> {new['throughput']:,.0f}/s "
            f"({new['throughput'] / old['throughput']:.2f}x), CPU per request {old['cpu_us_per_request']:.0f} -> "
            f"{new['cpu_us_per_request']:.0f} µs ({new['cpu_us_per_request'] / old['cpu_us_per_request']:.2f}x)"
        )
    save_results(rows, "http_revisions.csv")


if __name__ == "__main__":
    main()
