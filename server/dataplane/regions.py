"""Shared-memory regions that clients register: Triton's system shared-memory extension.

A client creates a POSIX shared-memory segment (``tritonclient.utils.shared_memory``) and
registers a window of it by name, key, offset and size. The server maps that window read/write
and reads inputs from it and writes outputs into it in place, with no tensor bytes on the wire.

What the server opens is only what the key names: a segment in /dev/shm, opened the way
``shm_open`` does (the key's one leading ``/`` dropped, no other ``/``, never a symlink, only a
regular file). It never unlinks a segment (the client created it) and never uses
``multiprocessing.shared_memory``, whose resource tracker would unlink the client's segment when
the server exits. Unregistering drops the mapping from the registry; a request still reading or
writing it keeps the mapping alive until it is done (numpy views hold it), so it never touches
unmapped memory. Messages and status codes are Triton's (server src/shared_memory_manager.cc).
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ErrorCode, ShoalError, shown

SHM_FOLDER = Path("/dev/shm")
MAX_KEY_CHARS = 255  # NAME_MAX


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class _Region:
    status: RegionStatus
    map: mmap.mmap  # the segment from 0 to offset + byte_size


class RegionRegistry:
    """The system shared-memory regions registered with this server, by name."""

    def __init__(self, max_total_bytes: int) -> None:
        self.max_total_bytes = max_total_bytes
        self._regions: dict[str, _Region] = {}

    @property
    def total_bytes(self) -> int:
        return sum(r.status.byte_size for r in self._regions.values())

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if name in self._regions:
            raise ShoalError(ErrorCode.ALREADY_EXISTS, f"shared memory region '{shown(name)}' already in manager")
        if byte_size <= 0 or offset < 0:
            raise ShoalError(ErrorCode.INVALID_ARGUMENT, f"failed to register shared memory region '{shown(name)}': "
                             "unable to process address spaceInvalid argument")
        if self.total_bytes + byte_size > self.max_total_bytes:
            raise ShoalError(ErrorCode.INVALID_ARGUMENT, (
                f"failed to register shared memory region '{shown(name)}': {byte_size} more bytes would pass the "
                f"server's limit of {self.max_total_bytes} registered bytes (--shared-memory-max-mb)"))
        fd = _open_segment(key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise ShoalError(ErrorCode.INVALID_ARGUMENT,
                                 f"failed to register shared memory region '{shown(name)}': invalid args")
            mapping = mmap.mmap(fd, offset + byte_size)
        finally:
            os.close(fd)
        self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), mapping)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (every region when ``""``); an unknown name is not an error, as in Triton."""
        if not name:
            self._regions.clear()
        else:
            self._regions.pop(name, None)

    def status(self, name: str) -> list[RegionStatus]:
        if not name:
            return [r.status for r in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise ShoalError(ErrorCode.NOT_FOUND, f"Unable to find system shared memory region: '{shown(name)}'")
        return [region.status]

    def window(self, name: str, offset: int, byte_size: int) -> memoryview:
        """``byte_size`` bytes at ``offset`` in the region (read/write); the view keeps the mapping alive."""
        region = self._regions.get(name)
        if region is None:
            raise ShoalError(ErrorCode.NOT_FOUND, f"Unable to find shared memory region: '{shown(name)}'")
        available = region.status.byte_size
        if not 0 <= offset < available:
            raise ShoalError(ErrorCode.INVALID_ARGUMENT, f"Invalid offset for shared memory region: '{shown(name)}'")
        if byte_size < 0 or offset + byte_size > available:
            raise ShoalError(ErrorCode.INVALID_ARGUMENT,
                             f"Invalid offset + byte size for shared memory region: '{shown(name)}'")
        start = region.status.offset + offset
        return memoryview(region.map)[start : start + byte_size]

    def close(self) -> None:
        self._regions.clear()


def _open_segment(key: str) -> int:
    """A descriptor of the segment ``key`` names, opened as ``shm_open(key, O_RDWR)`` would."""
    name = key[1:] if key.startswith("/") else key
    problem = not name or "/" in name or name in {".", ".."} or len(name) > MAX_KEY_CHARS or "\0" in name
    fd = -1
    if not problem:
        try:
            fd = os.open(SHM_FOLDER / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            problem = True
    if not problem and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        problem = True
    if problem:
        raise ShoalError(ErrorCode.INTERNAL, f"Unable to open shared memory region: '{shown(key)}'")
    return fd
