"""What Triton 2.51 answers on the wire, where Shoal's answers differed (issue 23, items 2-4).

Each expected value was read from a real tritonserver 2.51 serving the same configs
(``/work/shared/tools/triton_peer/run_triton.sh``, Python-backend models of these shapes):

- HTTP answers built from protobuf messages print every field, defaults included
  (``"max_batch_size": 0``), with the 64-bit fields Triton fixes as JSON numbers (core
  ``model_config_utils.cc`` ``ModelConfigToJson``); statistics carry ``cache_hit``, ``cache_miss``
  and ``response_stats``.
- Only a successful inference answer is compressed, and only when its request accepts it (server
  ``src/http_server.cc``: ``GetResponseCompressionType`` is called for infer requests alone).
  aiohttp asks for gzip on its own, and tritonclient.http.aio reads other answers uncompressed.
- A load that fails is INVALID_ARGUMENT ``load failed for model 'M': version 1 is at UNAVAILABLE
  state: ...;``; one Triton cannot read from the repository (no folder; a ``file:`` part past
  NAME_MAX, which 2.51 itself dies on and the client's model-control example asserts) is INTERNAL
  ``failed to load 'M', failed to poll from model repository``.
- Of several BYTES inputs whose element counts are wrong, Triton names the one sent last.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from shoal.repository.config_json import model_config
from tests import models
from tests.conftest import RunningServer, serving
from tests.http_api.test_http_errors import call, error

A = np.arange(16, dtype=np.int32)
CORE = "[request id: <id_unknown>] "  # Triton core's label of a request without an id (infer_request.cc LogRequest)
TWO_STRINGS = """
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] } ]
"""
BATCHED = """
backend: "identity"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 100 priority_levels: 2 default_priority_level: 1 }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
# Triton 2.51's GET /v2/models/nobatch/config for the same config (python backend): its keys, and those
# of its input and instance group (every field of the message is printed, defaults included).
TRITON_CONFIG_KEYS = {
    "backend",
    "batch_input",
    "batch_output",
    "cc_model_filenames",
    "default_model_filename",
    "input",
    "instance_group",
    "max_batch_size",
    "metric_tags",
    "model_warmup",
    "name",
    "optimization",
    "output",
    "parameters",
    "platform",
    "runtime",
    "version_policy",
}
TRITON_INPUT = {
    "allow_ragged_batch": False,
    "data_type": "TYPE_INT32",
    "dims": [16],
    "format": "FORMAT_NONE",
    "is_non_linear_format_io": False,
    "is_shape_tensor": False,
    "name": "IN",
    "optional": False,
}
TRITON_GROUP_KEYS = {"count", "gpus", "host_policy", "kind", "name", "passive", "profile", "secondary_devices"}
TRITON_OPTIMIZATION = {
    "eager_batching": False,
    "gather_kernel_buffer_threshold": 0,
    "input_pinned_memory": {"enable": True},
    "output_pinned_memory": {"enable": True},
    "priority": "PRIORITY_DEFAULT",
}
DURATION_KEYS = {
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_identity(repo, "nobatch", "INT32", max_batch_size=0, dims="[ 16 ]")
    models.write_config(repo / "batched", BATCHED)
    (repo / "batched" / "1").mkdir()
    models.write_config(repo / "strs", TWO_STRINGS)
    (repo / "strs" / "1").mkdir()
    models.add_broken_models(repo)  # corrupt_file: its version fails to load
    with serving(
        repo,
        tmp_path_factory.mktemp("server"),
        *layout,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "nobatch",
        "--load-model",
        "batched",
        "--load-model",
        "strs",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(server.http_url) as triton:
        yield triton


# -- item 2: every field of the message, as Triton prints it ----------------------------------------


def test_config_prints_default_valued_fields(client: httpclient.InferenceServerClient) -> None:
    config = client.get_model_config("nobatch")
    assert config["max_batch_size"] == 0  # the key Triton's auto-complete client reads; it was left out
    assert set(config) == TRITON_CONFIG_KEYS
    assert config["input"] == [TRITON_INPUT]
    assert set(config["instance_group"][0]) == TRITON_GROUP_KEYS
    assert config["optimization"] == TRITON_OPTIMIZATION
    assert config["platform"] == "" and config["parameters"] == {} and config["batch_input"] == []


def test_config_64_bit_fields_are_numbers_where_triton_makes_them_numbers(
    client: httpclient.InferenceServerClient,
) -> None:
    batching = client.get_model_config("batched")["dynamic_batching"]
    assert batching == {
        "max_queue_delay_microseconds": 100,
        "preferred_batch_size": [8],
        "preserve_ordering": False,
        "priority_levels": 2,
        "default_priority_level": 1,
        "priority_queue_policy": {},
    }


def test_config_64_bit_fields_triton_misses_stay_strings() -> None:
    """ModelConfigToJson fixes a listed set of fields; the others keep protobuf's strings."""
    document = model_config(
        {
            "name": "m",
            "instance_group": [{"secondary_devices": [{"device_id": "3"}]}],
            "sequence_batching": {"state": [{"dims": ["2"], "initial_state": [{"dims": ["2"]}]}]},
            "model_warmup": [{"name": "w", "inputs": {"IN": {"dims": ["4"], "zero_data": True}}}],
        }
    )
    assert document["instance_group"][0]["secondary_devices"][0]["device_id"] == "3"
    state = document["sequence_batching"]["state"][0]
    assert state["dims"] == [2] and state["initial_state"][0]["dims"] == ["2"]
    assert document["model_warmup"][0]["inputs"]["IN"]["dims"] == [4]


def test_config_over_http_is_the_grpc_config(server: RunningServer, client: httpclient.InferenceServerClient) -> None:
    with grpcclient.InferenceServerClient(server.url) as triton:
        over_grpc = triton.get_model_config("batched").config
    assert json_format.ParseDict(client.get_model_config("batched"), type(over_grpc)()) == over_grpc


def test_statistics_have_triton_keys(client: httpclient.InferenceServerClient) -> None:
    client.infer("nobatch", [_int_input()])
    row = client.get_inference_statistics("nobatch")["model_stats"][0]
    assert set(row["inference_stats"]) == DURATION_KEYS
    assert row["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0} and row["response_stats"] == {}


# -- item 3: only inference answers are compressed ---------------------------------------------------


def test_aio_client_reads_every_answer(server: RunningServer) -> None:
    """aiohttp sends ``Accept-Encoding: gzip, deflate`` by itself; tritonclient.http.aio does not
    decompress: statistics came back gzip and failed with UnicodeDecodeError."""

    async def scenario() -> None:
        triton = aioclient.InferenceServerClient(server.http_url)
        try:
            assert (await triton.get_inference_statistics("nobatch"))["model_stats"][0]["name"] == "nobatch"
            assert (await triton.get_model_config("nobatch"))["max_batch_size"] == 0
            assert (await triton.get_model_metadata("nobatch"))["inputs"][0]["shape"] == [16]
            assert {row["name"] for row in await triton.get_model_repository_index()} >= {"nobatch", "strs"}
            assert (await triton.get_server_metadata())["name"] == "shoal"
            for algorithm in ("gzip", "deflate", None):
                inputs = [aioclient.InferInput("IN", [16], "INT32")]
                inputs[0].set_data_from_numpy(A)
                result = await triton.infer("nobatch", inputs, response_compression_algorithm=algorithm)
                np.testing.assert_array_equal(result.as_numpy("OUT"), A)
        finally:
            await triton.close()

    asyncio.run(scenario())


def test_sync_client_reads_every_answer_and_compressed_inference(client: httpclient.InferenceServerClient) -> None:
    assert client.get_inference_statistics("nobatch")["model_stats"][0]["name"] == "nobatch"
    assert client.get_model_metadata("nobatch")["name"] == "nobatch"
    for algorithm in ("gzip", "deflate"):
        result = client.infer("nobatch", [_int_input()], response_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUT"), A)


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/v2/models/nobatch/config", b""),
        ("GET", "/v2/models/nobatch", b""),
        ("GET", "/v2/models/nobatch/stats", b""),
        ("GET", "/v2/models/stats", b""),
        ("GET", "/v2", b""),
        ("POST", "/v2/repository/index", b"{}"),
        ("GET", "/v2/systemsharedmemory/status", b""),
        ("GET", "/v2/cudasharedmemory/status", b""),
        ("GET", "/v2/models/nope/config", b""),
        ("POST", "/v2/models/nobatch/infer", b'{"inputs": []}'),  # an inference that fails: not compressed either
    ],
)
def test_no_answer_but_inference_is_compressed(server: RunningServer, method: str, path: str, body: bytes) -> None:
    status, headers, content = call(server, method, path, body, {"Accept-Encoding": "gzip, deflate"})
    assert "content-encoding" not in headers, (status, headers)
    json.loads(content)


def test_an_inference_answer_is_compressed_when_its_request_accepts_it(server: RunningServer) -> None:
    body = json.dumps({"inputs": [{"name": "IN", "datatype": "INT32", "shape": [16], "data": A.tolist()}]})
    status, headers, content = call(server, "POST", "/v2/models/nobatch/infer", body, {"Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(content))["outputs"][0]["data"] == A.tolist()


# -- item 4: load failures and BYTES counts in Triton's status and words -----------------------------


def test_a_version_that_fails_to_load_is_invalid_argument(server: RunningServer) -> None:
    prefix = "load failed for model 'corrupt_file': version 1 is at UNAVAILABLE state: "
    with grpcclient.InferenceServerClient(server.url) as triton, pytest.raises(InferenceServerException) as caught:
        triton.load_model("corrupt_file")
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = caught.value.message()
    assert message.startswith(prefix) and message.endswith(";"), message
    status, words = error(server, "POST", "/v2/repository/models/corrupt_file/load")
    assert status == 400 and words.startswith(prefix) and words.endswith(";"), words


def test_a_model_not_in_the_repository_fails_to_poll(server: RunningServer) -> None:
    words = "failed to load 'missing', failed to poll from model repository"
    with grpcclient.InferenceServerClient(server.url) as triton, pytest.raises(InferenceServerException) as caught:
        triton.load_model("missing")
    assert caught.value.status() == "StatusCode.INTERNAL" and words in caught.value.message()
    status, message = error(server, "POST", "/v2/repository/models/missing/load")
    assert status == 500 and words in message


def test_a_file_name_past_name_max_is_internal(server: RunningServer) -> None:
    """Triton client's simple_grpc_model_control.py: status INTERNAL, 'failed to poll from model repository'."""
    long_path = "file:" + "A" * 256
    with grpcclient.InferenceServerClient(server.url) as triton:
        with pytest.raises(InferenceServerException) as caught:
            triton.load_model("nobatch", config="{}", files={long_path: b"a"})
        assert caught.value.status() == "StatusCode.INTERNAL"
        assert "failed to poll from model repository" in caught.value.message()
        with pytest.raises(InferenceServerException) as caught:  # a name that fits: not supported, as before
            triton.load_model("nobatch", config="{}", files={"file:1/model.onnx": b"a"})
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert triton.is_server_live() and triton.is_model_ready("nobatch")
    status, message = error(
        server, "POST", "/v2/repository/models/nobatch/load", {"parameters": {"config": "{}", long_path: "YQ=="}}
    )
    assert status == 500 and "failed to poll from model repository" in message


# (counts of INPUT0 and INPUT1, the order they are sent in) -> Triton 2.51's message
BYTES_CASES = [
    ((16, 14), (0, 1), CORE + "expected 16 string elements for inference input 'INPUT1' for model 'strs', got 14"),
    (
        (16, 17),
        (0, 1),
        CORE + "unexpected number of string elements 17 for inference input 'INPUT1' for model 'strs', expecting 16",
    ),
    ((14, 15), (0, 1), CORE + "expected 16 string elements for inference input 'INPUT1' for model 'strs', got 15"),
    ((14, 15), (1, 0), CORE + "expected 16 string elements for inference input 'INPUT0' for model 'strs', got 14"),
    (
        (14, 17),
        (0, 1),
        CORE + "unexpected number of string elements 17 for inference input 'INPUT1' for model 'strs', expecting 16",
    ),
    ((14, 17), (1, 0), CORE + "expected 16 string elements for inference input 'INPUT0' for model 'strs', got 14"),
]


def _strings(count: int) -> bytes:
    return b"".join(struct.pack("<I", 1) + b"a" for _ in range(count))


@pytest.mark.parametrize("counts, order, words", BYTES_CASES)
def test_bytes_counts_over_grpc_raw_contents(
    server: RunningServer, counts: tuple[int, int], order: tuple[int, int], words: str
) -> None:
    request = service_pb2.ModelInferRequest(model_name="strs")
    for index in order:
        request.inputs.add(name=f"INPUT{index}", datatype="BYTES", shape=[16])
        request.raw_input_contents.append(_strings(counts[index]))
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, words)


@pytest.mark.parametrize("counts, order, words", BYTES_CASES)
def test_bytes_counts_over_http_binary(
    server: RunningServer, counts: tuple[int, int], order: tuple[int, int], words: str
) -> None:
    inputs, binary = [], b""
    for index in order:
        data = _strings(counts[index])
        inputs.append(
            {"name": f"INPUT{index}", "datatype": "BYTES", "shape": [16], "parameters": {"binary_data_size": len(data)}}
        )
        binary += data
    header = json.dumps({"inputs": inputs}).encode()
    assert error(
        server, "POST", "/v2/models/strs/infer", header + binary, {"Inference-Header-Content-Length": str(len(header))}
    ) == (400, words)


def test_a_front_end_error_comes_before_a_content_error(server: RunningServer) -> None:
    """Triton's front end (server src/grpc/infer_handler.cc ``InferGRPCToInput``) reads every input
    before its core checks contents: an input without data is named, though the one before it has
    too few strings (Triton 2.51 answers so)."""
    request = service_pb2.ModelInferRequest(model_name="strs")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[16])
    request.inputs.add(name="INPUT1", datatype="BYTES", shape=[16])
    request.raw_input_contents.append(_strings(14))
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert caught.value.details() == "unable to find data for input tensor 'INPUT1' for model 'strs' in request."


def test_typed_bytes_contents_name_the_last_unfit_input(server: RunningServer) -> None:
    """Typed ``bytes_contents`` are serialized by the front end and counted by the core, in the same
    order as raw contents (Triton 2.51: INPUT1 named)."""
    request = service_pb2.ModelInferRequest(model_name="strs")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[16]).contents.bytes_contents.extend([b"a"] * 14)
    request.inputs.add(name="INPUT1", datatype="BYTES", shape=[16]).contents.bytes_contents.extend([b"a"] * 15)
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert caught.value.details() == (
        CORE + "expected 16 string elements for inference input 'INPUT1' for model 'strs', got 15"
    )


def _int_input() -> httpclient.InferInput:
    tensor = httpclient.InferInput("IN", [16], "INT32")
    tensor.set_data_from_numpy(A)
    return tensor
