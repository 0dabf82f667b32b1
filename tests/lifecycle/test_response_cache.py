"""The response cache's keys, bound and flags (lifecycle/response_cache.py), without a server.

Two requests share an answer only if nothing that can change it differs: each difference below
makes its own key. The bound is in bytes of outputs, least recently used out first.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from shoal.lifecycle.response_cache import ResponseCache, parse_cache_config, request_key
from shoal.protocol.types import DataType
from shoal.request_types import Tensor

FEED = {"IN": np.arange(4, dtype=np.float32).reshape(1, 4)}


def key(versions=(1,), feed=None, outputs=("OUT",), class_counts=None, parameters=None) -> bytes:
    return request_key(versions, FEED if feed is None else feed, outputs, class_counts or {}, parameters or {})


@pytest.mark.parametrize(
    "changed",
    [
        {"versions": (2,)},
        {"versions": (1, 7)},  # an ensemble's steps resolved to another load
        {"feed": {"IN": np.arange(4, dtype=np.float64).reshape(1, 4)}},  # same values, other dtype
        {"feed": {"IN": np.arange(4, dtype=np.float32).reshape(2, 2)}},  # same bytes, other shape
        {"feed": {"IN": np.array([[0, 1, 2, 4]], dtype=np.float32)}},
        {"feed": {"OTHER": FEED["IN"]}},
        {"outputs": ("OUT", "OUT2")},
        {"outputs": None},  # every output, not the one named
        {"class_counts": {"OUT": 2}},
        {"parameters": {"offset": 1}},
    ],
)
def test_anything_that_can_change_the_answer_changes_the_key(changed: dict) -> None:
    assert key(**changed) != key()


def test_equal_requests_meet_on_one_key_whatever_the_memory_layout() -> None:
    strided = np.asfortranarray(np.arange(8, dtype=np.int32).reshape(2, 4))
    assert key(feed={"IN": strided}) == key(feed={"IN": np.arange(8, dtype=np.int32).reshape(2, 4)})
    assert key(parameters={"a": 1, "b": "x"}) == key(parameters={"b": "x", "a": 1})


def test_a_bfloat16_feed_has_a_key_of_its_own() -> None:
    """numpy exports no buffer of ml_dtypes' bfloat16: every BF16 request to a cached model failed
    INTERNAL. Its key reads the bytes, and tells it from FP16 and from raw two-byte records."""
    bf16 = DataType.BF16.numpy_dtype
    values = np.array([[1.5, -2.0, 0.25, 8.0]], dtype=bf16)
    assert key(feed={"IN": values}) == key(feed={"IN": values.copy()})
    assert key(feed={"IN": values}) != key(feed={"IN": np.array([[1.5, -2.0, 0.25, 9.0]], dtype=bf16)})
    assert key(feed={"IN": values}) != key(feed={"IN": values.view(np.float16)})
    assert key(feed={"IN": values}) != key(feed={"IN": values.view("V2")})
    assert key(feed={"IN": np.array(1.5, dtype=bf16)}) != key(feed={"IN": np.array(2.5, dtype=bf16)})  # 0-d


def test_bytes_elements_are_delimited() -> None:
    """["ab", "c"] and ["a", "bc"] hold the same bytes in a row: their keys must differ."""
    first = {"IN": np.array([b"ab", b"c"], dtype=object)}
    second = {"IN": np.array([b"a", b"bc"], dtype=object)}
    assert key(feed=first) != key(feed=second)


@pytest.mark.parametrize(
    "first, second",
    [
        (b"5", "5"),  # a Python model or BLS caller may pass str where the wire passes bytes
        (b"5", 5),
        ("5", 5),
        (b"\x005", "5"),  # the old key's str encoding was a NUL before the text
        (5, 5.0),
    ],
)
def test_bytes_elements_of_different_types_are_different_requests(first: object, second: object) -> None:
    """A model can tell b"5" from "5" from 5: a cached answer to one must never answer the other."""
    assert key(feed={"IN": np.array([first], dtype=object)}) != key(feed={"IN": np.array([second], dtype=object)})


def test_equal_bytes_elements_meet_on_one_key() -> None:
    assert key(feed={"IN": np.array([b"ab", "c", 7], dtype=object)}) == key(
        feed={"IN": np.array([b"ab", "c", 7], dtype=object)}
    )


def outputs(value: float, elements: int = 4) -> tuple[Tensor, ...]:
    data = np.full((1, elements), value, dtype=np.float32)
    return (Tensor("OUT", DataType.FP32, data.shape, data),)


def test_the_least_recently_used_entry_goes_first_once_the_bound_is_passed() -> None:
    one_entry = 16 + 64  # 4 float32 and the per-tensor allowance
    cache = ResponseCache(3 * one_entry)
    for index in range(3):
        assert cache.put(bytes([index]), (1,), outputs(index))
    assert cache.get(bytes([0])) is not None  # 0 is now the most recently used: 1 goes next
    cache.put(bytes([3]), (1,), outputs(3))
    assert cache.get(bytes([1])) is None
    assert [cache.get(bytes([i])) is not None for i in (0, 2, 3)] == [True, True, True]
    assert cache.used == 3 * one_entry <= cache.capacity


def test_an_answer_larger_than_the_cache_is_not_kept_and_a_repeated_key_is_not_kept_twice() -> None:
    cache = ResponseCache(100)
    assert cache.put(b"big", (1,), outputs(1.0, elements=100)) and len(cache) == 0
    assert cache.put(b"k", (1,), outputs(1.0)) and not cache.put(b"k", (1,), outputs(2.0))
    cached = cache.get(b"k")
    assert cached is not None and cached[0].data[0, 0] == 1.0


def test_what_is_kept_is_a_read_only_copy() -> None:
    """The answer may live in memory its request owned (an arena, a worker's shared memory)."""
    cache = ResponseCache(1000)
    answer = outputs(5.0)
    cache.put(b"k", (1,), answer)
    answer[0].data[0, 0] = -1.0  # the request's memory, reused
    cached = cache.get(b"k")
    assert cached is not None and cached[0].data[0, 0] == 5.0
    with pytest.raises(ValueError):
        cached[0].data[0, 0] = 0.0


def test_an_unloaded_versions_entries_are_forgotten() -> None:
    cache = ResponseCache(1000)
    cache.put(b"a", (1,), outputs(1.0))
    cache.put(b"b", (2,), outputs(2.0))
    cache.forget(1)
    assert cache.get(b"a") is None and cache.get(b"b") is not None
    assert cache.used == 16 + 64


def test_an_ensembles_entries_go_when_a_step_version_in_their_key_is_unloaded() -> None:
    """A kept ensemble (load 5) whose step (load 2) was reloaded can never make those keys again."""
    cache = ResponseCache(1000)
    cache.put(b"ensemble", (5, 2, 3), outputs(1.0))
    cache.put(b"step", (3,), outputs(2.0))
    cache.forget(2)
    assert cache.get(b"ensemble") is None and cache.get(b"step") is not None and cache.used == 16 + 64


@pytest.mark.parametrize(
    ("values", "size"),
    [
        ([], 0),
        (["local,size=1048576"], 1048576),
        (["local,size=0"], 0),
        (["local,size=1", "local,size=2"], 2),
    ],
)
def test_cache_config_sizes(values: list[str], size: int) -> None:
    assert parse_cache_config(values) == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("size=10", "No cache specified. --cache-config option format is <cache name>,<setting>=<value>. Got size=10"),
        ("local,size", "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size"),
        ("local,=5", "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,=5"),
        ("local,size=ten", "Failed to initialize LocalCache: config didn't contain a valid 'size' field."),
        ("local,size=-1", "Failed to initialize LocalCache: config didn't contain a valid 'size' field."),
        ("redis,host=localhost", "cache 'redis' is not available in Shoal (only 'local')"),
        ("local,ttl=5", "the local cache has no setting 'ttl' (only 'size')"),
    ],
)
def test_cache_config_refusals_in_tritons_words(value: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_cache_config([value])
    assert message in str(caught.value)


def test_each_hit_gets_its_own_copy_so_an_in_place_write_never_changes_the_entry() -> None:
    """An ensemble's next step (torch.from_numpy ignores the read-only flag) may write into what a hit answers."""
    from shoal.lifecycle.request_checks import Prepared
    from shoal.lifecycle.response_cache import VersionCache
    from shoal.statistics import ModelStatistics

    version = VersionCache(ResponseCache(1000), ModelStatistics())
    prepared = Prepared(feed=dict(FEED), outputs=("OUT",), batch_size=1)
    miss = asyncio.run(version.look_up(prepared, {}, (1,), arrival_ns=0))
    assert miss.outputs is None
    asyncio.run(version.insert(miss, outputs(3.0)))
    for _ in range(3):
        hit = asyncio.run(version.look_up(prepared, {}, (1,), arrival_ns=0)).outputs
        assert hit is not None and hit[0].data[0, 0] == 3.0
        np.multiply(hit[0].data, 2, out=hit[0].data)  # a consumer's in-place write


def test_a_large_request_is_hashed_and_its_answer_copied_off_the_event_loop() -> None:
    """Hashing and copying cost ~2 ms per MiB: above OFF_LOOP_BYTES neither may run on the serving loop,
    or one large request holds every other one. Small ones stay on the loop (a thread costs more)."""
    from shoal.lifecycle import response_cache
    from shoal.lifecycle.request_checks import Prepared
    from shoal.lifecycle.response_cache import VersionCache
    from shoal.off_loop import OFF_LOOP_BYTES, OFF_LOOP_ELEMENTS
    from shoal.statistics import ModelStatistics

    threads: list[str] = []
    real_key, real_put = response_cache.request_key, ResponseCache.put

    def spy_key(*args):
        threads.append("key:" + threading.current_thread().name)
        return real_key(*args)

    def spy_put(self, *args):
        threads.append("put:" + threading.current_thread().name)
        return real_put(self, *args)

    small = np.ones((1, 4), dtype=np.float32)

    async def round_trip(array: np.ndarray) -> None:
        datatype = DataType.BYTES if array.dtype == object else DataType.FP32
        version = VersionCache(ResponseCache(1 << 24), ModelStatistics())
        prepared = Prepared(feed={"IN": array}, outputs=("OUT",), batch_size=1)
        miss = await version.look_up(prepared, {}, (1,), arrival_ns=0)
        await version.insert(miss, (Tensor("OUT", datatype, array.shape, array),))
        hit = await version.look_up(prepared, {}, (1,), arrival_ns=0)
        assert hit.outputs is not None and np.array_equal(hit.outputs[0].data, array)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(response_cache, "request_key", spy_key)
        patch.setattr(ResponseCache, "put", spy_put)
        asyncio.run(round_trip(small))
        on_loop = list(threads)
        off_loop = []
        for large in (
            np.ones((1, OFF_LOOP_BYTES // 4 + 1), dtype=np.float32),
            np.array([b"x" * (OFF_LOOP_BYTES + 1)], dtype=object),  # one long element
            np.array([b"x"] * (OFF_LOOP_ELEMENTS + 1), dtype=object),
        ):  # many short ones
            threads.clear()
            asyncio.run(round_trip(large))
            off_loop.append(list(threads))
    main = threading.main_thread().name
    assert on_loop == [f"key:{main}", f"put:{main}", f"key:{main}"]
    for seen in off_loop:
        assert len(seen) == 3 and all(not t.endswith(":" + main) for t in seen), seen
