"""The tensor codec: raw and typed contents, BYTES framing, sizes, datatypes."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from shoal.errors import ErrorCode, ShoalError
from shoal.grpc import convert
from shoal.protocol import service_pb2, tensors
from shoal.protocol.types import DataType

AWKWARD_BYTES = [b"", b"\x00", b"a\x00b", b"\xff\xfe\x80", "é".encode(), b"x" * 300]


def test_bytes_round_trip_exactly() -> None:
    array = np.empty(len(AWKWARD_BYTES), dtype=object)
    array[:] = AWKWARD_BYTES
    raw = tensors.serialize_bytes(array)
    assert raw[:4] == struct.pack("<I", 0) and raw[4:8] == struct.pack("<I", 1)
    decoded = convert.decode_raw("x", DataType.BYTES, (2, 3), raw)
    assert decoded.shape == (2, 3)
    assert list(decoded.reshape(-1)) == AWKWARD_BYTES


@pytest.mark.parametrize(
    ("raw", "phrase"),
    [
        (b"\x01\x00", "incomplete string length indicator for inference input 'x' for model 'm', expecting 4 bytes "
                        "but only 2 bytes available"),
        (struct.pack("<I", 9) + b"abc", "runs past the content"),
        (struct.pack("<I", 1) + b"a", "expected 2 string elements for inference input 'x' for model 'm', got 1"),
    ],
)
def test_malformed_bytes_are_invalid(raw: bytes, phrase: str) -> None:
    with pytest.raises(ShoalError) as caught:
        convert.decode_raw("x", DataType.BYTES, (2,), raw, "m")
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and phrase in caught.value.message


@pytest.mark.parametrize("datatype", [d for d in DataType if d is not DataType.BYTES])
def test_numeric_raw_round_trip(datatype: DataType) -> None:
    rng = np.random.default_rng(1)
    array = (rng.standard_normal((2, 3)) * 50).astype(datatype.numpy_dtype)
    raw = tensors.to_raw(datatype, array)
    assert len(raw) == array.size * datatype.item_size
    back = convert.decode_raw("t", datatype, (2, 3), raw)
    assert back.dtype == datatype.numpy_dtype
    np.testing.assert_array_equal(back, array)


def test_bf16_wire_format_is_upper_half_of_fp32() -> None:
    value = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    raw = tensors.to_raw(DataType.BF16, value)
    assert raw == struct.pack("<f", 1.5)[2:4] + struct.pack("<f", -2.0)[2:4]


def test_raw_size_mismatch_names_tensor_and_sizes() -> None:
    with pytest.raises(ShoalError) as caught:
        convert.decode_raw("INPUT0", DataType.INT32, (1, 16), b"\x00" * 60, "m")
    assert caught.value.message == "input byte size mismatch for input 'INPUT0' for model 'm'. Expected 64, got 60"


def test_typed_contents_decode() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="a", datatype="INT16", shape=[2, 2])
    tensor.contents.int_contents.extend([1, -2, 3, 4])
    text = request.inputs.add(name="s", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend([b"\x00\xff", b"ok"])
    decoded = convert.infer_request(request)
    assert decoded.inputs[0].data.dtype == np.int16
    np.testing.assert_array_equal(decoded.inputs[0].data, [[1, -2], [3, 4]])
    assert list(decoded.inputs[1].data) == [b"\x00\xff", b"ok"]


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_precision_needs_raw(datatype: str) -> None:
    """No contents field holds FP16 or BF16; fp32_contents for them is the wrong type, as in Triton's
    front end (server grpc/infer_handler.cc InferGRPCToInputHelper)."""
    request = service_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="a", datatype=datatype, shape=[1])
    tensor.contents.SetInParent()
    with pytest.raises(ShoalError, match="can only be sent in raw_input_contents"):
        convert.infer_request(request)
    tensor.contents.fp32_contents.append(1.0)
    with pytest.raises(ShoalError) as caught:
        convert.infer_request(request)
    assert caught.value.message == (f"unexpected explicit tensor data for input tensor 'a' for model 'm' of type "
                                    f"'FP32', expected datatype '{datatype}'")


def test_request_parameters_of_every_kind() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.parameters["priority"].uint64_param = 2
    request.parameters["timeout"].int64_param = 1000
    request.parameters["ratio"].double_param = 0.5
    request.parameters["tag"].string_param = "x"
    request.parameters["flag"].bool_param = True
    decoded = convert.infer_request(request)
    assert decoded.parameters == {"priority": 2, "timeout": 1000, "ratio": 0.5, "tag": "x", "flag": True}
