"""Tensor content as the wire carries it, decoded with Triton's messages for content that does not
fit its shape: shared by the transports (raw contents) and the host (shared-memory regions)."""

from __future__ import annotations

import numpy as np

from shoal.errors import invalid, shown
from shoal.protocol import tensors
from shoal.protocol.types import DataType
from shoal.types import RegionSlice


def decode_raw(
    name: str, datatype: DataType, shape: tuple[int, ...], raw: bytes | memoryview, model: str = ""
) -> np.ndarray:
    """Raw content as an array; a size that does not fit the shape is refused in Triton's words."""
    try:
        return tensors.from_raw(datatype, shape, raw)
    except tensors.WireFormatError as exc:
        raise invalid(content_error(name, model, exc)) from None


def content_error(name: str, model: str, exc: tensors.WireFormatError) -> str:
    """Triton's message for tensor content that does not fit its shape (core infer_request.cc
    ``Normalize`` and ``ValidateBytesInputs``); Shoal's own for the cases Triton has none."""
    name, model = shown(name), shown(model)
    where = f"for inference input '{name}' for model '{model}'"
    if isinstance(exc, tensors.ByteSizeMismatch):
        return (f"input byte size mismatch for input '{name}' for model '{model}'. "
                f"Expected {exc.expected}, got {exc.got}")
    if isinstance(exc, tensors.StringCountMismatch):
        if exc.too_many:
            return f"unexpected number of string elements {exc.got} {where}, expecting {exc.expected}"
        return f"expected {exc.expected} string elements {where}, got {exc.got}"
    if isinstance(exc, tensors.IncompleteLengthPrefix):
        return (f"incomplete string length indicator {where}, expecting 4 bytes but only {exc.available} bytes "
                "available. Please make sure the string length indicator is in one buffer.")
    return f"input '{name}' for model '{model}': {exc}"


def region_slice(name: str, region: str | None, offset: int | None, byte_size: int | None) -> RegionSlice | None:
    """Where a tensor's shared-memory parameters (already read from either transport) place it, with
    Triton's front-end rules and messages; None when the tensor is not in shared memory."""
    if region is None:
        for key, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", byte_size)):
            if value is not None:
                raise invalid(f"'{key}' can not be specified without 'shared_memory_region' parameter for tensor "
                              f"'{shown(name)}'")
        return None
    if byte_size is None:
        raise invalid(f"'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter "
                      f"for tensor '{shown(name)}'")
    return RegionSlice(region, offset or 0, byte_size)
