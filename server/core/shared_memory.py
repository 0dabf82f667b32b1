"""Requests with tensors in registered shared-memory regions, in the process that holds the models.

The transports only parse where a tensor lives (``RegionInput``, ``RegionSlice``); the host
resolves the region here. Inputs are read in place (numpy views of the client's mapping, BYTES
decoded); outputs are encoded and written into the client's region once the request is answered,
and the response carries them with no data (``InferResponse.in_regions``). An unknown region, an
out-of-range window, a size that does not match the shape and an output region too small get
Triton's messages and codes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shoal.core.wire import decode_raw
from shoal.dataplane.regions import RegionRegistry
from shoal.errors import ErrorCode, ShoalError, shown
from shoal.protocol import tensors as wire
from shoal.types import InferRequest, InferResponse, Tensor


def with_region_inputs(registry: RegionRegistry, request: InferRequest) -> InferRequest:
    """``request`` with its shared-memory inputs read into ``inputs`` (views, not copies)."""
    read = []
    for source in request.region_inputs:
        window = registry.window(source.where.region, source.where.offset, source.where.byte_size)
        data = decode_raw(source.name, source.datatype, source.shape, window.toreadonly(), request.model_name)
        read.append(Tensor(source.name, source.datatype, source.shape, data))
    return dataclasses.replace(request, inputs=(*request.inputs, *read), region_inputs=())


def check_output_regions(registry: RegionRegistry, request: InferRequest) -> None:
    """Fail before running the model when an output's region or window does not exist."""
    for where in request.output_regions.values():
        registry.window(where.region, where.offset, where.byte_size)


def write_region_outputs(registry: RegionRegistry, request: InferRequest, response: InferResponse) -> InferResponse:
    """Write the outputs the request wants in shared memory there; they stay in the response without data."""
    outputs = []
    for tensor in response.outputs:
        where = request.output_regions.get(tensor.name)
        if where is None:
            outputs.append(tensor)
            continue
        raw = wire.to_raw(tensor.datatype, tensor.data)
        if len(raw) > where.byte_size:
            raise ShoalError(ErrorCode.INTERNAL, (
                f"shared memory size specified with the request for output '{shown(tensor.name)}' "
                f"({where.byte_size} bytes) should be at least {len(raw)} bytes to hold the results"))
        registry.window(where.region, where.offset, where.byte_size)[: len(raw)] = raw
        outputs.append(Tensor(tensor.name, tensor.datatype, tensor.shape, np.empty(0, tensor.data.dtype)))
    return dataclasses.replace(response, outputs=tuple(outputs),
                               in_regions=frozenset(request.output_regions) & {t.name for t in outputs})
