"""Throughput of an FP32 MLP (4 × 1024×1024) under perf_analyzer, with and without dynamic batching.

    python bench/throughput.py [--concurrency 1 2 4 8 16] [--window-ms 2000]

One run, one server, these model configurations of the same ONNX file:
  plain    count 1, no dynamic batching
  two      count 2, no dynamic batching
  batched  count 1, dynamic_batching { }  (delay 0: what is queued goes when the instance frees)
Prints, per concurrency, inferences/s and p50/p99 for plain and batched as a fraction of
in-process ONNX Runtime (one session, the same number of calling threads, batch 1);
requests of batch 8 (`-b 8`) against in-process batch 8; and the experiment users ask about:
10 concurrent clients against 1 instance, 2 instances and dynamic batching.
Writes bench/results/throughput.csv and throughput.png (matplotlib, the bench extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_mlp  # noqa: E402
from bench._perf import RESULTS, in_process, install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._server import shoal_server  # noqa: E402
from shoal.clients.loadtest.plot import pyplot  # noqa: E402

WIDTH, LAYERS = 1024, 4
CONFIGS = {
    "plain": "instance_group [ { count: 1 kind: KIND_CPU } ]",
    "two": "instance_group [ { count: 2 kind: KIND_CPU } ]",
    "batched": "instance_group [ { count: 1 kind: KIND_CPU } ]\ndynamic_batching { }",
}


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    c = [r["concurrency"] for r in rows]
    for key, label, style in (
        ("plain", "count 1", "o-"),
        ("batched", "count 1 + dynamic batching", "s-"),
        ("ort", "ONNX Runtime in-process", "^--"),
    ):
        left.plot(c, [r[f"{key}_throughput"] for r in rows], style, label=label)
        right.plot(c, [r[f"{key}_p99_us"] / 1000 for r in rows], style, label=f"{label} p99")
    left.set(xscale="log", xlabel="concurrency", ylabel="inferences / s", title="MLP 4×1024², batch 1")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="p99 latency (ms)", title="latency")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--window-ms", type=int, default=2000)
    args = parser.parse_args()
    install_perf_analyzer()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        model_file = None
        for name, extra in CONFIGS.items():
            if model_file is not None:
                (repo / name / "1").mkdir(parents=True)
                (repo / name / "1" / "model.onnx").symlink_to(model_file)
            write_mlp(repo, name, WIDTH, LAYERS, extra, max_batch_size=32)
            model_file = (repo / name / "1" / "model.onnx").resolve()
        rows: list[dict[str, Any]] = []
        with shoal_server(repo) as (url, _):
            for concurrency in args.concurrency:
                row: dict[str, Any] = {"concurrency": concurrency}
                for name in ("plain", "batched"):
                    result = perf_analyzer(url, name, concurrency, args.window_ms)
                    row.update({f"{name}_{k}": v for k, v in result.items()})
                rows.append(row)
            batch8 = {name: perf_analyzer(url, name, 16, args.window_ms, batch=8) for name in ("plain", "batched")}
            ten = {name: perf_analyzer(url, name, 10, args.window_ms) for name in CONFIGS}
        assert model_file is not None
        # In-process runs after the server stopped, so they never share the cores with it.
        cores = os.cpu_count() or 1
        one = {"INPUT0": np.zeros((1, WIDTH), np.float32)}
        for row in rows:
            result = in_process(model_file, one, row["concurrency"], args.window_ms / 1000, threads=cores)
            row.update({f"ort_{k}": v for k, v in result.items()})
        ort8 = in_process(
            model_file,
            {"INPUT0": np.zeros((8, WIDTH), np.float32)},
            2,
            args.window_ms / 1000,
            threads=max(1, cores // 2),
        )

    print(f"MLP {LAYERS} x {WIDTH}x{WIDTH} FP32, batch 1; ratio = Shoal / in-process ONNX Runtime")
    print(
        f"{'conc':>4} | {'plain/s':>8} {'p50ms':>6} {'p99ms':>6} {'ratio':>5} | {'batched/s':>9} {'p50ms':>6} "
        f"{'p99ms':>6} {'ratio':>5} | {'ORT/s':>7}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>4} | {r['plain_throughput']:>8.0f} {r['plain_p50_us'] / 1000:>6.2f} "
            f"{r['plain_p99_us'] / 1000:>6.2f} {r['plain_throughput'] / r['ort_throughput']:>5.2f} | "
            f"{r['batched_throughput']:>9.0f} {r['batched_p50_us'] / 1000:>6.2f} "
            f"{r['batched_p99_us'] / 1000:>6.2f} {r['batched_throughput'] / r['ort_throughput']:>5.2f} | "
            f"{r['ort_throughput']:>7.0f}"
        )
    print(f"\n-b 8 at concurrency 16 (samples/s): in-process batch 8 = {ort8['throughput']:.0f}")
    for name, result in batch8.items():
        print(
            f"  {name:<8} {result['throughput']:>7.0f}  ratio {result['throughput'] / ort8['throughput']:.2f}  "
            f"p99 {result['p99_us'] / 1000:.1f} ms"
        )
    print("\n10 concurrent clients, batch 1:")
    print(f"  {'configuration':<28} {'infer/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'queue µs':>9} {'infer µs':>9}")
    labels = {"plain": "1 instance", "two": "2 instances", "batched": "1 instance + dynamic batching"}
    for name, result in ten.items():
        print(
            f"  {labels[name]:<28} {result['throughput']:>8.0f} {result['p50_us'] / 1000:>7.2f} "
            f"{result['p99_us'] / 1000:>7.2f} {result['server_queue_us']:>9.0f} {result['server_infer_us']:>9.0f}"
        )
    save_results(rows, "throughput.csv")
    if plot(rows, RESULTS / "throughput.png"):
        print(f"wrote {RESULTS / 'throughput.png'}")


if __name__ == "__main__":
    main()
