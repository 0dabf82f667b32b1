"""The data plane's tensors at a fixed offset (``pack_at``, as process instances use it): every
datatype round-trips, a message that does not fit writes nothing and says how much it needs,
and views are read-only unless the reader asks for writable ones. A batch's alike feeds packed
grouped by name (``pack_feeds_at``) and copies taken in one piece (``unpack_copies``) give each
request its own tensors, whichever way a batch was packed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


NUMERIC = [DataType(name) for name in ALL_DATATYPES if name != "BYTES"]


def _feed(seed: int, rows: int) -> dict[str, np.ndarray]:
    """A request's inputs: one of every numeric datatype, ``rows`` rows of its own values."""
    generator = np.random.default_rng(seed)
    return {
        datatype.value.lower(): (
            generator.integers(0, 100, (rows, 3)) % (2 if datatype is DataType.BOOL else 100)
        ).astype(datatype.numpy_dtype)
        for datatype in NUMERIC
    }


def test_alike_feeds_pack_grouped_by_name_and_each_unpacks_as_its_own(arena: Arena) -> None:
    feeds = [_feed(seed, rows) for seed, rows in ((1, 1), (2, 3), (3, 0), (4, 2))]
    laid_out = packing.pack_feeds_at(arena, 128, feeds)
    assert laid_out is not None and len(laid_out) == len(feeds)
    for name_index in range(len(feeds[0])):  # each name's tensors back to back, the group aligned
        group = [slots[name_index] for slots in laid_out]
        assert group[0][3] % ALIGNMENT == 0 and group[0][3] >= 128
        assert all(after[3] == before[3] + before[4] for before, after in zip(group, group[1:], strict=False))
    for feed, slots in zip(feeds, laid_out, strict=True):
        assert [slot[0] for slot in slots] == list(feed)
        for tensor, copy in zip(packing.unpack(arena, slots), packing.unpack_copies(arena, slots), strict=True):
            sent = feed[tensor.name]
            assert tensor.datatype is DataType.from_numpy(sent.dtype) and tensor.shape == sent.shape
            assert np.array_equal(tensor.data, sent) and np.array_equal(copy, sent) and copy.dtype == sent.dtype


@pytest.mark.parametrize(
    "second",
    [
        {"b": np.zeros(2, np.int32), "a": np.zeros(2, np.float32)},  # the names in another order
        {"a": np.zeros(2, np.float64), "b": np.zeros(2, np.int32)},  # another dtype
        {"a": np.zeros(2, np.float32)},  # a name missing
        {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.int32), "c": np.zeros(1, np.int8)},  # one more
        {"a": np.zeros(2, np.float32), "b": np.array([b"x", b"y"], dtype=object)},  # BYTES
        {"a": np.zeros(2, np.float32), "b": np.array([b"x", b"y"])},  # BYTES as numpy bytes (S1)
        {"a": np.zeros(2, np.float32), "b": np.array(["x", "y"])},  # BYTES as numpy str (U1)
        {"a": np.zeros(2, np.float32), "b": [0, 0]},  # not an array
    ],
)
def test_feeds_that_are_not_alike_are_left_to_pack_at_with_nothing_written(arena: Arena, second: dict) -> None:
    arena.map[:8] = b"untouchd"
    first = {"a": np.ones(2, np.float32), "b": np.ones(2, np.int32)}
    assert packing.pack_feeds_at(arena, 0, [first, second]) is None
    assert arena.map[:8] == b"untouchd"


@pytest.mark.parametrize("strings", [np.array([b"x", b"yz"]), np.array(["x", "yz"])])
def test_numpy_strings_are_bytes_and_left_to_pack_at(arena: Arena, strings: np.ndarray) -> None:
    """``S`` and ``U`` arrays are BYTES (encoded element by element): alike as they are, never grouped
    (grouping them raised, in review)."""
    assert packing.pack_feeds_at(arena, 0, [{"s": strings}, {"s": strings}]) is None


def test_copies_share_no_bytes_and_keep_little_of_each_other_alive() -> None:
    """Copies made in one piece never overlap (slots that do are copied one by one), and a batch's
    large tensors are copied one by one: an output kept alive keeps at most ONE_COPY_BYTES of the
    others (one copy of a batch of 8 MB outputs kept all of them alive for any one, in review)."""
    created = Arena.create("shoal-test-copies", 1 << 20)
    try:
        small = [np.arange(16, dtype=np.int32) + k for k in range(4)]
        large = [np.full(48 << 10, k, dtype=np.uint8) for k in range(4)]  # 4 x 48 KiB: past one copy's span
        for arrays in (small, large):
            slots = packing.pack_feeds_at(created, 0, [{"x": array} for array in arrays])
            assert slots is not None
            copies = packing.unpack_copies(created, [feed_slots[0] for feed_slots in slots])
            for index, (sent, copy) in enumerate(zip(arrays, copies, strict=True)):
                assert np.array_equal(sent, copy) and copy.flags.writeable
                kept = copy if copy.base is None else copy.base
                assert kept.nbytes <= max(copy.nbytes, packing.ONE_COPY_BYTES)
                assert not any(np.shares_memory(copy, other) for other in copies[index + 1 :])
        packing.pack_feeds_at(created, 0, [{"x": small[0]}])
        overlapping = [("a", "INT32", (4,), 0, 16), ("b", "INT32", (4,), 8, 16)]
        first, second = packing.unpack_copies(created, overlapping)
        first[:] = -1
        assert second.tolist() == small[0][2:6].tolist()
    finally:
        created.close()


def test_feeds_that_do_not_fit_write_nothing_and_say_what_they_need(arena: Arena) -> None:
    arena.map[:8] = b"untouchd"
    feeds = [
        {"big": np.ones(5_000), "small": np.ones(3, np.int8)},
        {"big": np.ones(5_000), "small": np.ones(3, np.int8)},
    ]
    with pytest.raises(PoolFull) as caught:
        packing.pack_feeds_at(arena, 64, feeds)
    assert caught.value.wanted == 80_000 + ALIGNMENT and caught.value.capacity == arena.size
    assert arena.map[:8] == b"untouchd"


def test_copies_are_writable_and_outlive_the_arena_s_next_message(arena: Arena) -> None:
    """One copy of the span for numbers (also spread out and empty ones), BYTES decoded; none of them
    changes when the arena is rewritten, as it is by the next batch."""
    sent = [_tensor(DataType.INT64, 5), _tensor(DataType.BYTES, 3), _tensor(DataType.FP32, 0)]
    spread = [_tensor(DataType.INT16, 4)]
    slots = packing.pack_at(arena, 0, sent) + packing.pack_at(arena, 40_000, spread)  # far apart: copied one by one
    for chosen in (slots[:1] + slots[2:3], slots, slots[:1] + slots[3:]):  # one copy; BYTES; spread out
        copies = packing.unpack_copies(arena, chosen)
        arena.map[: arena.size] = b"\xff" * arena.size
        for slot, copy in zip(chosen, copies, strict=True):
            before = next(t for t in sent + spread if t.name == slot[0])
            assert copy.tolist() == before.data.tolist() and copy.shape == before.shape
            assert copy.flags.writeable or copy.dtype == object
        packing.pack_at(arena, 0, sent)
        packing.pack_at(arena, 40_000, spread)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(["x", "y", "z"]), st.sampled_from(NUMERIC), st.integers(0, 4)), max_size=3),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 2**32 - 1),
)
def test_any_batch_of_feeds_comes_back_as_it_was_sent(
    layouts: list[list[tuple[str, DataType, int]]], seed: int
) -> None:
    """Each request's tensors come back its own, whichever way the batch was packed: grouped when the
    requests are alike (the batcher's usual batch), tensor by tensor otherwise, as the process
    instance's host does (``PythonProcessModel._lay_out``)."""
    generator = np.random.default_rng(seed)
    first = layouts[0]
    feeds = []
    for layout in [first] * (seed % 3) + layouts:  # alike feeds first, sometimes
        feed = {}
        for name, datatype, rows in layout:
            feed[name] = (
                generator.integers(0, 2, (rows, 2))
                if datatype is DataType.BOOL
                else generator.integers(0, 99, (rows, 2))
            ).astype(datatype.numpy_dtype)
        feeds.append(feed)
    created = Arena.create("shoal-test-property", 1 << 16)
    try:
        laid_out = packing.pack_feeds_at(created, 64, feeds)
        if laid_out is None:
            tensors = [
                [Tensor(name, DataType.from_numpy(a.dtype), a.shape, a) for name, a in feed.items()] for feed in feeds
            ]
            flat = iter(packing.pack_at(created, 64, [t for ts in tensors for t in ts]))
            laid_out = [[next(flat) for _ in ts] for ts in tensors]
        all_slots = [slot for slots in laid_out for slot in slots]
        copies = iter(packing.unpack_copies(created, all_slots))
        for feed, slots in zip(feeds, laid_out, strict=True):
            assert [slot[0] for slot in slots] == list(feed)
            for slot in slots:
                copy, sent = next(copies), feed[slot[0]]
                assert copy.dtype == sent.dtype and copy.shape == sent.shape and np.array_equal(copy, sent)
    finally:
        created.close()
