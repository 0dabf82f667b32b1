"""Host and front-end worker CPU per request with one worker (issue 24, item 2: decode once).

    python bench/worker_wire.py [--seconds 4] [--concurrency 16] [--workers 1] [--label after]

Models: tiny (model_repository/simple, add/sub INT32 [1,16], dynamic batching, 200 µs delay) and bytes (the identity
backend, BYTES [1,64] of 8 to 40 bytes each, so the lengths differ, same batching). Each model is driven in turn by
one client process (tritonclient.grpc.aio, ``--concurrency`` calls in flight on one channel) for ``--seconds`` after
a second of warm-up. CPU per request: utime + stime (/proc) of the host and of the worker over the window, divided
by the requests the server's ModelStatistics counted. Prints one markdown row per model.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_simple  # noqa: E402
from bench._perf import cpu_split, requests_served, tree_cpu_seconds  # noqa: E402
from bench._server import shoal_server  # noqa: E402

BATCHING = "\ndynamic_batching { max_queue_delay_microseconds: 200 }\n"
BYTES_CONFIG = (
    """name: "bytes"
backend: "identity"
max_batch_size: 32
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 64 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 64 ] } ]
"""
    + BATCHING
)


def _inputs(model: str) -> list[object]:
    import tritonclient.grpc.aio as grpcclient

    if model == "tiny":
        inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for item in inputs:
            item.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        return inputs
    item = grpcclient.InferInput("INPUT0", [1, 64], "BYTES")
    item.set_data_from_numpy(np.array([[b"x" * (8 + i % 33) for i in range(64)]], dtype=object))
    return [item]


def _drive(url: str, model: str, concurrency: int, seconds: float) -> None:
    import tritonclient.grpc.aio as grpcclient

    async def main() -> None:
        client = grpcclient.InferenceServerClient(url)
        inputs = _inputs(model)
        stop = time.monotonic() + seconds

        async def caller() -> None:
            while time.monotonic() < stop:
                await client.infer(model, inputs)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        await client.close()

    asyncio.run(main())


def measure(url: str, pid: int, model: str, concurrency: int, seconds: float) -> dict[str, float]:
    client = multiprocessing.get_context("spawn").Process(target=_drive, args=(url, model, concurrency, seconds + 1))
    client.start()
    time.sleep(1.0)
    served_before, cpu_before = requests_served(url, model), tree_cpu_seconds(pid)
    began = time.monotonic()
    time.sleep(seconds)
    cpu_after, served_after = tree_cpu_seconds(pid), requests_served(url, model)
    elapsed = time.monotonic() - began
    client.join()
    host_s, workers_s = cpu_split(cpu_before, cpu_after, pid)
    served = max(1, served_after - served_before)
    return {"per_s": served / elapsed, "host_us": 1e6 * host_s / served, "worker_us": 1e6 * workers_s / served}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        write_simple(repo, "tiny", BATCHING)
        (repo / "bytes" / "1").mkdir(parents=True)
        (repo / "bytes" / "config.pbtxt").write_text(BYTES_CONFIG)
        with shoal_server(repo, "--grpc-workers", str(args.workers)) as (url, pid):
            print("| label | model | requests/s | host µs/request | worker µs/request |")
            print("|---|---|---|---|---|")
            for model in ("tiny", "bytes"):
                row = measure(url, pid, model, args.concurrency, args.seconds)
                figures = f"{row['per_s']:,.0f} | {row['host_us']:.0f} | {row['worker_us']:.0f}"
                print(f"| {args.label} | {model} | {figures} |", flush=True)


if __name__ == "__main__":
    main()
