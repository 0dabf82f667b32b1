"""Does the dynamic batcher keep a sub-millisecond max_queue_delay? perf_analyzer at concurrency 1.

    python bench/batcher_clock.py [--delays-us 0 50 200 1000] [--rounds 3] [--window-ms 2000]

One server, one copy of `simple` (max_batch_size 32, one instance) per delay, each with
`dynamic_batching { max_queue_delay_microseconds: D }`. At concurrency 1 a request is always
alone, so it waits the whole delay before it runs: its latency is the delay-0 latency plus the
delay plus whatever the batcher's clock overshoots. Each round measures every delay in turn
(perf_analyzer over gRPC, zero inputs); per delay the table gives the median over the rounds of
p50, p99 and overshoot = p50(delay) - p50(0) - delay, each round's figure taken against that
round's own delay-0 p50 (the load on a shared machine drifts between rounds). The server's own
view, less noisy: its mean queue time per request (perf_analyzer's "Server Queue", from the
model's statistics) and queue(delay) - queue(0) - delay, paired the same way. Prints a table, writes
bench/results/batcher_clock.csv.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._server import REPO_ROOT, shoal_server  # noqa: E402

SIMPLE = REPO_ROOT / "model_repository" / "simple"


def write_models(repository: Path, delays_us: list[int]) -> None:
    """`simple_delay_<D>`: the `simple` ONNX model, max_batch_size 32, batching with delay D µs."""
    config = (SIMPLE / "config.pbtxt").read_text()
    for delay in delays_us:
        folder = repository / f"simple_delay_{delay}"
        (folder / "1").mkdir(parents=True)
        shutil.copy(SIMPLE / "1" / "model.onnx", folder / "1" / "model.onnx")
        text = config.replace('name: "simple"', f'name: "simple_delay_{delay}"')
        text = text.replace("max_batch_size: 8", "max_batch_size: 32")
        (folder / "config.pbtxt").write_text(f"{text}\ndynamic_batching {{ max_queue_delay_microseconds: {delay} }}\n")


def measure(url: str, model: str, window_ms: int, tries: int = 3) -> dict[str, float]:
    """perf_analyzer at concurrency 1; a shared machine can keep it from a stable window, so retry."""
    for attempt in range(1, tries + 1):
        try:
            return perf_analyzer(url, model, 1, window_ms)
        except subprocess.CalledProcessError:
            if attempt == tries:
                raise
            print(f"  {model}: no stable measurement, trying again", flush=True)
    raise AssertionError("unreachable")


def paired_median(
    runs: list[dict[str, float]], delay0: list[dict[str, float]], key: str, minus: int | None = None
) -> int:
    """Median over the rounds of ``key``; with ``minus``, of key - (that round's delay-0 key) - minus."""
    if minus is None:
        return round(statistics.median(run[key] for run in runs))
    return round(statistics.median(run[key] - base[key] - minus for run, base in zip(runs, delay0, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delays-us", type=int, nargs="+", default=[0, 50, 200, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-ms", type=int, default=2000)
    args = parser.parse_args()
    delays = sorted(set([0, *args.delays_us]))
    install_perf_analyzer()
    samples: dict[int, list[dict[str, float]]] = {delay: [] for delay in delays}
    with tempfile.TemporaryDirectory() as folder:
        write_models(Path(folder), delays)
        with shoal_server(Path(folder)) as (url, _):
            for round_index in range(args.rounds):
                order = delays if round_index % 2 == 0 else delays[::-1]  # no delay always goes first
                for delay in order:
                    result = measure(url, f"simple_delay_{delay}", args.window_ms)
                    samples[delay].append(result)
                    print(
                        f"round {round_index + 1} delay {delay:>5} µs: p50 {result['p50_us']:.0f} µs "
                        f"p99 {result['p99_us']:.0f} µs server queue {result['server_queue_us']:.0f} µs",
                        flush=True,
                    )
    rows: list[dict[str, Any]] = []
    for delay in delays:
        runs, base = samples[delay], samples[0]
        rows.append(
            {
                "delay_us": delay,
                "p50_us": paired_median(runs, base, "p50_us"),
                "p99_us": paired_median(runs, base, "p99_us"),
                "overshoot_us": paired_median(runs, base, "p50_us", minus=delay),
                "server_queue_us": paired_median(runs, base, "server_queue_us"),
                "queue_overshoot_us": paired_median(runs, base, "server_queue_us", minus=delay),
                "p50_per_round_us": " ".join(f"{s['p50_us']:.0f}" for s in runs),
            }
        )
    header = (
        f"{'delay µs':>8} | {'p50 µs':>7} {'p99 µs':>7} {'overshoot':>9} | "
        f"{'queue µs':>8} {'queue overshoot':>15} | p50 per round"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['delay_us']:>8} | {r['p50_us']:>7} {r['p99_us']:>7} {r['overshoot_us']:>9} | "
            f"{r['server_queue_us']:>8} {r['queue_overshoot_us']:>15} | "
            f"{r['p50_per_round_us']}"
        )
    save_results(rows, "batcher_clock.csv")


if __name__ == "__main__":
    main()
