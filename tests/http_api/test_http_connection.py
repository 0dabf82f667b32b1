"""HTTP/1.1 on the wire (``shoal.http.connection``), against a real server in both layouts: requests
pipelined on one connection answered in order, each with its own answer; ``Expect: 100-continue``;
chunked bodies, counted against the bound as they come; HTTP/1.0 and ``Connection: close``; a
percent-encoded path; a body too large refused from its Content-Length before it is sent; an answer
larger than the socket's buffers to a client that reads it late; a request httptools cannot parse."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import models
from tests.conftest import RunningServer

TIMEOUT_S = 30.0
MAX_INPUT = 16 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_factory_module) -> RunningServer:
    repo = models.repository(tmp_path_factory.mktemp("repo"), "simple")
    models.add_identity(repo, "identity_fp32", "FP32")
    return server_factory_module(repo, "--http-max-input-size", str(MAX_INPUT))


@pytest.fixture(scope="module")
def server_factory_module(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator:
    from tests.conftest import start_server

    started: list[RunningServer] = []

    def factory(repository: Path, *extra_args: str) -> RunningServer:
        started.append(start_server(repository, tmp_path_factory.mktemp("server"), *layout, *extra_args))
        return started[-1]

    yield factory
    for running in started:
        assert running.stop() == 0, running.log()


def _connect(server: RunningServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=TIMEOUT_S)


def _read_answer(sock: socket.socket, pending: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One answer from ``sock`` (``pending``: bytes read past the previous answer), by its Content-Length."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; read {bytes(pending)!r}"
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        body += chunk
    pending[:] = body[length:]
    return status, headers, bytes(body[:length])


def _infer_body(a: np.ndarray, b: np.ndarray) -> bytes:
    inputs = [
        {"name": name, "shape": [1, 16], "datatype": "INT32", "data": data.ravel().tolist()}
        for name, data in (("INPUT0", a), ("INPUT1", b))
    ]
    return json.dumps({"inputs": inputs}).encode()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: shoal\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


def _identity_request(values: np.ndarray) -> bytes:
    """An identity_fp32 inference of ``values`` sent and answered as binary data."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "IN",
                    "shape": list(values.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ],
            "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
        }
    ).encode()
    extra = f"inference-header-content-length: {len(header)}\r\n"
    return _post("/v2/models/identity_fp32/infer", header + values.tobytes(), extra)


def test_pipelined_requests_are_answered_in_order_each_with_its_own_answer(server: RunningServer) -> None:
    rng = np.random.default_rng(3)
    pairs = [(rng.integers(-99, 99, 16, dtype=np.int32), rng.integers(-99, 99, 16, dtype=np.int32)) for _ in range(12)]
    wire = b"".join(_post("/v2/models/simple/infer", _infer_body(a, b)) for a, b in pairs)
    wire += b"GET /v2/health/ready HTTP/1.1\r\nhost: shoal\r\n\r\n"
    with _connect(server) as sock:
        sock.sendall(wire)  # every request in one go: the server reads them all before answering any
        pending = bytearray()
        for a, b in pairs:
            status, _, body = _read_answer(sock, pending)
            outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
            assert status == 200 and outputs == {"OUTPUT0": (a + b).tolist(), "OUTPUT1": (a - b).tolist()}
        assert _read_answer(sock, pending)[0] == 200
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: shoal\r\n\r\n")  # still kept alive
        assert _read_answer(sock, pending)[0] == 200


def test_expect_100_continue_gets_100_before_the_body_is_sent(server: RunningServer) -> None:
    a = np.arange(16, dtype=np.int32)
    body = _infer_body(a, a)
    with _connect(server) as sock:
        head = f"POST /v2/models/simple/infer HTTP/1.1\r\nhost: shoal\r\ncontent-length: {len(body)}\r\n"
        sock.sendall(head.encode() + b"expect: 100-continue\r\n\r\n")
        interim = sock.recv(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        sock.sendall(body)
        status, _, answer = _read_answer(sock, bytearray())
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == (2 * a).tolist()


def test_a_chunked_body_is_read_whole(server: RunningServer) -> None:
    a = np.arange(16, dtype=np.int32)
    body = _infer_body(a, -a)
    chunks = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:7], body[7:40], body[40:]))
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: shoal\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunks
            + b"0\r\n\r\n"
        )
        status, _, answer = _read_answer(sock, bytearray())
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert status == 200 and outputs == {"OUTPUT0": [0] * 16, "OUTPUT1": (2 * a).tolist()}


def test_a_chunked_body_past_the_bound_is_413_and_the_connection_closed(server: RunningServer) -> None:
    chunk = b"x" * (1 << 20)
    with _connect(server) as sock:
        sock.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: shoal\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(MAX_INPUT // len(chunk) + 1):  # past --http-max-input-size by one chunk
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        status, headers, body = _read_answer(sock, bytearray())
    assert status == 413 and headers["connection"] == "close", (status, headers)
    assert f"exceeds the maximum allowed value of {MAX_INPUT} bytes" in json.loads(body)["error"]


def test_a_declared_body_past_the_bound_is_refused_before_it_is_sent(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(
            f"POST /v2/models/simple/infer HTTP/1.1\r\nhost: shoal\r\ncontent-length: {MAX_INPUT + 1}\r\n\r\n".encode()
        )
        status, headers, body = _read_answer(sock, bytearray())  # no byte of the body was sent
    assert status == 413 and headers["connection"] == "close"
    assert f"request body of {MAX_INPUT + 1} bytes or more exceeds" in json.loads(body)["error"]


@pytest.mark.parametrize(
    "request_line",
    [b"GET /v2/health/live HTTP/1.0\r\n\r\n", b"GET /v2/health/live HTTP/1.1\r\nconnection: close\r\n\r\n"],
)
def test_http_1_0_and_connection_close_are_answered_then_closed(server: RunningServer, request_line: bytes) -> None:
    with _connect(server) as sock:
        sock.sendall(request_line)
        pending = bytearray()
        status, headers, _ = _read_answer(sock, pending)
        assert status == 200 and headers.get("connection") == "close"
        assert sock.recv(1) == b"" and not pending  # closed after the answer


def test_a_percent_encoded_path_is_decoded(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /v2/models/%73imple/ready HTTP/1.1\r\nhost: shoal\r\n\r\n")
        assert _read_answer(sock, bytearray())[0] == 200


def test_a_request_that_does_not_parse_is_400_and_the_server_serves_on(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nbad header line\r\n\r\n")
        status, headers, body = _read_answer(sock, bytearray())
    assert status == 400 and headers["connection"] == "close" and "error" in json.loads(body)
    with _connect(server) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: shoal\r\n\r\n")
        assert _read_answer(sock, bytearray())[0] == 200


def test_a_large_answer_reaches_a_client_that_reads_it_late(server: RunningServer) -> None:
    """8 MiB of FP32 as binary data: more than the socket's buffers hold, so the server's writing
    pauses until the client reads; the next request on the connection is answered after it."""
    values = np.random.default_rng(5).standard_normal((1, 2 * 2**20)).astype(np.float32)
    big = _identity_request(values)
    with _connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(big + b"GET /v2/health/live HTTP/1.1\r\nhost: shoal\r\n\r\n")
        pending = bytearray()
        status, headers, answer = _read_answer(sock, pending)
        assert status == 200, answer[:300]
        json_length = int(headers["inference-header-content-length"])
        assert np.array_equal(np.frombuffer(answer[json_length:], dtype=np.float32), values.ravel())
        assert _read_answer(sock, pending)[0] == 200


def test_head_is_answered_without_a_body_and_the_next_answer_is_intact(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(
            b"HEAD /v2/health/ready HTTP/1.1\r\nhost: shoal\r\n\r\n"
            b"GET /v2/models/simple/ready HTTP/1.1\r\nhost: shoal\r\n\r\n"
        )
        pending = bytearray()
        while pending.count(b"\r\n\r\n") < 2:
            chunk = sock.recv(65536)
            assert chunk, bytes(pending)
            pending += chunk
        head, _, rest = bytes(pending).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 405 ") and b"content-length: " in head, head
        assert rest.startswith(b"HTTP/1.1 200 "), rest[:80]  # no body between the two


def test_requests_read_whole_before_a_refusal_are_answered_before_it_in_order(server: RunningServer) -> None:
    a, b = np.arange(16, dtype=np.int32), np.full(16, 5, dtype=np.int32)
    with _connect(server) as sock:
        sock.sendall(
            _post("/v2/models/simple/infer", _infer_body(a, a))
            + _post("/v2/models/simple/infer", _infer_body(b, b))
            + b"GARBAGE\x01 / HTTP/1.1\r\n\r\n"
        )
        pending = bytearray()
        answers = [_read_answer(sock, pending) for _ in range(3)]
        assert sock.recv(1) == b""  # closed after the refusal
    assert [status for status, _, _ in answers] == [200, 200, 400]
    assert json.loads(answers[0][2])["outputs"][0]["data"] == (2 * a).tolist()
    assert json.loads(answers[1][2])["outputs"][0]["data"] == (2 * b).tolist()


def test_a_refusal_while_a_large_answer_waits_for_a_slow_reader_follows_it(server: RunningServer) -> None:
    """The refusal (a request that does not parse, sent while the 8 MiB answer before it is still being
    taken) is written after that answer, then the connection closes: it used to stay open for good."""
    values = np.zeros((1, 2 * 2**20), dtype=np.float32)
    big = _identity_request(values)
    with _connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(big)
        first = sock.recv(4096)  # the answer has begun: the rest waits for this client to read it
        assert first.startswith(b"HTTP/1.1 200 "), first[:80]
        sock.sendall(b"GARBAGE\x01 / HTTP/1.1\r\n\r\n")
        pending = bytearray(first)
        status, _, answer = _read_answer(sock, pending)
        assert status == 200 and len(answer) > values.nbytes
        assert _read_answer(sock, pending)[0] == 400
        assert sock.recv(1) == b""


def test_an_upgrade_with_a_body_is_refused_and_one_without_is_answered_in_turn(server: RunningServer) -> None:
    a = np.arange(16, dtype=np.int32)
    body = _infer_body(a, a)
    with _connect(server) as sock:
        sock.sendall(_post("/v2/models/simple/infer", body, "connection: upgrade\r\nupgrade: h2c\r\n"))
        status, headers, _ = _read_answer(sock, bytearray())
        assert status == 400 and headers["connection"] == "close"
    with _connect(server) as sock:
        sock.sendall(
            _post("/v2/models/simple/infer", body)
            + b"GET /v2/health/ready HTTP/1.1\r\nhost: shoal\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
        )
        pending = bytearray()
        assert _read_answer(sock, pending)[0] == 200
        status, headers, _ = _read_answer(sock, pending)  # answered as HTTP/1.1, then the connection closes
        assert status == 200 and headers.get("connection") == "close"


def test_a_chunked_body_s_trailer_is_not_a_header_of_the_request(tmp_path: Path, server_factory) -> None:
    """A trailer named as the restriction's header does not open a restricted API."""
    server = server_factory(
        models.repository(tmp_path, "simple"), "--http-restricted-api", "model-repository:admin-key=secret"
    )
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nhost: shoal\r\ntransfer-encoding: chunked\r\n\r\n"
            b"2\r\n{}\r\n0\r\nadmin-key: secret\r\n\r\n"
        )
        assert _read_answer(sock, bytearray())[0] == 403


def test_only_short_header_names_are_kept_decoded() -> None:
    """The names kept across requests are bounded in length too: a head may be 1 MiB, and one long
    name per request would otherwise stay in every serving process for good (~2 MiB each)."""
    import asyncio

    from shoal.http import connection
    from shoal.http.app import HttpApp
    from shoal.settings import HttpSettings

    long_name = b"X-Long-" + b"a" * 100_000
    before = len(connection._HEADER_NAMES)

    async def read_head() -> dict[str, str]:
        guard = connection.ConnectionGuard(HttpSettings(), 16)
        reader = connection.HttpConnection(HttpApp(None, MAX_INPUT), guard)  # type: ignore[arg-type]
        reader.on_message_begin()
        reader.on_header(long_name, b"1")
        reader.on_header(b"X-Short-Name-Kept", b"2")
        assert reader._parsing is not None
        return reader._parsing.headers

    headers = asyncio.run(read_head())
    assert headers == {long_name.decode().lower(): "1", "x-short-name-kept": "2"}  # read as ever
    assert long_name not in connection._HEADER_NAMES
    assert connection._HEADER_NAMES.get(b"X-Short-Name-Kept") == "x-short-name-kept"
    assert len(connection._HEADER_NAMES) <= max(before + 1, connection.MAX_HEADER_NAMES_KEPT)
