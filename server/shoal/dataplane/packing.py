"""Tensors in an arena: one block per message, a small slot per tensor that travels in the message.

``pack`` takes the block from the arena's ``BlockAllocator`` (many messages in flight: front-end
workers; ``pack_off_loop`` on a worker thread for a costly message); ``pack_at`` writes at a fixed
offset (one message at a time: process instances).

A slot is ``(name, datatype, shape, offset, nbytes)``: plain values, cheap to pickle. Fixed-size
datatypes are stored in native byte order (both processes run on this host) and read back as
zero-copy numpy views; BYTES use the wire format (4-byte length, then the bytes, per element). An
``EncodedTensor`` (BYTES still in that format) is copied in as it is; a reader decodes BYTES, or
takes them as ``EncodedTensor`` views (``unpack(encoded_bytes=True)``: a front-end worker, which
writes them to the wire as they are).
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import numpy as np

from shoal import off_loop
from shoal.dataplane.arena import ALIGNMENT, Arena, BlockAllocator, PoolFull
from shoal.protocol import codec
from shoal.protocol.types import BY_NAME, DataType
from shoal.request_types import EncodedTensor, Tensor

Slot: TypeAlias = tuple[str, str, tuple[int, ...], int, int]
NO_BLOCK = -1  # a message whose tensors hold no bytes at all needs no block
ONE_COPY_BYTES = 64 << 10  # unpack_copies copies a batch's small tensors at once, up to this span
# Past off_loop.OFF_LOOP_ELEMENTS BYTES elements, packing or unpacking a message is Python work per
# element (ms): callers do it on a worker thread, off their event loop (``costly``).


def costly(tensors_or_slots: Sequence[Tensor] | Sequence[Slot]) -> bool:
    """True when (un)packing these means encoding or decoding many BYTES elements (an
    ``EncodedTensor`` is copied as it is: no work per element)."""
    elements = 0
    for item in tensors_or_slots:
        if isinstance(item, Tensor):
            if item.datatype is DataType.BYTES and not isinstance(item, EncodedTensor):
                elements += item.data.size
        elif item[1] == DataType.BYTES.value:
            elements += math.prod(item[2])
    return off_loop.costly(elements=elements)


def _payload(tensor: Tensor) -> np.ndarray | bytes:
    if isinstance(tensor, EncodedTensor):
        return tensor.data
    if tensor.datatype is DataType.BYTES:
        return codec.serialize_bytes(tensor.data)
    return np.ascontiguousarray(tensor.data, dtype=tensor.datatype.numpy_dtype)


def encoded_bytes(tensors: Sequence[Tensor]) -> int:
    """The bytes ``tensors`` take in an arena; raises what encoding them raises (a BYTES element too
    long for its length prefix, one whose ``str`` raises): a check before ``pack_at``."""
    return _measure(tensors)[2]


def _measure(tensors: Sequence[Tensor]) -> tuple[list[np.ndarray | bytes], list[int], int]:
    """Each tensor's bytes, their sizes, and the bytes they take together in an arena (aligned)."""
    payloads = [_payload(t) for t in tensors]
    sizes = [p.nbytes if isinstance(p, np.ndarray) else len(p) for p in payloads]
    return payloads, sizes, sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes)


def pack(arena: Arena, allocator: BlockAllocator, tensors: Sequence[Tensor]) -> tuple[int, list[Slot]]:
    """Copy ``tensors`` into one new block; returns the block (to free later) and the slots.

    Raises ``PoolFull`` when the arena has no room: nothing is allocated then.
    """
    payloads, sizes, total = _measure(tensors)
    if total == 0:
        return NO_BLOCK, [(t.name, t.datatype.value, t.shape, 0, 0) for t in tensors]
    block = allocator.allocate(total)
    return block, _write(arena, block, tensors, payloads, sizes)


async def pack_off_loop(arena: Arena, allocator: BlockAllocator, tensors: Sequence[Tensor]) -> tuple[int, list[Slot]]:
    """``pack`` on a worker thread, for a costly message (``costly``), the event loop serving meanwhile.

    The thread cannot be stopped: if the caller is cancelled while it runs, the block it takes is
    freed when it finishes, since the caller that would have sent or freed it is gone.
    """
    work = asyncio.ensure_future(asyncio.to_thread(pack, arena, allocator, tensors))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(lambda done: _free_abandoned(arena, allocator, done))
        raise


def _free_abandoned(arena: Arena, allocator: BlockAllocator, done: asyncio.Future[tuple[int, list[Slot]]]) -> None:
    if done.cancelled() or done.exception() is not None:
        return  # nothing was allocated (PoolFull allocates nothing)
    block = done.result()[0]
    if block != NO_BLOCK:
        arena.release_pages(block, allocator.free(block))


def pack_at(arena: Arena, offset: int, tensors: Sequence[Tensor]) -> list[Slot]:
    """Copy ``tensors`` into the arena from ``offset`` on, with no allocator; returns the slots.

    For an owner with one message in the arena at a time (a process instance runs one batch at a
    time), which rewrites the same bytes for every message. Raises ``PoolFull`` when they do not
    fit, nothing written: its ``wanted`` is the bytes they need from ``offset`` (aligned).
    """
    payloads, sizes, total = _measure(tensors)
    if offset + total > arena.size:
        raise PoolFull(total, max(0, arena.size - offset), arena.size)
    return _write(arena, offset, tensors, payloads, sizes)


def pack_feeds_at(arena: Arena, offset: int, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[list[Slot]] | None:
    """Several feeds' tensors copied into the arena from ``offset`` on, grouped by name: each name's
    tensors back to back, in one copy for all the feeds (``np.concatenate``), not one per tensor; per
    feed its slots, as ``pack_at`` gives them. For a batch's requests, which the batcher made alike.

    None when the feeds are not alike as this needs (names in another order, BYTES: an object, bytes
    or str array, a dtype of no Triton datatype, dtypes differing between feeds): ``pack_at`` packs
    those tensor by tensor. The first group starts at ``offset`` (both callers pass an aligned one),
    each later one on an ``ALIGNMENT`` boundary, so each view is aligned to its item size. Raises
    ``PoolFull`` as ``pack_at`` does, nothing written. What it spares a process instance's batch:
    bench/python_conversation.py."""
    if not feeds:
        return []
    names = tuple(feeds[0])
    groups = []
    end = offset
    for name in names:
        arrays = []
        for feed in feeds:
            array = feed.get(name)
            if not isinstance(array, np.ndarray):
                return None
            arrays.append(array)
        dtype = arrays[0].dtype
        if any(array.dtype != dtype for array in arrays):
            return None
        try:
            datatype = DataType.from_numpy(dtype)
        except ValueError:
            return None
        if datatype is DataType.BYTES:  # encoded element by element (pack_at)
            return None
        groups.append((name, datatype, arrays, end))
        end += -(-sum(array.nbytes for array in arrays) // ALIGNMENT) * ALIGNMENT
    if any(tuple(feed) != names for feed in feeds[1:]):
        return None
    if end > arena.size:
        raise PoolFull(end - offset, max(0, arena.size - offset), arena.size)
    slots: list[list[Slot]] = [[] for _ in feeds]
    for name, datatype, arrays, start in groups:
        position = start
        for feed_slots, array in zip(slots, arrays, strict=True):
            feed_slots.append((name, datatype.value, array.shape, position, array.nbytes))
            position += array.nbytes
        if position > start:
            dtype = datatype.numpy_dtype
            into = np.frombuffer(arena.map, dtype, (position - start) // dtype.itemsize, start)
            np.concatenate([array.reshape(-1) for array in arrays], out=into)
    return slots


def _write(
    arena: Arena, start: int, tensors: Sequence[Tensor], payloads: list[np.ndarray | bytes], sizes: list[int]
) -> list[Slot]:
    slots = []
    offset = start
    view = arena.map
    for tensor, payload, size in zip(tensors, payloads, sizes, strict=True):
        if size:
            if isinstance(payload, np.ndarray):
                view[offset : offset + size] = payload.reshape(-1).view(np.uint8).data
            else:
                view[offset : offset + size] = payload
        slots.append((tensor.name, tensor.datatype.value, tensor.shape, offset, size))
        offset += -(-size // ALIGNMENT) * ALIGNMENT
    return slots


def extent(slots: Sequence[Slot]) -> int:
    """Where the slots' bytes end in the arena: what ``Arena.release_pages`` may give back after them."""
    return max((offset + nbytes for _, _, _, offset, nbytes in slots), default=0)


def unpack(
    arena: Arena,
    slots: Sequence[Slot],
    on_release: Callable[[], None] | None = None,
    writable: bool = False,
    encoded_bytes: bool = False,
    on_unfit: Callable[[str, codec.WireFormatError], None] | None = None,
) -> tuple[Tensor, ...]:
    """The slots' tensors, as read-only views into the arena (BYTES are decoded copies, or with
    ``encoded_bytes`` ``EncodedTensor`` views of their wire bytes, decoded by whoever needs values).

    With ``on_release``, the views share one owner object and ``on_release`` runs once the last
    view is gone: the caller frees the block then, and never while a view could still read it.
    ``writable`` views are for a reader that owns the bytes until it answers (a process instance's
    worker: a model may write into its inputs, and PyTorch warns about read-only arrays).
    BYTES whose content does not fit their shape raise ``WireFormatError``; with ``on_unfit`` they are
    reported to it (name, error) instead and come back empty: the caller refuses the request in its
    own words once every input has been read (a front-end worker forwards BYTES unchecked).
    """
    if not slots:
        if on_release is not None:
            on_release()
        return ()
    first = min(s[3] for s in slots)
    end = max(s[3] + s[4] for s in slots)
    if end == first:  # only empty tensors (their offset may be the arena's very end): nothing to view
        if on_release is not None:
            on_release()
        empty = memoryview(bytearray() if writable else b"")
        return tuple(_tensor(empty, first, slot, encoded_bytes, on_unfit) for slot in slots)
    owner = (ctypes.c_char * (end - first)).from_buffer(arena.map, first)
    if on_release is not None:
        weakref.finalize(owner, on_release)
    buffer = memoryview(owner).cast("B")
    if not writable:
        buffer = buffer.toreadonly()  # the arrays are read-only, as decoded ones are
    return tuple(_tensor(buffer, first, slot, encoded_bytes, on_unfit) for slot in slots)


def unpack_copies(arena: Arena, slots: Sequence[Slot]) -> list[np.ndarray]:
    """The slots' tensors as arrays of their own (writable; the arena is rewritten by the next message).

    Small numeric tensors lying back to back (a batch's outputs) are made from one copy of the bytes
    they span, not one copy each (bench/python_conversation.py); they then share that copy, which is
    why it is only taken up to ``ONE_COPY_BYTES`` (an output kept keeps at most that much of its
    batch's others alive) and only for slots whose bytes do not overlap (no two tensors share bytes).
    Else each is copied on its own, BYTES decoded (``unpack``)."""
    found = _back_to_back(slots)
    if found is None:
        return [t.data if t.datatype is DataType.BYTES else t.data.copy() for t in unpack(arena, slots)]
    laid_out, first, end = found
    if not laid_out:
        return []
    copy = np.frombuffer(arena.map, np.uint8, end - first, first).copy()
    return [
        np.frombuffer(copy, dtype, count, offset - first if count else 0).reshape(shape)
        for dtype, count, shape, offset, _ in laid_out
    ]


def _back_to_back(
    slots: Sequence[Slot],
) -> tuple[list[tuple[np.dtype, int, tuple[int, ...], int, int]], int, int] | None:
    """Each slot's (dtype, elements, shape, offset, bytes), and where their span starts and ends, when
    one copy serves them all (see ``unpack_copies``): numeric, bytes as their shape says, none
    overlapping, spanning at most ``ONE_COPY_BYTES`` and little else; else None."""
    laid_out = []
    for _, datatype_name, shape, offset, nbytes in slots:
        datatype = BY_NAME.get(datatype_name)
        if datatype is None or datatype is DataType.BYTES:
            return None
        dtype = datatype.numpy_dtype
        count = math.prod(shape)
        if nbytes != count * dtype.itemsize or nbytes > ONE_COPY_BYTES:
            return None
        laid_out.append((dtype, count, tuple(shape), offset, nbytes))
    ordered = sorted((offset, offset + nbytes) for _, _, _, offset, nbytes in laid_out)
    if any(after < before for (_, before), (after, _) in zip(ordered, ordered[1:], strict=False)):
        return None
    if not ordered:
        return laid_out, 0, 0
    first, end = ordered[0][0], ordered[-1][1]  # apart and in order: the last ends last
    if end - first > min(ONE_COPY_BYTES, 2 * sum(n for *_, n in laid_out) + ALIGNMENT * len(laid_out)):
        return None
    return laid_out, first, end


def _tensor(
    buffer: memoryview,
    base: int,
    slot: Slot,
    encoded_bytes: bool,
    on_unfit: Callable[[str, codec.WireFormatError], None] | None,
) -> Tensor:
    name, datatype_name, shape, offset, nbytes = slot
    datatype = BY_NAME[datatype_name]
    count = math.prod(shape)
    start = offset - base
    if datatype is DataType.BYTES:
        if encoded_bytes:
            encoded = np.frombuffer(buffer, np.uint8, nbytes, start if nbytes else 0)
            return EncodedTensor(name, datatype, tuple(shape), encoded)
        try:
            data = codec.deserialize_bytes(bytes(buffer[start : start + nbytes]), count).reshape(shape)
        except codec.WireFormatError as exc:
            if on_unfit is None:
                raise
            on_unfit(name, exc)
            data = np.empty(0, dtype=object)
    else:
        data = np.frombuffer(buffer, datatype.numpy_dtype, count, start if count else 0).reshape(shape)
    return Tensor(name, datatype, tuple(shape), data)
