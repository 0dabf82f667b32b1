"""The HTTP/REST endpoint through tritonclient.http against a real server, in both process layouts.

Health, metadata, config, statistics, the repository index, inference with JSON and binary
tensors for every datatype, requested outputs with and without ``binary_data``, classification,
shared memory and compression: what Triton's HTTP front end (server src/http_server.cc) answers,
checked here against the same server's gRPC answers where both exist.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningServer

NO_JSON = {"BF16"}  # tritonclient.http sends BF16 only as binary data


@pytest.fixture
def client(example_server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(example_server.http_url, concurrency=4) as triton:
        yield triton


def _values(datatype: str) -> np.ndarray:
    """A [2, 3] batch of this datatype with values that tell elements apart (extremes included)."""
    if datatype == "BYTES":
        return np.array([[b"a", b"", "\u00e9t\u00e9".encode()], [b"x" * 40, b"0", b"zz"]], dtype=object)
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype == "BF16":
        return np.array([[1.5, -2.0, 0.0], [3.25, 1e3, -0.5]], dtype=ml_dtypes.bfloat16)
    dtype = np.dtype(datatype.lower().replace("fp", "float"))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, info.max, 0], [1, 2, info.max - 1]], dtype=dtype)
    return np.array([[1.5, -2.25, 0.0], [3.0, 1e3, -0.5]], dtype=dtype)


def test_health_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "2") and not client.is_model_ready("nope")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "shoal" and "binary_tensor_data" in metadata["extensions"]
    model = client.get_model_metadata("simple")
    assert model["versions"] == ["1"] and model["platform"] == "onnxruntime_onnx"
    assert model["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    assert client.get_model_metadata("simple", "1") == model
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [16]  # numbers, as Triton's
    assert client.get_model_config("simple", "1") == config


def test_config_matches_grpc(example_server: RunningServer, client: httpclient.InferenceServerClient) -> None:
    """The same message: HTTP's JSON (every field printed, 64-bit integers as numbers) reads back as gRPC's."""
    with grpcclient.InferenceServerClient(example_server.url) as grpc:
        over_grpc = grpc.get_model_config("mlp").config
    assert json_format.ParseDict(client.get_model_config("mlp"), type(over_grpc)()) == over_grpc


def test_statistics_and_index(client: httpclient.InferenceServerClient) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    before = client.get_inference_statistics("simple")["model_stats"][0]["inference_count"]
    client.infer("simple", _simple_inputs(a, a))
    stats = client.get_inference_statistics("simple", "1")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("simple", "1")]
    assert stats[0]["inference_count"] == before + 1 and stats[0]["inference_stats"]["success"]["count"] >= 1
    assert stats[0]["batch_stats"][0]["batch_size"] == 1
    everything = client.get_inference_statistics()["model_stats"]
    assert {"simple", "mlp", "identity_fp32"} <= {s["name"] for s in everything}
    index = client.get_model_repository_index()
    assert {"name": "simple", "version": "1", "state": "READY"} in index
    assert client.get_model_repository_index() == index


def _simple_inputs(a: np.ndarray, b: np.ndarray, binary: bool = True) -> list[httpclient.InferInput]:
    inputs = [
        httpclient.InferInput("INPUT0", list(a.shape), "INT32"),
        httpclient.InferInput("INPUT1", list(b.shape), "INT32"),
    ]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs


@pytest.mark.parametrize(
    ("datatype", "binary_in", "binary_out"),
    [
        (datatype, binary_in, binary_out)
        for datatype, binary_in, binary_out in itertools.product(models.ALL_DATATYPES, (True, False), (True, False))
        if binary_in or datatype not in NO_JSON
    ],
)
def test_every_datatype_round_trips(
    client: httpclient.InferenceServerClient, datatype: str, binary_in: bool, binary_out: bool
) -> None:
    values = _values(datatype)
    tensor = httpclient.InferInput("IN", list(values.shape), datatype)
    tensor.set_data_from_numpy(values, binary_data=binary_in)
    output = httpclient.InferRequestedOutput("OUT", binary_data=binary_out)
    result = client.infer(f"identity_{datatype.lower()}", [tensor], outputs=[output], request_id="r1")
    back = result.as_numpy("OUT")
    assert result.get_response()["id"] == "r1"
    assert ("data" in result.get_output("OUT")) is not binary_out
    if datatype == "BYTES" and not binary_out:
        back = np.array([s.encode("utf-8") for s in back.reshape(-1)], dtype=object).reshape(back.shape)
    if datatype == "BF16":
        back = back.view(ml_dtypes.bfloat16) if back.dtype != ml_dtypes.bfloat16 else back
    assert back.shape == values.shape
    np.testing.assert_array_equal(back, values)


def test_requested_outputs_with_and_without_binary_data(client: httpclient.InferenceServerClient) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
    ]
    result = client.infer("simple", _simple_inputs(a, b, binary=False), outputs=outputs)
    assert result.get_output("OUTPUT0")["data"] == (a + b).reshape(-1).tolist()
    assert result.get_output("OUTPUT1")["parameters"]["binary_data_size"] == 64
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    only = client.infer("simple", _simple_inputs(a, b), outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert only.get_output("OUTPUT0") is None
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)
    everything = client.infer("simple", _simple_inputs(a, b))  # no outputs named: all, as binary
    assert all("parameters" in everything.get_output(name) for name in ("OUTPUT0", "OUTPUT1"))


def test_an_empty_outputs_list_asks_for_every_output(example_server: RunningServer) -> None:
    """``"outputs": []`` is answered with every output, as Triton answers it (Shoal answered none; found
    by the review of session 52)."""
    import http.client
    import json

    body = {
        "inputs": [
            {"name": name, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
            for name in ("INPUT0", "INPUT1")
        ],
        "outputs": [],
    }
    connection = http.client.HTTPConnection("127.0.0.1", example_server.http_port, timeout=10)
    connection.request("POST", "/v2/models/simple/infer", json.dumps(body))
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == 200, answer
    outputs = {output["name"]: output["data"] for output in answer["outputs"]}
    assert outputs == {"OUTPUT0": [2 * k for k in range(16)], "OUTPUT1": [0] * 16}


def test_nested_json_data_and_an_inline_request(example_server: RunningServer) -> None:
    """``data`` may be nested to the shape; the answer is flat, as Triton's."""
    import http.client
    import json

    body = {"inputs": [{"name": "IN", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}]}
    connection = http.client.HTTPConnection("127.0.0.1", example_server.http_port, timeout=10)
    connection.request("POST", "/v2/models/identity_int64/infer", json.dumps(body))
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == 200 and response.getheader("Content-Type") == "application/json"
    assert answer == {
        "model_name": "identity_int64",
        "model_version": "1",
        "outputs": [{"name": "OUT", "datatype": "INT64", "shape": [2, 2], "data": [1, 2, 3, 4]}],
    }


def test_classification_matches_grpc(example_server: RunningServer, client: httpclient.InferenceServerClient) -> None:
    values = np.array([[0.5, 3.0, -1.0, 2.0]], dtype=np.float32)
    tensor = httpclient.InferInput("IN", [1, 4], "FP32")
    tensor.set_data_from_numpy(values)
    for binary in (True, False):
        result = client.infer(
            "identity_fp32",
            [tensor],
            outputs=[httpclient.InferRequestedOutput("OUT", binary_data=binary, class_count=2)],
        )
        classes = [c.decode() if isinstance(c, bytes) else c for c in result.as_numpy("OUT").reshape(-1)]
        assert result.get_output("OUT")["datatype"] == "BYTES"
        with grpcclient.InferenceServerClient(example_server.url) as grpc:
            over_grpc = grpcclient.InferInput("IN", [1, 4], "FP32")
            over_grpc.set_data_from_numpy(values)
            expected = grpc.infer(
                "identity_fp32", [over_grpc], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=2)]
            ).as_numpy("OUT")
        assert classes == [c.decode() for c in expected.reshape(-1)] == ["3.000000:1", "2.000000:3"]


@pytest.mark.parametrize(("request_encoding", "response_encoding"), [("gzip", "deflate"), ("deflate", "gzip")])
def test_compression_both_ways(
    client: httpclient.InferenceServerClient, request_encoding: str, response_encoding: str
) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer(
        "simple",
        _simple_inputs(a, a),
        request_compression_algorithm=request_encoding,
        response_compression_algorithm=response_encoding,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def test_shared_memory_over_http(client: httpclient.InferenceServerClient) -> None:
    tag = f"{os.getpid()}_http"
    handles = {
        name: shm.create_shared_memory_region(f"{name}_{tag}", f"/shoal_http_{name}_{tag}", 64)
        for name in ("in0", "in1", "out0")
    }
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.full((1, 16), 2, dtype=np.int32)
        shm.set_shared_memory_region(handles["in0"], [a])
        shm.set_shared_memory_region(handles["in1"], [b])
        for name in handles:
            client.register_system_shared_memory(f"{name}_{tag}", f"/shoal_http_{name}_{tag}", 64)
        status = client.get_system_shared_memory_status(f"in0_{tag}")
        assert status == [{"name": f"in0_{tag}", "key": f"/shoal_http_in0_{tag}", "offset": 0, "byte_size": 64}]
        assert len(client.get_system_shared_memory_status()) == 3
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory(f"in0_{tag}", 64)
        inputs[1].set_shared_memory(f"in1_{tag}", 64)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory(f"out0_{tag}", 64)
        result = client.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handles["out0"], np.int32, [1, 16]), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)  # not in shared memory: in the body
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region: .never registered."):
            inputs[0].set_shared_memory("never registered", 64)
            client.infer("simple", inputs)
        client.unregister_system_shared_memory(f"in0_{tag}")
        assert len(client.get_system_shared_memory_status()) == 2
    finally:
        client.unregister_system_shared_memory()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)
    assert client.get_system_shared_memory_status() == []


def test_repository_load_and_unload(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    models.add_identity(repo, "ident", "FP32")
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "simple")
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert {"name": "ident"} in client.get_model_repository_index()  # never loaded: its name alone
        override = (
            '{"backend": "identity", "max_batch_size": 4, "input": [{"name": "IN", "data_type": '
            '"TYPE_FP32", "dims": [2]}], "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}]}'
        )
        client.load_model("ident", config=override)
        assert client.is_model_ready("ident") and client.get_model_config("ident")["max_batch_size"] == 4
        client.unload_model("ident", unload_dependents=True)
        assert not client.is_model_ready("ident")
        assert {
            "name": "ident",
            "version": "1",
            "state": "UNAVAILABLE",
            "reason": "unloaded",
        } in client.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="not valid JSON") as caught:
            client.load_model("ident", config="{nope")
        assert caught.value.status() == "400"
        with pytest.raises(InferenceServerException, match="is not supported") as caught:
            client.load_model("ident", files={"file:1/model.onnx": b"\x00"})
        client.load_model("ident")
        assert client.is_model_ready("ident")


def test_load_is_refused_without_explicit_mode(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("simple")
    assert caught.value.status() == "503"
    assert caught.value.message().startswith("explicit model load / unload is not allowed")


def test_every_worker_serves_http_and_a_replaced_one_too(tmp_path: Path) -> None:
    """With front-end workers, each one listens on the shared HTTP port, a restarted one included."""
    import signal

    from tests.conftest import serving
    from tests.core.test_frontend_workers import worker_pids
    from tests.polling import wait_until

    with serving(models.repository(tmp_path, "simple"), tmp_path, "--grpc-workers", "2") as server:
        where = f"HTTP on 127.0.0.1:{server.http_port}"
        wait_until(lambda: server.log().count(where) == 2, what="both workers to serve HTTP")
        victim = min(worker_pids(server))
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: len(live := worker_pids(server)) == 2 and victim not in live,  # one reading of /proc
            what="the killed worker to be replaced",
        )
        wait_until(lambda: server.log().count(where) == 3, what="the new worker to serve HTTP")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for _ in range(8):  # fresh connections: the kernel spreads them over both workers
            with httpclient.InferenceServerClient(server.http_url) as client:
                np.testing.assert_array_equal(client.infer("simple", _simple_inputs(a, a)).as_numpy("OUTPUT0"), a + a)


def test_sigterm_drains_http_requests_and_readiness_turns_false(tmp_path: Path, server_factory) -> None:
    """app.serve's stop order holds for HTTP: requests in flight are answered, ready turns 400 meanwhile,
    then the server exits 0."""
    import signal
    import threading

    from tests.http_api.test_http_errors import call
    from tests.polling import metric, wait_until

    repo = models.repository(tmp_path)
    models.add_delayed_identity(repo, "slow", delay_ms=1000)
    server = server_factory(repo)
    outcome: list[object] = []

    def slow() -> None:
        with httpclient.InferenceServerClient(server.http_url, network_timeout=30) as client:
            tensor = httpclient.InferInput("IN", [1, 2], "INT64")
            tensor.set_data_from_numpy(np.array([[7, 8]], dtype=np.int64), binary_data=False)
            outcome.append(client.infer("slow", [tensor]).as_numpy("OUT").tolist())

    # Two requests on the one instance: one waits while the other runs, so both are in flight once one
    # is seen pending (the one running is not counted: the first alone could be answered before a look).
    threads = [threading.Thread(target=slow) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: metric(server, "nv_inference_pending_request_count", "slow") >= 1,
        what="a request waiting for the model while the other runs",
    )
    server.process.send_signal(signal.SIGTERM)
    wait_until(lambda: call(server, "GET", "/v2/health/ready")[0] == 400, what="readiness to turn false")
    for thread in threads:
        thread.join(timeout=30)
    assert outcome == [[[7, 8]], [[7, 8]]]
    assert server.process.wait(timeout=30) == 0, server.log()


def test_cuda_shared_memory_over_http(server_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA endpoints over the stand-in runtime test_cuda_shared_memory.py builds (real C signatures,
    host memory): register, status, an output written to a region read back as the next input, unregister."""
    import base64

    from shoal.backends.devices import cuda_device_count
    from shoal.dataplane import cuda
    from tests.core.test_cuda_shared_memory import _build_fake_cudart

    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is here: the server would use it, not the stand-in")
    library = _build_fake_cudart(tmp_path)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(library.parent))
    first = cuda._libcudart_candidates()[0]
    if "/" in first:
        pytest.skip(f"a CUDA runtime is installed with Python packages ({first}): the server would load it")
    (library.parent / first).symlink_to(library)
    (library.parent / "libcuda.so.1").symlink_to(library)
    repo = tmp_path / "repo"
    models.add_identity(repo, "identity_fp32", "FP32")
    server = server_factory(repo)
    values = np.array([[1.5, -2.0, 3.25, 8.0]], dtype=np.float32)
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert client.get_cuda_shared_memory_status() == []
        handle = base64.b64encode(b"A" + bytes(62) + b"z").decode()  # JSON carries the base64 text
        client.register_cuda_shared_memory("a", handle, 0, 256)
        assert client.get_cuda_shared_memory_status("a") == [{"name": "a", "device_id": 0, "byte_size": 256}]
        tensor = httpclient.InferInput("IN", [1, 4], "FP32")
        tensor.set_data_from_numpy(values)
        output = httpclient.InferRequestedOutput("OUT")
        output.set_shared_memory("a", 16, offset=32)
        result = client.infer("identity_fp32", [tensor], outputs=[output])
        assert "data" not in result.get_output("OUT") and "parameters" not in result.get_output("OUT")
        tensor.set_shared_memory("a", 16, offset=32)
        np.testing.assert_array_equal(client.infer("identity_fp32", [tensor]).as_numpy("OUT"), values)
        with pytest.raises(InferenceServerException, match="failed to register shared memory region 'big'") as caught:
            client.register_cuda_shared_memory("big", base64.b64encode(b"B" + bytes(62) + b"z").decode(), 0, 257)
        assert caught.value.status() == "400"
        with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region") as caught:
            client.get_cuda_shared_memory_status("nope")
        assert caught.value.status() == "404"
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status() == []


def test_sequences_over_http(tmp_path: Path, server_factory) -> None:
    """Sequence parameters travel as the request's ``parameters`` (sequence_id, _start, _end), as over gRPC."""
    from tests.sequence_models import add_accumulator

    repo = tmp_path / "repo"
    add_accumulator(repo, "acc")
    add_accumulator(repo, "acc_text", corrid_type="TYPE_STRING")  # string ids
    server = server_factory(repo)
    with httpclient.InferenceServerClient(server.http_url) as client:
        sums = {}
        for model, cid in (("acc", 7), ("acc_text", "text-id")):
            sums[cid] = []
            for index, value in enumerate((1.0, 2.0, 4.0)):
                data = httpclient.InferInput("INPUT", [1, 1], "FP32")
                data.set_data_from_numpy(np.full((1, 1), value, dtype=np.float32), binary_data=index % 2 == 0)
                result = client.infer(
                    model, [data], sequence_id=cid, sequence_start=index == 0, sequence_end=index == 2
                )
                sums[cid].append(float(result.as_numpy("OUTPUT").item()))
        assert sums == {7: [1.0, 3.0, 7.0], "text-id": [1.0, 3.0, 7.0]}
        data = httpclient.InferInput("INPUT", [1, 1], "FP32")
        data.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("acc", [data])  # no sequence id: refused in Triton's words, as 400
        assert (
            caught.value.status() == "400"
            and "must specify a non-zero or non-empty correlation ID" in caught.value.message()
        )
