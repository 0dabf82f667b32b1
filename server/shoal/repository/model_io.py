"""What a model file declares about its tensors, and the two things done with it.

- ``complete``: Triton's auto-complete (strict model config off): fill ``max_batch_size``,
  ``input``, ``output`` and ``dynamic_batching`` from the model file;
- ``check_io``: refuse a config whose tensors contradict the model, naming the tensor.

Backends describe their files (``describe`` in each backend module); this module is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import load_failed
from shoal.protocol import config_pb2
from shoal.protocol.types import DataType
from shoal.repository import sequence_config
from shoal.repository.config import ModelSpec, TensorSpec

# Triton's --backend-config=default-max-batch-size default.
DEFAULT_MAX_BATCH_SIZE = 4


@dataclass(frozen=True)
class IOTensor:
    name: str
    datatype: DataType | None  # None: a type Shoal does not support
    shape: tuple[int | None, ...]  # None marks a variable dimension
    type_name: str = ""  # the framework's own spelling, for messages


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[IOTensor, ...]
    outputs: tuple[IOTensor, ...]

    @property
    def can_batch(self) -> bool:
        """Batching is possible when every input and output has a variable first dimension."""
        tensors = self.inputs + self.outputs
        return bool(tensors) and all(t.shape and t.shape[0] is None for t in tensors)


def complete(config: config_pb2.ModelConfig, io: ModelIO) -> tuple[config_pb2.ModelConfig, dict[str, str]]:
    """A completed copy of ``config`` and, per field it chose, why (for generated comments)."""
    out = config_pb2.ModelConfig()
    out.CopyFrom(config)
    reasons: dict[str, str] = {}
    if out.input and out.output:
        return out, reasons  # as Triton: inputs and outputs already given, nothing to complete
    if out.max_batch_size == 0 and io.can_batch:
        out.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        reasons["max_batch_size"] = (
            f"every input and output has a variable first dimension, so the model can batch; "
            f"{DEFAULT_MAX_BATCH_SIZE} is Triton's default (raise it for throughput, see `shoal config tune`)"
        )
    elif out.max_batch_size > 0 and not io.can_batch:
        raise load_failed(  # Triton's words (onnxruntime.cc AutoCompleteMaxBatch), then why
            f"autofill failed for model '{out.name}': model does not support batching while non-zero "
            f"max_batch_size is specified (max_batch_size is {out.max_batch_size}, but not every input and "
            "output of the model has a variable first dimension)"
        )
    elif out.max_batch_size == 0:
        reasons["max_batch_size"] = "a tensor has a fixed first dimension, so the model cannot batch"
    batching = out.max_batch_size > 0
    if out.max_batch_size > 1 and out.WhichOneof("scheduling_choice") is None:
        out.dynamic_batching.SetInParent()
        reasons["dynamic_batching"] = "the model batches: queued requests are merged up to max_batch_size"
    for target, tensors, kind in ((out.input, io.inputs, "input"), (out.output, io.outputs, "output")):
        # The sequence batcher's control and state tensors are the server's, not the config's.
        present = {t.name for t in target} | sequence_config.batcher_tensor_names(out)
        for tensor in tensors:
            if tensor.name in present:
                continue
            if tensor.datatype is None:
                raise load_failed(
                    f"model '{out.name}': {kind} '{tensor.name}' has type {tensor.type_name}, "
                    "which Shoal does not support"
                )
            added = target.add(name=tensor.name, data_type=config_pb2.DataType.Value(tensor.datatype.config_name))
            dims = tensor.shape[1:] if batching else tensor.shape
            if dims:
                added.dims.extend(-1 if d is None else d for d in dims)
            else:  # a scalar: Triton's dims [1], with an empty reshape only when the model batches
                # (onnxruntime.cc AutoCompleteIO; without batching the scalar is fed as check_io allows)
                added.dims.append(1)
                if batching:
                    added.reshape.SetInParent()
    return out, reasons


def check_io(spec: ModelSpec, io: ModelIO) -> None:
    """Refuse a config whose tensors contradict the model; the message names the tensor.

    Every config tensor must exist in the model and agree with it; every model input must be
    in the config (a config may list fewer outputs than the model has). A scalar in the model
    (shape ``[]``) agrees with config dims of 1s, with or without ``reshape: { shape: [] }``.
    """
    for kind, configured, declared in (("input", spec.inputs, io.inputs), ("output", spec.outputs, io.outputs)):
        by_name = {t.name: t for t in declared}
        for tensor in configured:
            if tensor.name not in by_name:
                raise load_failed(
                    f"model '{spec.name}': {kind} '{tensor.name}' is not an {kind} of the model "
                    f"(model {kind}s: {sorted(by_name)})"
                )
            _check_tensor(spec, kind, tensor, by_name[tensor.name])
    missing = [t.name for t in io.inputs if spec.input(t.name) is None]
    if missing:
        raise load_failed(f"model '{spec.name}': model input(s) {missing} are missing from the config")


def _check_tensor(spec: ModelSpec, kind: str, tensor: TensorSpec, model: IOTensor) -> None:
    label = f"model '{spec.name}': {kind} '{tensor.name}'"
    if model.datatype is None:
        raise load_failed(f"{label} has type {model.type_name}, which Shoal does not support")
    if model.datatype is not tensor.datatype:
        raise load_failed(
            f"{label} is {tensor.datatype.config_name} in the config but {model.datatype.config_name} in the model"
        )
    expected = list(tensor.reshape if tensor.reshape is not None else tensor.dims)
    shape = list(model.shape)
    if not shape:  # a scalar in the model: Triton's ORT backend (onnxruntime.cc ValidateInputs,
        # ValidateOutputs) takes any config dims made of 1s, feeds a scalar and reports the config dims
        if any(d != 1 for d in expected):
            raise load_failed(
                f"{label} is a scalar in the model, so its config dims may only be 1s (as [1]), got {expected}"
            )
        return
    if spec.max_batch_size > 0:
        if not shape or shape[0] is not None:
            raise load_failed(
                f"{label}: max_batch_size is {spec.max_batch_size} but the model's first dimension "
                f"is not variable (model shape {_show(model.shape)}); set max_batch_size: 0"
            )
        shape = shape[1:]
    if len(shape) != len(expected) or any(m is not None and m != c for m, c in zip(shape, expected, strict=True)):
        batch = "[-1] + " if spec.max_batch_size > 0 else ""
        raise load_failed(
            f"{label} has dims {batch}{expected} in the config but shape {_show(model.shape)} in the model"
        )


def _show(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("-1" if d is None else str(d) for d in shape) + "]"
