"""A region name registered again names the new segment, whatever a request did meanwhile.

A request whose inputs are large locates its region on a worker thread; the loop may unregister
the region while that thread opens the segment, and a client may register the name again on
another segment. The thread's descriptor (the old segment) was then kept under the name, and every
later request on it read and wrote the old segment: another client's memory (found by a hostile
review with a real server and real clients, 3 tries in 10). The interleaving is made here by
unregistering and registering from inside the open.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shoal.dataplane import regions
from shoal.dataplane.regions import RegionRegistry, Window

SIZE = 64


@pytest.fixture
def make_segment() -> Iterator[Callable[[int], str]]:
    made: list[Path] = []

    def make(fill: int) -> str:
        key = f"shoal-test-{uuid.uuid4().hex}"
        path = Path("/dev/shm") / key
        path.write_bytes(bytes([fill]) * SIZE)
        made.append(path)
        return key

    yield make
    for path in made:
        path.unlink()


@pytest.fixture
def windows() -> Iterator[list[Window]]:
    """Every window a test located: their descriptors closed at its end (the registry's go with it)."""
    located: list[Window] = []
    yield located
    for window in located:
        window.file.close()


def _window(registry: RegionRegistry, windows: list[Window]) -> Window:
    window = registry.window("r", 0, SIZE)
    assert isinstance(window, Window)
    windows.append(window)
    return window


def _read(registry: RegionRegistry, windows: list[Window]) -> np.ndarray:
    return _window(registry, windows).read()


def test_a_segment_opened_across_an_unregister_never_serves_the_name_registered_again(
    make_segment: Callable[[int], str], windows: list[Window], monkeypatch: pytest.MonkeyPatch
) -> None:
    old_key, new_key = make_segment(0xAA), make_segment(0xBB)
    registry = RegionRegistry(max_total_bytes=1 << 20)
    registry.register("r", old_key, 0, SIZE)
    opened = regions._reopen

    def open_while_the_client_registers_again(region: regions._Region) -> object:
        file = opened(region)
        registry.unregister("r")
        registry.register("r", new_key, 0, SIZE)
        return file

    monkeypatch.setattr(regions, "_reopen", open_while_the_client_registers_again)
    located_before = _window(registry, windows)  # the request that located the old registration
    monkeypatch.setattr(regions, "_reopen", opened)
    assert set(located_before.read().tolist()) == {0xAA}  # it keeps the segment it located

    assert set(_read(registry, windows).tolist()) == {0xBB}
    _window(registry, windows).write(bytes([0x11]) * SIZE)
    assert set(_read(registry, windows).tolist()) == {0x11}
    assert (Path("/dev/shm") / old_key).read_bytes() == bytes([0xAA]) * SIZE  # the old segment untouched


def test_a_kept_descriptor_serves_only_its_own_registration(
    make_segment: Callable[[int], str], windows: list[Window]
) -> None:
    """The name unregistered and registered again on the loop alone (no thread): the new segment."""
    old_key, new_key = make_segment(0xAA), make_segment(0xBB)
    registry = RegionRegistry(max_total_bytes=1 << 20)
    registry.register("r", old_key, 0, SIZE)
    assert set(_read(registry, windows).tolist()) == {0xAA}
    registry.unregister("r")
    registry.register("r", new_key, 0, SIZE)
    assert set(_read(registry, windows).tolist()) == {0xBB}
