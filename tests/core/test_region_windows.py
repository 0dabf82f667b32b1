"""A system shared-memory window of any size is read and written whole.

Linux moves at most 0x7ffff000 bytes (2 GiB - 4 KiB) per read or write call, preadv and pwrite
included: a window past that came up short once, and the request failed with "... is smaller
than when it was registered (its segment was truncated)" though nothing was truncated. The kernel's
cap is simulated here (a real 2 GiB tensor is too large for a test on this machine).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shoal.dataplane import regions
from shoal.dataplane.regions import RegionRegistry, Window
from shoal.errors import ShoalError

CAP = 4096  # bytes per call, standing in for the kernel's 0x7ffff000


@pytest.fixture
def capped(monkeypatch: pytest.MonkeyPatch) -> None:
    real_preadv, real_pwrite = os.preadv, os.pwrite

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        (buffer,) = buffers
        return real_preadv(fd, [memoryview(buffer).cast("B")[:CAP]], offset)

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        return real_pwrite(fd, memoryview(data)[:CAP], offset)

    monkeypatch.setattr(regions.os, "preadv", preadv)
    monkeypatch.setattr(regions.os, "pwrite", pwrite)


@pytest.fixture
def segment() -> Iterator[tuple[str, Path]]:
    key = f"shoal-test-{uuid.uuid4().hex}"
    path = Path("/dev/shm") / key
    path.write_bytes(bytes(64 * 1024))
    try:
        yield key, path
    finally:
        path.unlink()


def _window(registry: RegionRegistry, key: str, offset: int, byte_size: int) -> Window:
    registry.register("r", key, offset, byte_size)
    window = registry.window("r", 0, byte_size)
    assert isinstance(window, Window)
    return window


@pytest.mark.usefixtures("capped")
def test_a_window_larger_than_one_call_moves_is_read_and_written_whole(segment: tuple[str, Path]) -> None:
    key, path = segment
    registry = RegionRegistry(2**30)
    window = _window(registry, key, 100, 10 * CAP + 7)
    data = np.random.default_rng(0).integers(0, 256, window.byte_size, dtype=np.uint8).tobytes()
    window.write(data)
    assert path.read_bytes()[100 : 100 + len(data)] == data
    assert window.read().tobytes() == data
    registry.close()
    window.file.close()


@pytest.mark.usefixtures("capped")
def test_a_truncated_segment_still_fails_its_request(segment: tuple[str, Path]) -> None:
    key, path = segment
    registry = RegionRegistry(2**30)
    window = _window(registry, key, 0, 10 * CAP)
    os.truncate(path, 5 * CAP + 1)
    with pytest.raises(ShoalError, match="smaller than when it was registered"):
        window.read()
    registry.close()
    window.file.close()
