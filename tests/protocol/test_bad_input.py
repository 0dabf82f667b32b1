"""Each bad request gets a clear status naming model and tensor, and the next request succeeds."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests.grpc_api.test_rpcs import A, B, decode, simple_request


def _mutate(change: Callable[[pb.ModelInferRequest], None]) -> pb.ModelInferRequest:
    request = simple_request()
    change(request)
    return request


def _wrong_shape(r: pb.ModelInferRequest) -> None:
    r.inputs[0].shape[:] = [1, 8]
    r.raw_input_contents[0] = r.raw_input_contents[0][:32]


def _missing_input(r: pb.ModelInferRequest) -> None:
    del r.inputs[1]
    del r.raw_input_contents[1]


def _extra_input(r: pb.ModelInferRequest) -> None:
    r.inputs.add(name="INPUT9", datatype="INT32", shape=[1, 16])
    r.raw_input_contents.append(A.tobytes())


def _too_big_batch(r: pb.ModelInferRequest) -> None:
    big = np.zeros((9, 16), dtype=np.int32).tobytes()
    for index in range(2):
        r.inputs[index].shape[:] = [9, 16]
        r.raw_input_contents[index] = big


def _mixed_batch(r: pb.ModelInferRequest) -> None:
    r.inputs[1].shape[:] = [2, 16]
    r.raw_input_contents[1] = np.zeros((2, 16), dtype=np.int32).tobytes()


def _zero_batch_beside_one(r: pb.ModelInferRequest) -> None:
    r.inputs[0].shape[:] = [0, 16]
    r.raw_input_contents[0] = b""


def _raw_count(r: pb.ModelInferRequest) -> None:
    del r.raw_input_contents[1]


CASES = {
    "unknown model": (
        lambda r: setattr(r, "model_name", "nope"),
        grpc.StatusCode.NOT_FOUND,
        "Request for unknown model: 'nope' is not found",
    ),
    "unknown version": (
        lambda r: setattr(r, "model_version", "9"),
        grpc.StatusCode.NOT_FOUND,
        "'simple' version 9 is not found",
    ),
    "wrong datatype": (
        lambda r: setattr(r.inputs[0], "datatype", "FP32"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'",
    ),
    "unknown datatype": (
        lambda r: setattr(r.inputs[0], "datatype", "COMPLEX"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'INPUT0': unknown datatype 'COMPLEX'",
    ),
    "wrong shape": (
        _wrong_shape,
        grpc.StatusCode.INVALID_ARGUMENT,
        "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,8]. NOTE:",
    ),
    "missing input": (_missing_input, grpc.StatusCode.INVALID_ARGUMENT, "missing required input(s) ['INPUT1']"),
    "extra input": (
        _extra_input,
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected 2 inputs but got 3 inputs for model 'simple'",
    ),
    "unknown output": (
        lambda r: r.outputs.add(name="OUTPUT7"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unexpected inference output 'OUTPUT7' for model 'simple'",
    ),
    "raw byte size": (
        lambda r: r.raw_input_contents.__setitem__(1, b"\x00" * 63),
        grpc.StatusCode.INVALID_ARGUMENT,
        "[request id: <id_unknown>] input byte size mismatch for input 'INPUT1' for model 'simple'. "
        "Expected 64, got 63",
    ),
    "raw entry count": (
        _raw_count,
        grpc.StatusCode.INVALID_ARGUMENT,
        "unable to find data for input tensor 'INPUT1' for model 'simple' in request.",
    ),
    "batch too big": (
        _too_big_batch,
        grpc.StatusCode.INVALID_ARGUMENT,
        "batch-size must be <= 8 for 'simple'",
    ),
    "mixed batch sizes": (
        _mixed_batch,
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'INPUT1' batch size does not match other inputs for 'simple'",
    ),
    "zero batch beside a batch of one": (
        _zero_batch_beside_one,
        grpc.StatusCode.INVALID_ARGUMENT,
        "input 'INPUT0' for model 'simple' has batch size 0",
    ),
    "negative dim": (
        lambda r: r.inputs[0].shape.__setitem__(0, -1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "All input dimensions should be specified for input 'INPUT0'",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_then_good_request(stub: InferenceStub, case: str) -> None:
    change, code, phrase = CASES[case]
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_mutate(change))
    assert caught.value.code() == code
    assert phrase in caught.value.details()
    response = stub.ModelInfer(simple_request())
    np.testing.assert_array_equal(decode(response, 0), A + B)


def test_non_utf8_bytes_into_onnx_string_model(stub: InferenceStub) -> None:
    request = pb.ModelInferRequest(model_name="strings")
    request.inputs.add(name="IN", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"\xff")
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'IN'" in caught.value.details() and "UTF-8" in caught.value.details()


def test_garbage_bytes_on_the_wire(example_server) -> None:
    """A request body that is not a valid message is INVALID_ARGUMENT; the server goes on."""
    with grpc.insecure_channel(example_server.url) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        with pytest.raises(grpc.RpcError) as caught:
            call(b"\xff\xff\xff\xff\x0f garbage", timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Named as Triton's users know the type: our proto package (shoal.inference) stays inside.
        assert caught.value.details().startswith("malformed inference.ModelInferRequest message: ")
        assert "shoal" not in caught.value.details()
        assert InferenceStub(channel).ServerLive(pb.ServerLiveRequest()).live
