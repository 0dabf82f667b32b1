"""What the server's own Python costs a request, without any transport (issue 24's unmet goals).

    python bench/host_request_cost.py [--requests 20000] [--concurrency 1 16] [--rounds 2] [--label NAME]

The gRPC servicer's ``ModelInfer`` called in-process, on uvloop as the server runs it: the request
decoded from its wire bytes, ``LocalCore.infer`` (the model's version, its checks, the dynamic
batcher, the instance), the response built and serialized; no HTTP/2 engine, no socket. ``N``
coroutines (the concurrency) each send requests back to back. Models: bench/side_by_side.py's
``tiny`` (ONNX, max_batch_size 32, 200 µs queue delay, 2 ORT threads) and bench/python_backend.py's
Python model on a thread instance and on a process instance. Per model and concurrency:
requests/s and the CPU the event loop's thread used per request (``time.thread_time``: what
serializes at c=16 in a server, whose loop holds the GIL for it); the ONNX Runtime threads and an
instance's thread or worker process are not in it. What a real server adds (pygrpc-native's
HTTP/2 thread, its hand-over to the loop, the client's wake-ups) is what bench/thread_cpu.py
measures beside this. Prints a markdown table (medians over rounds); writes
bench/results/host_request_cost[_<label>].csv.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_tiny  # noqa: E402
from bench._perf import save_results  # noqa: E402
from bench.python_backend import MODEL as PYTHON_MODEL  # noqa: E402
from bench.python_backend import write_repository as write_python_model  # noqa: E402
from shoal.core.local import LocalCore  # noqa: E402
from shoal.grpc.servicer import InferenceServicer  # noqa: E402
from shoal.lifecycle.manager import ModelManager  # noqa: E402
from shoal.protocol import service_pb2 as pb  # noqa: E402
from shoal.settings import TraceConfig  # noqa: E402
from shoal.tracing.tracer import Tracer  # noqa: E402

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }\n'
WARM_UP = 400


class NoContext:
    """What ``ModelInfer`` reads of a gRPC context when nothing is traced."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def add_done_callback(self, callback: Any) -> None:
        pass


def request_bytes(model: str) -> bytes:
    """A request as the wire carries it, zero inputs (perf_analyzer's default)."""
    request = pb.ModelInferRequest(model_name=model)
    if model == "tiny":
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            request.raw_input_contents.append(np.zeros(16, np.int32).tobytes())
    else:
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 256])
        request.raw_input_contents.append(np.zeros(256, np.float32).tobytes())
    encoded: bytes = request.SerializeToString()
    return encoded


def write_models(root: Path) -> dict[str, tuple[Path, str]]:
    """Each case: (its repository, the model a request names)."""
    cases = {"tiny (ONNX)": (root / "onnx", "tiny")}
    write_tiny(root / "onnx")
    for case, folder, extra in (
        ("Python model, thread instance", "thread", THREADS),
        ("Python model, process instance", "process", ""),
    ):
        (root / folder).mkdir()
        write_python_model(root / folder, extra)
        cases[case] = (root / folder, PYTHON_MODEL)
    return cases


async def measure(repository: Path, model: str, requests: int, concurrency: int) -> dict[str, float]:
    manager = ModelManager(repository, control_mode="none")
    await manager.start()
    try:
        servicer = InferenceServicer(LocalCore(manager, tracer=Tracer(TraceConfig())))
        payload, context = request_bytes(model), NoContext()

        async def client(count: int) -> None:
            for _ in range(count):
                answer = await servicer.ModelInfer(pb.ModelInferRequest.FromString(payload), context)
                answer.SerializeToString()

        await asyncio.gather(*(client(WARM_UP // concurrency) for _ in range(concurrency)))
        each = max(1, requests // concurrency)
        wall, cpu = time.perf_counter(), time.thread_time()
        await asyncio.gather(*(client(each) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        done = each * concurrency
        return {"throughput": done / wall, "loop_cpu_us_per_request": 1e6 * cpu / done}
    finally:
        await manager.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    import uvloop

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        cases = write_models(Path(folder))
        for round_ in range(args.rounds):
            for case, (repository, model) in cases.items():
                for concurrency in args.concurrency:
                    figures = uvloop.run(measure(repository, model, args.requests, concurrency))
                    rows.append({"case": case, "concurrency": concurrency, "round": round_, **figures})
                    print(
                        f"round {round_} {case} c={concurrency}: {figures['throughput']:.0f}/s, "
                        f"{figures['loop_cpu_us_per_request']:.1f} µs of the loop's CPU per request"
                    )
    print(f"\nMedians of {args.rounds} round(s).")
    print("| model | c | requests/s | loop thread CPU per request (µs) |\n|---|---|---|---|")
    for case in cases:
        for concurrency in args.concurrency:
            mine = [row for row in rows if row["case"] == case and row["concurrency"] == concurrency]
            throughput = statistics.median(row["throughput"] for row in mine)
            cpu = statistics.median(row["loop_cpu_us_per_request"] for row in mine)
            print(f"| {case} | {concurrency} | {throughput:,.0f} | {cpu:.1f} |")
    save_results(rows, f"host_request_cost{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
