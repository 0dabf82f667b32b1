"""Shared-memory regions that clients register: Triton's system shared-memory extension.

A client creates a POSIX shared-memory segment (``tritonclient.utils.shared_memory``) and
registers a window of it by name, key, offset and size. The server reads inputs from it and
writes outputs into it with ``preadv``/``pwrite``: one copy each way, no tensor bytes on the
wire. Not a mapping, on purpose: a client can shrink its segment at any time, and touching a
mapped page past the new end kills the whole server with SIGBUS; a read or write of the
descriptor just comes up short, which is an error for that one request.

A registered region does not hold a descriptor of its own: held open, 1,008 registrations of one
64-byte segment took every descriptor of a server at the usual soft limit of 1,024, and it
stopped accepting connections. The ``OPEN_SEGMENTS`` regions used last keep theirs open (opening
a segment costs ~25 us, more than the read of a small tensor); another is opened again by the
request that uses it. The segment's identity (device and inode) is recorded at registration and
checked at each opening, so a key that now names another segment is an error, never another
file read. Unlike Triton's mapping, a segment its client unlinked while registered fails the
requests that must open it again.

What the server opens is only what the key names: a segment in /dev/shm, opened the way
``shm_open`` does (the key's one leading ``/`` dropped, no other ``/``, never a symlink, only a
regular file). It never unlinks a segment (the client created it) and never uses
``multiprocessing.shared_memory``, whose resource tracker would unlink the client's segment when
the server exits. Unregistering drops the region from the registry; a request that located it
before keeps its own descriptor open until it is done, so it never reads or writes another file.
Messages and status codes are Triton's (server src/shared_memory_manager.cc).

CUDA regions (``dataplane.cuda``) live in the same registry, as in Triton: one namespace of
names, one bound on what is registered (bytes and regions); each kind's status and unregister see
only its own.
"""

from __future__ import annotations

import io
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from shoal.dataplane import cuda
from shoal.dataplane.cuda import CudaRegion, CudaRegionStatus, CudaWindow
from shoal.errors import ErrorCode, ShoalError, shown

SHM_FOLDER = Path("/dev/shm")
MAX_KEY_CHARS = 255  # NAME_MAX
MAX_REGIONS = 4096  # the default bound on regions registered at once (--shared-memory-max-regions)
OPEN_SEGMENTS = 64  # descriptors kept open, for the regions used last


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class _Region:
    status: RegionStatus
    identity: tuple[int, int]  # st_dev and st_ino of the segment registered


@dataclass(frozen=True)
class Window:
    """``byte_size`` bytes of a region, from ``position`` in its segment; holds the segment open
    (its own descriptor, closed when the last user lets go)."""

    name: str
    file: io.FileIO
    position: int
    byte_size: int

    def read(self) -> np.ndarray:
        """A private copy of the window's bytes (uint8)."""
        data = np.empty(self.byte_size, np.uint8)
        view, done = data.data, 0
        while done < self.byte_size:  # Linux moves at most 2 GiB - 4 KiB per call
            moved = os.preadv(self.file.fileno(), [view[done:]], self.position + done)
            if moved <= 0:
                raise _shrunk(self.name)
            done += moved
        return data

    def write(self, data: bytes) -> None:
        if len(data) > self.byte_size:
            raise ValueError("the data is larger than the window")
        view, done = memoryview(data), 0
        while done < len(data):  # as read: one call may move less than asked
            moved = os.pwrite(self.file.fileno(), view[done:], self.position + done)
            if moved <= 0:
                raise _shrunk(self.name)
            done += moved


def _shrunk(name: str) -> ShoalError:
    return ShoalError(
        ErrorCode.INTERNAL,
        f"shared memory region '{shown(name)}' is smaller than when it was registered (its segment was truncated)",
    )


_Kind = TypeVar("_Kind", _Region, CudaRegion)


class RegionRegistry:
    """The shared-memory regions registered with this server, system and CUDA, by name."""

    def __init__(self, max_total_bytes: int, max_regions: int = MAX_REGIONS) -> None:
        self.max_total_bytes = max_total_bytes
        self.max_regions = max_regions
        self._regions: dict[str, _Region | CudaRegion] = {}
        # By region name, the last used at the end: the registration each descriptor was opened for, and it.
        self._open: OrderedDict[str, tuple[_Region, io.FileIO]] = OrderedDict()
        self._open_lock = threading.Lock()  # windows are located on the loop and on worker threads

    @property
    def total_bytes(self) -> int:
        return sum(r.status.byte_size for r in self._regions.values())

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_room(name, byte_size)
        if byte_size <= 0 or offset < 0:
            raise ShoalError(
                ErrorCode.INVALID_ARGUMENT,
                f"failed to register shared memory region '{shown(name)}': "
                "unable to process address spaceInvalid argument",
            )
        fd = _open_segment(key)
        try:
            found = os.fstat(fd)
        finally:
            os.close(fd)  # opened again by each request that uses the region
        if offset + byte_size > found.st_size:
            raise ShoalError(
                ErrorCode.INVALID_ARGUMENT, f"failed to register shared memory region '{shown(name)}': invalid args"
            )
        self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), (found.st_dev, found.st_ino))

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        cuda.require_runtime(name)  # without GPUs every registration is refused first, as in Triton
        self._check_room(name, byte_size)
        self._regions[name] = cuda.open_region(name, raw_handle, device_id, byte_size)

    def _check_room(self, name: str, byte_size: int) -> None:
        if not name:
            raise ShoalError(ErrorCode.INVALID_ARGUMENT, "a shared memory region needs a name ('' means every region)")
        if name in self._regions:
            raise ShoalError(ErrorCode.ALREADY_EXISTS, f"shared memory region '{shown(name)}' already in manager")
        if len(self._regions) >= self.max_regions:
            raise ShoalError(
                ErrorCode.INVALID_ARGUMENT,
                f"failed to register shared memory region '{shown(name)}': "
                f"{self.max_regions} regions are registered already, the most this server holds "
                "(--shared-memory-max-regions)",
            )
        if self.total_bytes + byte_size > self.max_total_bytes:
            raise ShoalError(
                ErrorCode.INVALID_ARGUMENT,
                (
                    f"failed to register shared memory region '{shown(name)}': {byte_size} more bytes would pass the "
                    f"server's limit of {self.max_total_bytes} registered bytes (--shared-memory-max-mb)"
                ),
            )

    def unregister(self, name: str) -> None:
        """Forget system region ``name`` (every one when ``""``); an unknown name, or a CUDA
        region's, is not an error and changes nothing, as in Triton."""
        self._forget(name, _Region)

    def unregister_cuda(self, name: str) -> None:
        """``unregister`` for CUDA regions; the IPC handle closes once no request holds a window."""
        self._forget(name, CudaRegion)

    def _forget(self, name: str, kind: type[_Region] | type[CudaRegion]) -> None:
        for known in [n for n, r in self._regions.items() if isinstance(r, kind) and (not name or n == name)]:
            del self._regions[known]
            with self._open_lock:
                self._open.pop(known, None)  # closed once no request holds a window of it

    def status(self, name: str) -> list[RegionStatus]:
        return [r.status for r in self._listed(name, _Region)]

    def cuda_status(self, name: str) -> list[CudaRegionStatus]:
        return [r.status for r in self._listed(name, CudaRegion)]

    def _listed(self, name: str, kind: type[_Kind]) -> list[_Kind]:
        """Every region of ``kind``, or the one named, with Triton's words when it is not of that kind."""
        if not name:
            return [r for r in self._regions.values() if isinstance(r, kind)]
        region = self._regions.get(name)
        cuda_wanted = kind is CudaRegion
        if region is None:
            kind_name = "cuda" if cuda_wanted else "system"
            raise ShoalError(ErrorCode.NOT_FOUND, f"Unable to find {kind_name} shared memory region: '{shown(name)}'")
        if not isinstance(region, kind):
            registered, wanted = ("system", "CUDA") if cuda_wanted else ("CUDA", "system")
            raise ShoalError(
                ErrorCode.NOT_FOUND,
                f"The region named '{shown(name)}' is registered as {registered} "
                f"shared memory, not {wanted} shared memory",
            )
        return [region]

    def window(self, name: str, offset: int, byte_size: int) -> Window | CudaWindow:
        """``byte_size`` bytes at ``offset`` in the region; checked against what was registered."""
        region = self._regions.get(name)
        if region is None:
            raise ShoalError(ErrorCode.NOT_FOUND, f"Unable to find shared memory region: '{shown(name)}'")
        available = region.status.byte_size
        if not 0 <= offset < available:
            raise ShoalError(ErrorCode.INVALID_ARGUMENT, f"Invalid offset for shared memory region: '{shown(name)}'")
        if byte_size < 0 or offset + byte_size > available:
            raise ShoalError(
                ErrorCode.INVALID_ARGUMENT, f"Invalid offset + byte size for shared memory region: '{shown(name)}'"
            )
        if isinstance(region, CudaRegion):
            return CudaWindow(name, region.mapping, offset, byte_size)
        return Window(name, self._segment(region), region.status.offset + offset, byte_size)

    def _segment(self, region: _Region) -> io.FileIO:
        """The region's segment, open: kept from a recent request, or opened again (and kept).

        What is kept belongs to one registration, not to its name: a request may locate a region on a
        worker thread while the loop unregisters it and registers the name again on another segment.
        Its descriptor (the old segment, which that request may still use) is then kept only if its
        registration is still the name's when the open is done, and a kept one serves only its own
        registration: else every later request on the name read and wrote the old segment, another
        client's memory."""
        name = region.status.name
        with self._open_lock:
            kept = self._open.get(name)
            if kept is not None and kept[0] is region:
                self._open.move_to_end(name)
                return kept[1]
        file = _reopen(region)
        with self._open_lock:
            if self._regions.get(name) is region:
                self._open[name] = (region, file)
                self._open.move_to_end(name)
                if len(self._open) > OPEN_SEGMENTS:
                    self._open.popitem(last=False)  # closed once no request holds a window of it
        return file

    def on_device(self, name: str) -> bool:
        """Whether ``name`` is a CUDA region: its copies block on the device, so they run off the loop."""
        return isinstance(self._regions.get(name), CudaRegion)

    def close(self) -> None:
        self._regions.clear()
        with self._open_lock:
            self._open.clear()


def _reopen(region: _Region) -> io.FileIO:
    """The region's segment, opened for one request; an error if its key now names another segment."""
    fd = _open_segment(region.status.key)
    found = os.fstat(fd)
    if (found.st_dev, found.st_ino) != region.identity:
        os.close(fd)
        raise ShoalError(
            ErrorCode.INTERNAL,
            f"shared memory region '{shown(region.status.name)}': its key "
            f"'{shown(region.status.key)}' names another segment than the one registered",
        )
    return io.FileIO(fd, "r+", closefd=True)


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
