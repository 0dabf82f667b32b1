"""The core's request and response types: tensors as numpy arrays, requests, responses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from shoal.protocol.codec import deserialize_bytes
from shoal.protocol.types import DataType


@dataclass(frozen=True)
class Tensor:
    """A named tensor as the client sent it: declared datatype and shape, decoded data."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class EncodedTensor(Tensor):
    """A BYTES tensor still as the wire carries it: ``data`` is a flat uint8 array of elements, each
    a 4-byte little-endian length then its bytes, not yet checked against ``shape``.

    A front-end worker forwards BYTES inputs so and gets BYTES outputs back so: the host decodes
    inputs and encodes outputs once, and the worker never builds an object per element. A
    transport writes ``data`` as it is (``raw``), or ``decoded()`` for a format that needs values.
    """

    def raw(self) -> bytes:
        return self.data.tobytes()

    def decoded(self) -> Tensor:
        data = deserialize_bytes(self.data.tobytes(), math.prod(self.shape)).reshape(self.shape)
        return Tensor(self.name, self.datatype, self.shape, data)


@dataclass(frozen=True)
class RegionSlice:
    """Bytes of a registered shared-memory region (Triton's shared-memory extension)."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class RegionInput:
    """An input whose content is in a shared-memory region, read by the process that holds the model."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    where: RegionSlice


@dataclass(frozen=True)
class InferRequest:
    model_name: str
    model_version: str
    id: str
    inputs: tuple[Tensor, ...]
    # None: every output of the model; otherwise these names, in this order.
    requested_outputs: tuple[str, ...] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # Outputs requested as classifications (the ``classification`` parameter): name → how many
    # of the highest-valued classes each batch row returns, as BYTES "value:index[:label]".
    class_counts: dict[str, int] = field(default_factory=dict)
    # Inputs in shared memory (besides ``inputs``) and outputs to write into it, by name.
    region_inputs: tuple[RegionInput, ...] = ()
    output_regions: dict[str, RegionSlice] = field(default_factory=dict)
    # A streaming request's sink: a decoupled model's responses go there as it sends them, from any
    # thread (lifecycle.streaming.ResponseSink); None for a request answered once.
    sink: ResponseSink | None = field(default=None, compare=False)


class ResponseSink(Protocol):
    """Where a decoupled model's responses go: outputs (name -> array), an error or None (a bare FINAL
    flag), with whether it is the last; ``cancelled`` once the client gave up."""

    def put(self, item: Any, final: bool) -> None: ...

    @property
    def cancelled(self) -> bool: ...


@dataclass(frozen=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: tuple[Tensor, ...]
    # Outputs written into the client's shared memory: their ``data`` is empty, their shape is real.
    in_regions: frozenset[str] = frozenset()
    # The trace its transport reports its send to (``Core.sent``); 0: untraced, nothing to report.
    trace_id: int = 0
