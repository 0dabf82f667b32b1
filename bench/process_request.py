"""What one request costs a process instance: sequential ``run`` calls on one worker, in-process.

    python bench/process_request.py [--requests 2000] [--sizes 64 65536 4194304] [--label after]

A TorchScript ``x * 2`` over FP32 ``[-1]`` (no weights to speak of, so the figures are the
instance's own cost: moving the tensors to the worker and back, and the pipe round trip), served
by one ``ProcessModel`` built as the server builds it (``share_weights``, then a worker process
that attaches). No gRPC, no scheduler: ``run`` is called back to back from one thread. For each
input size (bytes, the output is as big): wall µs per request (median and mean), and CPU µs per
request in this process (``time.process_time``, every thread) and in the worker (utime + stime
from /proc, 10 ms ticks). Prints a table and
writes bench/results/process_request[_<label>].csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import cpu_seconds, save_results  # noqa: E402
from shoal.backends.base import backend_for  # noqa: E402
from shoal.backends.devices import CPU  # noqa: E402
from shoal.instances.process import ProcessModel, WorkerLimits  # noqa: E402
from shoal.repository.config import normalize, parse_config, to_spec  # noqa: E402

CONFIG = """
name: "double"
backend: "pytorch"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "process_instances" value: { string_value: "true" } }
"""


def _instance(folder: Path) -> tuple[ProcessModel, Any]:
    import torch

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

    model_path = folder / "model.pt"
    torch.jit.script(Double()).save(str(model_path))  # type: ignore[no-untyped-call]
    spec = to_spec(normalize(parse_config(CONFIG), "double"))
    backend = backend_for(spec)
    parent = backend.load(spec, model_path, CPU, 1)
    handle = backend.share_weights(parent)
    limits = WorkerLimits(execution_timeout_s=0.0, liveness_interval_s=0.0)
    return ProcessModel(spec, model_path, CPU, handle, 1, limits, backend.worker_preload), parent


def measure(instance: ProcessModel, nbytes: int, requests: int) -> dict[str, float]:
    x = np.arange(nbytes // 4, dtype=np.float32)
    for _ in range(min(50, requests)):  # warm up: first-touch pages, torch's first call
        instance.run({"x": x}, ["y"])
    assert instance.pid is not None
    worker_before, own_before = cpu_seconds(instance.pid), time.process_time()
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        y = instance.run({"x": x}, ["y"])["y"]
        times.append(time.perf_counter() - start)
    own, worker = time.process_time() - own_before, cpu_seconds(instance.pid) - worker_before
    np.testing.assert_array_equal(y, x * 2)
    return {
        "bytes": nbytes,
        "requests": requests,
        "p50_us": 1e6 * statistics.median(times),
        "mean_us": 1e6 * statistics.fmean(times),
        "server_cpu_us": 1e6 * own / requests,
        "worker_cpu_us": 1e6 * worker / requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 65536, 4 << 20])
    parser.add_argument("--label", default="", help="suffix of the CSV name, e.g. before / after")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        instance, parent = _instance(Path(folder))
        try:
            # big tensors take longer: a tenth of the requests above 64 KiB
            rows = [
                measure(instance, nbytes, args.requests if nbytes <= 65536 else max(20, args.requests // 10))
                for nbytes in args.sizes
            ]
        finally:
            instance.close()
            parent.close()
    print("process instance, sequential run() calls (x * 2, FP32, input = output bytes)")
    print(f"  {'bytes':>9} {'requests':>8} {'p50 µs':>9} {'mean µs':>9} {'server CPU µs':>14} {'worker CPU µs':>14}")
    for row in rows:
        print(
            f"  {row['bytes']:>9} {row['requests']:>8} {row['p50_us']:>9.1f} {row['mean_us']:>9.1f} "
            f"{row['server_cpu_us']:>14.1f} {row['worker_cpu_us']:>14.1f}"
        )
    save_results(rows, f"process_request{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
