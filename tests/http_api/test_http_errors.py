"""Errors over HTTP: Triton's status codes and JSON error body ``{"error": "..."}``, and clean 4xx
answers for what a client can get wrong about HTTP itself (malformed JSON, a header length past
the body, a body over the limit, an unknown path, a wrong method, an encoding nobody can read).

Statuses and words as Triton 2.51's HTTP front end answers them (compared against
``run_triton.sh``): an unknown model is 404 ``Request for unknown model: 'x' is not found``, an
unready model 400 ``Model version not ready``, an unknown path 404 ``Not Found``, a wrong method
405 ``Method Not Allowed``, an unknown Content-Encoding 501 ``Unsupported compression type``, a
restricted API 403 ``This API is restricted, expecting header 'k'``. Where Triton answers 500 for
a client's mistake (malformed JSON), Shoal answers 400 with Triton's words.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from shoal.backends.devices import cuda_device_count
from shoal.errors import ErrorCode
from shoal.http.status import STATUS_BY_CODE
from shoal.settings import EXIT_STARTUP_FAILED
from tests import models
from tests.conftest import RunningServer
from tests.grpc_api.test_tls import pki  # noqa: F401 - the fixture: a CA, server and client certificates

SIMPLE_INFER = "/v2/models/simple/infer"
ONE_INPUT = {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


def call(
    server: RunningServer,
    method: str,
    path: str,
    body: bytes | str | dict[str, Any] = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: status, headers (lower-case names), body."""
    if isinstance(body, dict):
        body = json.dumps(body)
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def error(
    server: RunningServer,
    method: str,
    path: str,
    body: bytes | str | dict[str, Any] = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    """The status and message of a request expected to fail with Triton's error body."""
    status, response_headers, content = call(server, method, path, body, headers)
    assert response_headers["content-type"] == "application/json", content
    document = json.loads(content)
    assert list(document) == ["error"], document
    return status, document["error"]


def test_every_error_code_has_an_http_status() -> None:
    assert set(STATUS_BY_CODE) == set(ErrorCode)
    assert STATUS_BY_CODE[ErrorCode.MODEL_NOT_FOUND] == 404 and STATUS_BY_CODE[ErrorCode.INVALID_ARGUMENT] == 400


def test_paths_and_methods(example_server: RunningServer) -> None:
    assert error(example_server, "GET", "/v2/nothing") == (404, "Not Found")
    assert error(example_server, "GET", "/") == (404, "Not Found")
    assert error(example_server, "GET", SIMPLE_INFER) == (405, "Method Not Allowed")
    assert error(example_server, "POST", "/v2/health/live") == (405, "Method Not Allowed")
    assert error(example_server, "DELETE", "/v2/models/simple") == (405, "Method Not Allowed")


def test_unknown_and_unready_models(example_server: RunningServer) -> None:
    assert error(example_server, "GET", "/v2/models/nope") == (404, "Request for unknown model: 'nope' is not found")
    assert error(example_server, "GET", "/v2/models/simple/versions/7/config") == (
        404,
        "Request for unknown model: 'simple' version 7 is not found",
    )
    assert error(example_server, "POST", "/v2/models/nope/infer", ONE_INPUT)[0] == 404
    assert error(example_server, "GET", "/v2/models/nope/ready") == (400, "Model version not ready")
    for path in ("/v2/models/simple/versions/abc/ready", "/v2/models/simple/versions/-1/infer"):
        assert error(example_server, "GET", path) == (404, "Not Found")  # no route, as Triton's
    assert error(example_server, "GET", "/v2/models/nope/stats") == (400, "requested model 'nope' is not available")


def test_malformed_requests_are_400(example_server: RunningServer) -> None:
    status, message = error(example_server, "POST", SIMPLE_INFER, '{"inputs": [')
    assert status == 400 and message.startswith("failed to parse the request JSON buffer")
    assert error(example_server, "POST", SIMPLE_INFER, "[1]")[0] == 400
    assert error(example_server, "POST", SIMPLE_INFER, "{}") == (
        400,
        "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'",
    )
    no_data = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32"}]}
    assert error(example_server, "POST", SIMPLE_INFER, no_data) == (
        400,
        "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
        "'shared_memory_region' in 'parameters'. But no field is set",
    )
    wrong_count = {"inputs": [{"name": "IN", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]}
    status, message = error(example_server, "POST", "/v2/models/identity_fp32/infer", wrong_count)
    assert status == 400 and "Shape does not match true shape of 'data' field" in message
    strings = {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "FP32", "data": ["a", "b"]}]}
    assert error(example_server, "POST", "/v2/models/identity_fp32/infer", strings)[0] == 400
    fraction = {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT8", "data": [1.5]}]}
    assert error(example_server, "POST", "/v2/models/identity_int8/infer", fraction)[0] == 400
    too_big = {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT8", "data": [300]}]}
    assert error(example_server, "POST", "/v2/models/identity_int8/infer", too_big) == (
        400,
        "input 'IN': a value does not fit INT8",
    )
    unknown_output = {**ONE_INPUT, "outputs": [{"name": "NOPE"}]}
    assert error(example_server, "POST", "/v2/models/identity_fp32/infer", unknown_output)[0] == 400
    assert error(example_server, "POST", "/v2/repository/index", "not json")[0] == 400
    assert error(example_server, "POST", "/v2/systemsharedmemory/region/r/register", {"key": 7})[0] == 400


def test_binary_data_that_does_not_fit(example_server: RunningServer) -> None:
    header = json.dumps(
        {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}
    ).encode()
    body = header + np.array([1, 2], dtype=np.float32).tobytes()
    path = "/v2/models/identity_fp32/infer"
    status, headers, content = call(
        example_server, "POST", path, body, {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 200 and json.loads(content)["outputs"][0]["data"] == [1.0, 2.0]
    assert error(example_server, "POST", path, body, {"Inference-Header-Content-Length": "5000"}) == (
        400,
        f"inference header size should be in range (0, {len(body)}), got: 5000",
    )
    assert error(example_server, "POST", path, body, {"Inference-Header-Content-Length": "abc"})[0] == 400
    status, message = error(
        example_server, "POST", path, body[:-1], {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400 and "expecting 8" in message
    status, message = error(
        example_server, "POST", path, body + b"x", {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400 and "1 bytes of binary data past the inputs" in message


def test_compression_errors(example_server: RunningServer) -> None:
    body = json.dumps(ONE_INPUT).encode()
    path = "/v2/models/identity_fp32/infer"
    assert error(example_server, "POST", path, body, {"Content-Encoding": "br"}) == (
        501,
        "Unsupported compression type",
    )
    status, message = error(example_server, "POST", path, b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip data" in message
    status, headers, content = call(
        example_server,
        "POST",
        path,
        gzip.compress(body),
        {"Content-Encoding": "gzip", "Accept-Encoding": "deflate;q=0, gzip"},
    )
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(content))["outputs"][0]["data"] == [1.0, 2.0]


def test_bodies_over_the_limit_are_413(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path)
    models.add_identity(repo, "ident", "FP32")
    server = server_factory(repo, "--http-max-input-size", "4096")
    small = json.dumps(ONE_INPUT).encode()
    assert call(server, "POST", "/v2/models/ident/infer", small)[0] == 200
    status, message = error(server, "POST", "/v2/models/ident/infer", small + b" " * 5000)
    assert status == 413 and "exceeds the maximum allowed value of 4096 bytes" in message
    bomb = gzip.compress(small + b" " * 100_000)  # small on the wire, past the limit once decompressed
    status, message = error(server, "POST", "/v2/models/ident/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "decompressed" in message
    assert call(server, "GET", "/v2/health/ready")[0] == 200


def test_restricted_api_needs_its_header(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo, "--http-restricted-api", "model-repository,statistics:admin-key=s3cret")
    assert error(server, "POST", "/v2/repository/index") == (
        403,
        "This API is restricted, expecting header 'admin-key'",
    )
    assert error(server, "GET", "/v2/models/stats", headers={"admin-key": "wrong"})[0] == 403
    assert call(server, "GET", "/v2/models/stats", headers={"Admin-Key": "s3cret"})[0] == 200
    assert call(server, "GET", "/v2/models/simple")[0] == 200  # metadata is not restricted
    with httpclient.InferenceServerClient(server.http_url) as client:
        with pytest.raises(InferenceServerException, match="This API is restricted") as caught:
            client.get_model_repository_index()
        assert caught.value.status() == "403"
        assert client.get_model_repository_index(headers={"admin-key": "s3cret"})[0]["name"] == "simple"


def test_http_can_be_turned_off(tmp_path: Path, server_factory) -> None:
    server = server_factory(models.repository(tmp_path, "simple"), "--allow-http", "false")
    assert server.http_port == 0


def test_an_http_port_in_use_is_a_clear_error(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    first = server_factory(repo)
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal",
            "serve",
            "--model-repository",
            str(repo),
            "--grpc-address",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            str(first.http_port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == EXIT_STARTUP_FAILED, second.stderr
    assert f"shoal: error: cannot serve HTTP on 127.0.0.1:{first.http_port}: Address already in use" in second.stderr
    assert "Traceback" not in second.stderr
    assert call(first, "GET", "/v2/health/ready")[0] == 200


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_and_mutual_tls(pki: Path, tmp_path: Path, server_factory) -> None:  # noqa: F811
    repo = models.repository(tmp_path, "simple")
    server = server_factory(
        repo,
        "--http-use-ssl-mutual",
        "true",
        "--http-server-cert",
        str(pki / "server.pem"),
        "--http-server-key",
        str(pki / "server.key"),
        "--http-root-cert",
        str(pki / "ca.pem"),
    )
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.load_cert_chain(pki / "client.pem", pki / "client.key")
    connection = http.client.HTTPSConnection("localhost", server.http_port, context=context, timeout=10)
    connection.request("GET", "/v2/health/ready")
    assert connection.getresponse().status == 200
    connection.close()
    anonymous = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        connection = http.client.HTTPSConnection("localhost", server.http_port, context=anonymous, timeout=10)
        connection.request("GET", "/v2/health/ready")
        connection.getresponse()
    plain = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/v2/health/ready")
        plain.getresponse()


def test_binary_bytes_of_many_tiny_elements_are_refused_before_decoding(example_server: RunningServer) -> None:
    count = 3_000_000  # 12 MB of empty strings would take ~160 MiB of Python objects
    header = json.dumps(
        {
            "inputs": [
                {"name": "IN", "shape": [count], "datatype": "BYTES", "parameters": {"binary_data_size": 4 * count}}
            ]
        }
    ).encode()
    status, message = error(
        example_server,
        "POST",
        "/v2/models/strings/infer",
        header + bytes(4 * count),
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400 and "send fewer, longer elements" in message


def test_shared_memory_errors(example_server: RunningServer) -> None:
    handle = {"b64": base64.b64encode(bytes(64)).decode()}
    if cuda_device_count() == 0:
        assert error(
            example_server,
            "POST",
            "/v2/cudasharedmemory/region/r/register",
            {"raw_handle": handle, "device_id": 0, "byte_size": 64},
        ) == (400, "failed to register CUDA shared memory region: 'r', GPUs not supported")
    assert error(example_server, "POST", "/v2/cudasharedmemory/region/r/register", {"raw_handle": "x"}) == (
        400,
        "Shared memory register request: 'raw_handle' must be a JSON object",
    )
    assert error(example_server, "POST", "/v2/systemsharedmemory/region/r/register", {"byte_size": 64}) == (
        400,
        "Shared memory register request has no 'key' field",
    )
    assert error(example_server, "GET", "/v2/systemsharedmemory/region/nope/status") == (
        404,
        "Unable to find system shared memory region: 'nope'",
    )
    assert error(example_server, "GET", "/v2/cudasharedmemory/region/nope/status") == (
        404,
        "Unable to find cuda shared memory region: 'nope'",
    )
    assert call(example_server, "POST", "/v2/cudasharedmemory/unregister")[0] == 200


def test_an_unusable_certificate_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    (tmp_path / "key.pem").write_text("not a key\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal",
            "serve",
            "--model-repository",
            str(models.repository(tmp_path, "simple")),
            "--grpc-address",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--http-use-ssl",
            "true",
            "--http-server-cert",
            str(tmp_path / "cert.pem"),
            "--http-server-key",
            str(tmp_path / "key.pem"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_STARTUP_FAILED, result.stderr
    assert "shoal: error: cannot serve HTTP on 127.0.0.1:" in result.stderr and "SSLError" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_http_port_is_shared_only_on_purpose(tmp_path: Path, server_factory) -> None:
    """As --reuse-grpc-port: a second server that did not opt in is refused, one that did starts beside."""
    repo = models.repository(tmp_path, "simple")
    first = server_factory(repo, "--reuse-http-port", "true")
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal",
            "serve",
            "--model-repository",
            str(repo),
            "--grpc-address",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            str(first.http_port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == EXIT_STARTUP_FAILED and "--reuse-http-port" in refused.stderr
    second = server_factory(repo, "--http-port", str(first.http_port), "--reuse-http-port", "true")
    assert second.http_port == first.http_port and second.process.poll() is None
    assert call(second, "GET", "/v2/health/ready")[0] == 200
