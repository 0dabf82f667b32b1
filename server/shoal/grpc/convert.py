"""Protobuf ↔ core types, one pair of functions per message.

Tensor data arrives either as ``raw_input_contents`` (one entry per input, in input order;
wire format in ``shoal.protocol.codec``) or as typed ``contents``. Replies always use
``raw_output_contents``, which is what tritonclient and perf_analyzer read.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple, TypeAlias

import numpy as np
from google.protobuf import json_format

from shoal.core import (
    CudaRegionStatus,
    IndexEntry,
    ModelMetadata,
    ModelState,
    RegionStatus,
    ServerMetadata,
    StatisticsRow,
)
from shoal.core.wire import UnfitContents, refuse_model_files, region_slice
from shoal.errors import ShoalError, invalid, request_label, shown, valid_utf8
from shoal.logs import NO_VALUE
from shoal.protocol import codec, config_pb2, service_pb2
from shoal.protocol.types import BY_NAME, DataType
from shoal.request_types import EncodedTensor, InferRequest, InferResponse, RegionInput, RegionSlice, Tensor
from shoal.statistics import INFER_DURATIONS, Duration

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


# -- tensors -------------------------------------------------------------------------------------


def decode_contents(
    name: str,
    datatype: DataType,
    shape: tuple[int, ...],
    contents: service_pb2.InferTensorContents,
    unfit: UnfitContents,
) -> np.ndarray:
    """Typed contents as an array. As Triton's gRPC front end turns them into bytes for the core
    to check (server src/grpc/infer_handler.cc ``InferGRPCToInput``), a wrong count is noted in
    ``unfit``, to be refused with the core's byte-size or string-count message."""
    model = unfit.model
    _check_contents_fields(name, datatype, contents, model)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise invalid(f"input '{shown(name)}': {datatype.value} data can only be sent in raw_input_contents")
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        if datatype is DataType.BYTES:
            mismatch: codec.WireFormatError = codec.StringCountMismatch(count, min(len(values), count + 1))
        else:
            mismatch = codec.ByteSizeMismatch(
                datatype, shape, count * datatype.item_size, len(values) * datatype.item_size
            )
        unfit.note(name, mismatch)
        return np.empty(0, dtype=datatype.numpy_dtype)
    if datatype is DataType.BYTES:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    try:
        return np.array(values, dtype=datatype.numpy_dtype).reshape(shape)
    except OverflowError as exc:
        raise invalid(f"input '{shown(name)}': a value does not fit {datatype.value}") from exc


def _contents_type(field: str, datatype: DataType) -> str:
    """The type Triton reads a contents field as: int/uint fields serve the 8, 16 and 32 bit types."""
    if field == "int_contents":
        return datatype.value if datatype in (DataType.INT8, DataType.INT16) else "INT32"
    if field == "uint_contents":
        return datatype.value if datatype in (DataType.UINT8, DataType.UINT16) else "UINT32"
    return {
        "bool_contents": "BOOL",
        "int64_contents": "INT64",
        "uint64_contents": "UINT64",
        "fp32_contents": "FP32",
        "fp64_contents": "FP64",
        "bytes_contents": "BYTES",
    }[field]


def _check_contents_fields(
    name: str, datatype: DataType, contents: service_pb2.InferTensorContents, model: str
) -> None:
    """Typed contents in a field of another type, or in two fields, refused as Triton's front end does:
    fields read in its order, each checked by ``InferGRPCToInputHelper`` (server grpc/infer_handler.cc)."""
    supplied = False
    for field in (
        "bool_contents",
        "int_contents",
        "int64_contents",
        "uint_contents",
        "uint64_contents",
        "fp32_contents",
        "fp64_contents",
        "bytes_contents",
    ):
        if not getattr(contents, field):
            continue
        where = f"unexpected explicit tensor data for input tensor '{shown(name)}' for model '{shown(model)}'"
        if supplied:
            raise invalid(f"{where}, binary data was already supplied.")
        if _contents_type(field, datatype) != datatype.value:
            raise invalid(f"{where} of type '{_contents_type(field, datatype)}', expected datatype '{datatype.value}'")
        supplied = True


# A decoded BYTES element costs about 56 bytes of Python objects beyond its content: a bytes object
# (``sys.getsizeof(b"")`` is 33, rounded up to 48 by the allocator) and the 8-byte pointer to it; on
# the wire it costs a 4-byte length. So a request of many short strings costs up to 14 times its
# size once decoded (an 80 MB request of 20M empty strings took 5 GB). Such a request is refused
# before anything is decoded unless those objects stay within this multiple of its BYTES payload,
# or within the floor: whatever the element count, a request costs at most about 5 times its size
# (elements of 10 bytes or more are never refused; shorter ones past 2.4M elements may be).
BYTES_OBJECT_BYTES = 56
MAX_BYTES_OBJECTS_PER_PAYLOAD = 4
BYTES_OBJECTS_FLOOR = 128 * 2**20  # 2.4M elements of any length


def check_bytes_cost(declared: DeclaredInputs, raw: list[bytes]) -> None:
    """Refuse a request whose BYTES elements would cost far more memory than it carries.

    Counts are bounded before decoding: a raw input holds at most a fourth of its bytes in
    elements, and no more than its shape says are ever made (reading stops there)."""
    if not declared.bytes_inputs:
        return
    elements = payload = 0
    index = 0
    for tensor, _, datatype_name, shape, _, in_region in declared.entries:
        if in_region:
            continue
        if datatype_name == _BYTES:
            declared_count = max(0, math.prod(shape))
            if index < len(raw):
                elements += min(declared_count, len(raw[index]) // 4)
                payload += len(raw[index])
            elif tensor.HasField("contents"):
                elements += len(tensor.contents.bytes_contents)
                payload += tensor.contents.ByteSize()
        index += 1
    cost = elements * BYTES_OBJECT_BYTES
    allowed = max(BYTES_OBJECTS_FLOOR, MAX_BYTES_OBJECTS_PER_PAYLOAD * payload)
    if cost > allowed:
        raise invalid(
            f"the BYTES inputs of this request for model '{shown(declared.model)}' hold up to {elements} "
            f"elements in {payload} bytes: decoded, they would take about {cost // 2**20} MiB, more than the "
            f"{allowed // 2**20} MiB allowed (the larger of {BYTES_OBJECTS_FLOOR // 2**20} MiB and "
            f"{MAX_BYTES_OBJECTS_PER_PAYLOAD} times their size); send fewer, longer elements, or split the request"
        )


# -- messages -------------------------------------------------------------------------------------


def parameter_value(param: Any) -> Any:
    """The Python value of an InferParameter / ModelRepositoryParameter oneof."""
    choice = param.WhichOneof("parameter_choice")
    return getattr(param, choice) if choice else None


# One input as the message declares it, read once: (message entry, name, datatype name, shape,
# parameters or None, whether its parameters name a shared-memory region). Nothing checked yet.
DeclaredInput: TypeAlias = tuple[Any, str, str, tuple[int, ...], Any, bool]
_BYTES = DataType.BYTES.value
_ITEM_SIZES = {datatype.value: datatype.item_size for datatype in DataType}


class DeclaredInputs(NamedTuple):
    """A request's inputs read off the message in one walk, with what decoding them would cost
    (elements and bytes of the inputs not in shared memory, from their declared shapes; unknown
    datatypes count nothing, they are refused when decoded)."""

    model: str
    entries: list[DeclaredInput]
    inline: int  # inputs whose data the message carries
    bytes_elements: int
    data_bytes: int
    bytes_inputs: bool  # any inline BYTES input


def declare_inputs(message: service_pb2.ModelInferRequest) -> DeclaredInputs:
    """Each input's fields read once (every read of a protobuf field builds a new Python object)."""
    entries: list[DeclaredInput] = []
    inline = bytes_elements = data_bytes = 0
    bytes_inputs = False
    for tensor in message.inputs:
        parameters = tensor.parameters
        in_region = bool(parameters) and "shared_memory_region" in parameters
        datatype_name, shape = tensor.datatype, tuple(tensor.shape)
        entries.append((tensor, tensor.name, datatype_name, shape, parameters if parameters else None, in_region))
        if in_region:
            continue  # read from the client's segment by the host, never converted here
        inline += 1
        if datatype_name == _BYTES:
            bytes_inputs = True
            bytes_elements += abs(math.prod(shape))  # a bad shape is refused when decoded
        elif datatype_name in _ITEM_SIZES:
            data_bytes += abs(math.prod(shape)) * _ITEM_SIZES[datatype_name]
    return DeclaredInputs(message.model_name, entries, inline, bytes_elements, data_bytes, bytes_inputs)


def infer_request(
    message: service_pb2.ModelInferRequest, declared: DeclaredInputs | None = None, encoded_bytes: bool = False
) -> InferRequest:
    """The request; ``raw_input_contents`` line up, in order, with the inputs not in shared memory.
    ``declared``: ``declare_inputs(message)``, when the caller has read it already. ``encoded_bytes``:
    raw BYTES inputs are left as the wire carries them, unchecked (``infer_request_encoded``)."""
    if message.parameters:
        _check_reserved(message.parameters)
    if declared is None:
        declared = declare_inputs(message)
    model = declared.model
    if len(message.raw_input_contents) > declared.inline:
        raise invalid(
            f"expected {declared.inline} raw_input_contents entries (one per input not in shared memory), "
            f"got {len(message.raw_input_contents)}"
        )
    raw = list(message.raw_input_contents)  # each read of an entry copies it out of the message: once
    check_bytes_cost(declared, raw)
    inputs: list[Tensor] = []
    region_inputs: list[RegionInput] = []
    unfit = UnfitContents(model, message.id)
    for tensor, name, datatype_name, shape, parameters, _ in declared.entries:
        datatype = _declared(name, datatype_name, shape, model, message.id)
        where = shared_memory_slice(name, parameters) if parameters is not None else None
        if where is not None:
            if tensor.HasField("contents"):
                raise invalid(
                    f"unexpected 'content' provided when using shared memory for input tensor "
                    f"'{shown(name)}' for model '{shown(model)}'"
                )
            region_inputs.append(RegionInput(name, datatype, shape, where))
            continue
        # Triton's front end (server src/grpc/infer_handler.cc InferGRPCToInput) words these three.
        if raw and tensor.HasField("contents"):
            raise invalid(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{shown(name)}' for model '{shown(model)}'"
            )
        if len(inputs) < len(raw):
            if encoded_bytes and datatype_name == _BYTES:
                inputs.append(EncodedTensor(name, datatype, shape, np.frombuffer(raw[len(inputs)], np.uint8)))
                continue
            data = unfit.decode(name, datatype, shape, raw[len(inputs)], shape_checked=True)  # by _declared
        elif tensor.HasField("contents"):
            data = decode_contents(name, datatype, shape, tensor.contents, unfit)
        else:
            raise invalid(
                f"unable to find data for input tensor '{shown(name)}' for model '{shown(model)}' in request."
            )
        inputs.append(Tensor(name, datatype, shape, data))
    unfit.check()
    requested, output_regions, class_counts = _requested_outputs(message.outputs)
    return InferRequest(
        model_name=model,
        model_version=message.model_version,
        id=message.id,
        inputs=tuple(inputs),
        requested_outputs=requested,
        parameters={k: parameter_value(v) for k, v in message.parameters.items()} if message.parameters else {},
        class_counts=class_counts,
        region_inputs=tuple(region_inputs),
        output_regions=output_regions,
    )


def infer_request_encoded(
    message: service_pb2.ModelInferRequest, declared: DeclaredInputs | None = None
) -> InferRequest:
    """``infer_request`` for a core that decodes BYTES inputs itself (a front-end worker's ``RemoteCore``:
    its host decodes them once): raw BYTES inputs go on as ``EncodedTensor``, not decoded here, and the
    host refuses content that does not fit its shape in the same words (``core.wire.UnfitContents``).

    Everything else is checked here as ``infer_request`` checks it. A refusal is looked for again by
    ``infer_request``, decoding everything: the request is refused for what the one-process layout
    refuses it for, also when BYTES that do not fit come before another problem in Triton's order
    (another input's content, a requested output's parameters). Only a refused request pays that."""
    try:
        return infer_request(message, declared, encoded_bytes=True)
    except ShoalError:
        return infer_request(message, declared)


# The one request parameter starting with ``triton_`` a client may set (a stream's empty final response).
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"


def _check_reserved(parameters: Any) -> None:
    """Request parameters starting with ``triton_`` are Triton's own: refused but one, which must be a
    bool, in Triton 2.51's words (its gRPC front end, checked with ``run_triton.sh``)."""
    for key in parameters:
        if not key.startswith("triton_"):
            continue
        if key != EMPTY_FINAL_PARAMETER:
            raise invalid(
                "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
                f"starting with 'triton_' are allowed: {EMPTY_FINAL_PARAMETER}"
            )
        if parameters[key].WhichOneof("parameter_choice") != "bool_param":
            raise invalid(f"invalid value type for '{EMPTY_FINAL_PARAMETER}' parameter, expected bool_param.")


def _requested_outputs(outputs: Any) -> tuple[tuple[str, ...] | None, dict[str, RegionSlice], dict[str, int]]:
    """The outputs' names (None: none listed, so all), those placed in shared memory, and those asked as
    classifications; every shared-memory placement is checked before any classification."""
    if not outputs:
        return None, {}, {}
    names = []
    with_parameters = []
    regions = {}
    for output in outputs:
        name = output.name
        names.append(name)
        parameters = output.parameters
        if parameters:
            with_parameters.append((name, parameters))
            if (where := shared_memory_slice(name, parameters)) is not None:
                regions[name] = where
    return tuple(names), regions, class_counts(with_parameters)


def _declared(name: str, datatype_name: str, shape: tuple[int, ...], model: str, request_id: str) -> DataType:
    datatype = BY_NAME.get(datatype_name)
    if datatype is None:
        raise invalid(f"input '{shown(name)}': unknown datatype '{shown(datatype_name)}'")
    try:
        codec.check_shape(datatype, shape)
    except codec.NegativeDimension:  # in the words of Triton's core (Normalize)
        raise invalid(
            f"{request_label(request_id)}All input dimensions should be specified for input '{shown(name)}' "
            f"for model '{shown(model)}', got [{','.join(map(str, shape))}]"
        ) from None
    except codec.WireFormatError as exc:
        raise invalid(f"input '{shown(name)}': {exc}") from None
    return datatype


def shared_memory_slice(name: str, parameters: Any) -> RegionSlice | None:
    """Where a tensor's shared-memory parameters place it, checked as Triton's front end does
    (server src/grpc/grpc_utils.h ``ParseSharedMemoryParams``); None when it is not in shared memory."""
    name = shown(name)

    def typed(key: str, kind: str) -> Any:
        if key not in parameters:
            return None
        if parameters[key].WhichOneof("parameter_choice") != kind:
            raise invalid(f"invalid value type for '{key}' parameter for tensor '{name}', expected {kind}.")
        return getattr(parameters[key], kind)

    return region_slice(
        name,
        typed("shared_memory_region", "string_param"),
        typed("shared_memory_offset", "int64_param"),
        typed("shared_memory_byte_size", "int64_param"),
    )


def class_counts(outputs: list[tuple[str, Any]]) -> dict[str, int]:
    """The classification extension's per-output ``classification`` parameter (outputs given as name
    and parameters): an int64_param above 0, checked with Triton's wording (grpc_utils.cc
    ParseClassificationParams)."""
    counts = {}
    for name, parameters in outputs:
        if "classification" not in parameters:
            continue
        param = parameters["classification"]
        if param.WhichOneof("parameter_choice") != "int64_param":
            raise invalid(
                f"output '{shown(name)}': invalid value type for 'classification' parameter, expected int64_param"
            )
        if param.int64_param <= 0:
            raise invalid(
                f"output '{shown(name)}': invalid value for 'classification' parameter, "
                f"expected > 0, got {param.int64_param}"
            )
        counts[name] = param.int64_param
    return counts


def infer_response(response: InferResponse) -> service_pb2.ModelInferResponse:
    message = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for tensor in response.outputs:
        message.outputs.add(name=tensor.name, datatype=tensor.datatype.value, shape=tensor.shape)
        # An output written into the client's shared memory keeps its place, empty, as in Triton:
        # tritonclient finds each output's raw entry by position.
        if tensor.name in response.in_regions:
            message.raw_output_contents.append(b"")
        elif isinstance(tensor, EncodedTensor):  # BYTES as the host encoded them (a front-end worker)
            message.raw_output_contents.append(tensor.raw())
        else:
            message.raw_output_contents.append(codec.to_raw(tensor.datatype, tensor.data))
    return message


def system_shared_memory_status(regions: list[RegionStatus]) -> service_pb2.SystemSharedMemoryStatusResponse:
    message = service_pb2.SystemSharedMemoryStatusResponse()
    for region in regions:
        entry = message.regions[region.name]
        entry.name, entry.key, entry.offset, entry.byte_size = region.name, region.key, region.offset, region.byte_size
    return message


def cuda_shared_memory_status(regions: list[CudaRegionStatus]) -> service_pb2.CudaSharedMemoryStatusResponse:
    message = service_pb2.CudaSharedMemoryStatusResponse()
    for region in regions:
        entry = message.regions[region.name]
        entry.name, entry.device_id, entry.byte_size = region.name, region.device_id, region.byte_size
    return message


def model_metadata(metadata: ModelMetadata) -> service_pb2.ModelMetadataResponse:
    message = service_pb2.ModelMetadataResponse(
        name=metadata.name, versions=metadata.versions, platform=metadata.platform
    )
    for target, listed in ((message.inputs, metadata.inputs), (message.outputs, metadata.outputs)):
        for t in listed:
            target.add(name=t.name, datatype=t.datatype, shape=t.shape)
    return message


def server_metadata(metadata: ServerMetadata) -> service_pb2.ServerMetadataResponse:
    return service_pb2.ServerMetadataResponse(
        name=metadata.name, version=metadata.version, extensions=metadata.extensions
    )


def model_config(config_json: dict[str, Any]) -> service_pb2.ModelConfigResponse:
    config = json_format.ParseDict(config_json, config_pb2.ModelConfig())
    return service_pb2.ModelConfigResponse(config=config)


def load_parameters(message: service_pb2.RepositoryModelLoadRequest) -> dict[str, Any] | None:
    """The ``config`` override of a load: a ModelConfig as a JSON object, decoded here (the config
    pipeline turns it into a ModelConfig); model files sent inline are refused."""
    refuse_model_files(message.model_name, list(message.parameters))
    if "config" not in message.parameters:
        return None
    param = message.parameters["config"]
    if param.WhichOneof("parameter_choice") != "string_param":  # as Triton: text only, never bytes
        raise invalid("invalid value type for load parameter 'config', expected string_param.")
    name = shown(message.model_name)
    try:
        document = json.loads(param.string_param)
    except ValueError as exc:
        raise invalid(f"failed to load '{name}': the config parameter is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid(
            f"failed to load '{name}': the config parameter must be a JSON object (a ModelConfig), "
            f"got a JSON {type(document).__name__}"
        )
    return document


def unload_dependents(message: service_pb2.RepositoryModelUnloadRequest) -> bool:
    """The unload's ``unload_dependents`` parameter (tritonclient's ``unload_model(..., unload_dependents=)``)."""
    if "unload_dependents" not in message.parameters:
        return False
    param = message.parameters["unload_dependents"]
    if param.WhichOneof("parameter_choice") != "bool_param":
        raise invalid("invalid value type for 'unload_dependents' parameter, expected bool_param.")
    return bool(param.bool_param)


def repository_index(entries: list[IndexEntry]) -> service_pb2.RepositoryIndexResponse:
    message = service_pb2.RepositoryIndexResponse()
    for e in entries:
        state = "" if e.state is ModelState.UNKNOWN else e.state.value  # never loaded: name only, as Triton
        message.models.add(name=valid_utf8(e.name), version=e.version, state=state, reason=valid_utf8(e.reason))
    return message


def trace_settings(settings: dict[str, Any]) -> service_pb2.TraceSettingResponse:
    """Every value as a list of strings, as Triton's gRPC answers them."""
    response = service_pb2.TraceSettingResponse()
    for name, value in settings.items():
        response.settings[name].value.extend(value if isinstance(value, list) else [value])
    return response


def log_settings_changes(message: service_pb2.LogSettingsRequest) -> dict[str, Any]:
    """Each setting's value as its oneof carries it: bool, int or str (``NO_VALUE`` when no kind is set)."""
    changes: dict[str, Any] = {}
    for name, value in message.settings.items():
        kind = value.WhichOneof("parameter_choice")
        changes[name] = NO_VALUE if kind is None else getattr(value, kind)
    return changes


def log_settings(settings: dict[str, Any]) -> service_pb2.LogSettingsResponse:
    """Triton's kinds: booleans as bool_param, the verbose level as uint32_param, text as string_param."""
    response = service_pb2.LogSettingsResponse()
    for name, value in settings.items():
        target = response.settings[name]
        if isinstance(value, bool):
            target.bool_param = value
        elif isinstance(value, int):
            target.uint32_param = value
        else:
            target.string_param = value
    return response


def _duration(target: service_pb2.StatisticDuration, source: Duration) -> None:
    target.count = source.count
    target.ns = source.ns


def model_statistics(rows: list[StatisticsRow]) -> service_pb2.ModelStatisticsResponse:
    message = service_pb2.ModelStatisticsResponse()
    for row in rows:
        stats = row.statistics
        entry = message.model_stats.add(
            name=row.name,
            version=row.version,
            last_inference=stats.last_inference_ms,
            inference_count=stats.inference_count,
            execution_count=stats.execution_count,
        )
        inference = entry.inference_stats
        for field in INFER_DURATIONS:
            _duration(getattr(inference, field), getattr(stats, field))
        for size in sorted(stats.batch_stats):
            batch = stats.batch_stats[size]
            batch_row = entry.batch_stats.add(batch_size=size)
            _duration(batch_row.compute_input, batch.compute_input)
            _duration(batch_row.compute_infer, batch.compute_infer)
            _duration(batch_row.compute_output, batch.compute_output)
        for (kind, device_id), byte_size in sorted(row.memory_bytes.items()):
            entry.memory_usage.add(type=kind, id=device_id, byte_size=byte_size)
    return message
