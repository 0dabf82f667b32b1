"""The sequence batcher's two strategies under 64 concurrent sequences, in one run.

    python bench/sequence_batching.py [--sequences 64] [--steps 50] [--workers 0] [--label after]

The ONNX accumulator of the tests (control inputs START/READY/CORRID, its running sum kept as implicit
state by the server; tests/sequence_models.py), served by Shoal on a free loopback port as two models:
``direct`` (``direct { }``) and ``oldest`` (``oldest { max_candidate_sequences: 32
max_queue_delay_microseconds: 500 }``), each with ``max_batch_size: 32`` and two CPU instances, so every
sequence has a slot (64). For each model, --sequences client coroutines (tritonclient.grpc.aio, 8
channels) each run one sequence of --steps requests, each sent once the previous one was answered (as
perf_analyzer's sequence mode does); every answer is checked against the sequence's running sum. Prints
throughput (requests/s over the whole run), p50/p99 latency and the mean rows per execution from the
server's statistics; writes bench/results/sequence_batching[_<label>].csv.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as aioclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from shoal.tools import local_server  # noqa: E402
from tests.sequence_models import add_accumulator  # noqa: E402

CHANNELS = 8
MODELS = {
    "direct": "direct { }",
    "oldest": "oldest { max_candidate_sequences: 32 max_queue_delay_microseconds: 500 }",
}


async def one_sequence(client: aioclient.InferenceServerClient, model: str, cid: int, steps: int) -> list[float]:
    latencies = []
    total = 0.0
    for step in range(steps):
        value = float(cid % 7 + step)
        data = aioclient.InferInput("INPUT", [1, 1], "FP32")
        data.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        began = time.perf_counter()
        result = await client.infer(
            model, [data], sequence_id=cid, sequence_start=step == 0, sequence_end=step == steps - 1
        )
        latencies.append(time.perf_counter() - began)
        total += value
        got = float(result.as_numpy("OUTPUT").item())
        if got != total or int(result.as_numpy("CORRID_OUT").item()) != cid:
            raise AssertionError(f"sequence {cid} step {step}: got {got}, expected {total}")
    return latencies


async def measure(url: str, model: str, sequences: int, steps: int) -> dict[str, Any]:
    clients = [aioclient.InferenceServerClient(url) for _ in range(CHANNELS)]
    try:
        began = time.perf_counter()
        runs = await asyncio.gather(
            *(one_sequence(clients[cid % CHANNELS], model, cid, steps) for cid in range(1, sequences + 1))
        )
        elapsed = time.perf_counter() - began
        stats = (await clients[0].get_inference_statistics(model, as_json=True))["model_stats"][0]
    finally:
        for client in clients:
            await client.close()
    latencies = sorted(latency for run in runs for latency in run)
    executions = int(stats["execution_count"])
    return {
        "strategy": model,
        "sequences": sequences,
        "steps": steps,
        "requests": len(latencies),
        "throughput_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2),
        "rows_per_execution": round(int(stats["inference_count"]) / executions, 2) if executions else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=0, help="--grpc-workers of the server")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        for name, strategy in MODELS.items():
            add_accumulator(repo, name, strategy, max_batch_size=32, instances=2)
        extra = ("--grpc-workers", str(args.workers)) if args.workers else ()
        with local_server.running(repo, *extra, timeout_s=120) as server:
            for name in MODELS:
                row = asyncio.run(measure(server.url, name, args.sequences, args.steps))
                rows.append(row)
                print(
                    f"{name:7s} {row['requests']} requests: {row['throughput_per_s']:8.1f}/s  "
                    f"p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  "
                    f"{row['rows_per_execution']:5.2f} requests per execution"
                )
    save_results(rows, f"sequence_batching{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
