"""Every ModelConfig field, and what Shoal does with it: honoured, warned about, or refused at load.

Why a table: a Triton user's repository must never behave differently in silence. A field Shoal
parses but does not act on is named when the model loads: a warning where acting on it could not
change an answer (scheduling, performance, metrics), a refusal where it could (custom operators,
batch inputs, an accelerator this server does not have). ``FIELDS`` is keyed by dotted field path
(map values and repeated elements take their field's path); an entry covers the fields under it
unless a longer path has its own. ``tests/repository/test_unhonoured_fields.py`` walks ``model_config.proto``
and fails on a field no entry covers, so a field added to the proto cannot slip through unlisted.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from shoal.protocol import config_pb2


class Treatment(enum.Enum):
    HONOURED = "honoured"
    WARNED = "warned"  # loads; cannot change an answer
    REFUSED = "refused"  # the load fails with the reason


H, W, R = Treatment.HONOURED, Treatment.WARNED, Treatment.REFUSED

FIELDS: dict[str, tuple[Treatment, str]] = {
    "name": (H, ""),
    "platform": (H, ""),
    "backend": (H, ""),
    "runtime": (W, "Shoal runs its own backends; no backend shared library is loaded"),
    "version_policy": (H, ""),
    "max_batch_size": (H, ""),
    "input": (H, ""),
    "input.format": (H, "informational in Triton too"),
    "input.allow_ragged_batch": (R, "ragged batching is not implemented"),
    "input.is_shape_tensor": (R, "shape tensors (TensorRT) are not supported"),
    "input.is_non_linear_format_io": (R, "non-linear formats (TensorRT) are not supported"),
    "output": (H, ""),
    "output.is_shape_tensor": (R, "shape tensors (TensorRT) are not supported"),
    "output.is_non_linear_format_io": (R, "non-linear formats (TensorRT) are not supported"),
    "batch_input": (R, "batch inputs are not implemented: the model would see different inputs"),
    "batch_output": (R, "batch outputs are not implemented: the model's outputs would be split differently"),
    "optimization": (W, "not applied by Shoal's backends"),
    "optimization.priority": (W, "model priority is not applied"),
    "optimization.input_pinned_memory": (H, "Shoal stages no host copies to pin: nothing to do"),
    "optimization.output_pinned_memory": (H, "Shoal stages no host copies to pin: nothing to do"),
    "optimization.execution_accelerators": (
        R,
        "no execution accelerator (TensorRT, OpenVINO, ...) is available to Shoal's ONNX Runtime backend",
    ),
    "dynamic_batching": (H, ""),
    "sequence_batching": (H, ""),
    "ensemble_scheduling": (H, ""),
    "instance_group": (H, ""),
    "instance_group.rate_limiter": (H, "with --rate-limit execution_count (scheduling/rate_limiter.py)"),
    "instance_group.host_policy": (W, "host policies are not applied"),
    "instance_group.profile": (W, "TensorRT optimization profiles do not apply"),
    "instance_group.passive": (W, "passive instances are scheduled like any other"),
    "instance_group.secondary_devices": (W, "secondary devices (NVDLA) are not used"),
    "default_model_filename": (H, ""),
    "cc_model_filenames": (
        R,
        "per-compute-capability model files are not chosen: the default file would be served instead",
    ),
    "metric_tags": (W, "metric tags are not added to the metrics' labels"),
    "parameters": (H, "passed to the backend, which reads its own keys"),
    "model_warmup": (H, "run on every copy at load (lifecycle/warmup.py)"),
    "model_operations": (R, "custom operation libraries are not loaded"),
    "model_transaction_policy": (H, ""),
    "model_repository_agents": (
        R,
        "repository agents (checksum, decryption, ...) are not run: the model files would be used as they are",
    ),
    "response_cache": (H, "with --cache-config local,size=BYTES (lifecycle/response_cache.py)"),
    "model_metrics": (W, "custom metric histogram buckets are not applied"),
}


@dataclass(frozen=True)
class Finding:
    path: str  # the table's key: the field, or the block it is part of
    treatment: Treatment
    reason: str

    def message(self, model: str) -> str:
        verb = "is not honoured" if self.treatment is Treatment.WARNED else "is not supported"
        return f"model '{model}': {self.path} {verb}: {self.reason}"


def entry(path: str) -> str | None:
    """The key of the table entry that covers ``path``: the longest one that is it or a prefix of it."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in FIELDS:
            return key
    return None


def findings(config: config_pb2.ModelConfig) -> list[Finding]:
    """What ``config`` sets that Shoal warns about or refuses, once per table entry, in field order."""
    seen: dict[str, Finding] = {}
    for path in _set_paths(config, ""):
        key = entry(path)
        if key is None:
            raise KeyError(f"model_config.proto field {path} is not in unhonoured.FIELDS")
        treatment, reason = FIELDS[key]
        if treatment is not Treatment.HONOURED and key not in seen:
            seen[key] = Finding(key, treatment, reason)
    return list(seen.values())


def _set_paths(message: Message, prefix: str) -> Iterator[str]:
    """The paths of the fields ``message`` sets: a message field's own only when nothing in it is set
    (``dynamic_batching {}``), else those of what it sets, so that a block is judged by its contents."""
    for field, value in message.ListFields():
        path = prefix + field.name
        if field.message_type is None:
            yield path
            continue
        if field.message_type.GetOptions().map_entry:
            is_message = field.message_type.fields_by_name["value"].message_type is not None
            items = list(value.values()) if is_message else []
        else:
            items = list(value) if field.label == FieldDescriptor.LABEL_REPEATED else [value]
        inner = [child for item in items for child in _set_paths(item, path + ".")]
        yield from inner or [path]
