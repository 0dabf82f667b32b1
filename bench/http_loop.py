"""What an HTTP inference costs the event loop's thread, without sockets or a client process.

    python bench/http_loop.py [--requests 6000] [--concurrency 16] [--rounds 3] [--before REV] [--label NAME]

The endpoint's own objects in one process: ``--concurrency`` connections (``http.connection.HttpConnection``
on a transport that keeps no socket), each sent perf_analyzer's request for ``tiny`` (add/sub, INT32
[1,16], max_batch_size 32, a 200 µs queue delay: bench/_models.py) again as soon as its answer is written,
against the real ``HttpApp``, ``LocalCore`` and ONNX Runtime instance on a uvloop loop. Per request: the
loop thread's CPU (``time.thread_time``: parsing, routing, the JSON and binary body, the core and the
batcher, the answer) and the wall time. Two cores: ``local`` (the model served) and ``stub`` (the core
answers at once with a response it made before: the HTTP layers alone). A third line times the pieces
alone: ``infer_body.infer_request`` and ``infer_response`` for that request, and reading its JSON
header and writing its answer's by ``json`` and by orjson.

A real server adds the socket's system calls (a read and a write per request, with the client's wake-up
on this virtual machine) and the other threads; bench/http_side_by_side.py measures that, beside Triton.
This measures the Python, which is what changes from revision to revision, with less noise.

Each measurement is a child process (so ``--before REV`` runs Shoal as it was at git revision REV,
``bench._server.checked_out_server``, beside this checkout); ``--rounds`` alternates them, and the
medians are printed with this checkout's ratios. Writes bench/results/http_loop[_<label>].csv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import timeit
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_tiny  # noqa: E402
from bench._perf import save_results  # noqa: E402
from bench._server import child_figures, revisions, rounds_of  # noqa: E402

SCRIPT = Path(__file__).resolve()
WARM_UP_REQUESTS = 1000
PIECE_CALLS = 20_000
PIECES = ("infer_request_us", "infer_response_us", "json_read_us", "orjson_read_us", "json_write_us", "orjson_write_us")


def tiny_request() -> tuple[bytes, bytes]:
    """perf_analyzer's HTTP request for tiny (its inputs as binary data, its outputs asked as binary),
    and its JSON header."""
    header = json.dumps(
        {
            "inputs": [
                {"name": name, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}
                for name in ("INPUT0", "INPUT1")
            ],
            "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in ("OUTPUT0", "OUTPUT1")],
        }
    ).encode()
    body = header + bytes(128)
    head = (
        "POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: */*\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body, header


class _Socketless:
    """A transport that keeps no socket: each answer written sends the connection's next request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: bytes, load: dict[str, Any]) -> None:
        self.loop, self.request, self.load = loop, request, load
        self.protocol: Any = None

    def write(self, data: bytes) -> None:
        if not data.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"an answer that is not 200: {data[:400]!r}")
        load = self.load
        load["answered"] += 1
        if load["sent"] < load["total"]:
            load["sent"] += 1
            self.loop.call_soon(self.protocol.data_received, self.request)
        elif load["answered"] == load["total"]:
            load["done"].set_result(None)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def _drive(core: Any, request: bytes, concurrency: int, total: int) -> dict[str, float]:
    """``total`` requests through ``concurrency`` connections; per-request loop CPU and wall time, µs."""
    from shoal.http.app import HttpApp
    from shoal.http.connection import ConnectionGuard, HttpConnection
    from shoal.settings import HttpSettings

    loop = asyncio.get_running_loop()
    app = HttpApp(core, 64 * 2**20)
    guard = ConnectionGuard(HttpSettings(), 4096)
    load: dict[str, Any] = {"sent": 0, "answered": 0, "total": total, "done": loop.create_future()}
    connections = []
    for _ in range(concurrency):
        connection = HttpConnection(app, guard)
        transport = _Socketless(loop, request, load)
        transport.protocol = connection
        connection.connection_made(transport)  # type: ignore[arg-type]
        connections.append(connection)
    wall, cpu = time.perf_counter(), time.thread_time()
    for connection in connections[:total]:
        load["sent"] += 1
        connection.data_received(request)
    await load["done"]
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    for connection in connections:
        connection.connection_lost(None)
    return {"loop_cpu_us": cpu / total * 1e6, "wall_us": wall / total * 1e6}


def measure_here(core_kind: str, concurrency: int, total: int) -> dict[str, float]:
    """In a child: the endpoint of whichever ``shoal`` this process imports."""
    import uvloop

    from shoal.core.local import LocalCore
    from shoal.http import infer_body
    from shoal.lifecycle.manager import ModelManager

    request, header = tiny_request()

    async def run() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as folder:
            write_tiny(Path(folder))
            manager = ModelManager(Path(folder))
            await manager.start(())
            try:
                core = LocalCore(manager)
                if core_kind == "stub":
                    inference, _ = infer_body.infer_request("tiny", "", header, memoryview(bytes(128)))
                    answer = await core.infer(inference)

                    async def at_once(request: Any, origin: Any = None) -> Any:
                        return answer

                    core.infer = at_once  # type: ignore[method-assign]
                await _drive(core, request, concurrency, WARM_UP_REQUESTS)
                return await _drive(core, request, concurrency, total)
            finally:
                await manager.close()

    return uvloop.run(run())


def pieces_here() -> dict[str, float]:
    """In a child: µs per call of the body's conversions and of each JSON library alone."""
    import numpy as np
    import orjson

    from shoal.http import infer_body
    from shoal.protocol.types import DataType
    from shoal.request_types import InferResponse, Tensor

    _, header = tiny_request()
    binary = memoryview(bytes(128))
    inference, binary_outputs = infer_body.infer_request("tiny", "", header, binary)
    zeros = np.zeros((1, 16), np.int32)
    outputs = tuple(Tensor(name, DataType.INT32, (1, 16), zeros) for name in ("OUTPUT0", "OUTPUT1"))
    response = InferResponse(model_name="tiny", model_version="1", id="", outputs=outputs)
    body, header_length = infer_body.infer_response(response, binary_outputs)
    answer = json.loads(body[:header_length])
    compact = json.JSONEncoder(separators=(",", ":"))

    def per_call(function: Any) -> float:
        return timeit.timeit(function, number=PIECE_CALLS) / PIECE_CALLS * 1e6

    return {
        "infer_request_us": per_call(lambda: infer_body.infer_request("tiny", "", header, binary)),
        "infer_response_us": per_call(lambda: infer_body.infer_response(response, binary_outputs)),
        "json_read_us": per_call(lambda: json.loads(header.decode(json.detect_encoding(header)))),
        "orjson_read_us": per_call(lambda: orjson.loads(header)),
        "json_write_us": per_call(lambda: compact.encode(answer).encode()),
        "orjson_write_us": per_call(lambda: orjson.dumps(answer)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000, help="requests measured per child")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default="", help="a git revision measured beside this checkout")
    parser.add_argument("--label", default="")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--pieces-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_here(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    if args.pieces_child:
        print(json.dumps(pieces_here()))
        return
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        sides = revisions(stack, args.before)
        for round_number, name, python_path in rounds_of(sides, args.rounds):
            for core_kind in ("local", "stub"):
                figures = child_figures(
                    SCRIPT, ["--child", core_kind, str(args.concurrency), str(args.requests)], python_path
                )
                rows.append({"round": round_number, "shoal": name, "core": core_kind} | figures)
                print(
                    f"round {round_number} {name} core {core_kind}: loop CPU {figures['loop_cpu_us']:.1f} µs, "
                    f"wall {figures['wall_us']:.1f} µs per request",
                    flush=True,
                )
            pieces = child_figures(SCRIPT, ["--pieces-child"], python_path)
            rows.append({"round": round_number, "shoal": name, "core": "pieces"} | pieces)
    print(f"\nMedians of {args.rounds} round(s), µs per request (c={args.concurrency}).")
    print("| shoal | core | loop thread CPU | wall |")
    print("|---|---|---|---|")
    medians: dict[tuple[str, str], float] = {}
    for name, _ in sides:
        for core_kind in ("local", "stub"):
            mine = [row for row in rows if row["shoal"] == name and row["core"] == core_kind]
            medians[name, core_kind] = statistics.median(row["loop_cpu_us"] for row in mine)
            wall = statistics.median(row["wall_us"] for row in mine)
            print(f"| {name} | {core_kind} | {medians[name, core_kind]:.1f} | {wall:.1f} |")
    print("\n| shoal | infer_request | infer_response | json read | orjson read | json write | orjson write |")
    print("|---|---|---|---|---|---|---|")
    for name, _ in sides:
        mine = [row for row in rows if row["shoal"] == name and row["core"] == "pieces"]
        print(f"| {name} | " + " | ".join(f"{statistics.median(row[k] for row in mine):.2f}" for k in PIECES) + " |")
    if args.before:
        for core_kind in ("local", "stub"):
            ratio = medians["this checkout", core_kind] / medians[args.before, core_kind]
            print(f"core {core_kind}: loop thread CPU per request {ratio:.2f}x of {args.before}")
    save_results(rows, f"http_loop{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
