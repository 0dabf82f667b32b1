"""Three models on one device, with and without the rate limiter: what the high-priority one gets.

    python bench/rate_limiter.py [--window-ms 2000] [--bulk-concurrency 8]

Three copies of one FP32 MLP (4 × 1024×1024, two ONNX Runtime threads each: one execution fills both
cores of this machine, as one fills a GPU). 'urgent' (priority 1) takes one client at a time; 'bulk_a' and
'bulk_b' (priority 4) are loaded by perf_analyzer at --bulk-concurrency each meanwhile. Every group names
`DEVICE` (count 1, the server's only unit on device 0), so with `--rate-limit execution_count` one
execution runs at a time and 'urgent' goes before the others when it waits; with `--rate-limit off` all
three run at once and share the cores. Rows: 'urgent' alone (the baseline), beside the bulk load
with the limiter off, and on. Figures: urgent's inferences/s, p50 and p99 (perf_analyzer), and the
bulk models' inferences/s over the same time. Writes bench/results/rate_limiter.csv.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import ORT_THREADS_PARAMETER, write_mlp  # noqa: E402
from bench._perf import (  # noqa: E402
    PERF_ANALYZER,
    install_perf_analyzer,
    perf_analyzer,
    requests_served,
    save_results,
)
from bench._server import shoal_server  # noqa: E402

WIDTH, LAYERS = 1024, 4
PRIORITIES = {"urgent": 1, "bulk_a": 4, "bulk_b": 4}
STABILITY = 50.0  # percent: three windows within it end a measurement (a shared machine's are noisy)


def group(priority: int) -> str:
    return (
        f'instance_group [ {{ count: 1 kind: KIND_CPU rate_limiter {{ resources [ {{ name: "DEVICE" count: 1 }} ] '
        f"priority: {priority} }} }} ]\n{ORT_THREADS_PARAMETER}"
    )


def bulk_load(url: str, model: str, concurrency: int, seconds: float) -> subprocess.Popen[bytes]:
    """perf_analyzer loading ``model`` for about ``seconds`` (three windows, whatever their spread)."""
    window_ms = int(seconds * 1000 / 3)
    return subprocess.Popen(
        [
            str(PERF_ANALYZER),
            "-m",
            model,
            "-u",
            url,
            "-i",
            "grpc",
            "--input-data",
            "zero",
            "--concurrency-range",
            f"{concurrency}:{concurrency}",
            "-p",
            str(window_ms),
            "--max-trials",
            "3",
            "--stability-percentage",
            "999",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def measure(url: str, window_ms: int, bulk_concurrency: int) -> dict[str, Any]:
    """urgent at concurrency 1 while both bulk models are loaded; the bulk models' rate over the same time."""
    seconds = (window_ms / 1000) * 14 + 15  # urgent's run fits inside: at most 10 windows, start-up and margin
    loads = [bulk_load(url, model, bulk_concurrency, seconds) for model in ("bulk_a", "bulk_b")]
    try:
        deadline = time.monotonic() + 60
        while min(requests_served(url, m) for m in ("bulk_a", "bulk_b")) < 2 * bulk_concurrency:
            if time.monotonic() > deadline:
                raise RuntimeError("the bulk load did not start within 60 s")
            time.sleep(0.1)
        before = {m: requests_served(url, m) for m in ("bulk_a", "bulk_b")}
        started = time.monotonic()
        urgent = perf_analyzer(url, "urgent", 1, window_ms, stability_percent=STABILITY)
        spent = time.monotonic() - started
        bulk = sum(requests_served(url, m) - before[m] for m in before) / spent
    finally:
        for load in loads:
            load.wait(timeout=seconds + 120)
    return {**{f"urgent_{k}": v for k, v in urgent.items()}, "bulk_throughput": bulk}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-ms", type=int, default=2000)
    parser.add_argument("--bulk-concurrency", type=int, default=8)
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        for name, priority in PRIORITIES.items():
            write_mlp(repo, name, WIDTH, LAYERS, group(priority), max_batch_size=32)
        with shoal_server(repo) as (url, _):
            alone = perf_analyzer(url, "urgent", 1, args.window_ms, stability_percent=STABILITY)
            rows.append({"case": "urgent alone", **{f"urgent_{k}": v for k, v in alone.items()}, "bulk_throughput": 0})
            rows.append(
                {
                    "case": "beside the bulk load, --rate-limit off",
                    **measure(url, args.window_ms, args.bulk_concurrency),
                }
            )
        with shoal_server(repo, "--rate-limit", "execution_count", "--rate-limit-resource", "DEVICE:1:0") as (url, _):
            rows.append(
                {
                    "case": "beside the bulk load, --rate-limit execution_count",
                    **measure(url, args.window_ms, args.bulk_concurrency),
                }
            )
    print(
        f"MLP {LAYERS} x {WIDTH}x{WIDTH} FP32 x 3 models, 2 ORT threads each; urgent at concurrency 1, "
        f"bulk_a and bulk_b at {args.bulk_concurrency} each"
    )
    print(f"{'case':<52} {'urgent/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'bulk/s':>7}")
    for row in rows:
        print(
            f"{row['case']:<52} {row['urgent_throughput']:>9.1f} {row['urgent_p50_us'] / 1000:>7.2f} "
            f"{row['urgent_p99_us'] / 1000:>7.2f} {row['bulk_throughput']:>7.1f}"
        )
    save_results(rows, "rate_limiter.csv")


if __name__ == "__main__":
    main()
