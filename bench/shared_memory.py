"""4 MB tensors through system shared memory versus through gRPC, in one run.

    python bench/shared_memory.py [--concurrency 1 8] [--seconds 3] [--workers 0 2] [--label after]

An identity model (FP32, 1,048,576 elements = 4 MiB in and 4 MiB out, no batching) served by
Shoal on a free loopback port, once per --workers value. For each concurrency, that many client
threads (tritonclient.grpc, one connection each) send requests back to back for --seconds:
- grpc: the input as raw contents, the output read back with as_numpy;
- shared memory: each thread owns an input and an output region (tritonclient.utils.shared_memory);
  per request it writes the input into its region, infers with both tensors in regions, and reads
  the output from its region (a copy, as a client that keeps the result would).
Prints throughput and p50 per path, and shared memory's throughput over gRPC's; writes
bench/results/shared_memory[_<label>].csv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import closed_loop, save_results  # noqa: E402
from shoal.tools import local_server  # noqa: E402

ELEMENTS = 1 << 20
BYTE_SIZE = ELEMENTS * 4
# channel_args replace tritonclient's own, which lift grpc's 4 MiB message limit: lift it again.
CHANNEL_ARGS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
]
CONFIG = """
backend: "identity"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def write_repository(folder: Path) -> Path:
    model = folder / "repo" / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    return folder / "repo"


def grpc_caller(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
    data = np.random.default_rng(0).random(ELEMENTS, dtype=np.float32)
    tensor = grpcclient.InferInput("IN", [ELEMENTS], "FP32")

    def call() -> None:
        tensor.set_data_from_numpy(data)
        out = client.infer("echo", [tensor]).as_numpy("OUT")
        assert out is not None and out.shape == (ELEMENTS,)

    return call, client.close


def shm_caller(url: str) -> tuple[Callable[[], None], Callable[[], None]]:
    client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
    tag = uuid.uuid4().hex[:10]
    handles = {}
    for side in ("in", "out"):
        handles[side] = shm.create_shared_memory_region(f"{side}_{tag}", f"/shoal_bench_{side}_{tag}", BYTE_SIZE)
        client.register_system_shared_memory(f"{side}_{tag}", f"/shoal_bench_{side}_{tag}", BYTE_SIZE)
    data = np.random.default_rng(0).random(ELEMENTS, dtype=np.float32)
    tensor = grpcclient.InferInput("IN", [ELEMENTS], "FP32")
    tensor.set_shared_memory(f"in_{tag}", BYTE_SIZE)
    output = grpcclient.InferRequestedOutput("OUT")
    output.set_shared_memory(f"out_{tag}", BYTE_SIZE)

    def call() -> None:
        shm.set_shared_memory_region(handles["in"], [data])
        client.infer("echo", [tensor], outputs=[output])
        out = shm.get_contents_as_numpy(handles["out"], np.float32, [ELEMENTS]).copy()
        assert out.shape == (ELEMENTS,)

    def close() -> None:
        for side, handle in handles.items():
            client.unregister_system_shared_memory(f"{side}_{tag}")
            shm.destroy_shared_memory_region(handle)
        client.close()

    return call, close


def measure(
    make: Callable[[str], tuple[Callable[[], None], Callable[[], None]]], url: str, concurrency: int, seconds: float
) -> dict[str, float]:
    """Back-to-back calls from ``concurrency`` threads for ``seconds``: throughput and p50."""
    return closed_loop([make(url) for _ in range(concurrency)], seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="Shoal --grpc-workers values")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = write_repository(Path(folder))
        for workers in args.workers:
            with local_server.running(repo, "--grpc-workers", str(workers)) as server:
                for concurrency in args.concurrency:
                    figures = {
                        path: measure(make, server.url, concurrency, args.seconds)
                        for path, make in (("grpc", grpc_caller), ("shared_memory", shm_caller))
                    }
                    ratio = figures["shared_memory"]["infer_per_s"] / figures["grpc"]["infer_per_s"]
                    for path, figure in figures.items():
                        rows.append({"workers": workers, "concurrency": concurrency, "path": path, **figure})
                        print(
                            f"workers {workers} c={concurrency} {path:13s} {figure['infer_per_s']:8.1f}/s "
                            f"p50 {figure['p50_us']:9.0f} µs"
                        )
                    print(f"workers {workers} c={concurrency} shared memory / gRPC throughput: {ratio:.2f}x")
    save_results(rows, f"shared_memory{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
