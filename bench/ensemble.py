"""An ensemble of two models versus the same two calls made by the client, in one run.

    python bench/ensemble.py [--concurrency 1 16] [--seconds 5] [--workers 0]

Shoal serves model_repository/ (mlp_scale: UINT8 [256] to FP32, then the 4 x 256x256 MLP) on a free
loopback port. For each concurrency, that many client threads (tritonclient.grpc, one connection
each) send batch-1 requests back to back for --seconds, one path after the other:
- ensemble: one call to mlp_pipeline (the server runs mlp_scale, then mlp, the FP32 tensor between
  them staying in its memory);
- client: a call to mlp_scale, the FP32 result decoded, sent back in a call to mlp.
Both give the same output (checked once). Prints throughput, p50 and p99 per path and the
ensemble's throughput over the client's; writes bench/results/ensemble[_<label>].csv. Server CPU
per request comes from the server process tree's CPU time over each measurement.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import closed_loop, save_results  # noqa: E402
from bench._server import REPO_ROOT, shoal_server  # noqa: E402

RAW = np.random.default_rng(0).integers(0, 256, (1, 256), dtype=np.uint8)


def _raw_input() -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("RAW", [1, 256], "UINT8")
    tensor.set_data_from_numpy(RAW)
    return tensor


def ensemble_caller(url: str) -> tuple[Callable[[], np.ndarray], Callable[[], None]]:
    client = grpcclient.InferenceServerClient(url)
    raw = _raw_input()

    def call() -> np.ndarray:
        result: np.ndarray = client.infer("mlp_pipeline", [raw]).as_numpy("OUTPUT0")
        return result

    return call, client.close


def client_chain_caller(url: str) -> tuple[Callable[[], np.ndarray], Callable[[], None]]:
    client = grpcclient.InferenceServerClient(url)
    raw = _raw_input()
    scaled_input = grpcclient.InferInput("INPUT0", [1, 256], "FP32")

    def call() -> np.ndarray:
        scaled_input.set_data_from_numpy(client.infer("mlp_scale", [raw]).as_numpy("SCALED"))
        result: np.ndarray = client.infer("mlp", [scaled_input]).as_numpy("OUTPUT0")
        return result

    return call, client.close


def measure(
    make: Callable[[str], tuple[Callable[[], np.ndarray], Callable[[], None]]],
    url: str,
    pid: int,
    concurrency: int,
    seconds: float,
) -> dict[str, float]:
    """Back-to-back calls from ``concurrency`` threads for ``seconds``: throughput, p50, p99, server CPU."""
    return closed_loop([make(url) for _ in range(concurrency)], seconds, pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[0], help="Shoal --grpc-workers values")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for workers in args.workers:
        with shoal_server(REPO_ROOT / "model_repository", "--grpc-workers", str(workers)) as (url, pid):
            check_ensemble, close_ensemble = ensemble_caller(url)
            check_chain, close_chain = client_chain_caller(url)
            np.testing.assert_array_equal(check_ensemble(), check_chain())  # the same answer both ways
            close_ensemble()
            close_chain()
            for concurrency in args.concurrency:
                figures = {}
                for path, make in (("ensemble", ensemble_caller), ("client", client_chain_caller)):
                    figures[path] = measure(make, url, pid, concurrency, args.seconds)
                    rows.append({"workers": workers, "concurrency": concurrency, "path": path, **figures[path]})
                ratio = figures["ensemble"]["infer_per_s"] / figures["client"]["infer_per_s"]
                rows[-2]["throughput_vs_client"] = ratio
                for path, row in figures.items():
                    print(
                        f"workers {workers} c={concurrency:<3} {path:<9} {row['infer_per_s']:8.0f}/s "
                        f"p50 {row['p50_us']:8.0f} us  p99 {row['p99_us']:8.0f} us  "
                        f"server CPU {row['server_cpu_us_per_request']:6.0f} us/request",
                        flush=True,
                    )
                print(f"workers {workers} c={concurrency:<3} ensemble / client throughput: {ratio:.2f}", flush=True)
    save_results(rows, f"ensemble{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
