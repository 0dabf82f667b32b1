"""What one request costs the load generator itself: client CPU per request of shoal-load's senders.

    python bench/load_client_cost.py [--concurrency 1 4 16] [--seconds 3] [--rounds 2]

Starts Shoal on model_repository/ and drives the ``simple`` model from this process, one sender
after the other in each round (so a machine shared with other work disturbs them alike):
shoal-load's HTTP ``ConnectionPool``, aiohttp's client (what shoal-load used before; only when
aiohttp is importable: tritonclient[http] brings it), shoal-load's gRPC sender (the request as
prebuilt HTTP/2 frames, ``clients/shoal/clients/loadtest/grpc_h2.py``) and a grpc.aio unary call with the same
serialized request (what shoal-load's gRPC path used before). Prints requests/s and this process's
CPU per request (user + system), and writes bench/results/load_client_cost.csv. On a machine where
client and server share the cores, every microsecond here is taken from the server: that is why
shoal-load's clients are neither aiohttp nor grpc.aio.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from bench._server import REPO_ROOT  # noqa: E402
from shoal.clients import messages  # noqa: E402
from shoal.clients.loadtest.engine import INFER_PATH  # noqa: E402
from shoal.clients.loadtest.grpc_h2 import PrebuiltGrpcChannel  # noqa: E402
from shoal.clients.loadtest.http import ConnectionPool, HttpRequest, infer_request  # noqa: E402
from shoal.tools import local_server  # noqa: E402

Send = Callable[[], Awaitable[None]]
Maker = Callable[[], Awaitable[tuple[Send, Callable[[], Awaitable[None]]]]]  # a sender and its close
INPUTS = {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": np.zeros((1, 16), np.int32)}


async def drive(make: Maker, concurrency: int, seconds: float) -> int:
    """Closed loop: ``concurrency`` coroutines sending for ``seconds``; returns the requests answered."""
    send, close = await make()
    answered = 0
    end = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal answered
        while time.monotonic() < end:
            await send()
            answered += 1

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    await close()
    return answered


def pool_sender(url: str, request: HttpRequest) -> Maker:
    async def make() -> tuple[Send, Callable[[], Awaitable[None]]]:
        pool = ConnectionPool(url, request)

        async def send() -> None:
            error = await pool.send(10)
            if error:
                raise RuntimeError(error)

        return send, pool.close

    return make


def aiohttp_sender(url: str, request: HttpRequest) -> Maker:
    async def make() -> tuple[Send, Callable[[], Awaitable[None]]]:
        import aiohttp

        session = aiohttp.ClientSession(f"http://{url}", connector=aiohttp.TCPConnector(limit=0))

        async def send() -> None:
            async with session.post(request.path, data=request.body, headers=request.headers) as answer:
                await answer.read()
                if answer.status != 200:
                    raise RuntimeError(answer.status)

        return send, session.close

    return make


def grpc_aio_sender(url: str, body: bytes) -> Maker:
    import grpc

    async def make() -> tuple[Send, Callable[[], Awaitable[None]]]:
        channel = grpc.aio.insecure_channel(url)
        call = channel.unary_unary(INFER_PATH, request_serializer=None, response_deserializer=None)

        async def send() -> None:
            await call(body, timeout=10)

        return send, channel.close

    return make


def prebuilt_grpc_sender(url: str, body: bytes) -> Maker:
    async def make() -> tuple[Send, Callable[[], Awaitable[None]]]:
        channel = PrebuiltGrpcChannel(url, INFER_PATH, body)

        async def send() -> None:
            error = await channel.call(10)
            if error:
                raise RuntimeError(error)

        return send, channel.close

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    with local_server.running(REPO_ROOT / "model_repository") as server:
        request = infer_request("simple", "", INPUTS)
        senders = {"shoal-load http (ConnectionPool)": pool_sender(server.http_url, request)}
        try:
            import aiohttp  # noqa: F401

            senders["aiohttp client"] = aiohttp_sender(server.http_url, request)
        except ImportError:
            print("aiohttp is not installed: its row is left out")
        body = messages.infer_request("simple", INPUTS).SerializeToString()
        senders["shoal-load grpc (prebuilt HTTP/2)"] = prebuilt_grpc_sender(server.url, body)
        senders["grpc.aio client"] = grpc_aio_sender(server.url, body)
        print(f"{'sender':<34} {'conc':>4} {'round':>5} | {'requests/s':>10} | {'client CPU/request':>18}")
        for round_index in range(args.rounds):
            for concurrency in args.concurrency:
                for name, make in senders.items():
                    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                    answered = asyncio.run(drive(make, concurrency, args.seconds))
                    after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
                    cpu_us = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / answered * 1e6
                    print(
                        f"{name:<34} {concurrency:>4} {round_index + 1:>5} | {answered / elapsed:>10.0f} | "
                        f"{cpu_us:>15.0f} µs",
                        flush=True,
                    )
                    rows.append(
                        {
                            "sender": name,
                            "concurrency": concurrency,
                            "round": round_index + 1,
                            "requests_per_s": round(answered / elapsed, 1),
                            "client_cpu_us": round(cpu_us, 1),
                        }
                    )
    save_results(rows, "load_client_cost.csv")


if __name__ == "__main__":
    main()
