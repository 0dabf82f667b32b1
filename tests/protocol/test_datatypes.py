"""Every protocol datatype round-trips through a real server, via tritonclient and via typed contents."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton

from shoal.grpc.convert import _CONTENTS_FIELD
from shoal.protocol import InferenceStub, codec
from shoal.protocol import service_pb2 as pb
from shoal.protocol.types import DataType
from tests.conftest import RunningServer
from tests.models import ALL_DATATYPES
from tests.protocol.test_codec import AWKWARD_BYTES


def sample(datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        array = np.empty((1, len(AWKWARD_BYTES)), dtype=object)
        array[0, :] = AWKWARD_BYTES
        return array
    if datatype == "BOOL":
        return np.array([[True, False, True]])
    dtype = DataType(datatype).numpy_dtype
    if datatype in {"FP16", "FP32", "FP64", "BF16"}:
        return np.array([[1.5, -2.25, 1024.0]], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, 0, info.max]], dtype=dtype)


@pytest.mark.parametrize("datatype", [d for d in ALL_DATATYPES if d != "BF16"])
def test_tritonclient_round_trip(example_server: RunningServer, datatype: str) -> None:
    data = sample(datatype)
    with triton.InferenceServerClient(example_server.url) as client:
        tensor = triton.InferInput("IN", list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        result = client.infer(f"identity_{datatype.lower()}", [tensor])
    out = result.as_numpy("OUT")
    assert result.get_output("OUT").datatype == datatype
    if datatype == "BYTES":
        assert out.tolist() == data.tolist()
    else:
        assert out.dtype == data.dtype
        np.testing.assert_array_equal(out, data)


def test_bf16_round_trip_raw(stub: InferenceStub) -> None:
    """tritonclient reads BF16 as float32; the wire carries the upper 2 bytes of each float32."""
    data = np.array([[1.5, -2.25, 1024.0]], dtype=ml_dtypes.bfloat16)
    request = pb.ModelInferRequest(model_name="identity_bf16")
    request.inputs.add(name="IN", datatype="BF16", shape=data.shape)
    request.raw_input_contents.append(data.tobytes())
    response = stub.ModelInfer(request)
    assert response.outputs[0].datatype == "BF16"
    assert response.raw_output_contents[0] == data.tobytes()
    fp32 = np.frombuffer(
        b"".join(b"\x00\x00" + response.raw_output_contents[0][i : i + 2] for i in range(0, 6, 2)), "<f4"
    )
    np.testing.assert_array_equal(fp32, [1.5, -2.25, 1024.0])


@pytest.mark.parametrize("datatype", [d for d in ALL_DATATYPES if DataType(d) in _CONTENTS_FIELD])
def test_typed_contents_round_trip(stub: InferenceStub, datatype: str) -> None:
    data = sample(datatype)
    request = pb.ModelInferRequest(model_name=f"identity_{datatype.lower()}")
    tensor = request.inputs.add(name="IN", datatype=datatype, shape=data.shape)
    values = list(data.reshape(-1)) if datatype == "BYTES" else data.reshape(-1).tolist()
    getattr(tensor.contents, _CONTENTS_FIELD[DataType(datatype)]).extend(values)
    response = stub.ModelInfer(request)
    assert list(response.outputs[0].shape) == list(data.shape)
    raw = response.raw_output_contents[0]
    if datatype == "BYTES":
        assert list(codec.deserialize_bytes(raw, data.size)) == AWKWARD_BYTES
    else:
        np.testing.assert_array_equal(np.frombuffer(raw, dtype=data.dtype).reshape(data.shape), data)


def test_onnx_string_model_round_trips_utf8_with_nul(example_server: RunningServer) -> None:
    data = np.array(["héllo", "a\x00b", ""], dtype=object)
    with triton.InferenceServerClient(example_server.url) as client:
        tensor = triton.InferInput("IN", [3], "BYTES")
        tensor.set_data_from_numpy(data)
        out = client.infer("strings", [tensor]).as_numpy("OUT")
    assert [item.decode("utf-8") for item in out] == list(data)
