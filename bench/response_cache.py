"""The response cache's hit path against a miss, on Shoal and on Triton 2.51: one model with and without it.

    python bench/response_cache.py [--window-ms 2000]

Two copies of one FP32 MLP (4 × 1024×1024, two ONNX Runtime threads): 'cached' sets
`response_cache { enable: true }`, 'plain' does not; the server runs with `--cache-config
local,size=16777216`. perf_analyzer sends zero inputs, so after its first request every one of
'cached' is a hit, and every one of 'plain' executes. Rows: each model at concurrency 1 and 8 over gRPC
(inferences/s, p50, p99), and the server's own figures from the statistics: the mean cache lookup of a
hit and the mean lookup + insertion of a miss, in µs. The same on the real Triton
(../shared/tools/triton_peer/, whose Python backend runs the same ONNX file with onnxruntime, with
`--cache-config local,size=16777216` added to its start), after Shoal's, on the same cores.
Writes bench/results/response_cache.csv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import ORT_THREADS, ORT_THREADS_PARAMETER, write_mlp  # noqa: E402
from bench._perf import install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._server import shoal_server  # noqa: E402
from bench._triton import triton_server, write_onnx_model  # noqa: E402

WIDTH, LAYERS = 1024, 4
CACHE_BYTES = 16 << 20
ONE_INSTANCE = "instance_group [ { count: 1 kind: KIND_CPU } ]"
GROUP = f"{ONE_INSTANCE}\n{ORT_THREADS_PARAMETER}"
CACHE = "response_cache { enable: true }"
MLP_IO = (
    f'max_batch_size: 32\ninput [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
    f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]'
)


def mean_us(url: str, model: str, field: str) -> float:
    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    entry = stats.get(field, {})
    count = int(entry.get("count", 0))
    return int(entry.get("ns", 0)) / count / 1000 if count else 0.0


def measure(server: str, url: str, window_ms: int) -> list[dict[str, Any]]:
    rows = []
    for concurrency in (1, 8):
        for model in ("plain", "cached"):
            figures = perf_analyzer(url, model, concurrency, window_ms)
            rows.append({"server": server, "model": model, "concurrency": concurrency, **figures})
    hit_us, miss_us = mean_us(url, "cached", "cache_hit"), mean_us(url, "cached", "cache_miss")
    for row in rows:
        row.update(hit_lookup_us=hit_us, miss_lookup_insert_us=miss_us)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-ms", type=int, default=2000)
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    cache_flag = f"local,size={CACHE_BYTES}"
    with tempfile.TemporaryDirectory() as folder:
        repo, triton_repo = Path(folder) / "shoal", Path(folder) / "triton"
        write_mlp(repo, "cached", WIDTH, LAYERS, f"{GROUP}\n{CACHE}\n", max_batch_size=32)
        write_mlp(repo, "plain", WIDTH, LAYERS, GROUP, max_batch_size=32)
        with shoal_server(repo, "--cache-config", cache_flag) as (url, _):
            rows += measure("shoal", url, args.window_ms)
        for name, extra in (("cached", CACHE), ("plain", "")):
            write_onnx_model(
                triton_repo, name, repo / name / "1" / "model.onnx", MLP_IO, f"{ONE_INSTANCE}\n{extra}", ORT_THREADS
            )
        with triton_server(
            triton_repo, log_path=Path(folder) / "triton.log", extra_args=("--cache-config", cache_flag)
        ) as triton:
            rows += measure("triton", triton.url, args.window_ms)
    print(
        f"MLP {LAYERS} x {WIDTH}x{WIDTH} FP32, 2 ORT threads; gRPC, zero input (every 'cached' request after "
        "the first is a hit)"
    )
    print(f"{'server':<7} {'model':<7} {'c':>3} {'infer/s':>9} {'p50 ms':>7} {'p99 ms':>7}")
    for row in rows:
        print(
            f"{row['server']:<7} {row['model']:<7} {row['concurrency']:>3} {row['throughput']:>9.1f} "
            f"{row['p50_us'] / 1000:>7.2f} {row['p99_us'] / 1000:>7.2f}"
        )
    for server in ("shoal", "triton"):
        for concurrency in (1, 8):
            plain, cached = (
                next(r for r in rows if (r["server"], r["model"], r["concurrency"]) == (server, m, concurrency))
                for m in ("plain", "cached")
            )
            print(
                f"{server} c={concurrency}: hits give {cached['throughput'] / plain['throughput']:.1f}x the "
                f"throughput of executions, at {cached['p50_us'] / plain['p50_us']:.2f}x the p50"
            )
        first = next(r for r in rows if r["server"] == server)
        print(
            f"{server} server side: a hit's lookup {first['hit_lookup_us']:.1f} us, a miss's lookup + insertion "
            f"{first['miss_lookup_insert_us']:.1f} us"
        )
    for concurrency in (1, 8):
        ours, theirs = (
            next(r for r in rows if (r["server"], r["model"], r["concurrency"]) == (server, "cached", concurrency))
            for server in ("shoal", "triton")
        )
        print(f"hits at c={concurrency}: Shoal / Triton {ours['throughput'] / theirs['throughput']:.2f}x")
    save_results(rows, "response_cache.csv")


if __name__ == "__main__":
    main()
