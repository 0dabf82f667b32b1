"""Check a request against a model's config, build the backend feed, and shape the outputs.

Every rule here answers INVALID_ARGUMENT with a message that names the model and the
tensor (wording close to Triton's, which users search for).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from shoal.errors import ErrorCode, ShoalError, invalid
from shoal.lifecycle import classification
from shoal.protocol.types import DataType
from shoal.repository.config import ModelSpec, TensorSpec
from shoal.types import InferRequest, Tensor


@dataclass(frozen=True)
class Prepared:
    feed: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    batch_size: int  # 0 when the model does not batch
    # Outputs returned as classifications: name → how many classes per batch row.
    class_counts: Mapping[str, int] = field(default_factory=dict)


def prepare(spec: ModelSpec, request: InferRequest) -> Prepared:
    given = {}
    for tensor in request.inputs:
        if tensor.name in given:
            raise invalid(f"input '{tensor.name}' appears twice in the request for model '{spec.name}'")
        given[tensor.name] = tensor
    unexpected = [name for name in given if spec.input(name) is None]
    if unexpected:
        raise invalid(
            f"unexpected inference input '{unexpected[0]}' for model '{spec.name}'; "
            f"allowed inputs are: {[t.name for t in spec.inputs]}"
        )
    missing = [t.name for t in spec.inputs if t.name not in given and not t.optional]
    if missing:
        raise invalid(
            f"expected {len(spec.inputs)} inputs but got {len(given)} inputs for model '{spec.name}'; "
            f"missing required input(s) {missing}"
        )
    batch_sizes = set()
    feed = {}
    for tensor in given.values():
        tensor_spec = spec.input(tensor.name)
        assert tensor_spec is not None
        batch_sizes.add(_check_input(spec, tensor_spec, tensor))
        data = tensor.data
        if tensor_spec.reshape is not None:
            lead = list(tensor.shape[:1]) if spec.max_batch_size > 0 else []
            try:
                data = data.reshape(lead + list(tensor_spec.reshape))
            except ValueError:  # load-time validation of reshape against dims should make this unreachable
                raise invalid(
                    f"input '{tensor.name}' for model '{spec.name}': shape {list(tensor.shape)} cannot be "
                    f"reshaped to {lead + list(tensor_spec.reshape)}"
                ) from None
        feed[tensor.name] = data
    if len(batch_sizes) > 1:
        raise invalid(f"inputs for model '{spec.name}' have different batch sizes {sorted(batch_sizes)}")
    outputs = _requested_outputs(spec, request)
    _check_classifications(spec, request, outputs)
    return Prepared(feed, outputs, batch_sizes.pop() if batch_sizes else 0, request.class_counts)


def _check_input(spec: ModelSpec, tensor_spec: TensorSpec, tensor: Tensor) -> int:
    if tensor.datatype is not tensor_spec.datatype:
        raise invalid(
            f"inference input '{tensor.name}' data-type is '{tensor.datatype.value}', "
            f"but model '{spec.name}' expects '{tensor_spec.datatype.value}'"
        )
    dims = list(tensor_spec.dims)
    shape = list(tensor.shape)
    batch = 0
    if spec.max_batch_size > 0:
        expected = [-1, *dims]
        if shape:
            batch = shape[0]
            if batch > spec.max_batch_size:
                raise invalid(
                    f"inference request batch-size must be <= {spec.max_batch_size} for '{spec.name}'; "
                    f"input '{tensor.name}' has batch size {batch}"
                )
            if batch < 1:
                raise invalid(f"input '{tensor.name}' for model '{spec.name}' has batch size 0")
        shape_to_check = shape[1:]
    else:
        expected = dims
        shape_to_check = shape
    if len(shape) != len(expected) or any(
        d != -1 and d != s for d, s in zip(dims, shape_to_check, strict=True)
    ):
        raise invalid(
            f"unexpected shape for input '{tensor.name}' for model '{spec.name}'. "
            f"Expected {expected}, got {shape}"
        )
    return batch


def _requested_outputs(spec: ModelSpec, request: InferRequest) -> tuple[str, ...]:
    if request.requested_outputs is None:
        return tuple(t.name for t in spec.outputs)
    seen = set()
    for name in request.requested_outputs:
        if spec.output(name) is None:
            raise invalid(
                f"unexpected inference output '{name}' for model '{spec.name}'; "
                f"model outputs are: {[t.name for t in spec.outputs]}"
            )
        if name in seen:
            raise invalid(f"output '{name}' is requested twice for model '{spec.name}'")
        seen.add(name)
    return request.requested_outputs


def _check_classifications(spec: ModelSpec, request: InferRequest, outputs: tuple[str, ...]) -> None:
    for name, count in request.class_counts.items():
        tensor_spec = spec.output(name)
        if tensor_spec is None or name not in outputs:
            raise invalid(f"classification asked for output '{name}', which model '{spec.name}' "
                          f"does not return for this request; requested outputs are: {list(outputs)}")
        if count < 1:
            raise invalid(f"output '{name}': invalid value for 'classification' parameter, expected > 0, "
                          f"got {count}")
        classification.check_datatype(spec.name, name, tensor_spec.datatype)


def finish(spec: ModelSpec, prepared: Prepared, results: Mapping[str, np.ndarray]) -> tuple[Tensor, ...]:
    """Turn backend results into response tensors: config datatypes and shapes; an output
    requested as a classification becomes its top classes per batch row (BYTES)."""
    tensors = []
    for name in prepared.outputs:
        tensor_spec = spec.output(name)
        assert tensor_spec is not None
        data = np.asarray(results[name])
        if tensor_spec.reshape is not None:
            lead = [prepared.batch_size] if spec.max_batch_size > 0 else []
            data = data.reshape(lead + list(tensor_spec.dims))
        if spec.max_batch_size > 0 and (data.ndim == 0 or data.shape[0] != prepared.batch_size):
            raise ShoalError(
                ErrorCode.INTERNAL,
                f"model '{spec.name}' returned output '{name}' with shape {list(data.shape)} "
                f"for a batch of {prepared.batch_size}",
            )
        wanted = tensor_spec.datatype.numpy_dtype
        if data.dtype != wanted:
            data = data.astype(wanted)
        count = prepared.class_counts.get(name)
        if count is None:
            tensors.append(Tensor(name, tensor_spec.datatype, tuple(data.shape), data))
            continue
        batched = spec.max_batch_size > 0
        classes = classification.top_k(data, tensor_spec.datatype, count, batched, tensor_spec.labels)
        tensors.append(Tensor(name, DataType.BYTES, tuple(classes.shape), classes))
    return tuple(tensors)


def zeros_feed(spec: ModelSpec) -> dict[str, np.ndarray]:
    """A batch-1 feed of zeros (empty BYTES) in the backend's shapes; variable dims become 1."""
    feed = {}
    for tensor in spec.inputs:
        dims = [1 if d == -1 else d for d in (tensor.reshape if tensor.reshape is not None else tensor.dims)]
        shape = ([1] if spec.max_batch_size > 0 else []) + dims
        if tensor.datatype is DataType.BYTES:
            array = np.empty(shape, dtype=object)
            array.reshape(-1)[:] = [b""] * array.size
            feed[tensor.name] = array
        else:
            feed[tensor.name] = np.zeros(shape, dtype=tensor.datatype.numpy_dtype)
    return feed
