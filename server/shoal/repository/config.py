"""config.pbtxt → validated, normalized ``ModelSpec`` (a frozen dataclass).

Named steps, each testable alone (as Triton's model_config_utils): ``parse_config``
(text format against our ModelConfig schema) → ``detect_backend`` → auto-complete from
the model file (``model_io.complete``) → ``normalize`` (defaults Triton fills in) →
``validate`` (rules that need no model file) → ``to_spec`` (plain dataclasses).
``shoal.configuring.pipeline`` runs them in that order. Checks that need the model file
(tensor names, types and dims) are ``model_io.check_io``.
This and ``server/shoal/grpc`` are the only places that touch protobuf.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

from google.protobuf import json_format, text_format

from shoal.errors import ShoalError, load_failed, shown
from shoal.protocol import config_pb2, wire_names
from shoal.protocol.types import DataType
from shoal.repository import ensemble_config, sequence_config
from shoal.repository.ensemble_config import EnsembleScheduling
from shoal.repository.instance_defaults import DEFAULT_CPU_INSTANCE_COUNT
from shoal.repository.scanner import CONFIG_FILENAME as CONFIG_FILENAME
from shoal.repository.scanner import checked_path

# platform string → backend name, as Triton's auto-complete of backend fields.
PLATFORM_BACKENDS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch"}
BACKEND_PLATFORMS = {backend: platform for platform, backend in PLATFORM_BACKENDS.items()}
DEFAULT_MODEL_FILENAMES = {"onnxruntime": "model.onnx", "pytorch": "model.pt", "python": "model.py"}
# Triton gives CPU instance groups of these backends two instances by default.
# The batcher keeps two queues per priority level and walks them per batch; Triton sets no bound, but a
# config asking for billions of levels must be refused at load, not exhaust memory.
MAX_PRIORITY_LEVELS = 1024


class InstanceKind(enum.Enum):
    AUTO = "KIND_AUTO"
    GPU = "KIND_GPU"
    CPU = "KIND_CPU"
    MODEL = "KIND_MODEL"


@dataclass(frozen=True)
class TensorSpec:
    """A config input or output; ``dims`` exclude the batch dimension; -1 is variable."""

    name: str
    datatype: DataType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    # An output's ``label_filename`` (in the model folder) and its lines, read at load; a line
    # is the label of the class index equal to its line number (from 0).
    label_filename: str = ""
    labels: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class RateLimiterSpec:
    """An instance group's ``rate_limiter``: (name, global, count) per resource, and its priority (0 counts as 1)."""

    resources: tuple[tuple[str, bool, int], ...] = ()
    priority: int = 0


@dataclass(frozen=True)
class InstanceGroupSpec:
    name: str
    kind: InstanceKind
    count: int
    gpus: tuple[int, ...] = ()
    rate_limiter: RateLimiterSpec = RateLimiterSpec()


@dataclass(frozen=True)
class VersionPolicy:
    """``latest`` keeps the ``num_versions`` highest; ``all``; ``specific`` keeps ``versions``."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.num_versions :] if self.num_versions > 0 else []


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy; 0 means none/unbounded."""

    delay_on_timeout: bool = False  # timeout_action DELAY (else REJECT)
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policies: dict[int, QueuePolicy] = field(default_factory=dict)

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policies.get(level, self.default_queue_policy)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the server needs about one model, decoupled from protobuf."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_groups: tuple[InstanceGroupSpec, ...]
    version_policy: VersionPolicy
    default_model_filename: str
    dynamic_batching: DynamicBatching | None = None
    sequence_batching: sequence_config.SequenceBatching | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    # The normalized config as proto3 JSON (field names as in the .proto): what ModelConfig returns.
    config_json: dict[str, Any] = field(default_factory=dict)
    # platform "ensemble": its steps (repository/ensemble_config.py); it has no backend or instances.
    ensemble: EnsembleScheduling | None = None
    # response_cache { enable: true }: answered from the server's cache when it has one (--cache-config).
    response_cache: bool = False
    # model_transaction_policy { decoupled: true }: zero or more responses per request, then a FINAL flag.
    decoupled: bool = False

    def input(self, name: str) -> TensorSpec | None:
        return self._inputs_by_name.get(name)

    def output(self, name: str) -> TensorSpec | None:
        return self._outputs_by_name.get(name)

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        """Every output, in config order: what a request that names none gets."""
        return tuple(t.name for t in self.outputs)

    # Built once per spec (the fields never change): every request looks its tensors up by name.
    @functools.cached_property
    def _inputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in reversed(self.inputs)}  # reversed: the first of a repeated name wins

    @functools.cached_property
    def _outputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in reversed(self.outputs)}


def read_config(model_dir: Path) -> config_pb2.ModelConfig:
    """Read and parse ``<model_dir>/config.pbtxt`` (``model_dir`` lies in its repository, the parent
    folder); errors name the file relative to the repository, with line and column."""
    label = f"{model_dir.name}/{CONFIG_FILENAME}"
    path = checked_path(model_dir.parent, label)
    if not path.is_file():
        raise load_failed(f"{label}: no {CONFIG_FILENAME} in the model folder")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise load_failed(f"{label}: not UTF-8 text") from None
    except OSError as exc:
        raise load_failed(f"{label}: cannot read: {exc.strerror}") from None
    return parse_config(text, source=label)


def parse_config(text: str, source: str = CONFIG_FILENAME) -> config_pb2.ModelConfig:
    config = config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        # ParseError's text is "line:column : message"; prefix the file so it reads file:line:col.
        raise load_failed(wire_names(f"{source}:{exc}")) from exc
    return config


def normalize(
    config: config_pb2.ModelConfig,
    model_name: str,
    auto_kind: Callable[[str, config_pb2.ModelInstanceGroup], int] | None = None,
) -> config_pb2.ModelConfig:
    """Fill in the defaults Triton fills in; returns a new message.

    A config without ``instance_group`` gets one group named after the model, and an unnamed group
    ``<model>_<index>`` (core model_config_utils.cc ``NormalizeInstanceGroup``; its instances are
    ``<group>_<n>``, the ``model_instance_name`` a Python model reads: ``echo_0`` for a config without
    groups, as on Triton 2.51). A group without a ``count`` gets Triton's default for its kind (core
    model_config_utils.cc ``SetDefaultInstanceCount``): 2 for KIND_CPU on the onnxruntime backend,
    else 1 (per GPU for KIND_GPU). Triton resolves KIND_AUTO first; Shoal keeps the kind as written
    (placement resolves it, with the backend's say), so ``auto_kind(backend, group)`` tells the kind a
    KIND_AUTO group resolves to here (the lifecycle passes it; without it KIND_AUTO counts as not KIND_CPU).
    """
    out = config_pb2.ModelConfig()
    out.CopyFrom(config)
    if not out.name:
        out.name = model_name
    if out.platform in PLATFORM_BACKENDS and not out.backend:
        out.backend = PLATFORM_BACKENDS[out.platform]
    if out.backend in BACKEND_PLATFORMS and not out.platform:
        out.platform = BACKEND_PLATFORMS[out.backend]
    if not out.HasField("version_policy"):
        out.version_policy.latest.num_versions = 1
    if not out.default_model_filename and out.backend in DEFAULT_MODEL_FILENAMES:
        out.default_model_filename = DEFAULT_MODEL_FILENAMES[out.backend]
    if out.HasField("dynamic_batching") and out.max_batch_size > 0:
        if not out.dynamic_batching.preferred_batch_size:
            out.dynamic_batching.preferred_batch_size.append(out.max_batch_size)
    if out.HasField("sequence_batching"):
        sequence_config.normalize(out)
    if ensemble_config.is_ensemble(out):  # no instances of its own; Triton sets decoupled after its checks
        out.model_transaction_policy.SetInParent()
    else:
        _normalize_pinned_memory(out.optimization)
        if not out.instance_group:  # named after the model, as Triton names the group it adds
            out.instance_group.add(name=out.name)
    kinds = config_pb2.ModelInstanceGroup.Kind
    for index, group in enumerate(out.instance_group):
        if not group.name:
            group.name = f"{out.name}_{index}"
        if group.count < 1:
            kind = group.kind
            if kind == kinds.KIND_AUTO and auto_kind is not None:
                kind = auto_kind(out.backend, group)
            group.count = DEFAULT_CPU_INSTANCE_COUNT.get(out.backend, 1) if kind == kinds.KIND_CPU else 1
    return out


def _normalize_pinned_memory(optimization: config_pb2.ModelOptimizationPolicy) -> None:
    """Triton's NormalizeModelConfig: pinned input and output buffers on unless the config says, so
    the config a client reads back has Triton's ``optimization`` block (Shoal copies no pinned memory)."""
    if not optimization.HasField("input_pinned_memory"):
        optimization.input_pinned_memory.enable = True
    if not optimization.HasField("output_pinned_memory"):
        optimization.output_pinned_memory.enable = True


def validate(config: config_pb2.ModelConfig, model_name: str) -> None:
    """Rules that need no model file; raises a load error naming the field."""
    where = f"model '{model_name}'"
    if config.name != model_name:
        raise load_failed(f"{where}: config name '{config.name}' does not match the folder name")
    ensemble_config.validate_scheduling(config)
    if not config.backend and not ensemble_config.is_ensemble(config):
        raise load_failed(f"{where}: config sets neither 'platform' nor 'backend'")
    if config.platform and config.platform in PLATFORM_BACKENDS:
        if PLATFORM_BACKENDS[config.platform] != config.backend:
            raise load_failed(f"{where}: platform '{config.platform}' does not match backend '{config.backend}'")
    validate_filename(config, model_name)
    if config.max_batch_size < 0:
        raise load_failed(f"{where}: max_batch_size must be >= 0, got {config.max_batch_size}")
    if not config.input or not config.output:
        raise load_failed(f"{where}: config must list at least one input and one output")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            label = f"{where}: {kind} '{tensor.name}'"
            if not tensor.name:
                raise load_failed(f"{where}: an {kind} has no name")
            if tensor.name in seen:
                raise load_failed(f"{label} is listed twice")
            seen.add(tensor.name)
            if tensor.data_type == config_pb2.TYPE_INVALID:
                raise load_failed(f"{label} has no data_type")
            if not tensor.dims:
                raise load_failed(f"{label} must have at least one dim")
            if any(d < -1 or d == 0 for d in tensor.dims):
                raise load_failed(f"{label} has invalid dims {list(tensor.dims)}: use positive sizes or -1")
            if tensor.HasField("reshape"):
                _validate_reshape(label, list(tensor.dims), list(tensor.reshape.shape))
    for group in config.instance_group:
        if group.count < 1:
            raise load_failed(f"{where}: instance group '{group.name}' has count {group.count}")
        if group.gpus and group.kind in (
            config_pb2.ModelInstanceGroup.KIND_CPU,
            config_pb2.ModelInstanceGroup.KIND_MODEL,
        ):
            raise load_failed(f"{where}: instance group '{group.name}' of kind CPU cannot list gpus")
    policy = config.version_policy
    if policy.HasField("specific") and not policy.specific.versions:
        raise load_failed(f"{where}: version_policy specific lists no versions")
    if config.HasField("dynamic_batching"):
        _validate_dynamic_batching(config, where)
    if config.HasField("sequence_batching"):
        sequence_config.validate(config, where)
    _validate_response_cache(config)


def _validate_response_cache(config: config_pb2.ModelConfig) -> None:
    """Triton's refusals (core model_config_utils.cc), whether or not the server has a cache: a
    sequence's answers depend on its state, a decoupled model's on more than one response."""
    if not config.response_cache.enable:
        return
    if config.HasField("sequence_batching"):
        raise load_failed(
            f"Response Cache does not currently support model {config.name} with sequence batching "
            "scheduler. Please disable the response cache."
        )
    if config.model_transaction_policy.decoupled:
        raise load_failed(
            f"Response Cache does not currently support model {config.name} with 'decoupled' "
            "transaction policy. Please disable the response cache."
        )


def validate_filename(config: config_pb2.ModelConfig, model_name: str) -> None:
    """``default_model_filename`` is a plain file name in the version folder, and no file name the
    config gives holds a NUL byte (both checked before any open)."""
    problem = nul_in_file_names(config)
    if problem is not None:
        raise load_failed(f"model '{model_name}': {problem}")
    filename = config.default_model_filename
    if filename and (Path(filename).name != filename or filename in {".", ".."}):
        raise load_failed(
            f"model '{model_name}': default_model_filename must be a file name inside the "
            f"version folder, got {shown(filename)!r}"
        )


def nul_in_file_names(config: config_pb2.ModelConfig) -> str | None:
    """What is wrong when a field of ``config`` that names a file holds a NUL byte, which no file
    name can (opening one raises ValueError); None when none does. A config override checks this
    first, to refuse it as a bad argument that names the field."""
    named = [("default_model_filename", config.default_model_filename)]
    named += [(f"label_filename of output '{shown(o.name)}'", o.label_filename) for o in config.output]
    named += [
        (f"data_file of initial_state '{shown(initial.name)}'", initial.data_file)
        for state in config.sequence_batching.state
        for initial in state.initial_state
    ]
    for what, value in named:
        if "\0" in value:
            return f"{what} holds a NUL byte, which no file name can hold"
    return None


def _validate_reshape(label: str, dims: list[int], reshape: list[int]) -> None:
    """Triton's rule: dims and reshape hold the same elements. With variable dims (-1), each run of
    fixed dims between them must hold as many elements in both; an empty reshape (a scalar) needs
    dims of one element. At most one -1 on each side (a reshape can fill in only one)."""
    if any(d < -1 or d == 0 for d in reshape):
        raise load_failed(f"{label} has invalid reshape {reshape}: use positive sizes or -1")
    if not reshape:
        if _runs(dims) != (1,):
            raise load_failed(f"{label} has an empty reshape (a scalar), so its dims must hold one element, got {dims}")
        return
    if _runs(dims) != _runs(reshape):
        raise load_failed(f"{label} has different size for dims {dims} and reshape {reshape}")
    if reshape.count(-1) > 1:
        raise load_failed(
            f"{label}: reshape {reshape} has more than one variable dimension, which Shoal cannot reshape to"
        )


def _runs(shape: list[int]) -> tuple[int, ...]:
    """Element counts of the runs of fixed dims that the variable dims (-1) separate."""
    counts = [1]
    for dim in shape:
        if dim == -1:
            counts.append(1)
        else:
            counts[-1] *= dim
    return tuple(counts)


def _validate_dynamic_batching(config: config_pb2.ModelConfig, where: str) -> None:
    batching = config.dynamic_batching
    for size in batching.preferred_batch_size:
        if size < 1 or (config.max_batch_size > 0 and size > config.max_batch_size):
            raise load_failed(
                f"{where}: preferred_batch_size {size} must be between 1 and max_batch_size {config.max_batch_size}"
            )
    levels = batching.priority_levels
    if levels > MAX_PRIORITY_LEVELS:
        raise load_failed(f"{where}: priority_levels must be at most {MAX_PRIORITY_LEVELS}, got {levels}")
    if levels == 0 and (batching.default_priority_level or batching.priority_queue_policy):
        raise load_failed(f"{where}: priority settings need priority_levels > 0")
    if levels > 0 and not 1 <= batching.default_priority_level <= levels:
        raise load_failed(
            f"{where}: default_priority_level must be between 1 and priority_levels {levels}, "
            f"got {batching.default_priority_level}"
        )
    for level in batching.priority_queue_policy:
        if not 1 <= level <= levels:
            raise load_failed(f"{where}: priority_queue_policy for level {level}, but priority_levels is {levels}")


def read_labels(model_dir: Path, config: config_pb2.ModelConfig) -> dict[str, tuple[bytes, ...]]:
    """Output name → the lines of its ``label_filename``, as Triton's LabelProvider reads them.

    ``model_dir`` lies in its repository (the parent folder). The file is a path inside the model
    folder (subfolders allowed); one that leads outside it, or is missing, refuses the model.
    Lines are split on ``\\n`` only and kept as bytes (a label is returned as written, ``\\r``
    included); the file's final newline ends the last label rather than adding an empty one.
    """
    model_root = checked_path(model_dir.parent, model_dir.name)
    labels = {}
    for output in config.output:
        if not output.label_filename:
            continue
        relative = PurePath(model_dir.name, output.label_filename)
        where = f"model '{config.name}': label file '{shown(output.label_filename)}' for output '{output.name}'"
        try:
            path = checked_path(model_dir.parent, relative)
        except ShoalError:
            path = model_root  # outside the repository: refused below with the same message
        if path == model_root or not path.is_relative_to(model_root):
            raise load_failed(f"{where} is outside the model folder")
        if not path.is_file():
            raise load_failed(f"{where} is missing or not a file ('{shown(str(relative))}')")
        try:
            lines = path.read_bytes().split(b"\n")
        except OSError as exc:
            raise load_failed(f"{where}: cannot read '{shown(str(relative))}': {exc.strerror}") from None
        if lines[-1] == b"":
            lines.pop()
        labels[output.name] = tuple(lines)
    return labels


def to_spec(config: config_pb2.ModelConfig, labels: dict[str, tuple[bytes, ...]] | None = None) -> ModelSpec:
    """Convert a normalized, validated config into a ``ModelSpec``; ``labels`` from ``read_labels``."""
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    version_policy = VersionPolicy(
        kind=choice or "latest",
        num_versions=policy.latest.num_versions if choice == "latest" else 1,
        versions=tuple(policy.specific.versions),
    )
    kind_names = config_pb2.ModelInstanceGroup.Kind
    return ModelSpec(
        name=config.name,
        platform=config.platform,
        backend=config.backend,
        max_batch_size=config.max_batch_size,
        inputs=tuple(_tensor_spec(t.name, t.data_type, t.dims, t, optional=t.optional) for t in config.input),
        outputs=tuple(
            replace(
                _tensor_spec(t.name, t.data_type, t.dims, t),
                label_filename=t.label_filename,
                labels=(labels or {}).get(t.name, ()),
            )
            for t in config.output
        ),
        instance_groups=tuple(
            InstanceGroupSpec(
                g.name, InstanceKind(kind_names.Name(g.kind)), g.count, tuple(g.gpus), _rate_limiter(g.rate_limiter)
            )
            for g in config.instance_group
        ),
        version_policy=version_policy,
        default_model_filename=config.default_model_filename,
        dynamic_batching=_dynamic_batching(config) if config.HasField("dynamic_batching") else None,
        sequence_batching=sequence_config.to_spec(config) if config.HasField("sequence_batching") else None,
        parameters={k: v.string_value for k, v in config.parameters.items()},
        config_json=json_format.MessageToDict(config, preserving_proto_field_name=True),
        ensemble=ensemble_config.scheduling(config) if ensemble_config.is_ensemble(config) else None,
        response_cache=config.response_cache.enable,
        decoupled=config.model_transaction_policy.decoupled,
    )


def _rate_limiter(limiter: config_pb2.ModelRateLimiter) -> RateLimiterSpec:
    # ``global`` is a Python keyword: the field is read with getattr.
    return RateLimiterSpec(tuple((r.name, getattr(r, "global"), r.count) for r in limiter.resources), limiter.priority)


def detect_backend(config: config_pb2.ModelConfig, version_dirs: list[Path]) -> None:
    """Triton's auto-complete of backend fields: a platform names its backend (so that a config giving
    only ``platform: "onnxruntime_onnx"`` is completed from its model file as Triton completes it); with
    neither set, the model file in the newest version folder decides (model.onnx → onnxruntime,
    model.pt → pytorch)."""
    if config.platform in PLATFORM_BACKENDS and not config.backend:
        config.backend = PLATFORM_BACKENDS[config.platform]
    if config.platform or config.backend:
        return
    by_file = {filename: backend for backend, filename in DEFAULT_MODEL_FILENAMES.items()}
    by_file["model.pt2"] = "pytorch"  # a torch.export program
    for folder in sorted(version_dirs, key=lambda p: int(p.name), reverse=True):
        candidates = [config.default_model_filename] if config.default_model_filename else list(by_file)
        for filename in candidates:
            if filename not in by_file:
                continue
            model_dir = folder.parent
            if checked_path(model_dir.parent, Path(model_dir.name, folder.name, filename)).exists():
                config.backend = by_file[filename]
                if filename != DEFAULT_MODEL_FILENAMES.get(config.backend):
                    config.default_model_filename = filename
                return


def _dynamic_batching(config: config_pb2.ModelConfig) -> DynamicBatching:
    batching = config.dynamic_batching
    return DynamicBatching(
        preferred_batch_sizes=tuple(sorted(batching.preferred_batch_size)),
        max_queue_delay_us=batching.max_queue_delay_microseconds,
        preserve_ordering=batching.preserve_ordering,
        priority_levels=batching.priority_levels,
        default_priority_level=batching.default_priority_level,
        default_queue_policy=_queue_policy(batching.default_queue_policy),
        priority_queue_policies={
            level: _queue_policy(policy) for level, policy in batching.priority_queue_policy.items()
        },
    )


def _queue_policy(policy: config_pb2.ModelQueuePolicy) -> QueuePolicy:
    return QueuePolicy(
        delay_on_timeout=policy.timeout_action == config_pb2.ModelQueuePolicy.DELAY,
        default_timeout_us=policy.default_timeout_microseconds,
        allow_timeout_override=policy.allow_timeout_override,
        max_queue_size=policy.max_queue_size,
    )


def _tensor_spec(name: str, data_type: int, dims: Any, tensor: Any, optional: bool = False) -> TensorSpec:
    reshape = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
    datatype = DataType.from_config_name(config_pb2.DataType.Name(data_type))
    return TensorSpec(name, datatype, tuple(dims), reshape, optional)
