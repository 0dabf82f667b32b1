"""Descriptors and memory a client without credentials could exhaust (issue 22, item 5).

HTTP bounds the time to send a request's head and body, idle keep-alive connections and the number of
open connections; the server raises its soft descriptor limit to the hard one; a registered shared-
memory region holds no descriptor, and their number is bounded; failed accepts are logged once per
interval. Each test failed before its fix. The servers run in both process layouts; waits are polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import resource
import select
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from shoal.dataplane.regions import OPEN_SEGMENTS, RegionRegistry
from shoal.descriptors import ACCEPT_FAILED, AcceptFailureLog
from shoal.errors import ShoalError
from shoal.http import server as server_module
from shoal.http.app import HttpApp
from shoal.protocol import InferenceStub, service_pb2
from shoal.settings import HttpSettings
from tests import models
from tests.conftest import RunningServer
from tests.grpc_api.test_transport_abuse import children
from tests.http_api.test_http_errors import call
from tests.polling import wait_until

CLOSE_TIMEOUT_S = 30.0  # the test-shortened timeouts are 1-3 s; this is how long a close may take to be seen
LIVE = b"GET /v2/health/live HTTP/1.1\r\nhost: shoal\r\n\r\n"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    models.add_identity(folder, "identity_fp32", "FP32")
    return folder


def connect(server: RunningServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=CLOSE_TIMEOUT_S)


def read_until_closed(sock: socket.socket, timeout_s: float = CLOSE_TIMEOUT_S) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open after ``timeout_s``."""
    received, deadline = b"", time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the server did not close the connection within {timeout_s} s; it sent {received!r}")


def read_answer(sock: socket.socket) -> bytes:
    """One answer on a kept-alive connection (the tests' answers are small: one read of the head and body)."""
    sock.settimeout(CLOSE_TIMEOUT_S)
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {answer!r}"
        answer += chunk
    return answer


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def refusal(answer: bytes, status: int) -> str:
    """The message of a refusal with ``status``: Triton's error body, and the connection closed."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer
    assert b"connection: close" in head.lower() and b"content-type: application/json" in head.lower(), answer
    document = json.loads(body)
    assert list(document) == ["error"], document
    return str(document["error"])


def grpc_live(server: RunningServer) -> bool:
    with grpc.insecure_channel(server.url) as channel:
        return bool(InferenceStub(channel).ServerLive(service_pb2.ServerLiveRequest(), timeout=30).live)


def test_partial_headers_are_closed_within_the_header_timeout(repo: Path, server_factory) -> None:
    server = server_factory(repo, "--http-header-timeout-secs", "1")
    with contextlib.ExitStack() as sockets:
        partial, silent = (sockets.enter_context(connect(server)) for _ in range(2))
        partial.sendall(b"POST /v2/repository/index HTTP/1.1\r\nhost: shoal\r\ncontent-le")
        assert "--http-header-timeout-secs" in refusal(read_until_closed(partial), 408)
        assert read_until_closed(silent) == b""  # nothing sent: closed without an answer
        kept = sockets.enter_context(connect(server))
        kept.sendall(LIVE)
        assert read_answer(kept).startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /v2/health/live HTTP/1.1\r\n")  # the next request on a kept-alive connection stalls
        assert "--http-header-timeout-secs" in refusal(read_until_closed(kept), 408)
    assert call(server, "GET", "/v2/health/live")[0] == 200


def _body_head(length: int) -> bytes:
    return (
        b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nhost: shoal\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(length).encode() + b"\r\n\r\n"
    )


def test_a_stalled_or_trickling_body_is_closed(repo: Path, server_factory) -> None:
    server = server_factory(repo, "--http-body-idle-timeout-secs", "1", "--http-body-timeout-secs", "3")
    with contextlib.ExitStack() as sockets:
        stalled, trickling = (sockets.enter_context(connect(server)) for _ in range(2))
        stalled.sendall(_body_head(1000) + b'{"inputs"')
        trickling.sendall(_body_head(10**6))
        deadline, received = time.monotonic() + CLOSE_TIMEOUT_S, b""
        while time.monotonic() < deadline:  # a byte every 0.2 s: never idle for 1 s, never done within 3 s
            try:
                trickling.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([trickling], [], [], 0.2)[0]:
                received = read_until_closed(trickling)
                break
        assert "--http-body-timeout-secs" in refusal(received, 408)
        assert "--http-body-idle-timeout-secs" in refusal(read_until_closed(stalled), 408)
    assert call(server, "GET", "/v2/health/live")[0] == 200


def test_an_idle_keep_alive_connection_is_closed(repo: Path, server_factory) -> None:
    server = server_factory(repo, "--http-keep-alive-timeout-secs", "1")
    with contextlib.closing(connect(server)) as sock:
        sock.sendall(LIVE)
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
        assert read_until_closed(sock) == b""


@contextlib.contextmanager
def soft_descriptor_limit(soft: int) -> Iterator[int]:
    """This process's soft descriptor limit lowered (a server started meanwhile inherits it); the hard limit."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (before, hard))


def open_files_limit(pid: int) -> tuple[int, int]:
    """The soft and hard ``Max open files`` of a process."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-file limit for {pid}")


def test_the_soft_descriptor_limit_is_raised(repo: Path, server_factory) -> None:
    low, idle = 256, 600  # more idle connections than the old limit, also per worker (two share them)
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4 * idle:
        pytest.skip("the hard descriptor limit is too low to test raising the soft one")
    with soft_descriptor_limit(low) as hard:
        server = server_factory(repo, "--http-header-timeout-secs", "600")
    for pid in (server.pid, *children(server.pid)):
        assert open_files_limit(pid) == (hard, hard), pid
    with contextlib.ExitStack() as sockets:
        held = [sockets.enter_context(connect(server)) for _ in range(idle)]
        assert grpc_live(server)
        assert call(server, "GET", "/v2/health/live")[0] == 200
        for sock in held[-3:]:  # the last accepted are served too
            sock.sendall(LIVE)
            assert read_answer(sock).startswith(b"HTTP/1.1 200 ")


def test_past_the_connection_bound_a_new_connection_is_refused(
    repo: Path, server_factory, layout: tuple[str, ...]
) -> None:
    bound, processes = 4, 2 if layout else 1
    server = server_factory(repo, "--http-max-connections", str(bound))
    served: list[http.client.HTTPConnection] = []
    message = ""
    with contextlib.ExitStack() as connections:
        for _ in range(bound * processes + 1):  # the last one finds every process full
            connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=CLOSE_TIMEOUT_S)
            connections.callback(connection.close)
            connection.request("GET", "/v2/health/live")
            response = connection.getresponse()
            body = response.read()
            if response.status != 200:
                assert response.status == 503 and response.getheader("connection") == "close", (response.status, body)
                message = json.loads(body)["error"]
                break
            served.append(connection)
        assert "--http-max-connections" in message and len(served) >= bound, (message, len(served))
        for connection in served:  # the connections already open are still served, and so is gRPC
            connection.request("GET", "/v2/health/live")
            response = connection.getresponse()
            assert response.status == 200, response.read()
            response.read()
        assert grpc_live(server)
    wait_until(
        lambda: call(server, "GET", "/v2/health/live")[0] == 200,
        CLOSE_TIMEOUT_S,
        "a new connection served once the others closed",
    )
    wait_until(lambda: "--http-max-connections allows here" in server.log(), CLOSE_TIMEOUT_S, "the refusal logged")


@pytest.fixture
def segment() -> Iterator[str]:
    key = f"/shoal_limits_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region("limits", key, 64)
    yield key
    shm.destroy_shared_memory_region(handle)


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_shared_memory_regions_hold_no_descriptor_and_are_bounded(repo: Path, server_factory, segment: str) -> None:
    bound = 1500
    server = server_factory(repo, "--shared-memory-max-regions", str(bound))
    with grpcclient.InferenceServerClient(server.url) as client:
        before = descriptors(server.pid)
        for index in range(bound):
            client.register_system_shared_memory(f"r{index}", segment, 64)
        grown = descriptors(server.pid) - before
        assert grown < 50, f"{grown} descriptors more after {bound} registrations"
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("one_more", segment, 64)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
        assert "--shared-memory-max-regions" in refused.value.message(), refused.value
        assert grpc_live(server) and call(server, "GET", "/v2/health/live")[0] == 200
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status(as_json=True) == {}
        client.register_system_shared_memory("again", segment, 64)
        client.unregister_system_shared_memory()


def test_a_key_that_names_another_segment_is_not_read(segment: str) -> None:
    registry = RegionRegistry(1 << 20)
    registry.register("r", segment, 0, 64)
    path = Path("/dev/shm") / segment.lstrip("/")
    path.unlink()
    path.write_bytes(bytes(64))  # the client's key, now another segment
    with pytest.raises(ShoalError, match="names another segment"):
        registry.window("r", 0, 64)
    registry.close()


def test_only_the_regions_used_last_keep_a_descriptor(segment: str) -> None:
    registry = RegionRegistry(1 << 20)
    before = descriptors(os.getpid())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the last user of a segment lets it close
        for index in range(3 * OPEN_SEGMENTS):
            registry.register(f"r{index}", segment, 0, 64)
            assert registry.window(f"r{index}", 0, 64).read().size == 64
        assert descriptors(os.getpid()) - before <= OPEN_SEGMENTS
        assert registry.window("r0", 0, 64).read().size == 64  # closed meanwhile: opened again
        registry.unregister("")
        assert descriptors(os.getpid()) <= before
        registry.close()


def test_failed_accepts_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    log = AcceptFailureLog(interval_s=3600)
    context = {"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files")}
    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.ERROR, logger="shoal.descriptors"):
        for _ in range(50):
            log(loop, context)
    loop.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "shoal.descriptors"]
    assert len(lines) == 1 and "Too many open files" in lines[0], lines


def test_bodies_being_received_are_bounded_in_all() -> None:
    """Slow uploads on many connections could each hold up to --http-max-input-size; in all they hold at most
    --http-max-pending-body-mb (503 past it, counted from Content-Length or, when chunked, as the bytes come),
    and what a finished or failed upload held is released. An endpoint in this process, over raw sockets."""
    app = HttpApp(core=None, max_body_bytes=1 << 20)  # type: ignore[arg-type]  # every path here is 404

    async def scenario() -> None:
        endpoint = server_module.HttpServer(app, HttpSettings(address="127.0.0.1", port=0, max_pending_body_bytes=100))
        port = await endpoint.start()

        async def send(head: bytes, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            await writer.drain()
            return reader, writer

        async def status(reader: asyncio.StreamReader) -> tuple[int, bytes]:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            return int(head.split()[1]), await reader.readexactly(length)

        declared = b"POST /nowhere HTTP/1.1\r\nhost: x\r\ncontent-length: 80\r\n\r\n"
        chunked = b"POST /nowhere HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        slow_reader, slow_writer = await send(declared, b"x" * 10)  # 80 declared, 10 sent: being received
        try:
            reader, writer = await send(declared, b"y" * 80)
            refused = await status(reader)
            writer.close()
            assert refused[0] == 503 and b"--http-max-pending-body-mb" in refused[1], refused
            reader, writer = await send(chunked, b"50\r\n" + b"y" * 80 + b"\r\n0\r\n\r\n")  # counted as it comes
            assert (await status(reader))[0] == 503
            writer.close()
            slow_writer.write(b"x" * 70)  # the slow upload ends: answered (404), and its 80 bytes released
            assert (await status(slow_reader))[0] == 404
            for head, body in ((declared, b"y" * 80), (chunked, b"50\r\n" + b"y" * 80 + b"\r\n0\r\n\r\n")):
                reader, writer = await send(head, body)
                assert (await status(reader))[0] == 404
                writer.close()
            cut_reader, cut_writer = await send(declared, b"x" * 10)  # an upload cut off midway is released too
            cut_writer.close()
            for _ in range(200):
                if not endpoint._guard or endpoint._guard.pending_body_bytes == 0:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.01)
            reader, writer = await send(declared, b"y" * 80)
            assert (await status(reader))[0] == 404
            writer.close()
        finally:
            slow_writer.close()
            await endpoint.stop(0.1)

    asyncio.run(scenario())


def _closed_by_server(sock: socket.socket) -> bool:
    """The server closed (or reset) this connection: a read finds its end at once."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def test_http_takes_at_most_half_the_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the hard limit is low (1,024), 4,096 HTTP connections would leave gRPC no descriptor."""
    monkeypatch.setattr(server_module, "open_file_limit", lambda: 1024)
    assert server_module.connection_bound(4096) == 512 and server_module.connection_bound(100) == 100
    monkeypatch.setattr(server_module, "open_file_limit", lambda: None)
    assert server_module.connection_bound(4096) == 4096


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_running_out_of_descriptors_is_logged_once_and_recovers(repo: Path, server_factory, loop: str) -> None:
    """asyncio logged each failed accept with a traceback, every second, per listener: now once per
    interval. uvloop reports nothing: libuv accepts and closes at once what it cannot serve (a
    descriptor it keeps in reserve for that), so the clients see their connections closed."""
    server = server_factory(repo, "--event-loop", loop)
    processes = [server.pid, *children(server.pid)]
    limits = {pid: resource.prlimit(pid, resource.RLIMIT_NOFILE) for pid in processes}
    with contextlib.ExitStack() as sockets:
        for pid in processes:  # a few descriptors left to each process
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (descriptors(pid) + 8, limits[pid][1]))
        opened = [sockets.enter_context(connect(server)) for _ in range(40 * len(processes))]
        if loop == "asyncio":
            wait_until(lambda: "cannot accept new connections" in server.log(), CLOSE_TIMEOUT_S, "the report")
            time.sleep(3)  # accepts are retried each second: three more failures, that must not be logged
        else:
            wait_until(lambda: any(_closed_by_server(sock) for sock in opened), CLOSE_TIMEOUT_S, "a closed connection")
        for pid in processes:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits[pid])
    log = server.log()
    assert ACCEPT_FAILED not in log and "Traceback" not in log, log
    if loop == "asyncio":
        assert 1 <= log.count("cannot accept new connections") <= len(processes), log  # one line per process
    wait_until(lambda: call(server, "GET", "/v2/health/live")[0] == 200, CLOSE_TIMEOUT_S, "HTTP served again")
    assert grpc_live(server)
