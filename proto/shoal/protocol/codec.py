"""The wire format of tensor data, shared by the server and the clients.

Raw contents are little-endian and row-major with no padding; BYTES elements are each a
4-byte little-endian length followed by the bytes; BF16 is the upper half of each
little-endian float32 (``ml_dtypes.bfloat16`` holds exactly that).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shoal.protocol.types import DataType

MAX_DIMS = 64  # numpy's limit on dimensions
_MAX_BYTES = 2**63 - 1  # numpy's limit on an array's size in bytes (intp)
_OBJECT_SIZE = np.dtype(object).itemsize  # BYTES elements are held as Python objects
_MAX_ELEMENT = 2**32 - 1  # the most a 4-byte length prefix can say
_CHUNK = 1 << 16  # BYTES elements handled per C call: a few MB of scratch, a few ms holding the GIL
_UNIFORM_MAX = 1 << 20  # the longest element the one-length path reads as a numpy record
# The little-endian dtype each fixed-size datatype travels as on the wire (looked up per tensor).
_WIRE_DTYPES = {
    datatype: datatype.numpy_dtype.newbyteorder("<") if datatype.item_size > 1 else datatype.numpy_dtype
    for datatype in DataType
    if datatype is not DataType.BYTES
}
# Read per tensor, so looked up here rather than through the enum's properties (each a few hundred ns).
_ITEM_SIZES = {datatype: datatype.item_size for datatype in DataType}
_NATIVE_DTYPES = {datatype: datatype.numpy_dtype for datatype in DataType}
# Datatypes whose wire bytes are already the native layout (every one of them on a little-endian host).
_WIRE_IS_NATIVE = {datatype for datatype, wire in _WIRE_DTYPES.items() if wire == datatype.numpy_dtype}


class WireFormatError(ValueError):
    """Raw tensor content that does not match its declared datatype and shape."""


class NegativeDimension(WireFormatError):
    """A shape with a negative dim (the transport words it as Triton's core does)."""


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
        super().__init__(
            f"BYTES content holds {'more than ' if got > expected else ''}"
            f"{expected if got > expected else got} elements, the shape needs {expected}"
        )
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
    no element. A BYTES element counts as its 8-byte pointer: this is numpy's limit, not the memory
    decoded elements take (the server bounds that before decoding: ``grpc.convert.check_bytes_cost``).
    """
    if len(shape) > MAX_DIMS:  # first: the messages below print the shape
        raise WireFormatError(f"shape has {len(shape)} dimensions, at most {MAX_DIMS} are supported")
    if shape and min(shape) < 0:
        raise NegativeDimension(f"shape {list(shape)} has a negative dimension")
    item_size = _OBJECT_SIZE if datatype is DataType.BYTES else _ITEM_SIZES[datatype]
    size = math.prod(shape) or math.prod(d for d in shape if d)
    if size * item_size > _MAX_BYTES:
        raise WireFormatError(f"shape {list(shape)} of {datatype.value} is larger than any array can be")


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements, row-major; ``str`` elements (and other objects, ``element_bytes``) UTF-8 encoded.

    Only the conversion to ``bytes`` runs per element in Python; the length prefixes are written by
    numpy (one small object per element here used to cost ~200 bytes and ~1 µs each). A chunk of
    elements at a time: numpy's scratch stays small, and no C call holds the GIL for long, so this
    can run on a worker thread beside the event loop.
    """
    flat = np.asarray(array, dtype=object).reshape(-1)
    chunks = [_frame(flat[start : start + _CHUNK].tolist()) for start in range(0, flat.size, _CHUNK)]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def element_bytes(item: Any) -> bytes:
    """One BYTES element's content as Triton's Python backend gives it (``serialize_byte_tensor``):
    ``bytes`` as they are, anything else the UTF-8 of its ``str`` (the number 12 is ``b"12"``; ``bytes(12)``
    would be twelve zero bytes). A ``bytearray`` or ``memoryview`` gives its bytes (Triton's rule would
    send the text of its repr)."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    return str(item).encode("utf-8")


def elements_bytes(items: list[Any]) -> list[bytes]:
    """Each element's ``element_bytes``: ``items`` itself when all are ``bytes``, and ``str`` alone without a
    call per element."""
    types = set(map(type, items))
    if types <= {bytes}:
        return items
    if types == {str}:
        return [item.encode("utf-8") for item in items]
    return [element_bytes(item) for item in items]


def _frame(items: list[Any]) -> bytes:
    """``items`` each behind its 4-byte length: the content joined, then spread around the prefixes."""
    items = elements_bytes(items)
    lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
    if lengths.size and int(lengths.max()) > _MAX_ELEMENT:
        raise WireFormatError(f"a BYTES element of {int(lengths.max())} bytes does not fit a 4-byte length")
    content = np.frombuffer(b"".join(items), dtype=np.uint8)
    framed = np.empty(4 * len(items) + content.size, dtype=np.uint8)
    prefix_at = np.arange(len(items), dtype=np.int64) * 4
    prefix_at[1:] += np.cumsum(lengths[:-1])
    is_prefix = np.zeros(framed.size, dtype=bool)
    is_prefix[(prefix_at[:, None] + np.arange(4)).reshape(-1)] = True
    framed[is_prefix] = lengths.astype("<u4").view(np.uint8)
    framed[~is_prefix] = content
    return framed.tobytes()


def deserialize_bytes(raw: bytes, count: int) -> np.ndarray:
    """``count`` BYTES elements as a 1-D object array of ``bytes``; checked in Triton's order
    (core infer_request.cc ``ValidateBytesInputs``): a length prefix cut short, then one element
    more than ``count`` (reading stops there), then fewer elements than ``count``.

    Elements all of one length (fixed-size records, empty strings) are checked and cut by numpy;
    others are read in one tight loop. Nothing is allocated for more elements than ``raw`` can hold.
    """
    raw = bytes(raw)
    items = _uniform_items(raw, count)
    if items is None:
        items = _scan_items(raw, count)
    array = np.empty(len(items), dtype=object)
    for start in range(0, len(items), _CHUNK):  # a chunk at a time: see serialize_bytes
        array[start : start + _CHUNK] = items[start : start + _CHUNK]
    return array


def _uniform_items(raw: bytes, count: int) -> list[bytes] | None:
    """The elements when ``raw`` is ``count`` elements of the first one's length, else None."""
    if count < 2 or len(raw) < 4:
        return None
    length = int.from_bytes(raw[:4], "little")
    if length > _UNIFORM_MAX or len(raw) != count * (4 + length):
        return None
    if length == 0:
        if np.frombuffer(raw, dtype="<u4").any():
            return None
        return [b""] * count
    records = np.frombuffer(raw, dtype=np.dtype([("length", "<u4"), ("data", f"V{length}")]))
    if (records["length"] != length).any():
        return None
    items: list[bytes] = []
    for start in range(0, count, _CHUNK):  # numpy makes the bytes objects, in C; a chunk at a time
        items += records["data"][start : start + _CHUNK].tolist()
    return items


def _scan_items(raw: bytes, count: int) -> list[bytes]:
    """The elements read one by one, as Triton reads them (see ``deserialize_bytes``)."""
    items: list[bytes] = []
    append = items.append
    end = len(raw)
    offset = 0
    for _ in range(min(count, end // 4)):
        start = offset + 4
        if start > end:
            break
        stop = start + int.from_bytes(raw[offset:start], "little")
        if stop > end:
            raise WireFormatError(f"BYTES element of {stop - start} bytes runs past the content")
        append(raw[start:stop])
        offset = stop
    if offset < end:
        if end - offset < 4:
            raise IncompleteLengthPrefix(end - offset)
        if len(items) == count:
            raise StringCountMismatch(count, count + 1)
    if len(items) != count:
        raise StringCountMismatch(count, len(items))
    return items


def from_raw(
    datatype: DataType, shape: tuple[int, ...], raw: bytes | memoryview, shape_checked: bool = False
) -> np.ndarray:
    """Decode raw content; the array has the datatype's native numpy dtype and ``shape``
    (``shape_checked``: the caller's ``check_shape`` passed, so it is not run twice)."""
    if not shape_checked:
        check_shape(datatype, shape)
    count = math.prod(shape)
    if datatype is DataType.BYTES:
        return deserialize_bytes(bytes(raw), count).reshape(shape)  # no copy when ``raw`` is bytes already
    expected = count * _ITEM_SIZES[datatype]
    if len(raw) != expected:
        raise ByteSizeMismatch(datatype, shape, expected, len(raw))
    array = np.frombuffer(raw, dtype=_WIRE_DTYPES[datatype]).reshape(shape)
    return array if datatype in _WIRE_IS_NATIVE else array.astype(_NATIVE_DTYPES[datatype])


def to_raw(datatype: DataType, array: np.ndarray) -> bytes:
    if datatype is DataType.BYTES:
        return serialize_bytes(array)
    data = np.ascontiguousarray(array, dtype=_NATIVE_DTYPES[datatype])
    if datatype in _WIRE_IS_NATIVE:
        return data.tobytes()
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    return data.tobytes()
