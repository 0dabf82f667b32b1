"""shoal-load's HTTP connections (``ConnectionPool``) against a scripted loopback server: every answer is
counted for the request it answers, a stale keep-alive connection costs no error, a late answer never
reaches the next request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from shoal.clients.loadtest.http import ConnectionPool, HttpRequest, infer_request

Handler = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def request() -> HttpRequest:
    return infer_request("m", "", {"IN": np.arange(4, dtype=np.float32)})


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One whole request (headers and Content-Length body); b'' when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return head + await reader.readexactly(length)


def answer(status: int = 200, body: bytes = b"{}", close: bool = False) -> bytes:
    extra = "Connection: close\r\n" if close else ""
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def serve(handler: Handler, client: Callable[[str], Awaitable[None]]) -> list[bytes]:
    """Run ``client(url)`` against a loopback server whose n-th connection runs ``handler(n, ...)``;
    returns every request the server read."""
    seen: list[bytes] = []
    connections = 0

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1

        async def reading() -> bytes:
            data = await read_request(reader)
            if data:
                seen.append(data)
            return data

        reader.read_request = reading  # type: ignore[attr-defined]
        try:
            await handler(connections, reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await asyncio.wait_for(client(f"127.0.0.1:{port}"), 30)
    finally:
        server.close()
    return seen


def test_requests_reuse_one_keep_alive_connection_and_carry_the_prebuilt_bytes() -> None:
    async def handler(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read_request():  # type: ignore[attr-defined]
            writer.write(answer(body=b"x" * 100_000))  # an answer larger than one read
            await writer.drain()

    results: list[str | None] = []
    connections: list[int] = []

    async def client(url: str) -> None:
        pool = ConnectionPool(url, request())
        for _ in range(5):
            results.append(await pool.send(5))
        connections.append(len(pool._open))
        await pool.close()

    seen = asyncio.run(serve(handler, client))
    assert results == [None] * 5
    assert connections == [1]
    expected = request().wire("127.0.0.1:" + seen[0].split(b"Host: 127.0.0.1:")[1].split(b"\r\n")[0].decode())
    assert seen == [expected] * 5
    assert expected.endswith(request().body) and b"Inference-Header-Content-Length" in expected


def test_a_keep_alive_connection_the_server_closed_while_idle_is_replaced_without_an_error() -> None:
    async def handler(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.read_request():  # type: ignore[attr-defined]
            writer.write(answer())  # keep-alive answer, then the server closes (its idle timeout)
            await writer.drain()

    results: list[str | None] = []

    async def client(url: str) -> None:
        pool = ConnectionPool(url, request())
        for _ in range(3):
            results.append(await pool.send(5))
        await pool.close()

    seen = asyncio.run(serve(handler, client))
    assert results == [None, None, None]
    assert len(seen) == 3  # each request reached the server once


def test_an_answer_cut_short_is_a_connection_error_and_not_sent_again() -> None:
    async def handler(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.read_request():  # type: ignore[attr-defined]
            writer.write(answer(body=b"0123456789")[:-4])  # the server dies mid-answer
            await writer.drain()

    results: list[str | None] = []

    async def client(url: str) -> None:
        pool = ConnectionPool(url, request())
        results.append(await pool.send(5))
        await pool.close()

    seen = asyncio.run(serve(handler, client))
    assert results == ["CONNECTION_ERROR"]
    assert len(seen) == 1


def test_a_late_answer_never_answers_the_next_request() -> None:
    """A request that timed out leaves its connection: the late 503 must not be read as the next answer."""
    timed_out = asyncio.Event()

    async def handler(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read_request():  # type: ignore[attr-defined]
            if n == 1:
                await timed_out.wait()  # answer only once the client gave up on this request
                writer.write(answer(503))
            else:
                writer.write(answer(200))
            await writer.drain()

    results: list[str | None] = []

    async def client(url: str) -> None:
        pool = ConnectionPool(url, request())
        results.append(await pool.send(0.2))
        timed_out.set()
        results.append(await pool.send(5))
        await pool.close()

    asyncio.run(serve(handler, client))
    assert results == ["DEADLINE_EXCEEDED", None]


def test_statuses_and_connection_close_answers() -> None:
    async def handler(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read_request():  # type: ignore[attr-defined]
            writer.write(answer(400 if n == 1 else 200, close=n == 1))
            await writer.drain()
            if n == 1:
                return

    results: list[str | None] = []

    async def client(url: str) -> None:
        pool = ConnectionPool(url, request())
        results.append(await pool.send(5))
        results.append(await pool.send(5))
        results.append(await pool.send(5))
        await pool.close()

    seen = asyncio.run(serve(handler, client))
    assert results == ["HTTP_400", None, None]
    assert len(seen) == 3


def test_a_refused_connection_is_a_connection_error() -> None:
    async def client() -> str | None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return await ConnectionPool(f"http://127.0.0.1:{port}/", request()).send(5)

    assert asyncio.run(client()) == "CONNECTION_ERROR"


def test_a_url_path_prefix_is_kept() -> None:
    assert request().wire("h:1", "/proxy").startswith(b"POST /proxy/v2/models/m/infer HTTP/1.1\r\nHost: h:1\r\n")
