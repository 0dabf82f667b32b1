"""Inference messages that are costly to convert are converted on a worker thread, off the event loop.

Converting BYTES tensors does Python work per element (one ``bytes`` object each), so a request
or response of millions of strings used to hold the event loop for seconds, and with it every
other call, health checks included. The work is bounded by what the message declares: decoding
reads at most one element past an input's shape, and an output's size is its element count. Small
messages are converted inline, since a thread hop costs tens of µs. A worker thread still takes
the GIL for its Python work, but gives it up every few milliseconds (``sys.getswitchinterval``),
so the loop keeps answering.
"""

from __future__ import annotations

import asyncio

from shoal import off_loop
from shoal.grpc import convert
from shoal.protocol import service_pb2
from shoal.protocol.types import DataType
from shoal.request_types import EncodedTensor, InferRequest, InferResponse


def _costly(bytes_elements: int, data_bytes: int) -> bool:
    """A message converted off the loop (shoal.off_loop): ~16k BYTES elements take a few ms to convert,
    and 1 MiB of fixed-size data a copy or two of that size."""
    return off_loop.costly(data_bytes, bytes_elements)


def _response_is_costly(response: InferResponse) -> bool:
    """Decoded BYTES cost Python work per element; fixed-size and encoded BYTES (``EncodedTensor``) a copy."""
    bytes_elements = data_bytes = 0
    for t in response.outputs:
        if t.datatype is DataType.BYTES and not isinstance(t, EncodedTensor):
            bytes_elements += t.data.size
        else:
            data_bytes += t.data.nbytes  # 0 in shared memory
    return _costly(bytes_elements, data_bytes)


async def infer_request(message: service_pb2.ModelInferRequest, encoded_bytes: bool = False) -> InferRequest:
    """``convert.infer_request``, on a worker thread when the message declares much data.

    ``encoded_bytes``: ``convert.infer_request_encoded`` (raw BYTES inputs left encoded, for a core whose
    host decodes them), where BYTES cost a copy, not work per element: judged by the least they can
    weigh (a 4-byte length each)."""
    declared = convert.declare_inputs(message)  # judged from the declared shapes (reading raw content copies it)
    if encoded_bytes:
        if _costly(0, declared.data_bytes + 4 * declared.bytes_elements):
            return await asyncio.to_thread(convert.infer_request_encoded, message, declared)
        return convert.infer_request_encoded(message, declared)
    if _costly(declared.bytes_elements, declared.data_bytes):
        return await asyncio.to_thread(convert.infer_request, message, declared)
    return convert.infer_request(message, declared)


async def infer_response(response: InferResponse) -> service_pb2.ModelInferResponse:
    """``convert.infer_response``, on a worker thread when the response holds much data."""
    if _response_is_costly(response):
        return await asyncio.to_thread(convert.infer_response, response)
    return convert.infer_response(response)
