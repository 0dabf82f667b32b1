"""JSON ↔ core types for every endpoint but inference (``http.tensors``): one function per message.

Shapes and field names are Triton's HTTP answers (KServe v2 REST and Triton's extensions), which
are the gRPC messages' proto3 JSON with their field names, and 64-bit integers as JSON numbers.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from shoal.core import (
    CudaRegionStatus,
    IndexEntry,
    ModelMetadata,
    ModelState,
    RegionStatus,
    ServerMetadata,
    StatisticsRow,
)
from shoal.errors import invalid, shown
from shoal.protocol import config_pb2
from shoal.statistics import Duration


def parse_object(body: bytes, what: str) -> dict[str, Any]:
    """A request body that must be a JSON object; an empty body is ``{}`` (Triton's POSTs allow it)."""
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise invalid(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(document, dict):
        raise invalid(f"the {what} request must be a JSON object, got a JSON {type(document).__name__}")
    return document


def server_metadata(metadata: ServerMetadata) -> dict[str, Any]:
    return {"name": metadata.name, "version": metadata.version, "extensions": list(metadata.extensions)}


def model_metadata(metadata: ModelMetadata) -> dict[str, Any]:
    def tensors(listed: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in listed]

    return {"name": metadata.name, "versions": list(metadata.versions), "platform": metadata.platform,
            "inputs": tensors(metadata.inputs), "outputs": tensors(metadata.outputs)}


_INT64_TYPES = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def model_config(config_json: dict[str, Any]) -> dict[str, Any]:
    """The core's proto3 JSON config with 64-bit integers as numbers (``"dims": [16]``), as Triton's."""
    return _numbers(config_pb2.ModelConfig.DESCRIPTOR, config_json)


def _numbers(descriptor: Descriptor, document: dict[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = {}
    for key, value in document.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            converted[key] = value
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            converted[key] = {k: _field_value(entry, v) for k, v in value.items()}
        elif field.label == FieldDescriptor.LABEL_REPEATED:
            converted[key] = [_field_value(field, item) for item in value]
        else:
            converted[key] = _field_value(field, value)
    return converted


def _field_value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None and isinstance(value, dict):
        return _numbers(field.message_type, value)
    if field.type in _INT64_TYPES and isinstance(value, str):
        return int(value)
    return value


def _duration(source: Duration) -> dict[str, int]:
    return {"count": source.count, "ns": source.ns}


def model_statistics(rows: list[StatisticsRow]) -> dict[str, Any]:
    entries = []
    for row in rows:
        stats = row.statistics
        entries.append({
            "name": row.name, "version": row.version, "last_inference": stats.last_inference_ms,
            "inference_count": stats.inference_count, "execution_count": stats.execution_count,
            "inference_stats": {field: _duration(getattr(stats, field)) for field in (
                "success", "fail", "queue", "compute_input", "compute_infer", "compute_output")},
            "batch_stats": [
                {"batch_size": size, "compute_input": _duration(batch.compute_input),
                 "compute_infer": _duration(batch.compute_infer), "compute_output": _duration(batch.compute_output)}
                for size, batch in sorted(stats.batch_stats.items())
            ],
            "memory_usage": [{"type": kind, "id": device_id, "byte_size": byte_size}
                             for (kind, device_id), byte_size in sorted(row.memory_bytes.items())],
        })
    return {"model_stats": entries}


def repository_index(entries: list[IndexEntry]) -> list[dict[str, str]]:
    """Triton's rows: empty fields left out (a model never loaded is its name alone)."""
    rows = []
    for e in entries:
        state = "" if e.state is ModelState.UNKNOWN else e.state.value
        row = {"name": e.name, "version": e.version, "state": state, "reason": e.reason}
        rows.append({key: value for key, value in row.items() if value})
    return rows


def index_ready_only(body: dict[str, Any]) -> bool:
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise invalid("invalid value type for 'ready', expected a boolean")
    return ready


def unload_dependents(body: dict[str, Any]) -> bool:
    """The unload's ``{"parameters": {"unload_dependents": true}}``, as tritonclient.http sends it."""
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise invalid("'parameters' must be a JSON object")
    value = parameters.get("unload_dependents", False)
    if not isinstance(value, bool):
        raise invalid("invalid value type for 'unload_dependents' parameter, expected bool_param.")
    return value


def load_config(name: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``config`` override of a load (``{"parameters": {"config": "<ModelConfig JSON>"}}``), checked
    as the gRPC path checks it; model files sent inline (``file:...``) are refused the same way."""
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise invalid("'parameters' must be a JSON object")
    files = [key for key in parameters if key.startswith("file:")]
    if files:
        raise invalid(f"loading model files sent with the request ({shown(files[0])}) is not supported")
    if "config" not in parameters:
        return None
    text = parameters["config"]
    if not isinstance(text, str):  # as Triton: the config is JSON text in a string
        raise invalid("invalid value type for load parameter 'config', expected string_param.")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"failed to load '{shown(name)}': the config parameter is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid(f"failed to load '{shown(name)}': the config parameter must be a JSON object (a ModelConfig), "
                      f"got a JSON {type(document).__name__}")
    return document


def shared_memory_status(regions: list[RegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


def shared_memory_register(body: dict[str, Any]) -> tuple[str, int, int]:
    """``{"key": str, "offset": int, "byte_size": int}`` as tritonclient sends it."""
    key = _field(body, "key", str)
    return key, _field(body, "offset", int, 0), _field(body, "byte_size", int)


def cuda_shared_memory_status(regions: list[CudaRegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]


def cuda_shared_memory_register(body: dict[str, Any]) -> tuple[bytes, int, int]:
    """``{"raw_handle": {"b64": str}, "device_id": int, "byte_size": int}``: the handle's bytes, base64."""
    handle = _field(body, "raw_handle", dict)
    encoded = handle.get("b64")
    if not isinstance(encoded, str):
        raise invalid("Shared memory register request has no 'b64' field in 'raw_handle'")
    try:
        raw_handle = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise invalid(f"the 'raw_handle' of a shared memory register request is not valid base64: {exc}") from None
    return raw_handle, _field(body, "device_id", int, 0), _field(body, "byte_size", int)


def _field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """A field of a register request, in Triton's words when it is missing."""
    value = body.get(name, default)
    if value is None:
        raise invalid(f"Shared memory register request has no '{name}' field")
    if not isinstance(value, kind) or isinstance(value, bool):
        what = {"str": "string", "int": "integer", "dict": "object"}[kind.__name__]
        raise invalid(f"Shared memory register request: '{name}' must be a JSON {what}")
    return value
