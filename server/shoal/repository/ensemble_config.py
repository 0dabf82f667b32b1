"""``platform: "ensemble"``: its ``ensemble_scheduling`` parsed and checked, in Triton's words.

Two checks, at the two moments Triton makes them:

- ``validate_scheduling`` needs only the ensemble's own config (Triton's
  ``ValidateEnsembleSchedulingConfig``, core model_config_utils.cc): the fields an ensemble must and
  must not have, every step complete, no tensor written by two steps, and the data flow from the
  ensemble's inputs through the steps to its outputs (an input nobody reads, an output nobody
  writes, a tensor left over: a loop between steps shows up as one of these);
- ``repository.ensemble_composing.validate_against_composing`` runs once the composing models are
  loaded, against their completed configs (its own module: it reads their ``ModelSpec``, which is
  built from what this module parses).

``dependency_cycle`` finds ensembles that (through other ensembles) contain themselves.
Messages are Triton's, quirks included (``ensemble input 'X' for ensemble E' is not used``), since
users search for them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shoal.errors import load_failed
from shoal.protocol import config_pb2

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
