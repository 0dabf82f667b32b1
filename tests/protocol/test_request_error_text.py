"""Request errors in Triton's exact words, where Triton answers the same case (clients match on them).

Each expected text is copied from Triton's source, named in the test: core ``src/infer_request.cc``
(``Normalize``, ``ValidateRequestInputs``, ``ValidateBytesInputs``, ``AddOriginalInput``), core
``src/model.cc`` (``GetInput``, ``GetOutput``) and server ``src/grpc/infer_handler.cc``
(``InferGRPCToInput``); Triton's own tests assert the same texts (server
``qa/L0_input_validation/input_validation_test.py``, core ``src/test/input_byte_size_test.cc``).
Triton begins its core's messages with the request's label, ``[request id: <id_unknown>] `` for a
request without an id (``CORE``); so does Shoal, and not the front end's messages, as Triton.
Malformed payloads that tritonclient refuses to build go through tritonclient's own generated
stub, so they still cross the real wire.
"""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningServer, serving

A = np.arange(16, dtype=np.int32).reshape(1, 16)
CORE = "[request id: <id_unknown>] "  # infer_request.cc LogRequest(), for a request without an id


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")  # max_batch_size 8, INPUT0/INPUT1 INT32 dims [16]
    models.add_onnx_strings(repo)  # "strings": BYTES IN -> OUT, dims [-1], no batching
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.url) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _input(name: str, array: np.ndarray, datatype: str = "INT32") -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _error(
    client: triton.InferenceServerClient,
    model: str,
    inputs: list[triton.InferInput],
    outputs: list[triton.InferRequestedOutput] | None = None,
) -> str:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, inputs, outputs=outputs)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    return str(caught.value.message())


def _raw_error(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(caught.value.details())


def _simple_request(*shapes: list[int]) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name, shape in zip(("INPUT0", "INPUT1"), shapes, strict=False):
        request.inputs.add(name=name, datatype="INT32", shape=shape)
    return request


def _strings_request(shape: list[int], raw: bytes) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="strings")
    request.inputs.add(name="IN", datatype="BYTES", shape=shape)
    request.raw_input_contents.append(raw)
    return request


def _strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def test_missing_input(client: triton.InferenceServerClient) -> None:
    """infer_request.cc ValidateRequestInputs, the message for a model without optional inputs."""
    message = _error(client, "simple", [_input("INPUT0", A)])
    assert message == (
        CORE + "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], "
        "but missing required input(s) ['INPUT1']. Please provide all required input(s)."
    )


def test_no_inputs(client: triton.InferenceServerClient) -> None:
    """infer_request.cc ValidateRequestInputs: no inputs print as ``[]``."""
    message = _error(client, "simple", [])
    assert message == (
        CORE + "expected 2 inputs but got 0 inputs for model 'simple'. Got input(s) [], "
        "but missing required input(s) ['INPUT0','INPUT1']. Please provide all required input(s)."
    )


def test_unknown_input_in_place_of_a_required_one(client: triton.InferenceServerClient) -> None:
    """With as many inputs as the model takes, an unknown name is model.cc GetInput's message."""
    message = _error(client, "simple", [_input("INPUT0", A), _input("INPUT9", A)])
    assert message == "unexpected inference input 'INPUT9' for model 'simple'"


def test_unknown_output(client: triton.InferenceServerClient) -> None:
    """model.cc GetOutput, checked before the inputs (infer_request.cc Normalize)."""
    message = _error(client, "simple", [_input("INPUT0", A)], [triton.InferRequestedOutput("OUTPUT7")])
    assert message == "unexpected inference output 'OUTPUT7' for model 'simple'"


def test_batch_too_large(client: triton.InferenceServerClient) -> None:
    """infer_request.cc Normalize: the batch size against max_batch_size, nothing appended."""
    big = np.zeros((9, 16), dtype=np.int32)
    message = _error(client, "simple", [_input("INPUT0", big), _input("INPUT1", big)])
    assert message == CORE + "inference request batch-size must be <= 8 for 'simple'"


def test_batch_sizes_differ(client: triton.InferenceServerClient) -> None:
    """infer_request.cc Normalize: every input's first dimension is the batch size."""
    message = _error(client, "simple", [_input("INPUT0", A), _input("INPUT1", np.zeros((2, 16), np.int32))])
    assert message == CORE + "input 'INPUT1' batch size does not match other inputs for 'simple'"


def test_wrong_datatype(client: triton.InferenceServerClient) -> None:
    """infer_request.cc Normalize: the request's datatype against the config's."""
    message = _error(client, "simple", [_input("INPUT0", A.astype(np.float32), "FP32"), _input("INPUT1", A)])
    assert message == CORE + "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"


def test_wrong_shape_with_batching(client: triton.InferenceServerClient) -> None:
    """infer_request.cc Normalize: shapes print as DimsListToString does (``[-1,16]``), and a
    batching model's message ends with Triton's note on the implicit batch dimension."""
    message = _error(client, "simple", [_input("INPUT0", A), _input("INPUT1", A.reshape(1, 2, 8))])
    assert message == (
        CORE + "unexpected shape for input 'INPUT1' for model 'simple'. Expected [-1,16], got [1,2,8]. "
        "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
        "prepended to each input shape. If you want to specify the full shape including the batch dim in "
        "your input dims config, try setting max_batch_size to zero. See the model configuration docs for "
        "more info on max_batch_size."
    )


def test_wrong_shape_without_batching(client: triton.InferenceServerClient) -> None:
    """infer_request.cc Normalize: without batching the note is empty, so the text ends in ``". "``."""
    strings = np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object)
    message = _error(client, "strings", [_input("IN", strings, "BYTES")])
    assert message == CORE + "unexpected shape for input 'IN' for model 'strings'. Expected [-1], got [2,2]. "


def test_raw_byte_size_mismatch(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_request.cc Normalize: raw content of another size than the shape needs."""
    request = _simple_request([1, 16], [1, 16])
    request.raw_input_contents.extend([A.tobytes(), A.tobytes()[:60]])
    assert _raw_error(stub, request) == (
        CORE + "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 60"
    )


def test_typed_contents_count_mismatch(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_handler.cc InferGRPCToInput turns typed contents into bytes; the core then finds the
    same byte-size mismatch (15 INT32 values: 60 bytes for a shape of 64)."""
    request = _simple_request([1, 16], [1, 16])
    request.inputs[0].contents.int_contents.extend(range(16))
    request.inputs[1].contents.int_contents.extend(range(15))
    assert _raw_error(stub, request) == (
        CORE + "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 60"
    )


def test_bytes_fewer_elements_than_the_shape(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_request.cc ValidateBytesInputs, the issue's case: shape [3], two strings sent."""
    message = _raw_error(stub, _strings_request([3], _strings(b"ab", b"c")))
    assert message == CORE + "expected 3 string elements for inference input 'IN' for model 'strings', got 2"


def test_bytes_more_elements_than_the_shape(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_request.cc ValidateBytesInputs stops at the first element past the shape's count."""
    message = _raw_error(stub, _strings_request([1], _strings(b"ab", b"c", b"d")))
    assert message == (
        CORE + "unexpected number of string elements 2 for inference input 'IN' for model 'strings', expecting 1"
    )


def test_bytes_more_typed_elements_than_the_shape(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """Typed bytes_contents are serialized by the front end, then read by ValidateBytesInputs."""
    request = service_pb2.ModelInferRequest(model_name="strings")
    request.inputs.add(name="IN", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"a", b"b", b"c"])
    message = _raw_error(stub, request)
    assert message == (
        CORE + "unexpected number of string elements 3 for inference input 'IN' for model 'strings', expecting 2"
    )


def test_bytes_cut_inside_a_length_prefix(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_request.cc ValidateBytesInputs: fewer than 4 bytes left where a length should start."""
    message = _raw_error(stub, _strings_request([2], _strings(b"ab") + b"\x01\x00"))
    assert message == (
        CORE + "incomplete string length indicator for inference input 'IN' for model 'strings', expecting 4 bytes "
        "but only 2 bytes available. Please make sure the string length indicator is in one buffer."
    )


def test_input_listed_twice(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_request.cc AddOriginalInput."""
    request = _simple_request([1, 16], [1, 16])
    request.inputs[1].name = "INPUT0"
    request.raw_input_contents.extend([A.tobytes(), A.tobytes()])
    assert _raw_error(stub, request) == CORE + "input 'INPUT0' already exists in request"


def test_input_without_data(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_handler.cc InferGRPCToInput: fewer raw_input_contents than inputs."""
    request = _simple_request([1, 16], [1, 16])
    request.raw_input_contents.append(A.tobytes())
    assert _raw_error(stub, request) == "unable to find data for input tensor 'INPUT1' for model 'simple' in request."


def test_contents_beside_raw_contents(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_handler.cc InferGRPCToInput: typed contents and raw_input_contents in one request."""
    request = _simple_request([1, 16], [1, 16])
    request.inputs[0].contents.int_contents.extend(range(16))
    request.raw_input_contents.extend([A.tobytes(), A.tobytes()])
    assert _raw_error(stub, request) == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"
    )


def test_contents_of_another_type(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_handler.cc InferGRPCToInputHelper: typed contents in a field of another type."""
    request = _simple_request([1, 16], [1, 16])
    request.inputs[0].contents.int_contents.extend(range(16))
    request.inputs[1].contents.fp32_contents.extend([1.0] * 16)
    assert _raw_error(stub, request) == (
        "unexpected explicit tensor data for input tensor 'INPUT1' for model "
        "'simple' of type 'FP32', expected datatype 'INT32'"
    )


def test_contents_in_two_fields(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_handler.cc InferGRPCToInputHelper: a second non-empty field after the first."""
    request = _simple_request([1, 16], [1, 16])
    request.inputs[0].contents.int_contents.extend(range(16))
    request.inputs[1].contents.int_contents.extend(range(16))
    request.inputs[1].contents.fp32_contents.extend([1.0] * 16)
    assert _raw_error(stub, request) == (
        "unexpected explicit tensor data for input tensor 'INPUT1' for model "
        "'simple', binary data was already supplied."
    )


def test_the_server_still_serves(client: triton.InferenceServerClient) -> None:
    result = client.infer("simple", [_input("INPUT0", A), _input("INPUT1", A)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + A)


def test_the_label_names_the_request_id_over_both_transports(
    client: triton.InferenceServerClient, server: RunningServer
) -> None:
    """infer_request.cc LogRequest: a request with an id is labelled with it (run on Triton 2.51:
    ``[request id: r-7] unexpected shape ...`` over gRPC, ``[request id: abc] inference input ...``
    over HTTP); the front end's own messages carry no label."""
    wrong = [_input("INPUT0", A), _input("INPUT1", A.reshape(1, 2, 8))]
    with pytest.raises(InferenceServerException) as caught:
        client.infer("simple", wrong, request_id="r-7")
    assert str(caught.value.message()).startswith("[request id: r-7] unexpected shape for input 'INPUT1'")
    with httpclient.InferenceServerClient(server.http_url) as http:
        typed = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        typed.set_data_from_numpy(A.astype(np.float32))
        other = httpclient.InferInput("INPUT1", [1, 16], "INT32")
        other.set_data_from_numpy(A)
        with pytest.raises(InferenceServerException) as refused:
            http.infer("simple", [typed, other], request_id="abc")
        assert refused.value.message() == (
            "[request id: abc] inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"
        )
        with pytest.raises(InferenceServerException) as unknown:
            http.infer("simple", [_http_input("INPUT0"), _http_input("INPUT9")], request_id="abc")
        assert unknown.value.message() == "unexpected inference input 'INPUT9' for model 'simple'"


def test_a_negative_dimension_in_tritons_words(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """infer_request.cc Normalize, over gRPC (whose shapes are signed): run on Triton 2.51."""
    request = _simple_request([-1, 16], [1, 16])
    request.raw_input_contents.extend([A.tobytes(), A.tobytes()])
    assert _raw_error(stub, request) == (
        CORE + "All input dimensions should be specified for input 'INPUT0' for model 'simple', got [-1,16]"
    )


def _http_input(name: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, [1, 16], "INT32")
    tensor.set_data_from_numpy(A)
    return tensor


def test_request_parameters_starting_with_triton_are_refused(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, server: RunningServer
) -> None:
    """Triton keeps ``triton_`` request parameters for itself (run on Triton 2.51, session 53; Shoal
    took them): gRPC refuses all but ``triton_enable_empty_final_response``, which must be a bool,
    before it reads the inputs (a bad datatype is not what it names); HTTP refuses every one. Input
    and output parameters, and keys only like the prefix (``Triton_x``), are not refused."""
    for key in ("triton_x", "triton_"):
        request = _simple_request([1, 16], [1, 16])
        request.inputs[0].datatype = "NO_SUCH_TYPE"
        request.parameters[key].int64_param = 1
        assert _raw_error(stub, request) == (
            "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
            "starting with 'triton_' are allowed: triton_enable_empty_final_response"
        )
    request = _simple_request([1, 16], [1, 16])
    request.parameters["triton_enable_empty_final_response"].int64_param = 1
    assert _raw_error(stub, request) == (
        "invalid value type for 'triton_enable_empty_final_response' parameter, expected bool_param."
    )
    for name, fill in (("allowed", "triton_enable_empty_final_response"), ("like", "Triton_x")):
        request = _simple_request([1, 16], [1, 16])
        request.parameters[fill].bool_param = True
        request.inputs[0].parameters["triton_y"].int64_param = 1
        request.outputs.add(name="OUTPUT0").parameters["triton_z"].int64_param = 1
        request.raw_input_contents.extend([A.tobytes(), A.tobytes()])
        answer = stub.ModelInfer(request)
        assert np.frombuffer(answer.raw_output_contents[0], np.int32).tolist() == (A + A).ravel().tolist(), name
    inputs = [
        {"name": name, "datatype": "INT32", "shape": [1, 16], "data": A.ravel().tolist()}
        for name in ("INPUT0", "INPUT1")
    ]
    url = f"http://{server.http_url}/v2/models/simple/infer"
    for key in ("triton_x", "triton_enable_empty_final_response"):  # raw: tritonclient refuses to send them
        body = json.dumps({"inputs": inputs, "parameters": {key: True}}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, body, method="POST"), timeout=30)
        assert refused.value.code == 400
        assert json.loads(refused.value.read())["error"] == (
            "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified."
        )
    body = json.dumps({"inputs": inputs, "parameters": {"Triton_x": 1}}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, body, method="POST"), timeout=30) as answer:
        assert json.loads(answer.read())["outputs"][0]["data"] == (A + A).ravel().tolist()
