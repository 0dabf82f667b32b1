"""Requests and replies of the KServe v2 protocol, built from and read into plain Python/numpy.

Shared by the sync and the asyncio client so both speak exactly the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format

from shoal.protocol import codec
from shoal.protocol import service_pb2 as pb
from shoal.protocol.types import DataType, ModelMetadata, ServerMetadata, TensorMetadata


@dataclass(frozen=True)
class ModelIndexEntry:
    name: str
    version: str
    state: str
    reason: str


def datatype_of(array: np.ndarray) -> DataType:
    """The protocol datatype for a numpy array (object/str/bytes arrays are BYTES)."""
    return DataType.from_numpy(array.dtype)


def infer_request(
    model: str,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    version: str = "",
    request_id: str = "",
    priority: int = 0,
    timeout_us: int = 0,
    parameters: Mapping[str, bool | int | float | str] | None = None,
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, value in inputs.items():
        array = np.asarray(value)
        datatype = datatype_of(array)
        request.inputs.add(name=name, datatype=datatype.value, shape=array.shape)
        request.raw_input_contents.append(codec.to_raw(datatype, array))
    for name in outputs or ():
        request.outputs.add(name=name)
    if priority:
        request.parameters["priority"].uint64_param = priority
    if timeout_us:
        request.parameters["timeout"].int64_param = timeout_us
    for key, param in (parameters or {}).items():
        _set_parameter(request.parameters[key], param)
    return request


def _set_parameter(target: pb.InferParameter, value: bool | int | float | str) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def infer_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Output name → numpy array (BYTES as object arrays of ``bytes``, BF16 as ``ml_dtypes.bfloat16``)."""
    result = {}
    for index, output in enumerate(response.outputs):
        datatype = DataType(output.datatype)
        shape = tuple(output.shape)
        if index < len(response.raw_output_contents):
            result[output.name] = codec.from_raw(datatype, shape, response.raw_output_contents[index])
        else:  # typed contents, from servers that do not reply raw
            result[output.name] = _from_contents(datatype, shape, output.contents)
    return result


def _from_contents(datatype: DataType, shape: tuple[int, ...], contents: pb.InferTensorContents) -> np.ndarray:
    field = {
        DataType.BOOL: "bool_contents",
        DataType.INT64: "int64_contents",
        DataType.UINT64: "uint64_contents",
        DataType.FP32: "fp32_contents",
        DataType.FP64: "fp64_contents",
        DataType.BYTES: "bytes_contents",
    }.get(datatype, "uint_contents" if datatype.value.startswith("UINT") else "int_contents")
    values = list(getattr(contents, field))
    if datatype is DataType.BYTES:
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array.reshape(shape)
    return np.array(values, dtype=datatype.numpy_dtype).reshape(shape)


def server_metadata(response: pb.ServerMetadataResponse) -> ServerMetadata:
    return ServerMetadata(response.name, response.version, tuple(response.extensions))


def model_metadata(response: pb.ModelMetadataResponse) -> ModelMetadata:
    def tensors_of(items: Any) -> tuple[TensorMetadata, ...]:
        return tuple(TensorMetadata(t.name, t.datatype, tuple(t.shape)) for t in items)

    return ModelMetadata(
        response.name,
        tuple(response.versions),
        response.platform,
        tensors_of(response.inputs),
        tensors_of(response.outputs),
    )


def to_dict(message: Any) -> dict[str, Any]:
    """A response as proto3 JSON with the .proto field names (as tritonclient's ``as_json``)."""
    as_dict: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return as_dict


def repository_index(response: pb.RepositoryIndexResponse) -> list[ModelIndexEntry]:
    return [ModelIndexEntry(m.name, m.version, m.state, m.reason) for m in response.models]


def load_request(model: str, config: Mapping[str, Any] | None) -> pb.RepositoryModelLoadRequest:
    """``config`` is sent as JSON in the ``config`` parameter, as tritonclient's ``load_model`` does."""
    request = pb.RepositoryModelLoadRequest(model_name=model)
    if config is not None:
        request.parameters["config"].string_param = json.dumps(config)
    return request


def unload_request(model: str, unload_dependents: bool = False) -> pb.RepositoryModelUnloadRequest:
    request = pb.RepositoryModelUnloadRequest(model_name=model)
    if unload_dependents:
        request.parameters["unload_dependents"].bool_param = True
    return request
