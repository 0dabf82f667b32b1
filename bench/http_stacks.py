"""Per-request cost of candidate HTTP stacks for Shoal's HTTP endpoint, measured here.

    python bench/http_stacks.py [--seconds 3 --concurrency 1,16 --repeats 3]

Each stack serves one route in a subprocess on a free loopback port, the way Shoal would run it
(inside an asyncio loop the process already has, on a socket it bound itself): ``POST
/v2/models/m/infer`` with a small KServe v2 JSON body, parsed with ``json.loads`` and answered
with ``json.dumps``, so the figure is the stack's cost plus the same small JSON work. The client
is a raw asyncio HTTP/1.1 keep-alive client in another process (one connection per concurrent
request, next request as soon as the answer is read), light enough that the server process is
the bottleneck. Bounded in time per run. Each cell is run ``--repeats`` times, stacks taking
turns, and the median kept (the machine is shared). Prints requests/s and the server process's
CPU time per request (user + system, from /proc), the figure that decides; writes
bench/results/http_stacks.csv.

Candidates (each must run in an existing loop on a given socket, which SO_REUSEPORT needs):
``shoal``, Shoal's own HTTP/1.1 protocol (``shoal.http.connection``: httptools, no ASGI) under an
application that answers the route directly; ``aiohttp`` (web.Application behind AppRunner/SockSite)
and ``uvicorn`` with ``httptools`` and a raw ASGI app (``uvicorn.Server.startup(sockets=...)``),
which served Shoal's HTTP until session 43. Every stack runs on the event loop Shoal would take
(``--event-loop``, default ``auto``: uvloop where it imports). ``--stacks ...,granian`` adds granian's
embedded server (``granian.server.embed.Server``, an RSGI app; the bench extra installs it): HTTP in
Rust on a runtime thread of its own, each request handed to the process's asyncio loop. It binds its
own socket, so it fails the second condition, and is measured for its cost only (it takes the port
the harness bound and released).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from shoal import event_loops  # noqa: E402

BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}]})
REQUEST = (
    f"POST /v2/models/m/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(BODY)}\r\n\r\n{BODY}"
).encode()


def _answer(body: bytes) -> bytes:
    request = json.loads(body)
    tensor = request["inputs"][0]
    output = {"name": "OUTPUT0", "datatype": tensor["datatype"], "shape": tensor["shape"], "data": tensor["data"]}
    return json.dumps({"model_name": "m", "model_version": "1", "outputs": [output]}).encode()


async def _serve_aiohttp(sock: socket.socket) -> None:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        return web.Response(body=_answer(await request.read()), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    await asyncio.Event().wait()


async def _serve_uvicorn(sock: socket.socket) -> None:
    import uvicorn

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = _answer(body)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    config = uvicorn.Config(
        app,
        http="httptools",
        ws="none",
        lifespan="off",
        interface="asgi3",
        access_log=False,
        log_level="warning",
        proxy_headers=False,
    )  # as server/shoal/http/server.py
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # what Server.serve sets up before startup
    await server.startup(sockets=[sock])
    await asyncio.Event().wait()


async def _serve_shoal(sock: socket.socket) -> None:
    from shoal.http.app import Answer
    from shoal.http.connection import ConnectionGuard, HttpConnection
    from shoal.settings import HttpSettings

    class App:
        """What HttpConnection asks of shoal.http.app.HttpApp, answering the route here."""

        max_body_bytes = 64 << 20

        async def respond(self, method: str, path: str, headers: dict[str, str], body: bytes, started: int) -> Answer:
            return Answer(200, "application/json", (), _answer(body))

        def sent(self, answer: Answer, sent_ns: int) -> None:
            pass

    app, guard = App(), ConnectionGuard(HttpSettings(), 4096)
    await asyncio.get_running_loop().create_server(
        lambda: HttpConnection(app, guard),  # type: ignore[arg-type]
        sock=sock,
    )
    await asyncio.Event().wait()


async def _serve_granian(sock: socket.socket) -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    async def app(scope: Any, protocol: Any) -> None:
        answer = _answer(await protocol())
        protocol.response_bytes(200, [("content-type", "application/json")], answer)

    port = sock.getsockname()[1]
    sock.close()  # granian binds its own socket
    server = Server(
        app,
        address="127.0.0.1",
        port=port,
        interface=Interfaces.RSGI,
        http=HTTPModes.http1,
        websockets=False,
        log_enabled=False,
    )
    await server.serve()


STACKS = {"shoal": _serve_shoal, "aiohttp": _serve_aiohttp, "uvicorn": _serve_uvicorn, "granian": _serve_granian}


def serve(stack: str, port_file: Path, loop: str) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port_file.write_text(str(sock.getsockname()[1]))
    event_loops.run(STACKS[stack](sock), event_loops.resolve(loop))


async def _client(port: int, stop_at: list[float], counts: list[int], request: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at[0]:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            counts[0] += 1
    finally:
        writer.close()


async def load(port: int, concurrency: int, seconds: float, request: bytes = REQUEST) -> int:
    """Requests answered in ``seconds`` after a half-second warm-up."""
    counts = [0]
    warm = [time.monotonic() + 0.5]
    await asyncio.gather(*(_client(port, warm, counts, request) for _ in range(concurrency)))
    counts[0] = 0
    stop_at = [time.monotonic() + seconds]
    await asyncio.gather(*(_client(port, stop_at, counts, request) for _ in range(concurrency)))
    return counts[0]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in ticks


def _wait_listening(port: int, deadline: float) -> None:
    """Until the server accepts connections (granian binds its port after the harness wrote it)."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port}") from None
            time.sleep(0.05)


def measure(stack: str, concurrency: int, seconds: float, work: Path, loop: str = "auto") -> dict[str, Any]:
    port_file = work / f"{stack}.port"
    port_file.unlink(missing_ok=True)
    process = subprocess.Popen([sys.executable, __file__, "--serve", stack, str(port_file), loop])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{stack} did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        _wait_listening(port, deadline)
        cpu_before = _cpu_seconds(process.pid)
        started = time.monotonic()
        done = asyncio.run(load(port, concurrency, seconds))
        elapsed = time.monotonic() - started - 0.5  # the warm-up half second
        cpu = _cpu_seconds(process.pid) - cpu_before
    finally:
        process.kill()
        process.wait()
    return {
        "stack": stack,
        "concurrency": concurrency,
        "requests_per_s": round(done / seconds),
        "server_cpu_us_per_request": round(cpu / max(1, done) * 1e6, 1),
        "seconds": round(elapsed, 1),
    }


def measure_shoal(seconds: float, repeats: int) -> list[dict[str, Any]]:
    """On Shoal itself (one process, the example ``simple`` model, c=16): the HTTP layer's floor
    (GET /v2/health/ready) beside a binary infer, in server CPU per request (every thread of it)."""
    import tempfile

    import numpy as np

    from shoal.tools import local_server
    from tests import models

    raw = np.arange(16, dtype=np.int32).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {"name": name, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}
                for name in ("INPUT0", "INPUT1")
            ]
        }
    )
    body = header.encode() + raw + raw
    requests = {
        "shoal ready": b"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "shoal infer": (
            f"POST /v2/models/simple/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body,
    }
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in requests}
    with (
        tempfile.TemporaryDirectory() as folder,
        local_server.running(models.repository(Path(folder), "simple")) as server,
    ):
        for _ in range(repeats):
            for name, request in requests.items():
                before = _cpu_seconds(server.pid)
                done = asyncio.run(load(server.http_port, 16, seconds, request))
                runs[name].append((done, _cpu_seconds(server.pid) - before))
    return [
        {
            "stack": name,
            "concurrency": 16,
            "requests_per_s": round(statistics.median(d for d, _ in done) / seconds),
            "server_cpu_us_per_request": round(statistics.median(c / max(1, d) for d, c in done) * 1e6, 1),
            "seconds": seconds,
            "repeats": repeats,
        }
        for name, done in runs.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", nargs=3, metavar=("STACK", "PORT_FILE", "LOOP"), help=argparse.SUPPRESS)
    parser.add_argument("--event-loop", choices=event_loops.CHOICES, default="auto")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--stacks", default="shoal,uvicorn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--shoal",
        action="store_true",
        help="also measure Shoal's own HTTP endpoint: the floor "
        "(GET /v2/health/ready) beside a binary infer of the example simple model, c=16",
    )
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], Path(args.serve[1]), args.serve[2])
        return
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {stack: [] for stack in args.stacks.split(",")}
            for _ in range(args.repeats):
                for stack, done in runs.items():
                    done.append(measure(stack, concurrency, args.seconds, Path(folder), args.event_loop))
            for stack, done in runs.items():
                row = {**done[0], "repeats": len(done)}
                for key in ("requests_per_s", "server_cpu_us_per_request"):
                    row[key] = statistics.median(run[key] for run in done)
                print(
                    f"{stack:8} c={concurrency:<3} {row['requests_per_s']:>7} req/s "
                    f"{row['server_cpu_us_per_request']:>7} µs server CPU per request (median of {len(done)})"
                )
                rows.append(row)
    if args.shoal:
        for row in measure_shoal(args.seconds, args.repeats):
            print(
                f"{row['stack']:12} c=16  {row['requests_per_s']:>7} req/s "
                f"{row['server_cpu_us_per_request']:>7} µs server CPU per request (median of {args.repeats})"
            )
            rows.append(row)
    save_results(rows, "http_stacks.csv")


if __name__ == "__main__":
    main()
