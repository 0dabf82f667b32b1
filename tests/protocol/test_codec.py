"""The tensor codec: raw and typed contents, BYTES framing, sizes, datatypes."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.core import wire
from shoal.errors import ErrorCode, ShoalError
from shoal.grpc import convert
from shoal.protocol import codec, service_pb2
from shoal.protocol.types import DataType

AWKWARD_BYTES = [b"", b"\x00", b"a\x00b", b"\xff\xfe\x80", "é".encode(), b"x" * 300]


def test_bytes_round_trip_exactly() -> None:
    array = np.empty(len(AWKWARD_BYTES), dtype=object)
    array[:] = AWKWARD_BYTES
    raw = codec.serialize_bytes(array)
    assert raw[:4] == struct.pack("<I", 0) and raw[4:8] == struct.pack("<I", 1)
    decoded = wire.decode_raw("x", DataType.BYTES, (2, 3), raw)
    assert decoded.shape == (2, 3)
    assert list(decoded.reshape(-1)) == AWKWARD_BYTES


def test_bytes_elements_that_are_no_bytes_are_the_utf8_of_their_str_as_tritons() -> None:
    """Triton's ``serialize_byte_tensor`` (which its Python backend sends outputs through) encodes an
    element that is no ``bytes`` as ``str(element).encode("utf-8")``: the number 12 is b"12" (it was
    ``bytes(12)``, twelve zero bytes), None is b"None"; bytes stay as they are."""
    array = np.array([12, None, 2.5, "é", b"\x00b", np.int64(7), np.str_("s"), bytearray(b"ba")], dtype=object)
    expected = [b"12", b"None", b"2.5", "é".encode(), b"\x00b", b"7", b"s", b"ba"]
    assert list(codec.deserialize_bytes(codec.serialize_bytes(array), len(expected))) == expected


@pytest.mark.parametrize(
    ("raw", "phrase"),
    [
        (
            b"\x01\x00",
            "incomplete string length indicator for inference input 'x' for model 'm', expecting 4 bytes "
            "but only 2 bytes available",
        ),
        (struct.pack("<I", 9) + b"abc", "runs past the content"),
        (
            struct.pack("<I", 1) + b"a",
            ("[request id: <id_unknown>] expected 2 string elements for inference input 'x' for model 'm', got 1"),
        ),
    ],
)
def test_malformed_bytes_are_invalid(raw: bytes, phrase: str) -> None:
    with pytest.raises(ShoalError) as caught:
        wire.decode_raw("x", DataType.BYTES, (2,), raw, "m")
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and phrase in caught.value.message


@pytest.mark.parametrize("datatype", [d for d in DataType if d is not DataType.BYTES])
def test_numeric_raw_round_trip(datatype: DataType) -> None:
    rng = np.random.default_rng(1)
    array = (rng.standard_normal((2, 3)) * 50).astype(datatype.numpy_dtype)
    raw = codec.to_raw(datatype, array)
    assert len(raw) == array.size * datatype.item_size
    back = wire.decode_raw("t", datatype, (2, 3), raw)
    assert back.dtype == datatype.numpy_dtype
    np.testing.assert_array_equal(back, array)


def test_bf16_wire_format_is_upper_half_of_fp32() -> None:
    value = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    raw = codec.to_raw(DataType.BF16, value)
    assert raw == struct.pack("<f", 1.5)[2:4] + struct.pack("<f", -2.0)[2:4]


def test_raw_size_mismatch_names_tensor_and_sizes() -> None:
    with pytest.raises(ShoalError) as caught:
        wire.decode_raw("INPUT0", DataType.INT32, (1, 16), b"\x00" * 60, "m")
    assert caught.value.message == (
        "[request id: <id_unknown>] input byte size mismatch for input 'INPUT0' for model 'm'. Expected 64, got 60"
    )


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
    assert caught.value.message == (
        f"unexpected explicit tensor data for input tensor 'a' for model 'm' of type "
        f"'FP32', expected datatype '{datatype}'"
    )


def test_request_parameters_of_every_kind() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.parameters["priority"].uint64_param = 2
    request.parameters["timeout"].int64_param = 1000
    request.parameters["ratio"].double_param = 0.5
    request.parameters["tag"].string_param = "x"
    request.parameters["flag"].bool_param = True
    decoded = convert.infer_request(request)
    assert decoded.parameters == {"priority": 2, "timeout": 1000, "ratio": 0.5, "tag": "x", "flag": True}


# -- BYTES framing: the vectorised paths against the one-by-one reference --------------------------


def _framed(items: list[bytes]) -> bytes:
    """The wire format written the plain way, one element at a time."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def _objects(items: list[bytes]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.binary(max_size=12), max_size=40), length=st.sampled_from([None, 0, 1, 3]))
def test_bytes_framing_matches_the_plain_reference(items: list[bytes], length: int | None) -> None:
    """Any elements, and elements all of one length (read by numpy records), both ways."""
    if length is not None:
        items = [item[:length].ljust(length, b"\x00") for item in items]
    raw = _framed(items)
    assert codec.serialize_bytes(_objects(items)) == raw
    assert list(codec.deserialize_bytes(raw, len(items))) == items


def test_bytes_framing_of_many_elements_spans_chunks() -> None:
    items = [bytes([i % 251]) * (i % 7) for i in range(200_003)]
    raw = codec.serialize_bytes(_objects(items))
    assert raw == _framed(items)
    assert list(codec.deserialize_bytes(raw, len(items))) == items


@pytest.mark.parametrize(
    ("raw", "count", "error"),
    [
        # All lengths 2 but one: read one by one, in Triton's order.
        (_framed([b"ab", b"cd"]) + struct.pack("<I", 3) + b"ef", 3, "runs past the content"),
        (_framed([b"ab", b"cd", b"ef"]), 2, "holds more than 2 elements"),
        (_framed([b"", b""]) + b"\x00\x00", 2, "ends inside a length prefix"),
        (_framed([b"", b"", b""]), 4, "holds 3 elements, the shape needs 4"),
        (struct.pack("<I", 0) * 3 + struct.pack("<I", 1), 4, "runs past the content"),
    ],
)
def test_bytes_that_look_of_one_length_are_still_checked(raw: bytes, count: int, error: str) -> None:
    with pytest.raises(codec.WireFormatError, match=error):
        codec.deserialize_bytes(raw, count)


# -- the memory a BYTES request may cost ------------------------------------------------------------


def _empty_strings_request(count: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="s", datatype="BYTES", shape=[count])
    request.raw_input_contents.append(struct.pack("<I", 0) * count)
    return request


def test_many_tiny_strings_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """5M empty strings: 20 MB on the wire, ~280 MB as Python objects. Refused without decoding."""
    monkeypatch.setattr(codec, "deserialize_bytes", lambda raw, count: pytest.fail("decoded"))
    with pytest.raises(ShoalError) as caught:
        convert.infer_request(_empty_strings_request(5_000_000))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.message.startswith(
        "the BYTES inputs of this request for model 'm' hold up to 5000000 elements in 20000000 bytes"
    )


def test_strings_within_the_floor_or_long_enough_are_decoded() -> None:
    assert convert.infer_request(_empty_strings_request(1_000_000)).inputs[0].data.shape == (1_000_000,)
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="s", datatype="BYTES", shape=[3_000_000])  # 10 bytes each: never refused
    request.raw_input_contents.append((struct.pack("<I", 10) + b"0123456789") * 3_000_000)
    assert convert.infer_request(request).inputs[0].data[-1] == b"0123456789"


def test_the_cost_counts_typed_contents_and_every_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert, "BYTES_OBJECTS_FLOOR", 100 * convert.BYTES_OBJECT_BYTES)
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="a", datatype="BYTES", shape=[60]).contents.bytes_contents.extend([b""] * 60)
    convert.infer_request(request)
    request.inputs.add(name="b", datatype="BYTES", shape=[60]).contents.bytes_contents.extend([b""] * 60)
    with pytest.raises(ShoalError, match="hold up to 120 elements"):
        convert.infer_request(request)


def test_a_shape_that_claims_more_than_the_content_holds_keeps_tritons_words() -> None:
    """The cost is bounded by what the content can hold (4 bytes an element), not by the shape."""
    request = _empty_strings_request(2)
    request.inputs[0].shape[:] = [2**40]
    with pytest.raises(ShoalError) as caught:
        convert.infer_request(request)
    assert caught.value.message == (
        f"[request id: <id_unknown>] expected {2**40} string elements for inference input 's' for model 'm', got 2"
    )
