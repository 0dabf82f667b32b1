"""The data plane's tensors at a fixed offset (``pack_at``, as process instances use it): every
datatype round-trips, a message that does not fit writes nothing and says how much it needs,
and views are read-only unless the reader asks for writable ones."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shoal.dataplane import packing
from shoal.dataplane.arena import ALIGNMENT, Arena, PoolFull
from shoal.protocol.types import DataType
from shoal.request_types import Tensor
from tests.models import ALL_DATATYPES


def _tensor(datatype: DataType, count: int) -> Tensor:
    if datatype is DataType.BYTES:
        data = np.array([b"", b"\x00\xff", "é".encode()] * count, dtype=object)[:count]
    elif datatype is DataType.BOOL:
        data = np.arange(count) % 3 == 0
    else:
        data = np.arange(count).astype(datatype.numpy_dtype)
    return Tensor(datatype.value.lower(), datatype, (count,), data)


@pytest.fixture
def arena() -> Iterator[Arena]:
    created = Arena.create("shoal-test", 1 << 16)
    yield created
    created.close()


def test_every_datatype_round_trips_at_an_offset(arena: Arena) -> None:
    sent = [_tensor(DataType(name), 7) for name in ALL_DATATYPES] + [_tensor(DataType.FP32, 0)]
    slots = packing.pack_at(arena, 128, sent)
    assert all(offset % ALIGNMENT == 0 and offset >= 128 for _, _, _, offset, _ in slots)
    assert packing.extent(slots) == max(offset + nbytes for _, _, _, offset, nbytes in slots)
    for before, after in zip(sent, packing.unpack(arena, slots), strict=True):
        assert (after.name, after.datatype, after.shape) == (before.name, before.datatype, before.shape)
        assert after.data.dtype == before.datatype.numpy_dtype
        assert after.data.tolist() == before.data.tolist()


def test_a_message_that_does_not_fit_writes_nothing_and_says_what_it_needs(arena: Arena) -> None:
    arena.map[:8] = b"untouchd"
    big = Tensor("big", DataType.FP64, (10_000,), np.ones(10_000))
    with pytest.raises(PoolFull) as caught:
        packing.pack_at(arena, 0, [big])
    assert caught.value.wanted == 80_000 and caught.value.capacity == arena.size
    assert arena.map[:8] == b"untouchd"


def test_views_are_read_only_unless_the_reader_owns_the_bytes(arena: Arena) -> None:
    slots = packing.pack_at(arena, 0, [_tensor(DataType.INT32, 4)])
    (shared,) = packing.unpack(arena, slots)
    assert not shared.data.flags.writeable
    (owned,) = packing.unpack(arena, slots, writable=True)
    owned.data[0] = 42
    assert shared.data[0] == 42  # both views are the arena's bytes, not copies


def test_empty_tensors_at_the_arena_s_very_end_unpack(arena: Arena) -> None:
    """Zero-size tensors placed where the arena ends (a batch whose BLS calls filled it exactly) hold no
    bytes to view: they unpack empty, writable when asked, instead of failing the whole answer."""
    slots = [("e", "FP32", (0, 3), arena.size, 0), ("s", "BYTES", (0,), arena.size, 0)]
    for writable in (False, True):
        empty, strings = packing.unpack(arena, slots, writable=writable)
        assert (empty.data.shape, empty.data.dtype, strings.data.shape) == ((0, 3), np.float32, (0,))
        assert empty.data.flags.writeable == writable
