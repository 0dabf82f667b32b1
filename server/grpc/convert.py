"""Protobuf ↔ core types, one pair of functions per message, and the tensor codec.

Tensor data arrives either as ``raw_input_contents`` (one entry per input, in input
order; little-endian, row-major; BYTES as 4-byte little-endian length + bytes per
element) or as typed ``contents``. Replies always use ``raw_output_contents``, which
is what tritonclient and perf_analyzer read.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from google.protobuf import json_format

from server.core import ModelMetadata, ServerMetadata
from server.errors import invalid
from server.lifecycle.manager import IndexEntry
from server.pb import config_pb2, service_pb2
from server.statistics import Duration, ModelStatistics
from server.types import DataType, InferRequest, InferResponse, Tensor

_CONTENTS_FIELD = {
    DataType.BOOL: "bool_contents",
    DataType.UINT8: "uint_contents",
    DataType.UINT16: "uint_contents",
    DataType.UINT32: "uint_contents",
    DataType.UINT64: "uint64_contents",
    DataType.INT8: "int_contents",
    DataType.INT16: "int_contents",
    DataType.INT32: "int_contents",
    DataType.INT64: "int64_contents",
    DataType.FP32: "fp32_contents",
    DataType.FP64: "fp64_contents",
    DataType.BYTES: "bytes_contents",
}
_LENGTH = struct.Struct("<I")


# -- tensor codec ------------------------------------------------------------------------------


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements, row-major, each as a 4-byte little-endian length and the bytes."""
    parts = []
    for item in array.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def deserialize_bytes(name: str, raw: bytes, count: int) -> np.ndarray:
    items = []
    offset = 0
    view = memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise invalid(f"input '{name}': BYTES content ends inside a length prefix")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(raw):
            raise invalid(f"input '{name}': BYTES element of {length} bytes runs past the content")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise invalid(f"input '{name}': BYTES content holds {len(items)} elements, the shape needs {count}")
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def decode_raw(name: str, datatype: DataType, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    count = math.prod(shape)
    if datatype is DataType.BYTES:
        return deserialize_bytes(name, raw, count).reshape(shape)
    expected = count * datatype.item_size
    if len(raw) != expected:
        raise invalid(
            f"input '{name}': raw content has {len(raw)} bytes, but shape {list(shape)} of "
            f"{datatype.value} needs {expected}"
        )
    dtype = datatype.numpy_dtype.newbyteorder("<") if datatype.item_size > 1 else datatype.numpy_dtype
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return array.astype(datatype.numpy_dtype, copy=False)


def decode_contents(
    name: str, datatype: DataType, shape: tuple[int, ...], contents: service_pb2.InferTensorContents
) -> np.ndarray:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise invalid(f"input '{name}': {datatype.value} data can only be sent in raw_input_contents")
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise invalid(
            f"input '{name}': contents hold {len(values)} {datatype.value} values, shape {list(shape)} needs {count}"
        )
    if datatype is DataType.BYTES:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    try:
        return np.array(values, dtype=datatype.numpy_dtype).reshape(shape)
    except OverflowError as exc:
        raise invalid(f"input '{name}': a value does not fit {datatype.value}") from exc


def encode_raw(tensor: Tensor) -> bytes:
    if tensor.datatype is DataType.BYTES:
        return serialize_bytes(tensor.data)
    data = np.ascontiguousarray(tensor.data)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    return data.tobytes()


# -- messages -------------------------------------------------------------------------------------


def parameter_value(param: Any) -> Any:
    """The Python value of an InferParameter / ModelRepositoryParameter oneof."""
    choice = param.WhichOneof("parameter_choice")
    return getattr(param, choice) if choice else None


def infer_request(message: service_pb2.ModelInferRequest) -> InferRequest:
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise invalid(
            f"expected {len(message.inputs)} raw_input_contents entries (one per input), got {len(raw)}"
        )
    inputs = []
    for index, tensor in enumerate(message.inputs):
        try:
            datatype = DataType(tensor.datatype)
        except ValueError:
            raise invalid(f"input '{tensor.name}': unknown datatype '{tensor.datatype}'") from None
        shape = tuple(int(d) for d in tensor.shape)
        if any(d < 0 for d in shape):
            raise invalid(f"input '{tensor.name}': shape {list(shape)} has a negative dimension")
        if raw:
            if tensor.HasField("contents"):
                raise invalid(f"input '{tensor.name}': contents and raw_input_contents are both set")
            data = decode_raw(tensor.name, datatype, shape, raw[index])
        else:
            data = decode_contents(tensor.name, datatype, shape, tensor.contents)
        inputs.append(Tensor(tensor.name, datatype, shape, data))
    for output in message.outputs:
        if "classification" in output.parameters:
            raise invalid(f"output '{output.name}': the classification extension is not supported")
    return InferRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        id=message.id,
        inputs=tuple(inputs),
        requested_outputs=tuple(o.name for o in message.outputs) if message.outputs else None,
        parameters={k: parameter_value(v) for k, v in message.parameters.items()},
    )


def infer_response(response: InferResponse) -> service_pb2.ModelInferResponse:
    message = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for tensor in response.outputs:
        message.outputs.add(name=tensor.name, datatype=tensor.datatype.value, shape=tensor.shape)
        message.raw_output_contents.append(encode_raw(tensor))
    return message


def model_metadata(metadata: ModelMetadata) -> service_pb2.ModelMetadataResponse:
    message = service_pb2.ModelMetadataResponse(
        name=metadata.name, versions=metadata.versions, platform=metadata.platform
    )
    for target, tensors in ((message.inputs, metadata.inputs), (message.outputs, metadata.outputs)):
        for t in tensors:
            target.add(name=t.name, datatype=t.datatype, shape=t.shape)
    return message


def server_metadata(metadata: ServerMetadata) -> service_pb2.ServerMetadataResponse:
    return service_pb2.ServerMetadataResponse(
        name=metadata.name, version=metadata.version, extensions=metadata.extensions
    )


def model_config(config_json: dict[str, Any]) -> service_pb2.ModelConfigResponse:
    config = json_format.ParseDict(config_json, config_pb2.ModelConfig())
    return service_pb2.ModelConfigResponse(config=config)


def repository_index(entries: list[IndexEntry]) -> service_pb2.RepositoryIndexResponse:
    message = service_pb2.RepositoryIndexResponse()
    for e in entries:
        message.models.add(name=e.name, version=e.version, state=e.state.value, reason=e.reason)
    return message


def _duration(target: service_pb2.StatisticDuration, source: Duration) -> None:
    target.count = source.count
    target.ns = source.ns


def model_statistics(rows: list[tuple[str, str, ModelStatistics]]) -> service_pb2.ModelStatisticsResponse:
    message = service_pb2.ModelStatisticsResponse()
    for name, version, stats in rows:
        entry = message.model_stats.add(
            name=name,
            version=version,
            last_inference=stats.last_inference_ms,
            inference_count=stats.inference_count,
            execution_count=stats.execution_count,
        )
        inference = entry.inference_stats
        for field in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
            _duration(getattr(inference, field), getattr(stats, field))
        for size in sorted(stats.batch_stats):
            batch = stats.batch_stats[size]
            row = entry.batch_stats.add(batch_size=size)
            _duration(row.compute_input, batch.compute_input)
            _duration(row.compute_infer, batch.compute_infer)
            _duration(row.compute_output, batch.compute_output)
    return message
