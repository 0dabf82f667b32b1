"""``platform: "ensemble"``: its ``ensemble_scheduling`` parsed and checked, in Triton's words.

Two checks, at the two moments Triton makes them:

- ``validate_scheduling`` needs only the ensemble's own config (Triton's
  ``ValidateEnsembleSchedulingConfig``, core model_config_utils.cc): the fields an ensemble must and
  must not have, every step complete, no tensor written by two steps, and the data flow from the
  ensemble's inputs through the steps to its outputs (an input nobody reads, an output nobody
  writes, a tensor left over: a loop between steps shows up as one of these);
- ``validate_against_composing`` runs once the composing models are loaded, against their
  completed configs (Triton's ``ValidateEnsembleConfig``, core ensemble_utils.cc): batch sizes,
  every model input mapped exactly once, no map to or from a tensor the model lacks, and each
  ensemble tensor's datatype and shape the same wherever it is read or written.

``dependency_cycle`` finds ensembles that (through other ensembles) contain themselves.
Messages are Triton's, quirks included (``ensemble input 'X' for ensemble E' is not used``), since
users search for them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.errors import load_failed
from shoal.protocol import config_pb2

if TYPE_CHECKING:
    from shoal.repository.config import ModelSpec

ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True)
class EnsembleStep:
    """One step: a composing model and how its tensors map to the ensemble's."""

    model_name: str
    model_version: int  # -1: the model's highest ready version, as for a request without one
    input_map: tuple[tuple[str, str], ...]  # (the model's input, the ensemble tensor it reads)
    output_map: tuple[tuple[str, str], ...]  # (the model's output, the ensemble tensor it writes)

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(tensor for _, tensor in self.input_map)

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(tensor for _, tensor in self.output_map)


@dataclass(frozen=True)
class EnsembleScheduling:
    steps: tuple[EnsembleStep, ...]
    composing_models: tuple[str, ...] = field(init=False)  # each once, in step order

    def __post_init__(self) -> None:
        object.__setattr__(self, "composing_models", tuple(dict.fromkeys(s.model_name for s in self.steps)))


def is_ensemble(config: config_pb2.ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM


def scheduling(config: config_pb2.ModelConfig) -> EnsembleScheduling:
    """The steps of a validated ensemble config, maps sorted by name (protobuf maps have no order)."""
    return EnsembleScheduling(
        tuple(
            EnsembleStep(
                step.model_name,
                step.model_version,
                tuple(sorted(step.input_map.items())),
                tuple(sorted(step.output_map.items())),
            )
            for step in config.ensemble_scheduling.step
        )
    )


def validate_scheduling(config: config_pb2.ModelConfig) -> None:
    """What needs no composing model; raises a load error with Triton's message."""
    name = config.name
    if not is_ensemble(config):
        if config.HasField("ensemble_scheduling"):
            raise load_failed(
                f"ensemble scheduling cannot be set for model '{name}' whose platform is not {ENSEMBLE_PLATFORM}"
            )
        return
    if not config.HasField("ensemble_scheduling"):
        raise load_failed(f"ensemble scheduling must be set for ensemble {name} whose platform is {ENSEMBLE_PLATFORM}")
    if config.instance_group:
        raise load_failed(f"instance group should not be specified for ensemble '{name}'")
    if config.HasField("optimization"):
        raise load_failed(f"optimization should not be specified for ensemble '{name}'")
    if config.model_warmup:
        raise load_failed(f"model_warmup can not be specified for ensemble '{name}'")
    if not config.ensemble_scheduling.step:
        raise load_failed(f"must specify 'step' for ensemble '{name}'")
    _check_flow(config, _graph(config))


@dataclass
class _Tensor:
    """An ensemble tensor in the data-flow graph: who writes it (``written``), what it feeds."""

    written: bool = False
    ready: bool = False
    before: list[_Tensor] = field(default_factory=list)
    after: list[_Tensor] = field(default_factory=list)


def _graph(config: config_pb2.ModelConfig) -> dict[str, _Tensor]:
    """Triton's ``BuildEnsembleGraph``: each tensor a step writes comes after every tensor it reads."""
    tensors: dict[str, _Tensor] = {}
    where = f"ensemble '{config.name}'"
    for index, step in enumerate(config.ensemble_scheduling.step):
        for field_name in ("model_name", "input_map", "output_map"):
            if not getattr(step, field_name):
                raise load_failed(f"must specify '{field_name}' in step {index} of {where}")
        written = []
        for tensor_name in sorted(step.output_map.values()):
            tensor = tensors.setdefault(tensor_name, _Tensor())
            if tensor.written:
                raise load_failed(
                    f"ensemble tensor '{tensor_name}' can appear in an output map only once for {where} step {index}"
                )
            tensor.written = True
            written.append(tensor)
        for tensor_name in sorted(step.input_map.values()):
            source = tensors.setdefault(tensor_name, _Tensor())
            for tensor in written:
                tensor.before.append(source)
                source.after.append(tensor)
    return tensors


def _check_flow(config: config_pb2.ModelConfig, tensors: dict[str, _Tensor]) -> None:
    """From the inputs, mark every tensor whose writers' inputs are all ready; then nothing may be
    unreached or unread (Triton's data-flow check, same order, same words)."""
    name = config.name
    pending: deque[_Tensor] = deque()
    for tensor_config in config.input:
        tensor = tensors.get(tensor_config.name)
        if tensor is None:
            raise load_failed(f"ensemble input '{tensor_config.name}' for ensemble {name}' is not used")
        tensor.ready = True
        pending.append(tensor)
    while pending:
        for following in pending.popleft().after:
            if not following.ready and all(t.ready for t in following.before):
                following.ready = True
                pending.append(following)
    outputs = set()
    for tensor_config in config.output:
        tensor = tensors.get(tensor_config.name)
        if tensor is None:
            raise load_failed(f"ensemble output '{tensor_config.name}' for ensemble {name}' is not used")
        if not tensor.ready:
            raise load_failed(f"output '{tensor_config.name}' for ensemble '{name}' is not written")
        outputs.add(tensor_config.name)
    for tensor_name, tensor in tensors.items():
        if tensor_name not in outputs and (not tensor.ready or not tensor.after):
            raise load_failed(f"ensemble tensor '{tensor_name}' is unused in ensemble '{name}'")


def dependency_cycle(name: str, composing: Sequence[str], steps_of: Callable[[str], Sequence[str]]) -> str:
    """Triton's message for an ensemble that contains itself through ``composing`` (its models),
    following ``steps_of(model)`` (an ensemble's composing models; empty for any other model); or "".
    """
    seen: set[str] = set()
    pending = [(model, name) for model in composing]  # (model to visit, the ensemble that uses it)
    while pending:
        model, user = pending.pop()
        if model == name:
            return f"circular dependency between ensembles: {name} -> ... -> {user} -> {name}"
        if model in seen:
            continue
        seen.add(model)
        pending.extend((inner, model) for inner in steps_of(model))
    return ""


# -- against the composing models ----------------------------------------------------------------


@dataclass(frozen=True)
class _Inferred:
    """An ensemble tensor's datatype and dims as one model declares them (Triton's ``TensorNode``)."""

    model: str
    datatype: str  # TYPE_* as in the config
    dims: tuple[int, ...]  # without the batch dimension
    batching: bool

    @property
    def full_dims(self) -> tuple[int, ...]:
        return (-1, *self.dims) if self.batching else self.dims


def validate_against_composing(spec: ModelSpec, composing: Sequence[ModelSpec]) -> None:
    """Every step against its model's completed config (``composing``: one per step, in order)."""
    assert spec.ensemble is not None and len(composing) == len(spec.ensemble.steps)
    batching = spec.max_batch_size > 0
    known: dict[str, _Inferred] = {}
    for tensor in (*spec.inputs, *spec.outputs):
        dims = tensor.reshape if tensor.reshape is not None else tensor.dims  # as Triton: the reshape, if any
        known[tensor.name] = _Inferred(spec.name, tensor.datatype.config_name, dims, batching)
    for step, model in zip(spec.ensemble.steps, composing, strict=True):
        if model.max_batch_size != 0 and model.max_batch_size < spec.max_batch_size:
            raise load_failed(
                f"ensemble {spec.name} allows maximum batch size {spec.max_batch_size}, but it contains model "
                f"{step.model_name} which only allows maximum batch size to be {model.max_batch_size}"
            )
        _check_step(spec.name, step, model, known)


def _check_step(ensemble: str, step: EnsembleStep, model: ModelSpec, known: dict[str, _Inferred]) -> None:
    where = f"in ensemble {ensemble}"
    batching = model.max_batch_size > 0
    for model_input, tensor_name in step.input_map:
        if model.input(model_input) is None:
            raise load_failed(
                f"{where}, ensemble tensor {tensor_name} is mapping to non-existing input "
                f"{model_input} in model {model.name}"
            )
    mapped = dict(step.input_map)
    for tensor in model.inputs:
        if tensor.name not in mapped:
            if tensor.optional:
                continue
            raise load_failed(
                f"{where}, input {tensor.name} in model {model.name} is not mapped to any ensemble tensors"
            )
        inferred = _Inferred(model.name, tensor.datatype.config_name, tensor.dims, batching)
        _agree(where, mapped[tensor.name], inferred, known)
    for model_output, tensor_name in step.output_map:
        output = model.output(model_output)
        if output is None:
            raise load_failed(
                f"{where}, ensemble tensor {tensor_name} is mapped from non-existing output "
                f"{model_output} in model {model.name}"
            )
        _agree(where, tensor_name, _Inferred(model.name, output.datatype.config_name, output.dims, batching), known)


def _agree(where: str, tensor_name: str, inferred: _Inferred, known: dict[str, _Inferred]) -> None:
    """The first model to name a tensor sets its type and shape; every later one must agree (a -1
    matches any size; a non-batching model's [-1, d...] matches a batching one's [d...])."""
    first = known.setdefault(tensor_name, inferred)
    prefix = f"{where}, ensemble tensor {tensor_name}: "
    if first.datatype != inferred.datatype:
        raise load_failed(
            f"{prefix}inconsistent data type: {first.datatype} is inferred from model {first.model} "
            f"while {inferred.datatype} is inferred from model {inferred.model}"
        )
    if not _same_dims(first.dims, inferred.dims) and not _same_dims(first.full_dims, inferred.full_dims):
        raise load_failed(
            f"{prefix}inconsistent shape: {_text(first.full_dims)} is inferred from model "
            f"{first.model} while {_text(inferred.full_dims)} is inferred from model {inferred.model}"
        )


def _same_dims(left: tuple[int, ...], right: tuple[int, ...]) -> bool:
    return len(left) == len(right) and all(a == b or a == -1 or b == -1 for a, b in zip(left, right, strict=True))


def _text(dims: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"
