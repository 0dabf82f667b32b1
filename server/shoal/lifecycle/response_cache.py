"""Triton's response cache (``--cache-config local,size=BYTES``, ``response_cache { enable: true }``).

Why: a model asked the same thing again (a popular query, a retried request) is answered without
executing, as Triton's local cache does. One cache for the server, bounded by the bytes of the outputs
it holds, least recently used first out.

What makes two requests the same, so that an answer is never another request's: the loaded version
(a number no other load of any version gets, so a reload never serves the old copy's answers; for an
ensemble, also the numbers of the versions its steps run). An entry goes when any version whose number
is in its key is unloaded: an ensemble kept across a step's reload keeps no answers it can no longer give.
every input as the model receives it (name, numpy dtype, shape and bytes; BYTES elements length-prefixed
and tagged with their type, so that ``b"5"``, ``"5"`` and ``5`` are three requests),
the requested outputs and classification counts, and every request parameter. The key is a 256-bit
BLAKE2b digest of all that: two different requests meet on one key with probability 2^-128.
What is kept is the response's outputs, copied out of whatever memory they were in (an arena the
request owned, a worker's shared memory) and made read-only: nothing cached refers to a request's memory.

Hashing a request and copying an answer cost about 2 ms per MiB here: above ``OFF_LOOP_BYTES`` they run
on a worker thread (hashlib and numpy's copy let go of the GIL), as the transports' codecs do, so one
large request does not hold every other request on the serving loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.lifecycle.request_checks import Prepared
from shoal.off_loop import OFF_LOOP_BYTES, OFF_LOOP_ELEMENTS
from shoal.request_types import Tensor
from shoal.statistics import ModelStatistics


def request_key(
    versions: Sequence[int],
    feed: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None,
    class_counts: Mapping[str, int],
    parameters: Mapping[str, Any],
) -> bytes:
    """The digest of everything that can change a version's answer to a request."""
    digest = hashlib.blake2b(digest_size=32)

    def put(part: bytes) -> None:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)

    for version in versions:
        put(version.to_bytes(8, "little"))
    for name in sorted(feed):
        array = feed[name]
        put(name.encode())
        put(f"{array.dtype.str}:{array.dtype.name}".encode())  # bfloat16's str is a bare '<V2'; its name says it
        put(repr(array.shape).encode())
        if array.dtype == object:
            for element in array.reshape(-1):
                put(_element_bytes(element))
        else:
            contiguous = np.ascontiguousarray(array)
            digest.update(contiguous.nbytes.to_bytes(8, "little"))
            if contiguous.nbytes:
                # The buffer itself, as bytes (no copy): a bfloat16 array exports no buffer of its own type.
                digest.update(contiguous.reshape(-1).view(np.uint8).data)
    put(repr(None if outputs is None else tuple(outputs)).encode())
    put(repr(sorted(class_counts.items())).encode())
    put(repr(sorted((str(k), repr(v)) for k, v in parameters.items())).encode())
    return digest.digest()


def _element_bytes(element: object) -> bytes:
    """A BYTES element as the key sees it: its type, then its value (a model can tell ``b"5"`` from
    ``"5"`` and from ``5``, which Python models and BLS callers may pass; so must the key)."""
    if isinstance(element, bytes):
        return b"b" + element
    if isinstance(element, str):
        return b"s" + element.encode("utf-8", "surrogatepass")
    return b"o" + f"{type(element).__module__}.{type(element).__qualname__}:{element!r}".encode()


def _costly(arrays: Iterable[np.ndarray]) -> bool:
    """Whether hashing or copying ``arrays`` would hold the loop: over ``OFF_LOOP_BYTES``, or BYTES
    tensors of over ``OFF_LOOP_ELEMENTS`` elements (each is hashed on its own)."""
    total = 0
    for array in arrays:
        if array.dtype != object:
            total += array.nbytes
        elif array.size > OFF_LOOP_ELEMENTS:
            return True
        else:
            total += sum(len(e) if isinstance(e, bytes | str) else 8 for e in array.reshape(-1))
    return total > OFF_LOOP_BYTES


@dataclass(frozen=True)
class Entry:
    loads: tuple[int, ...]  # the load numbers in its key: unloading any of them makes it unreachable
    outputs: tuple[Tensor, ...]
    size: int


def _owned(tensor: Tensor) -> Tensor:
    data = np.array(tensor.data, copy=True)
    data.flags.writeable = False
    return Tensor(tensor.name, tensor.datatype, tensor.shape, data)


def _size(outputs: Sequence[Tensor]) -> int:
    total = 0
    for tensor in outputs:
        if tensor.data.dtype == object:
            total += sum(len(e) if isinstance(e, bytes | str) else 8 for e in tensor.data.reshape(-1))
        else:
            total += tensor.data.nbytes
    return total + 64 * len(outputs)


class ResponseCache:
    """The server's cache: entries by key, least recently used first out once ``capacity`` bytes are passed.

    Lookups and insertions come from versions' ``infer`` on the serving loop, and from BLS calls that
    may reach it from a model's thread: a lock keeps the order and the byte count whole.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> tuple[Tensor, ...] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.outputs

    def put(self, key: bytes, loads: Sequence[int], outputs: Sequence[Tensor]) -> bool:
        """Keep a copy of ``outputs``; False if ``key`` was there already (another request with the
        same key finished first). One larger than the whole cache is not kept (True: still a miss)."""
        size = _size(outputs)
        if size > self.capacity:
            return True
        owned = tuple(_owned(t) for t in outputs)  # copied outside the lock
        with self._lock:
            if key in self._entries:
                return False
            while self.used + size > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.used -= evicted.size
            self._entries[key] = Entry(tuple(loads), owned, size)
            self.used += size
            return True

    def forget(self, load_number: int) -> None:
        """Drop the entries an unloaded version's number is in (no request can make their keys again)."""
        with self._lock:
            for key in [k for k, entry in self._entries.items() if load_number in entry.loads]:
                self.used -= self._entries.pop(key).size

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class Lookup:
    """One request's look into the cache: its key, what it found, when the look began and ended."""

    key: bytes
    composition: tuple[int, ...]  # the load numbers the key was made of
    outputs: tuple[Tensor, ...] | None
    started_ns: int
    ended_ns: int


class VersionCache:
    """A loaded version's part of the server's cache, and its statistics as Triton keeps them
    (core infer_stats.cc): a hit is a success whose queue time ends when the lookup begins, with no
    execution, inference or compute time; a miss adds its lookup and insertion time to the request's."""

    def __init__(self, cache: ResponseCache, statistics: ModelStatistics) -> None:
        self.cache = cache
        self.statistics = statistics

    async def look_up(
        self, prepared: Prepared, parameters: Mapping[str, Any], composition: Sequence[int], arrival_ns: int
    ) -> Lookup:
        """Look for the request's answer; a hit is counted here (its queue time is that of a request that
        goes straight from its checks to the lookup, as Triton's: none to speak of). ``composition``: the
        load numbers of the version and, for an ensemble, of the versions its steps run now, so that a
        composing model reloaded under a kept ensemble never answers from its old copy's entries."""
        started_ns = time.monotonic_ns()
        if _costly(prepared.feed.values()):
            key, outputs = await asyncio.to_thread(self._find, prepared, parameters, composition)
        else:
            key, outputs = self._find(prepared, parameters, composition)
        ended_ns = time.monotonic_ns()
        if outputs is not None:
            self.statistics.record_cache_hit(ended_ns - arrival_ns, 0, ended_ns - started_ns)
        return Lookup(key, tuple(composition), outputs, started_ns, ended_ns)

    def _find(
        self, prepared: Prepared, parameters: Mapping[str, Any], composition: Sequence[int]
    ) -> tuple[bytes, tuple[Tensor, ...] | None]:
        key = request_key(composition, prepared.feed, prepared.outputs, prepared.class_counts, parameters)
        kept = self.cache.get(key)
        if kept is None:
            return key, None
        # Each hit gets its own copy: what it answers may be written into in place (torch.from_numpy ignores
        # the read-only flag; an ensemble's next step or a BLS caller may do so), and the entry must not change.
        return key, tuple(Tensor(t.name, t.datatype, t.shape, t.data.copy()) for t in kept)

    async def insert(self, lookup: Lookup, outputs: Sequence[Tensor]) -> None:
        """Keep a successful answer; a miss unless an equal request's answer got there first (Triton,
        too, counts that one neither as a hit nor as a miss)."""
        started_ns = time.monotonic_ns()
        if _costly(t.data for t in outputs):
            kept = await asyncio.to_thread(self.cache.put, lookup.key, lookup.composition, outputs)
        else:
            kept = self.cache.put(lookup.key, lookup.composition, outputs)
        if kept:
            ended_ns = time.monotonic_ns()
            self.statistics.record_cache_miss(lookup.ended_ns - lookup.started_ns + ended_ns - started_ns)


def parse_cache_config(values: Sequence[str]) -> int:
    """``--cache-config`` values (``<cache name>,<setting>=<value>``, Triton's format and words) to the
    local cache's size in bytes; 0 when none is given (no cache). ValueError says what is wrong."""
    settings: dict[str, dict[str, str]] = {}
    for text in values:
        name, comma, rest = text.partition(",")
        if not comma or not name:
            raise ValueError(
                f"No cache specified. --cache-config option format is <cache name>,<setting>=<value>. Got {text}"
            )
        setting, equals, value = rest.partition("=")
        if not equals or not setting or not value:
            raise ValueError(f"--cache-config option format is '<cache name>,<setting>=<value>'. Got {text}")
        settings.setdefault(name, {})[setting] = value
    if not settings:
        return 0
    unknown = sorted(set(settings) - {"local"})
    if unknown:
        raise ValueError(f"--cache-config: cache '{unknown[0]}' is not available in Shoal (only 'local')")
    extra = sorted(set(settings["local"]) - {"size"})
    if extra:
        raise ValueError(f"--cache-config: the local cache has no setting '{extra[0]}' (only 'size')")
    size = settings["local"].get("size", "")
    if not size.isdigit():
        raise ValueError("Failed to initialize LocalCache: config didn't contain a valid 'size' field.")
    return int(size)
