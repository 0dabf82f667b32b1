"""The GPU check, as ONE script for a session lent a GPU machine (PyTorch backend; no ORT GPU there).

    python bench/gpu_check.py               # on the GPU
    python bench/gpu_check.py --device cpu  # rehearsal on the CPU (KIND_CPU, no nvidia-smi figures)

1. Device memory of a ~400 MB TorchScript model: thread instances count 1 vs 4 and process
   instances count 1 vs 4 — the weight bytes Shoal reports (ModelStatistics memory_usage) and
   what nvidia-smi sees for the server and its workers.
2. Stream overlap: throughput of a small model with 1 vs 4 thread instances (each executor
   thread has its own CUDA stream), shoal-load at concurrency 16.
3. CUDA IPC: process instances (weights handed over as CUDA IPC handles) return the same
   outputs as thread instances.
Prints every figure; exits 1 if a check fails, or if the driver reports a GPU that torch cannot
use (a CPU-only torch on a GPU host); 0 with a note when the driver reports no CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import shoal_load  # noqa: E402
from bench._server import shoal_server  # noqa: E402
from bench.torch_memory import save_model, tree_pids  # noqa: E402
from shoal.backends.devices import cuda_device_count  # noqa: E402
from shoal.clients import InferenceClient  # noqa: E402
from shoal.tools import nvidia_smi  # noqa: E402


def cuda_problem(torch_devices: int, driver_devices: int, torch_version: str) -> str | None:
    """Why the check cannot run on a host whose driver sees GPUs, or None (no GPU at all is no problem)."""
    if driver_devices > 0 and torch_devices == 0:
        return (
            f"the driver reports {driver_devices} CUDA device(s) but torch {torch_version} sees none: "
            "install a CUDA build of torch (or check CUDA_VISIBLE_DEVICES)"
        )
    return None


def write_config(repo: Path, name: str, width: int, count: int, kind: str, processes: bool) -> None:
    (repo / name / "config.pbtxt").write_text(
        f'backend: "pytorch"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        f'output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        f"instance_group [ {{ count: {count} kind: {kind} }} ]\n"
        f'parameters {{ key: "process_instances" value: {{ string_value: "{str(processes).lower()}" }} }}\n'
    )


def serve_variant(folder: Path, model: Path, width: int, count: int, kind: str, processes: bool) -> dict[str, Any]:
    repo = folder / f"repo-{count}-{processes}-{width}"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.pt").hardlink_to(model)
    write_config(repo, "m", width, count, kind, processes)
    x = np.linspace(-1, 1, 4 * width, dtype=np.float32).reshape(4, width)
    with shoal_server(repo, timeout_s=600) as (url, pid):
        with InferenceClient(url, timeout_s=600) as client:
            outputs = [client.infer("m", {"INPUT__0": x})["OUTPUT__0"] for _ in range(2 * count)]
            usage = client.statistics("m")[0].get("memory_usage", [])
        return {
            "outputs": outputs[0],
            "weights_mb": sum(int(u["byte_size"]) for u in usage) / 2**20,
            "nvidia_smi_mb": nvidia_smi.used_mb(tree_pids(pid)),
            "url": url,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--width", type=int, default=3200)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    import torch

    if args.device == "cuda":
        problem = cuda_problem(
            torch.cuda.device_count() if torch.cuda.is_available() else 0, cuda_device_count(), torch.__version__
        )
        if problem is not None:
            print(f"FAIL: {problem}")
            return 1
        if cuda_device_count() == 0:
            print("no CUDA device: nothing to check (use --device cpu to rehearse)")
            return 0
    kind = "KIND_GPU" if args.device == "cuda" else "KIND_CPU"
    failures = []
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        big = folder / "big.pt"
        save_model(big, args.width, args.layers)
        print(f"1. memory, {args.layers} x {args.width}x{args.width} TorchScript on {args.device}")
        results = {}
        for processes in (False, True):
            for count in (1, 4):
                label = f"{'process' if processes else 'thread'} instances, count {count}"
                results[label] = serve_variant(folder, big, args.width, count, kind, processes)
                r = results[label]
                print(
                    f"   {label:<28} weights reported {r['weights_mb']:>8.1f} MB   nvidia-smi {r['nvidia_smi_mb']} MB"
                )
        reference = results["thread instances, count 1"]["outputs"]
        for label, r in results.items():
            if not np.allclose(r["outputs"], reference, rtol=1e-4, atol=1e-5):
                failures.append(f"{label} returned different outputs (CUDA IPC / sharing broken?)")
        print("3. process instances return the thread instances' outputs:", not failures)
        small = folder / "small.pt"
        save_model(small, 256, 4)
        print("2. stream overlap, 4 x 256x256 at shoal-load concurrency 16:")
        rates = {}
        for count in (1, 4):
            repo = folder / f"small-{count}"
            (repo / "m" / "1").mkdir(parents=True)
            (repo / "m" / "1" / "model.pt").hardlink_to(small)
            write_config(repo, "m", 256, count, kind, False)
            with shoal_server(repo, timeout_s=600) as (url, _):
                rates[count] = shoal_load(url, "m", 16)
            print(f"   count {count}: {rates[count]:.0f} infer/s")
        print(f"   4 instances / 1 instance: {rates[4] / rates[1]:.2f}")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
