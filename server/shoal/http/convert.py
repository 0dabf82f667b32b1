"""JSON ↔ core types for every endpoint but inference (``http.infer_body``): one function per message.

Shapes and field names are Triton's HTTP answers (KServe v2 REST and Triton's extensions), which
are the gRPC messages' proto3 JSON with their field names, every field printed (defaults too), and
64-bit integers as JSON numbers (the config is ``repository.config_json``'s, as a Python model reads it too).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from shoal.core import (
    CudaRegionStatus,
    IndexEntry,
    ModelMetadata,
    ModelState,
    RegionStatus,
    ServerMetadata,
    StatisticsRow,
)
from shoal.core.wire import refuse_model_files
from shoal.errors import invalid, shown, valid_utf8
from shoal.statistics import INFER_DURATIONS, Duration


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


def trace_settings_changes(body: dict[str, Any]) -> dict[str, list[str] | None]:
    """Triton's JSON: ``trace_level`` a list of strings (an empty one changes nothing, as Triton),
    every other setting a string; ``null`` clears a setting."""
    changes: dict[str, list[str] | None] = {}
    for name, value in body.items():
        if value is None:
            changes[name] = None
        elif name == "trace_level":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise invalid("expect a list of strings for 'trace_level'")
            if value:
                changes[name] = value
        elif isinstance(value, str):
            changes[name] = [value]
        else:
            raise invalid(f"expect a string for '{shown(name)}', as Triton writes every trace setting but the level")
    return changes


def server_metadata(metadata: ServerMetadata) -> dict[str, Any]:
    return {"name": metadata.name, "version": metadata.version, "extensions": list(metadata.extensions)}


def model_metadata(metadata: ModelMetadata) -> dict[str, Any]:
    def tensors(listed: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in listed]

    return {
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": tensors(metadata.inputs),
        "outputs": tensors(metadata.outputs),
    }


def _duration(source: Duration) -> dict[str, int]:
    return {"count": source.count, "ns": source.ns}


def model_statistics(rows: list[StatisticsRow]) -> dict[str, Any]:
    """Triton's statistics answer, with every key its HTTP answer has (server src/http_server.cc)."""
    entries = []
    for row in rows:
        stats = row.statistics
        entries.append(
            {
                "name": row.name,
                "version": row.version,
                "last_inference": stats.last_inference_ms,
                "inference_count": stats.inference_count,
                "execution_count": stats.execution_count,
                "inference_stats": {
                    field: _duration(getattr(stats, field)) for field in INFER_DURATIONS
                },  # Triton prints the cache's counts in every model's statistics
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": _duration(batch.compute_input),
                        "compute_infer": _duration(batch.compute_infer),
                        "compute_output": _duration(batch.compute_output),
                    }
                    for size, batch in sorted(stats.batch_stats.items())
                ],
                "memory_usage": [
                    {"type": kind, "id": device_id, "byte_size": byte_size}
                    for (kind, device_id), byte_size in sorted(row.memory_bytes.items())
                ],
                "response_stats": {},  # Triton's per-response statistics of decoupled models: Shoal keeps none
            }
        )
    return {"model_stats": entries}


def repository_index(entries: list[IndexEntry]) -> list[dict[str, str]]:
    """Triton's rows: empty fields left out (a model never loaded is its name alone)."""
    rows = []
    for e in entries:
        state = "" if e.state is ModelState.UNKNOWN else e.state.value
        row = {"name": valid_utf8(e.name), "version": e.version, "state": state, "reason": valid_utf8(e.reason)}
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
    refuse_model_files(name, list(parameters))
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
        raise invalid(
            f"failed to load '{shown(name)}': the config parameter must be a JSON object (a ModelConfig), "
            f"got a JSON {type(document).__name__}"
        )
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
