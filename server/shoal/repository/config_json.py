"""A model's config as Triton's ``ModelConfigToJson`` writes it (core model_config_utils.cc): what its
HTTP config endpoint answers, and what a Python model's ``initialize`` reads as ``args["model_config"]``
(Triton's backend API hands the backend the same JSON)."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from shoal.protocol import config_pb2

# The 64-bit fields Triton's ModelConfigToJson (core model_config_utils.cc) turns back into JSON
# numbers, as paths: "[]" steps into each item of a list, "{}" into each value of a map. Every other
# 64-bit field stays a string there, as protobuf prints it: optimization.cuda.graph_spec dims,
# instance_group.secondary_devices.device_id, and sequence_batching.state.initial_state.dims (its fix
# looks for initial_state in the wrong message).
_NUMBER_PATHS = (
    ("input", "[]", "dims"),
    ("input", "[]", "reshape", "shape"),
    ("output", "[]", "dims"),
    ("output", "[]", "reshape", "shape"),
    ("version_policy", "specific", "versions"),
    ("dynamic_batching", "max_queue_delay_microseconds"),
    ("dynamic_batching", "priority_levels"),
    ("dynamic_batching", "default_priority_level"),
    ("dynamic_batching", "default_queue_policy", "default_timeout_microseconds"),
    ("dynamic_batching", "priority_queue_policy", "{}", "default_timeout_microseconds"),
    ("sequence_batching", "max_sequence_idle_microseconds"),
    ("sequence_batching", "oldest", "max_queue_delay_microseconds"),
    ("sequence_batching", "direct", "max_queue_delay_microseconds"),
    ("sequence_batching", "state", "[]", "dims"),
    ("ensemble_scheduling", "step", "[]", "model_version"),
    ("model_warmup", "[]", "inputs", "{}", "dims"),
)


def model_config(config_json: dict[str, Any]) -> dict[str, Any]:
    """The config as Triton's HTTP answer prints it: every field without presence, defaults included
    (``"max_batch_size": 0``, ``"optional": false``, ``"batch_input": []``), as protobuf's JSON printer
    with ``always_print_primitive_fields`` writes it (clients such as Triton's own read
    ``config["max_batch_size"]``); unset messages left out; then Triton's 64-bit fields as numbers."""
    message = json_format.ParseDict(config_json, config_pb2.ModelConfig())
    document: dict[str, Any] = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for path in _NUMBER_PATHS:
        _numbers_at(document, path)
    return document


def _numbers_at(node: Any, path: tuple[str, ...]) -> None:
    """Turn the 64-bit integer strings at ``path`` under ``node`` (a value or a list of them) into numbers."""
    step, rest = path[0], path[1:]
    if step in ("[]", "{}"):
        children = node if step == "[]" else list(node.values())
        for child in children:
            _numbers_at(child, rest)
        return
    if not isinstance(node, dict) or step not in node:
        return
    if rest:
        _numbers_at(node[step], rest)
    elif isinstance(node[step], list):
        node[step] = [int(value) for value in node[step]]
    else:
        node[step] = int(node[step])
