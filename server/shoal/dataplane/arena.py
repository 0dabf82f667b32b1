"""Shared memory as one ``memfd`` per direction: nothing named, nothing left in /dev/shm.

An ``Arena`` is created by one process (``Arena.create``), which allocates blocks in it with its
``BlockAllocator``; the other process maps the same file descriptor (inherited through
``subprocess``'s ``pass_fds`` by front-end workers, sent over a pipe to process instances) and
only reads and writes the blocks it is told about. The
kernel frees the memory when the last process holding a mapping or descriptor exits, SIGKILL
included, so a crash leaks nothing.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading

ALIGNMENT = 64  # bytes: every block starts on a cache line, so any dtype's view is aligned
RELEASE_BYTES = 1 << 20  # freed blocks at least this big give their pages back to the kernel...
RESIDENT_BYTES = 16 << 20  # ...except in an arena's first 16 MiB, which first-fit reuses: refaults cost more


class PoolFull(Exception):
    """No free block is big enough for the request: the caller answers UNAVAILABLE (back-pressure)."""

    def __init__(self, wanted: int, free: int, capacity: int) -> None:
        super().__init__(f"needs {wanted} bytes of the shared-memory pool; {free} of {capacity} are free")
        self.wanted = wanted
        self.capacity = capacity


class Arena:
    """A shared-memory area mapped read/write in this process."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size)

    @classmethod
    def create(cls, name: str, size: int) -> Arena:
        """A new zero-filled area of ``size`` bytes; pages are only backed once written."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, size)

    def release_pages(self, offset: int, nbytes: int) -> None:
        """Give the whole pages inside a freed block back to the kernel: big blocks only, and only
        past the first ``RESIDENT_BYTES`` (faulting pages in again costs several times the copy:
        bench/process_request.py, 4 MiB requests: 9 ms with every batch's pages given back, 1.6 without)."""
        if nbytes < RELEASE_BYTES:
            return
        start = max(RESIDENT_BYTES, -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE)
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self.map.madvise(mmap.MADV_REMOVE, start, end - start)

    def close_fd(self) -> None:
        """The mapping stays (mmap keeps a descriptor of its own); this one goes, once the other
        process has its copy."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap if no view is left; views still alive keep the mapping until they go."""
        self.close_fd()
        try:
            self.map.close()
        except BufferError:
            pass  # numpy views still point into it; the mapping goes with the last of them


class BlockAllocator:
    """First-fit blocks in ``[0, capacity)``, freed in any order and merged with free neighbours.

    The free list stays short (blocks are small and short-lived, and freeing merges), so a scan
    costs little. Only the arena's owner allocates, mostly on its event loop thread, and on a worker
    thread when a message is costly to pack (``tensors.costly``): a lock keeps the two apart.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free_starts = [0]  # sorted
        self._free_sizes = {0: capacity}
        self._used: dict[int, int] = {}
        self.free_bytes = capacity
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int:
        """The offset of a block of at least ``nbytes``; ``PoolFull`` if none is free."""
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            return self._take(size, nbytes)

    def _take(self, size: int, nbytes: int) -> int:
        for index, start in enumerate(self._free_starts):
            available = self._free_sizes[start]
            if available < size:
                continue
            del self._free_sizes[start]
            if available == size:
                del self._free_starts[index]
            else:
                self._free_starts[index] = start + size
                self._free_sizes[start + size] = available - size
            self._used[start] = size
            self.free_bytes -= size
            return start
        raise PoolFull(nbytes, self.free_bytes, self.capacity)

    def free(self, offset: int) -> int:
        """Free the block at ``offset``; returns its size."""
        with self._lock:
            return self._give_back(offset)

    def _give_back(self, offset: int) -> int:
        size = self._used.pop(offset)
        self.free_bytes += size
        index = bisect.bisect(self._free_starts, offset)
        start, end = offset, offset + size
        if index < len(self._free_starts) and self._free_starts[index] == end:  # merge with the next
            end += self._free_sizes.pop(end)
            del self._free_starts[index]
        if index > 0:  # merge with the previous
            previous = self._free_starts[index - 1]
            if previous + self._free_sizes[previous] == start:
                start = previous
                index -= 1
                del self._free_starts[index]
        self._free_starts.insert(index, start)
        self._free_sizes[start] = end - start
        return size
