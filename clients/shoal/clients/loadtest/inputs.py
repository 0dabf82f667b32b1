"""The request a load test sends: inputs built from the model's metadata, serialized once."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shoal.clients import messages
from shoal.clients.loadtest.control import Control
from shoal.protocol.types import DataType


class InputError(ValueError):
    """The inputs cannot be built as asked (message meant for the user)."""


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME:D1,D2`` → (name, dims)."""
    name, _, dims = text.rpartition(":")
    try:
        values = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise InputError(f"--shape {text!r}: expected NAME:D1,D2,... with integer dims") from None
    if not name or any(d < 0 for d in values):
        raise InputError(f"--shape {text!r}: expected NAME:D1,D2,... with non-negative dims")
    return name, values


def build_inputs(
    client: Control,
    model: str,
    version: str,
    batch_size: int,
    shapes: Mapping[str, tuple[int, ...]],
    data: str,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    metadata = client.model_metadata(model, version)
    max_batch_size = int(client.model_config(model, version).get("max_batch_size", 0))
    if batch_size > 1 and max_batch_size == 0:
        raise InputError(f"model '{model}' does not support batching; use --batch-size 1")
    if max_batch_size and batch_size > max_batch_size:
        raise InputError(f"--batch-size {batch_size} exceeds model '{model}' max_batch_size {max_batch_size}")
    unknown = set(shapes) - {t.name for t in metadata.inputs}
    if unknown:
        names = [t.name for t in metadata.inputs]
        raise InputError(f"--shape names unknown input(s) {sorted(unknown)}; inputs: {names}")
    from_file = _load_json(Path(data)) if data not in {"random", "zeros"} else {}
    rng = np.random.default_rng(seed)
    inputs = {}
    for tensor in metadata.inputs:
        dims = list(tensor.shape[1:] if max_batch_size else tensor.shape)
        if tensor.name in shapes:
            dims = list(shapes[tensor.name])
        if any(d < 0 for d in dims):
            raise InputError(
                f"input '{tensor.name}' has variable dims {list(tensor.shape)}: give --shape {tensor.name}:..."
            )
        shape = ([batch_size] if max_batch_size else []) + dims
        datatype = DataType(tensor.datatype)
        if from_file:
            if tensor.name not in from_file:
                raise InputError(f"--input-data {data}: no data for input '{tensor.name}'")
            inputs[tensor.name] = _from_values(tensor.name, datatype, from_file[tensor.name], shape)
        else:
            inputs[tensor.name] = _generate(datatype, shape, data == "zeros", rng)
    return inputs


def serialize_request(model: str, version: str, inputs: Mapping[str, np.ndarray]) -> bytes:
    serialized: bytes = messages.infer_request(model, inputs, version=version).SerializeToString()
    return serialized


def _generate(datatype: DataType, shape: list[int], zeros: bool, rng: np.random.Generator) -> np.ndarray:
    if datatype is DataType.BYTES:
        array = np.empty(shape, dtype=object)
        array.reshape(-1)[:] = [b"" if zeros else rng.bytes(8).hex().encode() for _ in range(array.size)]
        return array
    if zeros:
        return np.zeros(shape, dtype=datatype.numpy_dtype)
    if datatype is DataType.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    if datatype.numpy_dtype.kind in "iu":
        return rng.integers(0, 100, shape).astype(datatype.numpy_dtype)
    return rng.standard_normal(shape).astype(datatype.numpy_dtype)  # finite, unlike random bytes


def _load_json(path: Path) -> dict[str, Any]:
    """``{"NAME": [values...]}``, or perf_analyzer's ``{"data": [{"NAME": [...]}, ...]}`` (first entry)."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"--input-data {path}: {exc}") from None
    if isinstance(document, dict) and isinstance(document.get("data"), list) and document["data"]:
        document = document["data"][0]
    if not isinstance(document, dict):
        raise InputError(f"--input-data {path}: expected an object of input name → values")
    return {name: value.get("content", value) if isinstance(value, dict) else value for name, value in document.items()}


def _from_values(name: str, datatype: DataType, values: Any, shape: list[int]) -> np.ndarray:
    if datatype is DataType.BYTES:  # bytes(5) would be five zero bytes: only strings are taken
        flat = np.asarray(values, dtype=object).reshape(-1)
        if not all(isinstance(v, str) for v in flat):
            raise InputError(f"--input-data: input '{name}' is BYTES: its values must be strings")
        flat = np.array([v.encode() for v in flat], dtype=object)
    else:
        try:
            flat = np.asarray(values, dtype=datatype.numpy_dtype).reshape(-1)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InputError(f"--input-data: input '{name}' ({datatype.value}): {exc}") from None
    total = int(np.prod(shape))
    if flat.size == total:
        return flat.reshape(shape)
    if shape and flat.size * shape[0] == total:  # one sample given: repeat it for the batch
        return np.tile(flat, shape[0]).reshape(shape)
    raise InputError(f"--input-data: input '{name}' has {flat.size} values, shape {shape} needs {total}")
