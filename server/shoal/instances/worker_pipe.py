"""The pipe and the two arenas between a process instance's host side and its worker: one protocol.

Both kinds of process instance speak it (``instances.process`` with ``process_worker`` for a
backend's model attached to the server's weights; ``instances.python_process`` with
``python_worker`` and ``python_link`` for a Python model). Messages are small tuples whose first
item names the kind; tensors never ride on the pipe: they are packed into the two memfd arenas
(``dataplane.packing``), REQUESTS written by the host and RESPONSES by the worker, and a message
carries their slots.

Either kind, host → worker: None (stop), PING, (ARENA, REQUESTS | RESPONSES, size) followed by the
arena's descriptor; worker → host: READY, PING, (FAILED, message), (GROW, bytes the outputs need).
A backend's model: host → worker (RUN, input slots, output names); worker → host (OK, output slots).
A Python model (its batch conversation, BLS calls included, is told in ``instances.python_process``):

    host → worker  (RUN_REQUESTS, [(input slots, outputs, request id, correlation id, parameters, trace id)], batch)
    worker → host  (BLS, call id, BlsCall, input slots)
    host → worker  (BLS_REPLY, call id, BlsResult, output slots, final, batch)
    worker → host  (RESPONSE, index, outputs, error, code, final)   a decoupled model's responses
    host → worker  (CANCEL_REQUEST, index)                          a decoupled request's client gave up
    worker → host  (DONE, [(output slots, error, code)])
"""

from __future__ import annotations

from collections.abc import Mapping
from multiprocessing import reduction
from typing import Any

import numpy as np

from shoal.dataplane import packing
from shoal.dataplane.arena import ALIGNMENT, Arena, PoolFull
from shoal.errors import ErrorCode, ShoalError
from shoal.protocol.types import DataType
from shoal.request_types import Tensor

PING = "ping"  # the liveness check: an idle worker echoes it at once
READY, RUN, ARENA, OK, FAILED, GROW = "ready", "run", "arena", "ok", "failed", "grow"
REQUESTS, RESPONSES = "requests", "responses"
RUN_REQUESTS, DONE, RESPONSE = "run_requests", "done", "response"
BLS, BLS_REPLY, CANCEL_REQUEST = "bls", "bls_reply", "cancel_request"

# Each arena starts this big (its pages are only backed once written) and doubles as batches need.
INITIAL_ARENA_BYTES = 1 << 20
MAX_ARENA_BYTES = 1 << 32  # per direction: two of the largest gRPC messages


def arena_bytes(needed: int, what: str) -> int:
    """The size of an arena that holds ``needed`` bytes: a power of two; past the bound, an error."""
    if needed > MAX_ARENA_BYTES:
        raise ShoalError(
            ErrorCode.INVALID_ARGUMENT if what == "inputs" else ErrorCode.INTERNAL,
            f"the batch's {what} need {needed} bytes of shared memory; a process instance "
            f"moves at most {MAX_ARENA_BYTES >> 20} MiB each way per batch",
        )
    return min(MAX_ARENA_BYTES, max(INITIAL_ARENA_BYTES, 1 << (needed - 1).bit_length()))


def trim(arena: Arena, used: int) -> None:
    """After a batch: give back the pages it used past the arena's resident part."""
    arena.release_pages(0, used)


def as_tensors(arrays: Mapping[str, np.ndarray]) -> list[Tensor]:
    found = []
    for name, array in arrays.items():
        array = np.asarray(array)
        try:
            datatype = DataType.from_numpy(array.dtype)
        except ValueError as exc:
            raise ShoalError(ErrorCode.INTERNAL, f"tensor '{name}': {exc}") from None
        found.append(Tensor(name, datatype, tuple(array.shape), array))
    return found


def receive_arena(conn: Any, arenas: dict[str, Arena], message: tuple[str, str, int]) -> None:
    """In a worker: map the arena whose descriptor follows ``message`` on the pipe, in place of the old one."""
    _, which, size = message
    map_arena(arenas, which, size, reduction.recv_handle(conn))


def map_arena(arenas: dict[str, Arena], which: str, size: int, fd: int) -> None:
    """In a worker: map the arena ``fd`` (received from the server) in place of the old one."""
    arena = Arena(fd, size)
    arena.close_fd()  # the mapping is all a worker needs
    old = arenas.get(which)
    arenas[which] = arena
    if old is not None:
        old.close()


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def put(arena: Arena, offset: int, arrays: Mapping[str, Any]) -> tuple[list[packing.Slot] | None, int]:
    """``arrays`` packed at ``offset``, and where the next pack may start; (None, offset) when they do not fit."""
    try:
        slots = packing.pack_at(arena, offset, as_tensors(arrays))
    except PoolFull:
        return None, offset
    return slots, aligned(max(offset, packing.extent(slots)))


def take(arena: Arena, slots: list[packing.Slot]) -> dict[str, Any]:
    """Copies of the tensors at ``slots`` (the arena is rewritten by the next batch)."""
    return {t.name: t.data if t.datatype.value == "BYTES" else t.data.copy() for t in packing.unpack(arena, slots)}
