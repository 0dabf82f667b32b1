"""``sequence_batching`` in config.pbtxt → a validated, normalized ``SequenceBatching`` (a frozen dataclass).

The steps mirror ``config.py``'s (which calls them when a config has ``sequence_batching``):
``normalize`` fills Triton's defaults (``max_sequence_idle_microseconds`` 1,000,000; the oldest
strategy's ``preferred_batch_size`` ``[max_batch_size]``), ``validate`` checks what needs no model
file, with Triton's words where Triton refuses the same thing (core model_config_utils.cc and
sequence_batch_scheduler.cc), and ``to_spec`` converts. ``backend_inputs``/``backend_outputs`` are
the tensors the backend sees beyond the config's own: control inputs and implicit state, which a
client never sends nor receives. ``read_initial_states`` reads ``initial_state`` data files from the
model folder's ``initial_state/`` (as Triton), through the repository's checked paths.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath

import numpy as np

from shoal.errors import load_failed, shown
from shoal.protocol import config_pb2
from shoal.protocol.types import DataType
from shoal.repository.scanner import checked_path

DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000
INITIAL_STATE_FOLDER = "initial_state"
_Batching = config_pb2.ModelSequenceBatching
_CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")


class ControlKind(enum.Enum):
    START = "CONTROL_SEQUENCE_START"
    READY = "CONTROL_SEQUENCE_READY"
    END = "CONTROL_SEQUENCE_END"
    CORRID = "CONTROL_SEQUENCE_CORRID"


@dataclass(frozen=True)
class Control:
    """One control input: the tensor ``name`` the batcher fills with ``false``/``true`` (START, END,
    READY) or the correlation id (CORRID) per request, shape ``[1]`` (``[batch, 1]`` when batching)."""

    kind: ControlKind
    name: str
    datatype: DataType
    false_value: float | int | bool = 0
    true_value: float | int | bool = 1


@dataclass(frozen=True)
class StateSpec:
    """Implicit state: the batcher feeds ``input_name`` and keeps ``output_name`` per sequence."""

    input_name: str
    output_name: str
    datatype: DataType
    dims: tuple[int, ...]  # without the batch dimension; -1 is variable
    initial_name: str = ""
    initial_dims: tuple[int, ...] = ()
    initial_file: str = ""  # in the model folder's initial_state/; "" with initial_name set: zeros
    # The initial value read at load (``read_initial_states``); None: zeros of ``dims`` (-1 as 1).
    initial: np.ndarray | None = field(default=None, compare=False, repr=False)

    def start_value(self) -> np.ndarray:
        """The state a new sequence starts with (without the batch dimension)."""
        if self.initial is not None:
            return self.initial
        shape = self.initial_dims if self.initial_name else tuple(1 if d == -1 else d for d in self.dims)
        if self.datatype is DataType.BYTES:
            return np.full(shape, b"", dtype=object)
        return np.zeros(shape, dtype=self.datatype.numpy_dtype)


@dataclass(frozen=True)
class SequenceBatching:
    strategy: str  # "direct" or "oldest"
    max_sequence_idle_us: int = DEFAULT_MAX_SEQUENCE_IDLE_US
    controls: tuple[Control, ...] = ()
    states: tuple[StateSpec, ...] = ()
    max_queue_delay_us: int = 0
    minimum_slot_utilization: float = 0.0  # direct
    max_candidate_sequences: int = 0  # oldest; 0: max(1, max_batch_size)
    preferred_batch_sizes: tuple[int, ...] = ()  # oldest
    preserve_ordering: bool = False  # oldest

    def control(self, kind: ControlKind) -> Control | None:
        return next((c for c in self.controls if c.kind is kind), None)

    def slots_per_instance(self, max_batch_size: int) -> int:
        """Triton's ``seq_slot_cnt``: the batch size (at least 1), or oldest's candidate sequences."""
        if self.strategy == "oldest" and self.max_candidate_sequences > 0:
            return self.max_candidate_sequences
        return max(1, max_batch_size)


def normalize(config: config_pb2.ModelConfig) -> None:
    """Triton's defaults, in place (core model_config_utils.cc NormalizeModelConfig)."""
    batching = config.sequence_batching
    if batching.max_sequence_idle_microseconds == 0:
        batching.max_sequence_idle_microseconds = DEFAULT_MAX_SEQUENCE_IDLE_US
    if batching.HasField("oldest") and config.max_batch_size > 0 and not batching.oldest.preferred_batch_size:
        batching.oldest.preferred_batch_size.append(config.max_batch_size)


def validate(config: config_pb2.ModelConfig, where: str) -> None:
    """Rules that need no model file; raises a load error."""
    batching = config.sequence_batching
    if batching.iterative_sequence:
        raise load_failed(f"{where}: sequence_batching iterative_sequence is not supported by this server")
    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size < 1 or (config.max_batch_size > 0 and size > config.max_batch_size):
                raise load_failed(
                    f"{where}: sequence_batching oldest preferred_batch_size {size} must be between 1 "
                    f"and max_batch_size {config.max_batch_size}"
                )
        if batching.oldest.max_candidate_sequences < 0:
            raise load_failed(f"{where}: sequence_batching oldest max_candidate_sequences must be >= 0")
    if batching.HasField("direct") and not 0.0 <= batching.direct.minimum_slot_utilization <= 1.0:
        raise load_failed(f"{where}: sequence_batching direct minimum_slot_utilization must be between 0 and 1")
    _controls(config)
    taken = {t.name for t in config.input} | {t.name for t in config.output}
    for control in batching.control_input:
        if control.name in taken:
            raise load_failed(
                f"{where}: sequence batching control tensor '{control.name}' is also a config input "
                "or output; the batcher fills it, so list it only under control_input"
            )
    _validate_states(config, where, taken | {c.name for c in batching.control_input})


def _controls(config: config_pb2.ModelConfig) -> tuple[Control, ...]:
    """Each control kind's tensor, checked as Triton's Get{Boolean,Typed}SequenceControlProperties."""
    name = config.name
    seen_tensors: set[str] = set()
    found: dict[ControlKind, Control] = {}
    for control_input in config.sequence_batching.control_input:
        if not control_input.name:
            raise load_failed(f"sequence batching control tensor must have a name for {name}")
        if control_input.name in seen_tensors:
            raise load_failed(
                f"sequence batching control tensor '{control_input.name}' is specified for multiple "
                f"control kinds for {name}"
            )
        seen_tensors.add(control_input.name)
        for control in control_input.control:
            kind = ControlKind(_Batching.Control.Kind.Name(control.kind))
            if kind in found:
                raise load_failed(f"sequence batching specifies multiple {kind.value} tensors for {name}")
            found[kind] = _control(control_input.name, kind, control, name)
    return tuple(found.values())


def _control(tensor: str, kind: ControlKind, control: config_pb2.ModelSequenceBatching.Control, model: str) -> Control:
    lists = {
        "int32_false_true": list(control.int32_false_true),
        "fp32_false_true": list(control.fp32_false_true),
        "bool_false_true": list(control.bool_false_true),
    }
    given = [key for key, values in lists.items() if values]
    if kind is ControlKind.CORRID:
        if given:
            raise load_failed(
                f"sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
                f"'bool_false_true' for {kind.value} for {model}"
            )
        type_name = config_pb2.DataType.Name(control.data_type)
        if type_name not in _CORRID_TYPES:
            raise load_failed(
                f"unexpected control data type, expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
                f"TYPE_INT32, or TYPE_STRING for {kind.value} for {model}"
            )
        return Control(kind, tensor, DataType.from_config_name(type_name))
    if not given:
        raise load_failed(
            f"sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
            f"'bool_false_true' for {kind.value} for {model}"
        )
    if len(given) > 1:
        raise load_failed(
            f"sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' "
            f"and 'bool_false_true' for {kind.value} for {model}"
        )
    key = given[0]
    values = lists[key]
    if len(values) != 2:
        raise load_failed(f"sequence batching control '{key}' must have exactly 2 entries for {kind.value} for {model}")
    datatype = {"int32_false_true": DataType.INT32, "fp32_false_true": DataType.FP32, "bool_false_true": DataType.BOOL}[
        key
    ]
    return Control(kind, tensor, datatype, values[0], values[1])


def _validate_states(config: config_pb2.ModelConfig, where: str, taken: set[str]) -> None:
    seen: set[str] = set()
    for state in config.sequence_batching.state:
        label = f"{where}: state '{state.input_name}'"
        if not state.input_name or not state.output_name:
            raise load_failed(f"{where}: a state must set both input_name and output_name")
        for tensor in (state.input_name, state.output_name):
            if tensor in taken or tensor in seen:
                raise load_failed(
                    f"{label}: tensor '{tensor}' is used twice (config inputs and outputs, control "
                    "inputs and states must all differ)"
                )
            seen.add(tensor)
        if state.data_type == config_pb2.TYPE_INVALID:
            raise load_failed(f"{label} has no data_type")
        if not state.dims or any(d < -1 or d == 0 for d in state.dims):
            raise load_failed(f"{label} has invalid dims {list(state.dims)}: use positive sizes or -1")
        if state.use_growable_memory:
            raise load_failed(f"{label}: use_growable_memory is not supported by this server")
        if len(state.initial_state) > 1:  # Triton's words (SequenceBatchScheduler::Create)
            raise load_failed(
                f"initial_state field for state input '{state.input_name}' must contain exactly one "
                f"or zero element. Found '{len(state.initial_state)}' elements."
            )
        if state.initial_state:
            _validate_initial_state(state)


def _validate_initial_state(state: config_pb2.ModelSequenceBatching.State) -> None:
    """Triton's checks and words (SequenceBatchScheduler::GenerateInitialStateData)."""
    initial = state.initial_state[0]
    name = state.input_name
    if initial.data_type != state.data_type:
        raise load_failed(
            f"The data type used for 'initial_state' field of state '{name}' does not match the state data type."
        )
    if not initial.name:
        raise load_failed(f"Field 'name' must be set when using initial_state for state input '{name}'.")
    if len(initial.dims) != len(state.dims):
        raise load_failed(
            f"Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions "
            f"for state input '{name}'. {len(initial.dims)} != {len(state.dims)}"
        )
    for initial_dim, state_dim in zip(initial.dims, state.dims, strict=True):
        if initial_dim == -1:
            raise load_failed(f"'initial_state' field for state input name '{name}' contains variable dimensions.")
        if initial_dim < 1:
            raise load_failed(f"'initial_state' dims for state input name '{name}' must be positive")
        if state_dim != -1 and initial_dim != state_dim:
            raise load_failed(
                f"'initial_state' dim for input name '{name}' doesn't match 'state' dim description. "
                f"{initial_dim} != {state_dim}"
            )
    if initial.WhichOneof("state_data") is None:
        raise load_failed(f"initial_state setting expects state'{name}' to have state_data set")
    if initial.data_file and (PurePath(initial.data_file).is_absolute() or ".." in PurePath(initial.data_file).parts):
        raise load_failed(
            f"initial_state data_file for state input '{name}' must be a path inside the model "
            f"folder's {INITIAL_STATE_FOLDER}/, got {shown(initial.data_file)!r}"
        )


def to_spec(config: config_pb2.ModelConfig) -> SequenceBatching:
    """Convert a normalized, validated ``sequence_batching``."""
    batching = config.sequence_batching
    oldest = batching.HasField("oldest")
    states = []
    for state in batching.state:
        initial = state.initial_state[0] if state.initial_state else None
        states.append(
            StateSpec(
                input_name=state.input_name,
                output_name=state.output_name,
                datatype=DataType.from_config_name(config_pb2.DataType.Name(state.data_type)),
                dims=tuple(state.dims),
                initial_name=initial.name if initial else "",
                initial_dims=tuple(initial.dims) if initial else (),
                initial_file=initial.data_file if initial else "",
            )
        )
    return SequenceBatching(
        strategy="oldest" if oldest else "direct",
        max_sequence_idle_us=batching.max_sequence_idle_microseconds,
        controls=_controls(config),
        states=tuple(states),
        max_queue_delay_us=(
            batching.oldest.max_queue_delay_microseconds if oldest else batching.direct.max_queue_delay_microseconds
        ),
        minimum_slot_utilization=0.0 if oldest else batching.direct.minimum_slot_utilization,
        max_candidate_sequences=batching.oldest.max_candidate_sequences if oldest else 0,
        preferred_batch_sizes=tuple(sorted(batching.oldest.preferred_batch_size)) if oldest else (),
        preserve_ordering=batching.oldest.preserve_ordering if oldest else False,
    )


def read_initial_states(model_dir: Path, batching: SequenceBatching) -> SequenceBatching:
    """``batching`` with each ``data_file`` initial state read from ``<model>/initial_state/`` (raw
    little-endian values, or for TYPE_STRING Triton's length-prefixed elements), checked to lie in
    the repository; the file must hold at least the state's bytes, as Triton requires."""
    states = []
    for state in batching.states:
        if not state.initial_file:
            states.append(state)
            continue
        relative = PurePath(model_dir.name, INITIAL_STATE_FOLDER, state.initial_file)
        path = checked_path(model_dir.parent, relative)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise load_failed(
                f"initial_state file '{relative}' for state input '{state.input_name}' cannot be read: {exc.strerror}"
            ) from None
        states.append(replace(state, initial=_decode_initial(state, data, str(relative))))
    return replace(batching, states=tuple(states))


def _decode_initial(state: StateSpec, data: bytes, label: str) -> np.ndarray:
    count = int(np.prod(state.initial_dims))
    if state.datatype is DataType.BYTES:
        elements: list[bytes] = []
        offset = 0
        while len(elements) < count and offset + 4 <= len(data):
            size = int.from_bytes(data[offset : offset + 4], "little")
            elements.append(data[offset + 4 : offset + 4 + size])
            offset += 4 + size
        if len(elements) != count:
            raise load_failed(f"initial_state file '{label}' holds {len(elements)} strings, expected {count}")
        array = np.empty(count, dtype=object)
        array[:] = elements
        return array.reshape(state.initial_dims)
    needed = count * state.datatype.item_size
    if len(data) < needed:  # Triton's words
        raise load_failed(
            f"initial_state setting expects {needed} bytes, but the data provided from "
            f"{state.initial_file}only has {len(data)} bytes."
        )
    return np.frombuffer(data[:needed], dtype=state.datatype.numpy_dtype).reshape(state.initial_dims).copy()


def backend_inputs(batching: SequenceBatching) -> list[tuple[str, DataType, tuple[int, ...]]]:
    """(name, datatype, dims without batch) of the inputs the batcher adds: controls, then state inputs."""
    added: list[tuple[str, DataType, tuple[int, ...]]] = [(c.name, c.datatype, (1,)) for c in batching.controls]
    added += [(s.input_name, s.datatype, s.dims) for s in batching.states]
    return added


def backend_outputs(batching: SequenceBatching) -> list[tuple[str, DataType, tuple[int, ...]]]:
    """(name, datatype, dims without batch) of the outputs the batcher reads: the state outputs."""
    return [(s.output_name, s.datatype, s.dims) for s in batching.states]


def batcher_tensor_names(config: config_pb2.ModelConfig) -> set[str]:
    """Names of the tensors the sequence batcher feeds or reads (control inputs, states) in ``config``."""
    if not config.HasField("sequence_batching"):
        return set()
    batching = config.sequence_batching
    return {c.name for c in batching.control_input} | {n for s in batching.state for n in (s.input_name, s.output_name)}
