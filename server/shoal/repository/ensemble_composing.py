"""An ensemble against its composing models' completed configs, in Triton's words.

Triton's ``ValidateEnsembleConfig`` (core ensemble_utils.cc), once the composing models are loaded:
batch sizes, every model input mapped exactly once, no map to or from a tensor the model lacks, and
each ensemble tensor's datatype and shape the same wherever it is read or written. Its own module:
it reads ``ModelSpec``s, which ``repository.config`` builds from what ``ensemble_config`` parses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.errors import load_failed
from shoal.repository.config import ModelSpec
from shoal.repository.ensemble_config import EnsembleStep


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
