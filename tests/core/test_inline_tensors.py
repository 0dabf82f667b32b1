"""Small numeric tensors carried in a pipe's message (``dataplane.inline``): every fixed-size datatype
comes back as it was sent, through pickle as the pipe carries it, as a writable array of its own;
anything else (BYTES, bfloat16, another byte order, more bytes than the limit for the whole batch)
is left to an arena."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.dataplane import inline
from shoal.protocol.types import DataType
from tests.models import ALL_DATATYPES

NUMERIC = [
    DataType(name).numpy_dtype for name in ALL_DATATYPES if name not in ("BYTES", "BF16")
]  # BF16 is a numpy "void" dtype (ml_dtypes): it goes in an arena


def _through_the_pipe(carried: object) -> object:
    return pickle.loads(pickle.dumps(carried, 4))


@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
def test_every_fixed_size_datatype_comes_back_as_it_was_sent(dtype: np.dtype) -> None:
    sent = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    carried = inline.inline_feeds([{"X": sent}])
    assert carried is not None
    (got,) = (inline.arrays_of(feed) for feed in _through_the_pipe(carried))  # type: ignore[attr-defined]
    array = got["X"]
    assert array.dtype == sent.dtype and array.shape == sent.shape and np.array_equal(array, sent)
    assert array.flags.writeable and not np.shares_memory(array, sent)
    array[...] = 0  # the reader's own: the sender's array is untouched
    assert np.array_equal(sent, (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4))


def test_a_strided_array_travels_in_c_order() -> None:
    sent = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    (feed,) = inline.inline_feeds([{"X": sent}]) or []
    assert np.array_equal(inline.arrays_of(feed)["X"], sent)


@pytest.mark.parametrize(
    "array",
    [
        np.array([b"a", b"bc"], dtype=object),
        np.array(["a", "bc"]),
        np.zeros(4, DataType.BF16.numpy_dtype),
        np.arange(4, dtype=">f4"),
        np.zeros(2, np.complex64),
    ],
    ids=["bytes", "str", "bf16", "big-endian", "complex"],
)
def test_what_is_not_a_native_numeric_array_is_left_to_an_arena(array: np.ndarray) -> None:
    assert inline.inline_feeds([{"A": np.zeros(2, np.float32)}, {"A": np.zeros(2, np.float32), "B": array}]) is None


def test_the_limit_counts_every_feed_of_the_batch() -> None:
    half = np.zeros(inline.INLINE_BYTES // 2, np.uint8)
    assert inline.inline_feeds([{"X": half}, {"X": half}]) is not None  # exactly the limit
    assert inline.inline_feeds([{"X": half}, {"X": half}, {"X": np.zeros(1, np.uint8)}]) is None
    assert inline.inline_feeds([{"X": np.zeros(3, np.float32)}], limit=11) is None


def test_empty_and_scalar_tensors() -> None:
    sent = [{"E": np.zeros((0, 4), np.float32), "S": np.array(7, np.int64)}]
    (feed,) = _through_the_pipe(inline.inline_feeds(sent))  # type: ignore[misc]
    got = inline.arrays_of(feed)
    assert got["E"].shape == (0, 4) and got["E"].dtype == np.float32
    assert got["S"].shape == () and int(got["S"]) == 7


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(NUMERIC), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
        min_size=1,
        max_size=6,
    )
)
def test_any_small_batch_comes_back_as_it_was_sent(specs: list[tuple[np.dtype, list[int]]]) -> None:
    feeds = [
        {f"T{i}": (np.arange(int(np.prod(shape))) % 5).astype(dtype).reshape(shape)}
        for i, (dtype, shape) in enumerate(specs)
    ]
    carried = _through_the_pipe(inline.inline_feeds(feeds))
    assert carried is not None
    for sent, feed in zip(feeds, carried, strict=True):  # type: ignore[call-overload]
        got = inline.arrays_of(feed)
        assert list(got) == list(sent)
        for name, array in sent.items():
            assert got[name].dtype == array.dtype and got[name].shape == array.shape
            assert np.array_equal(got[name], array)
