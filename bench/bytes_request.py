"""What one large BYTES request costs the server: peak memory, time, and how long health calls wait.

    python bench/bytes_request.py [--elements 1000000 20000000] [--lengths 0]

Starts Shoal with an identity model of one BYTES input (no batching, dims [-1]) and sends one
request of ``elements`` strings whose lengths cycle through ``lengths``, while another process calls
ServerLive in a loop. Reports the request's answer (OK or the refusal), its latency, the longest ServerLive
latency while it ran, and the server's peak RSS (VmHWM) before and after. Writes
bench/results/bytes_request.csv.
"""

from __future__ import annotations

import argparse
import multiprocessing
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from bench._server import shoal_server  # noqa: E402
from shoal.protocol import InferenceStub, service_pb2  # noqa: E402

CONFIG = """backend: "identity"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
LIMIT = 2**31 - 1


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def poll_live(url: str, done: Any, latencies: Any) -> None:
    """ServerLive in a loop until ``done``; in its own process, so the client's work never delays it."""
    worst = 0.0
    with grpc.insecure_channel(url) as channel:
        stub = InferenceStub(channel)
        while not done.is_set():
            start = time.perf_counter()
            try:
                stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60)
            except grpc.RpcError:  # counted as the time it waited
                pass
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.005)
    latencies.put(worst)


def one_request(url: str, pid: int, elements: int, lengths: list[int]) -> dict[str, Any]:
    """One request of ``elements`` strings, with ServerLive polled from another process meanwhile."""
    item = b"".join(struct.pack("<I", length) + b"x" * length for length in lengths)
    request = service_pb2.ModelInferRequest(model_name="strings")
    request.inputs.add(name="IN", datatype="BYTES", shape=[elements // len(lengths) * len(lengths)])
    request.raw_input_contents.append(item * (elements // len(lengths)))
    options = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]
    context = multiprocessing.get_context("spawn")
    done, latencies = context.Event(), context.Queue()
    poller = context.Process(target=poll_live, args=(url, done, latencies))
    rss_before = peak_rss_mb(pid)
    poller.start()
    with grpc.insecure_channel(url, options=options) as channel:
        stub = InferenceStub(channel)
        stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60)
        time.sleep(1.0)  # the poller is up
        start = time.perf_counter()
        try:
            stub.ModelInfer(request, timeout=600)
            answer = "OK"
        except grpc.RpcError as exc:
            answer = f"{exc.code().name}: {exc.details()[:60]}"
        latency_s = time.perf_counter() - start
    done.set()
    worst_live_s = latencies.get(timeout=120)
    poller.join()
    return {
        "elements": elements,
        "lengths": "/".join(map(str, lengths)),
        "wire_mb": round(len(request.raw_input_contents[0]) / 2**20, 1),
        "answer": answer,
        "latency_s": round(latency_s, 2),
        "max_live_ms": round(worst_live_s * 1000, 1),
        "peak_rss_mb_before": round(rss_before),
        "peak_rss_mb_after": round(peak_rss_mb(pid)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[1_000_000, 20_000_000])
    parser.add_argument("--lengths", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    rows = []
    for elements in args.elements:
        with tempfile.TemporaryDirectory() as folder:
            model = Path(folder) / "strings"
            (model / "1").mkdir(parents=True)
            (model / "config.pbtxt").write_text(CONFIG)
            with shoal_server(Path(folder)) as (url, pid):
                rows.append(one_request(url, pid, elements, args.lengths))
        print(rows[-1], flush=True)
    save_results(rows, "bytes_request.csv")


if __name__ == "__main__":
    main()
