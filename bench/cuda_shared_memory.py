"""CUDA shared memory on a GPU host, in one run: correctness, then latency against host memory.

    python bench/cuda_shared_memory.py [--elements 1048576] [--requests 200] [--workers 0 2]

A TorchScript model on GPU 0 (y = 2x + 1, FP32, no batching) served by Shoal, once per --workers
value. The client allocates its input and output with torch on cuda:0 and registers them as CUDA
regions through their IPC handles (``untyped_storage()._share_cuda_()``: no cuda-python needed).
1. Check: the output region holds 2x + 1 after one request; a region registered larger than its
   allocation is refused (INVALID_ARGUMENT); status lists both regions with their device.
2. Latency, --requests back to back at concurrency 1, a tensor that starts and ends on the GPU:
   - cuda_shared_memory: write x into the input region (device copy), infer with both tensors in
     regions, wait for nothing else (the output is on the device when the reply comes);
   - host: x to the host, sent inline over gRPC, the output read back and moved to the GPU.
Prints p50 and throughput per path and the ratio; exits 1 if a check fails, 0 with a note when
there is no CUDA device (nothing to run).
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shoal.tools import local_server  # noqa: E402

CHANNEL_ARGS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
CONFIG = """
backend: "pytorch"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]
"""


def write_repository(folder: Path, torch: Any) -> Path:
    class AffineTwice(torch.nn.Module):  # type: ignore[misc]  # torch is imported lazily, as Any
        def forward(self, x: Any) -> Any:
            return x * 2 + 1

    model = folder / "repo" / "affine"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    torch.jit.script(AffineTwice()).save(str(model / "1" / "model.pt"))
    return folder / "repo"


def raw_handle(tensor: Any) -> bytes:
    """The base64 cudaIpcMemHandle_t of ``tensor``'s allocation, as tritonclient's helper returns it.
    CUDA regions have no offset, so the tensor must start its allocation."""
    _, handle, _, offset, *_ = tensor.untyped_storage()._share_cuda_()
    if offset != 0:
        raise RuntimeError(f"the tensor starts {offset} bytes into its allocation; allocate it first")
    return base64.b64encode(handle)


def p50_and_rate(call: Callable[[], None], requests: int) -> dict[str, float]:
    call()  # warm
    latencies = []
    started = time.perf_counter()
    for _ in range(requests):
        begin = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - begin)
    return {"p50_us": statistics.median(latencies) * 1e6, "infer_per_s": requests / (time.perf_counter() - started)}


def run(url: str, torch: Any, elements: int, requests: int) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The checks (failures as text) and the latency figures against one server."""
    problems: list[str] = []
    device = torch.device("cuda:0")
    # At least 2 MiB each, so torch's caching allocator gives each tensor an allocation of its own
    # (a region starts at its allocation); the regions use their first ``elements``.
    allocated = max(elements, 1 << 19)
    x_region, y_region, spare = (
        torch.empty(allocated, dtype=torch.float32, device=device)[:elements] for _ in range(3)
    )
    source = torch.linspace(-1, 1, elements, dtype=torch.float32, device=device)
    byte_size = elements * 4
    client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
    client.register_cuda_shared_memory("x", raw_handle(x_region), 0, byte_size)
    client.register_cuda_shared_memory("y", raw_handle(y_region), 0, byte_size)
    try:
        client.register_cuda_shared_memory("too_big", raw_handle(spare), 0, max(1 << 30, allocated * 8))
        problems.append("a region larger than its allocation was accepted")
    except InferenceServerException as exc:
        if exc.status() != "StatusCode.INVALID_ARGUMENT":
            problems.append(f"a region larger than its allocation: {exc}")
    status = client.get_cuda_shared_memory_status(as_json=True).get("regions", {})
    if set(status) != {"x", "y"}:
        problems.append(f"status lists {sorted(status)}, not x and y")
    tensor = grpcclient.InferInput("x", [elements], "FP32")
    tensor.set_shared_memory("x", byte_size)
    output = grpcclient.InferRequestedOutput("y")
    output.set_shared_memory("y", byte_size)

    def through_cuda_regions() -> None:
        x_region.copy_(source)
        torch.cuda.synchronize(device)  # the server reads the region from another process
        client.infer("affine", [tensor], outputs=[output])

    through_cuda_regions()
    if not torch.allclose(y_region, source * 2 + 1):
        problems.append("the output region does not hold 2x + 1")
    inline = grpcclient.InferInput("x", [elements], "FP32")

    def through_host() -> None:
        inline.set_data_from_numpy(source.cpu().numpy())
        result = torch.tensor(client.infer("affine", [inline]).as_numpy("y"), device=device)
        assert result.shape == (elements,)

    figures = {
        "cuda_shared_memory": p50_and_rate(through_cuda_regions, requests),
        "host": p50_and_rate(through_host, requests),
    }
    client.unregister_cuda_shared_memory()
    client.close()
    return problems, figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 20, help="FP32 elements per tensor (default 4 MiB)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="Shoal --grpc-workers values")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (CUDA shared memory needs a GPU)")
        return 0
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = write_repository(Path(folder), torch)
        for workers in args.workers:
            with local_server.running(repo, "--grpc-workers", str(workers), timeout_s=600) as server:
                found, figures = run(server.url, torch, args.elements, args.requests)
            problems += [f"workers {workers}: {problem}" for problem in found]
            for path, figure in figures.items():
                print(
                    f"workers {workers} {args.elements * 4 / 2**20:.1f} MiB {path:18s} "
                    f"p50 {figure['p50_us']:9.0f} µs {figure['infer_per_s']:8.1f}/s"
                )
            ratio = figures["cuda_shared_memory"]["infer_per_s"] / figures["host"]["infer_per_s"]
            print(f"workers {workers} CUDA shared memory / host path throughput: {ratio:.2f}x")
    for problem in problems:
        print(f"FAILED: {problem}")
    print("CUDA shared memory check:", "FAILED" if problems else "passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
