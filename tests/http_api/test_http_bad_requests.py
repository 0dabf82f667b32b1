"""Hostile requests over HTTP that once got a 500 or were quietly accepted: each must be a clean
400 with Triton's error body, and the server must log no traceback for a client's mistake.

Found by the review of the HTTP endpoint; each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import threading
import uuid
import zlib

import numpy as np
import pytest

from shoal.errors import ShoalError
from shoal.http import app as http_app
from shoal.http import handlers, infer_body
from shoal.http.app import HttpApp
from shoal.http.connection import MAX_HEAD_BYTES
from shoal.http.handlers import Reply, Request
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, Tensor
from tests.conftest import RunningServer
from tests.http_api.test_http_errors import call, error

FP32_INFER = "/v2/models/identity_fp32/infer"
BYTES_INFER = "/v2/models/identity_bytes/infer"


def _no_traceback(server: RunningServer) -> None:
    assert "unexpected error while serving an HTTP request" not in server.log(), server.log()


def test_deeply_nested_json_is_400_not_500(example_server: RunningServer) -> None:
    """Python's JSON parser gives up on deep nesting with RecursionError, not ValueError."""
    deep = "[" * 100_000 + "]" * 100_000
    status, message = error(example_server, "POST", FP32_INFER, '{"inputs": ' + deep + "}")
    assert status == 400 and message.startswith("failed to parse the request JSON buffer"), message
    status, message = error(example_server, "POST", "/v2/repository/index", deep)
    assert status == 400 and message.startswith("failed to parse the request JSON buffer"), message
    load = json.dumps({"parameters": {"config": deep}})
    status, message = error(example_server, "POST", "/v2/repository/models/simple/load", load)
    assert status == 400 and "config parameter is not valid JSON" in message, message
    _no_traceback(example_server)


def _one_string(value: object) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 1], "data": [value]}]}


def test_a_lone_surrogate_in_bytes_data_is_400(example_server: RunningServer) -> None:
    """JSON's "\\ud800" parses to a str that has no UTF-8 encoding."""
    status, message = error(example_server, "POST", BYTES_INFER, json.dumps(_one_string("\ud800")))
    assert status == 400 and "not valid Unicode" in message, message
    _no_traceback(example_server)


def test_a_number_among_bytes_strings_is_refused(example_server: RunningServer) -> None:
    """numpy reads ["a", 1] as two strings; docs/http.md promises a number for BYTES is refused."""
    mixed = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 2], "data": ["a", 1]}]}
    assert error(example_server, "POST", BYTES_INFER, mixed) == (
        400,
        "Unable to parse 'data' of input 'IN': BYTES data must be strings",
    )
    nested = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [2, 1], "data": [["a"], [True]]}]}
    assert error(example_server, "POST", BYTES_INFER, nested)[0] == 400


def test_a_float_too_large_for_its_type_is_refused_not_made_infinite(example_server: RunningServer) -> None:
    """1e300 does not fit FP32 or FP16: refused as an integer out of range is, not sent on as inf."""
    for model, datatype in (("identity_fp32", "FP32"), ("identity_fp16", "FP16"), ("identity_bf16", "BF16")):
        body = {"inputs": [{"name": "IN", "datatype": datatype, "shape": [1, 2], "data": [1.0, -1e300]}]}
        assert error(example_server, "POST", f"/v2/models/{model}/infer", body) == (
            400,
            f"input 'IN': a value does not fit {datatype}",
        )
    infinite = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1e999]}]}  # inf as sent
    status, headers, content = call(example_server, "POST", FP32_INFER, json.dumps(infinite))
    assert status == 200 and json.loads(content)["outputs"][0]["data"] == [float("inf")], content
    assert "RuntimeWarning" not in example_server.log()


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        (DataType.INT32, [1, True]),
        (DataType.UINT8, [True, 3]),
        (DataType.FP32, [True, 2.5]),
        (DataType.FP64, [[1.5, 2.0], [0.5, False]]),
        (DataType.INT64, [[1, 2], [3, True]]),
    ],
)
def test_a_boolean_among_numbers_is_refused_not_read_as_one(datatype: DataType, data: list[object]) -> None:
    """numpy reads [1, true] as [1, 1]: docs/http.md promises a value of the wrong kind is refused
    (booleans alone always were); found by the review of session 47."""
    shape = np.asarray(data).shape
    with pytest.raises(ShoalError) as raised:
        infer_body.json_data("IN", datatype, shape, data)
    expected = f"Unable to parse 'data' of input 'IN': expected {datatype.value} values, got booleans"
    assert raised.value.message == expected
    numbers = json.loads(json.dumps(data).replace("true", "1").replace("false", "0"))
    assert infer_body.json_data("IN", datatype, shape, numbers).tolist() == numbers


def test_a_boolean_among_numbers_is_400_over_http(example_server: RunningServer) -> None:
    mixed = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [True, 2.5]}]}
    assert error(example_server, "POST", FP32_INFER, mixed) == (
        400,
        "Unable to parse 'data' of input 'IN': expected FP32 values, got booleans",
    )
    _no_traceback(example_server)


def test_binary_data_flags_must_be_booleans(example_server: RunningServer) -> None:
    """ "false" is truthy in Python: it once asked for binary data. Triton's words for a non-boolean."""
    one = [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1]}]
    per_output = {"inputs": one, "outputs": [{"name": "OUT", "parameters": {"binary_data": "false"}}]}
    assert error(example_server, "POST", FP32_INFER, per_output) == (
        400,
        "Unable to parse 'binary_data': attempt to access JSON non-boolean as boolean",
    )
    every_output = {"inputs": one, "parameters": {"binary_data_output": 0}}
    assert error(example_server, "POST", FP32_INFER, every_output) == (
        400,
        "Unable to parse 'binary_data_output': attempt to access JSON non-boolean as boolean",
    )
    fine = {"inputs": one, "outputs": [{"name": "OUT", "parameters": {"binary_data": False}}]}
    status, headers, content = call(example_server, "POST", FP32_INFER, json.dumps(fine))
    assert status == 200 and json.loads(content)["outputs"][0]["data"] == [1.0], content


def test_binary_data_output_is_for_the_outputs_not_listed(example_server: RunningServer) -> None:
    """Triton's CheckBinaryOutputData: an output listed without ``binary_data`` is JSON, whatever
    ``binary_data_output`` says (run beside Triton 2.51); with no outputs listed, every one is binary."""
    one = [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1]}]
    for outputs in ([{"name": "OUT"}], [{"name": "OUT", "parameters": {}}]):
        listed = {"inputs": one, "outputs": outputs, "parameters": {"binary_data_output": True}}
        status, headers, content = call(example_server, "POST", FP32_INFER, json.dumps(listed))
        assert status == 200 and "inference-header-content-length" not in headers, headers
        assert json.loads(content)["outputs"][0]["data"] == [1.0], content
    unlisted = {"inputs": one, "parameters": {"binary_data_output": True}}
    status, headers, content = call(example_server, "POST", FP32_INFER, json.dumps(unlisted))
    header_length = int(headers["inference-header-content-length"])
    output = json.loads(content[:header_length])["outputs"][0]
    assert status == 200 and "data" not in output and output["parameters"]["binary_data_size"] == 4
    assert np.frombuffer(content[header_length:], dtype="<f4").tolist() == [1.0]


def test_an_output_in_shared_memory_takes_no_classification_or_binary_data(example_server: RunningServer) -> None:
    """Triton's HTTP front end refuses both (ValidateOutputParameter): classification results are not
    written to shared memory, and an output cannot come back both in a region and as binary data."""
    key = f"shoal-test-{uuid.uuid4().hex}"
    descriptor = os.open(f"/dev/shm/{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(descriptor, 64)
        assert (
            call(
                example_server,
                "POST",
                "/v2/systemsharedmemory/region/out/register",
                json.dumps({"key": key, "offset": 0, "byte_size": 64}),
            )[0]
            == 200
        )
        inputs = [{"name": "IN", "datatype": "FP32", "shape": [1, 3], "data": [1, 3, 2]}]
        region = {"shared_memory_region": "out", "shared_memory_byte_size": 64}

        def with_output(**parameters: object) -> dict[str, object]:
            return {"inputs": inputs, "outputs": [{"name": "OUT", "parameters": {**region, **parameters}}]}

        assert error(example_server, "POST", FP32_INFER, with_output(classification=2)) == (
            400,
            "Output can't set both 'shared_memory_region' and 'classification'",
        )
        assert error(example_server, "POST", FP32_INFER, with_output(binary_data=True)) == (
            400,
            "Output can't set both 'shared_memory_region' and 'binary_data'",
        )
        assert os.pread(descriptor, 64, 0) == bytes(64)  # nothing was written
        status, _, content = call(example_server, "POST", FP32_INFER, json.dumps(with_output(binary_data=False)))
        assert status == 200 and "data" not in json.loads(content)["outputs"][0], content
        assert os.pread(descriptor, 12, 0) == b"".join(
            v.to_bytes(4, "little") for v in (0x3F800000, 0x40400000, 0x40000000)
        )
    finally:
        call(example_server, "POST", "/v2/systemsharedmemory/region/out/unregister")
        os.close(descriptor)
        os.unlink(f"/dev/shm/{key}")


def test_an_input_with_two_sources_names_them_as_triton_does(example_server: RunningServer) -> None:
    both = {
        "inputs": [
            {
                "name": "IN",
                "datatype": "FP32",
                "shape": [1, 1],
                "data": [1],
                "parameters": {"binary_data_size": 4, "shared_memory_region": "r", "shared_memory_byte_size": 4},
            }
        ]
    }
    assert error(example_server, "POST", FP32_INFER, both) == (
        400,
        "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
        "'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size' 'shared_memory_region'",
    )


def test_a_small_compressed_body_that_inflates_a_lot_is_decompressed_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """65 KB of gzip inflates to 64 MiB in about 0.1 s: on the event loop that stalls every other
    request, so what may inflate past OFF_LOOP_BYTES (deflate reaches ~1032:1) goes to a thread."""
    threads: list[int] = []
    real = HttpApp._decompress

    def recording(self: HttpApp, body: bytes, encoding: str) -> bytes:
        threads.append(threading.get_ident())
        return real(self, body, encoding)

    monkeypatch.setattr(HttpApp, "_decompress", recording)
    app = HttpApp(core=None, max_body_bytes=64 * 2**20)  # type: ignore[arg-type]
    compressed = gzip.compress(b" " * (16 * 2**20))
    assert len(compressed) < 2**20  # under the threshold for the raw body

    async def read(body: bytes) -> tuple[bytes, int]:
        data = await app._decoded(body, {"content-encoding": "gzip"})
        return data, threading.get_ident()

    data, loop_thread = asyncio.run(read(compressed))
    assert len(data) == 16 * 2**20 and threads[-1] != loop_thread
    data, loop_thread = asyncio.run(read(gzip.compress(b"{}")))  # tiny: not worth a thread hop
    assert data == b"{}" and threads[-1] == loop_thread


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_answers_are_compressed_off_the_loop_at_zlib_s_default_level(
    monkeypatch: pytest.MonkeyPatch, encoding: str
) -> None:
    """gzip.compress's default level 9 took ~0.18 s for a 1 MiB answer, on the event loop."""
    threads: list[int] = []
    real = http_app._compress

    def recording(body: bytes, chosen: str) -> bytes:
        threads.append(threading.get_ident())
        return real(body, chosen)

    monkeypatch.setattr(http_app, "_compress", recording)
    sent: list[bytes] = []

    async def answer(body: bytes) -> int:
        encoded = await http_app._compressed(Reply(body=body, compressible=True), encoding, 0)  # an inference answer
        assert ("content-encoding", encoding) in encoded.headers
        sent.append(encoded.body)
        return threading.get_ident()

    body = json.dumps(list(range(100_000))).encode()
    loop_thread = asyncio.run(answer(body))
    assert threads[-1] != loop_thread
    compressed = sent[-1]
    assert (gzip.decompress(compressed) if encoding == "gzip" else zlib.decompress(compressed)) == body
    if encoding == "gzip":  # past the 10-byte header (its time stamp): the deflate stream of level 6
        assert compressed[10:] == gzip.compress(body, 6, mtime=0)[10:]
    else:
        assert compressed == zlib.compress(body, 6)
    loop_thread = asyncio.run(answer(b"{}"))
    assert threads[-1] == loop_thread


class _EchoCore:
    """A core that answers every request with one FP32 output of ``size`` elements."""

    def __init__(self, size: int) -> None:
        self.size = size

    async def infer(self, request: InferRequest, origin: object = None) -> InferResponse:
        data = np.zeros(self.size, np.float32)
        return InferResponse(
            request.model_name, "1", "", (Tensor("OUT", DataType.FP32, data.shape, data),), frozenset()
        )


@pytest.mark.parametrize(
    ("size", "binary", "off_loop"),
    [
        (100_000, False, True),  # 100,000 JSON values: ~60 ms of Python work
        (100_000, True, False),  # 400 KB of raw bytes: one copy, on the loop
        (100, False, False),
    ],
)
def test_an_answer_of_many_json_values_is_encoded_off_the_loop(
    monkeypatch: pytest.MonkeyPatch, size: int, binary: bool, off_loop: bool
) -> None:
    threads: list[int] = []
    real = infer_body.infer_response

    def recording(*args: object) -> tuple[bytes, int | None]:
        threads.append(threading.get_ident())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(infer_body, "infer_response", recording)
    body = json.dumps(
        {
            "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [1]}],
            "parameters": {"binary_data_output": binary},
        }
    ).encode()

    async def infer() -> int:
        await handlers.infer(_EchoCore(size), Request({"model": "m"}, {}, body))  # type: ignore[arg-type]
        return threading.get_ident()

    loop_thread = asyncio.run(infer())
    assert (threads[-1] != loop_thread) is off_loop


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_an_endless_header_is_431_and_the_connection_closed(example_server: RunningServer) -> None:
    """httptools keeps a header it is still reading in memory whole: 300 MB of one header line grew the
    server by as much. Past MAX_HEAD_BYTES the server answers 431, closes, and keeps serving."""
    with socket.create_connection(("127.0.0.1", example_server.http_port)) as sock:
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(4 * MAX_HEAD_BYTES // 2**16):
                sock.sendall(b"a" * 2**16)
        except OSError:
            pass  # closed by the server while sending: its answer is still there to read
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
        "error": f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"
    }
    status, _, content = call(example_server, "GET", "/v2/health/ready")
    assert status == 200, content


def test_heads_are_counted_per_request_on_a_kept_alive_connection(example_server: RunningServer) -> None:
    """Many requests on one connection, each with a large (allowed) header, all answered."""
    header = b"X-Pad: " + b"a" * (MAX_HEAD_BYTES // 3) + b"\r\n"
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n"
    with socket.create_connection(("127.0.0.1", example_server.http_port)) as sock:
        for _ in range(6):
            sock.sendall(request)
            sock.settimeout(30)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("value", [{"a": 1}, [1, 2], None])
def test_a_request_parameter_must_be_a_scalar(example_server: RunningServer, value: object) -> None:
    """As Triton's SetTritonParameterFromJsonParameter: an object, list or null reached the core and
    the models' request.parameters() before."""
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1]}], "parameters": {"p": value}}
    assert error(example_server, "POST", FP32_INFER, body) == (
        400,
        "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'.",
    )


def test_scalar_request_parameters_are_accepted(example_server: RunningServer) -> None:
    body = {
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1]}],
        "parameters": {"s": "x", "i": -3, "b": True, "d": 0.5},
    }
    assert call(example_server, "POST", FP32_INFER, json.dumps(body))[0] == 200


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        ("gzip;q=0.1, deflate;q=0.9", "deflate"),  # the client prefers deflate
        ("identity;q=1, gzip;q=0.5", None),  # ... or no compression at all
        ("deflate, gzip", "deflate"),  # equal weights: the first listed, as Triton's CompressionTypeUsed
        ("gzip, deflate", "gzip"),
        ("br;q=1, gzip;q=0.2", "gzip"),
    ],
)
def test_accept_encoding_follows_the_client_s_weights(accept: str, chosen: str | None) -> None:
    assert http_app._accepted_encoding(accept) == chosen


def test_bytes_elements_read_the_same_as_json_as_in_binary_answers() -> None:
    """A BYTES output's elements that are no ``bytes`` (a thread instance's own objects) are written as
    JSON strings of what the binary and gRPC answers carry for them (codec.element_bytes)."""
    values = [b"a", "\u00e9", 12, None, bytearray(b"ba"), memoryview(b"mv")]
    assert infer_body._json_strings("S", values) == ["a", "\u00e9", "12", "None", "ba", "mv"]
