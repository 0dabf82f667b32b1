"""The wire format of tensor data, shared by the server and the clients.

Raw contents are little-endian and row-major with no padding; BYTES elements are each a
4-byte little-endian length followed by the bytes; BF16 is the upper half of each
little-endian float32 (``ml_dtypes.bfloat16`` holds exactly that).
"""

from __future__ import annotations

import math
import struct

import numpy as np

from shoal.protocol.types import DataType

_LENGTH = struct.Struct("<I")
MAX_DIMS = 64  # numpy's limit on dimensions
_MAX_BYTES = 2**63 - 1  # numpy's limit on an array's size in bytes (intp)
_OBJECT_SIZE = np.dtype(object).itemsize  # BYTES elements are held as Python objects
# The little-endian dtype each fixed-size datatype travels as on the wire (looked up per tensor).
_WIRE_DTYPES = {
    datatype: datatype.numpy_dtype.newbyteorder("<") if datatype.item_size > 1 else datatype.numpy_dtype
    for datatype in DataType if datatype is not DataType.BYTES
}


class WireFormatError(ValueError):
    """Raw tensor content that does not match its declared datatype and shape."""


class ByteSizeMismatch(WireFormatError):
    """Fixed-size content whose byte count is not what the shape needs."""

    def __init__(self, datatype: DataType, shape: tuple[int, ...], expected: int, got: int) -> None:
        super().__init__(f"raw content has {got} bytes, but shape {list(shape)} of {datatype.value} needs {expected}")
        self.expected = expected
        self.got = got


class StringCountMismatch(WireFormatError):
    """BYTES content with another number of elements than the shape needs. As Triton reads it
    (core infer_request.cc ``ValidateBytesInputs``), reading stops at the first element past the
    shape's count: ``got`` is then ``expected + 1`` and ``too_many`` is set."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"BYTES content holds {'more than ' if got > expected else ''}"
                         f"{expected if got > expected else got} elements, the shape needs {expected}")
        self.expected = expected
        self.got = got
        self.too_many = got > expected


class IncompleteLengthPrefix(WireFormatError):
    """BYTES content that ends inside an element's 4-byte length prefix."""

    def __init__(self, available: int) -> None:
        super().__init__(f"BYTES content ends inside a length prefix ({available} of 4 bytes)")
        self.available = available


def check_shape(datatype: DataType, shape: tuple[int, ...]) -> None:
    """Refuse shapes no array can have: negative dims, over 64 dims, or a size past numpy's limit.

    numpy counts every non-zero dim, so ``[0, 2**62]`` of INT32 is refused although it holds
    no element.
    """
    if any(d < 0 for d in shape):
        raise WireFormatError(f"shape {list(shape)} has a negative dimension")
    if len(shape) > MAX_DIMS:
        raise WireFormatError(f"shape has {len(shape)} dimensions, at most {MAX_DIMS} are supported")
    item_size = _OBJECT_SIZE if datatype is DataType.BYTES else datatype.item_size
    if math.prod(d for d in shape if d) * item_size > _MAX_BYTES:
        raise WireFormatError(f"shape {list(shape)} of {datatype.value} is larger than any array can be")


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements, row-major; ``str`` elements are UTF-8 encoded."""
    parts = []
    for item in np.asarray(array, dtype=object).reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def deserialize_bytes(raw: bytes, count: int) -> np.ndarray:
    """``count`` BYTES elements as a 1-D object array of ``bytes``; checked in Triton's order
    (core infer_request.cc ``ValidateBytesInputs``): a length prefix cut short, then one element
    more than ``count`` (reading stops there), then fewer elements than ``count``."""
    items: list[bytes] = []
    offset = 0
    view = memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise IncompleteLengthPrefix(len(raw) - offset)
        (length,) = _LENGTH.unpack_from(view, offset)
        if len(items) == count:
            raise StringCountMismatch(count, count + 1)
        offset += 4
        if offset + length > len(raw):
            raise WireFormatError(f"BYTES element of {length} bytes runs past the content")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise StringCountMismatch(count, len(items))
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def from_raw(datatype: DataType, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    """Decode raw content; the array has the datatype's native numpy dtype and ``shape``."""
    check_shape(datatype, shape)
    count = math.prod(shape)
    if datatype is DataType.BYTES:
        return deserialize_bytes(raw, count).reshape(shape)
    expected = count * datatype.item_size
    if len(raw) != expected:
        raise ByteSizeMismatch(datatype, shape, expected, len(raw))
    return np.frombuffer(raw, dtype=_WIRE_DTYPES[datatype]).reshape(shape).astype(datatype.numpy_dtype, copy=False)


def to_raw(datatype: DataType, array: np.ndarray) -> bytes:
    if datatype is DataType.BYTES:
        return serialize_bytes(array)
    data = np.ascontiguousarray(array, dtype=datatype.numpy_dtype)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    return data.tobytes()
