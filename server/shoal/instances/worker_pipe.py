"""The pipe and the two arenas between a process instance's host side and its worker: one protocol.

Both kinds of process instance speak it (``instances.process`` with ``process_worker`` for a
backend's model attached to the server's weights; ``instances.python_process`` with
``python_worker`` and ``python_link`` for a Python model). Every message is one of the typed
records below (a ``NamedTuple``: it pickles as a tuple does, and each field has a name); the
receiver dispatches on its type, never on equality (two records without fields compare equal).
Tensors are packed into the two memfd arenas (``dataplane.packing``), REQUESTS written by the host
and RESPONSES by the worker, and a message carries their slots; but a batch whose tensors are all
small and numeric carries them in its message (``dataplane.inline``: cheaper than an arena's
bookkeeping at that size), either way.

Either kind, host → worker: Stop, Ping, NewArena (its descriptor follows on the pipe);
worker → host: Ready, Ping, Failed, Grow (the outputs need a bigger arena).
A backend's model: host → worker Run; worker → host Ran.
A Python model (its batch conversation, BLS calls included, is told in ``instances.python_process``):

    host → worker  RunRequests(requests, batch)
    worker → host  Bls(call id, call, input slots)             any number, from any thread of the model
    host → worker  BlsReply(call id, result, output slots, final, batch)
    worker → host  Response(position, outputs, error, code, final)  a decoupled model's responses
    host → worker  CancelRequest(position, batch)                  a decoupled request's client gave up
    worker → host  Done(answers, batch)
"""

from __future__ import annotations

import gc
import pickle
import socket
import struct
from collections.abc import Mapping
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from shoal.dataplane import inline, packing
from shoal.dataplane.arena import ALIGNMENT, Arena, PoolFull
from shoal.errors import ErrorCode, ShoalError
from shoal.protocol.types import DataType
from shoal.request_types import Tensor

if TYPE_CHECKING:  # a feed model's worker never loads the Python backend
    from shoal.backends.python.bls import BlsCall, BlsResult

REQUESTS, RESPONSES = "requests", "responses"  # the two arenas: the host writes one, the worker the other

Slots = list[packing.Slot]
# A batch's tensors: slots in an arena, or (small numeric ones) in the message (``inline``).
Carried = Slots | dict[str, inline.Inlined]


class Stop(NamedTuple):
    """host → worker: end the loop (the process then exits)."""


class Ping(NamedTuple):
    """Either way: the liveness check; an idle worker echoes it at once."""


class Ready(NamedTuple):
    """worker → host: the model is loaded; the host hands it the arenas next."""


class Failed(NamedTuple):
    """worker → host: loading or a batch failed, and why (``inputs_kept``: as ``Ran``'s)."""

    message: str
    inputs_kept: bool = False


class NewArena(NamedTuple):
    """host → worker: map this arena in place of the old one. Its descriptor follows on the pipe
    (``reduction.send_handle``); ``fd`` is -1 on the wire and the received descriptor once read."""

    which: str  # REQUESTS or RESPONSES
    size: int
    fd: int = -1


class Grow(NamedTuple):
    """worker → host: the outputs need a RESPONSES arena of at least ``needed`` bytes (a NewArena answers)."""

    needed: int


class Run(NamedTuple):
    """host → worker: run one feed (a backend's model)."""

    inputs: Carried  # in the REQUESTS arena, or in the message
    outputs: list[str]  # the names wanted


class Ran(NamedTuple):
    """worker → host: the feed's outputs, in the RESPONSES arena or in the message. ``inputs_kept``: the
    model still holds views of the feed's inputs (``InputViews``): the host leaves that REQUESTS arena to them."""

    outputs: Carried
    inputs_kept: bool = False


class PipedRequest(NamedTuple):
    """One queued request of a Python model's batch, as its ``execute`` sees it."""

    inputs: Carried  # in the REQUESTS arena, or in the message
    outputs: list[str]
    request_id: str
    correlation_id: Any
    parameters: Mapping[str, Any]
    trace_id: int  # the request's trace, which its BLS calls name (0: not traced)
    trace_context: str  # its OpenTelemetry context, for ``trace().get_context()`` ("": none)


class RunRequests(NamedTuple):
    """host → worker: run a Python model's batch; ``batch`` numbers it (a BLS reply names its batch)."""

    requests: list[PipedRequest]
    batch: int


class Bls(NamedTuple):
    """worker → host: a BLS call; its inputs in the RESPONSES arena (``inputs``), or pickled in ``call``."""

    call_id: int
    call: BlsCall
    inputs: Slots | None


class BlsReply(NamedTuple):
    """host → worker: one reply to a BLS call (a decoupled call gets several, the last ``final``); its
    outputs in the REQUESTS arena if ``outputs``, valid only while batch ``batch`` runs."""

    call_id: int
    result: BlsResult
    outputs: Slots | None
    final: bool
    batch: int


class Response(NamedTuple):
    """worker → host: one response of a decoupled model to its batch's request number ``position``
    (its tensors pickled)."""

    position: int
    outputs: dict[str, Any] | None
    error: str
    code: str
    final: bool


class CancelRequest(NamedTuple):
    """host → worker: the client of batch ``batch``'s request number ``position`` gave up (a decoupled
    model's; the worker may read it after that batch ended, when it no longer counts)."""

    position: int
    batch: int


class Answer(NamedTuple):
    """One request's outcome in ``Done``: its outputs (slots in the RESPONSES arena, or in the message), or an error."""

    outputs: Carried
    error: str = ""
    code: str = ""


class Done(NamedTuple):
    """worker → host: batch ``batch`` is over; one answer per request, in order. The host takes it
    only as the answer of the batch it is running: any other means the pipe is out of step.
    ``inputs_kept``: the model still holds views of the batch's inputs (``InputViews``): the host
    leaves that REQUESTS arena to them and hands the worker a new one before the next batch."""

    answers: list[Answer]
    batch: int = -1
    inputs_kept: bool = False


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


def with_descriptor(conn: Any, message: NewArena) -> NewArena:
    """``message`` with the descriptor that follows it on the pipe (read it at once: nothing comes between)."""
    return message._replace(fd=reduction.recv_handle(conn))


def map_arena(arenas: dict[str, Arena], message: NewArena) -> None:
    """In a worker: map the arena ``message`` brought (its descriptor received) in place of the old one."""
    which, size, fd = message
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


class InputViews:
    """In a worker: a batch's inputs for its model, and whether the model kept any past the batch.

    The inputs are views of the REQUESTS arena, which the host rewrites with every batch (and whose
    pages past its resident part it gives back), so a view the model keeps past its batch (a model
    that stores an input in ``self`` and returns it with a later request, as a stateful model may)
    would read a later batch's bytes: another request's data. A batch's views share one owner
    (``packing.unpack``'s ``on_release``), so once the batch is over and the worker has let go of its
    own references, ``kept`` knows whether the model holds one. If it does, the batch's answer says so,
    the host writes no more into that arena (it maps a new one for the next batch; the worker's
    mapping of the old one lasts as long as the model's views), and from then on this worker hands its
    model copies (a model that keeps inputs would otherwise keep an arena per batch). Triton's stub
    keeps such views valid too: its shared-memory blocks are counted references."""

    def __init__(self) -> None:
        self.copying = False  # the model kept inputs once: it gets copies from now on
        self._released = True  # the last batch's views are all gone

    def unpack(self, arena: Arena, slots: list[packing.Slot]) -> list[tuple[str, Any]]:
        """Each slot's (name, writable array): views of ``arena``, or copies once a model kept inputs."""
        if self.copying:
            return [(slot[0], array) for slot, array in zip(slots, packing.unpack_copies(arena, slots), strict=True)]
        self._released = False
        tensors = packing.unpack(arena, slots, on_release=self._release, writable=True)
        return [(tensor.name, tensor.data) for tensor in tensors]

    def _release(self) -> None:
        self._released = True

    def kept(self) -> bool:
        """Whether the model still holds a view of the last batch's inputs (the worker's own references
        gone). Views held only by a reference cycle (a traceback's frames) are collected first. Once
        copying, never: copies are the model's own (the views it kept first are in the arena it was left)."""
        if self.copying or self._released:
            return False
        gc.collect()
        if self._released:
            return False
        self.copying = True
        return True


def take(arena: Arena, slots: list[packing.Slot]) -> dict[str, Any]:
    """Copies of the tensors at ``slots`` (the arena is rewritten by the next batch)."""
    return {slot[0]: array for slot, array in zip(slots, packing.unpack_copies(arena, slots), strict=True)}


def pickled(message: Any) -> bytes:
    """A message as either side writes it on the pipe (``send_bytes``): pickled with protocol 4 by
    ``pickle`` itself, not the pipe's ``ForkingPickler`` (which copies its reducer table per message;
    the messages are plain data). Protocol 5 (the pipe's default from Python 3.14) would keep an array
    that was read-only on one side read-only on the other, where a model may write into it."""
    return pickle.dumps(message, 4)


def framed(message: bytes | memoryview) -> bytes:
    """A pickled message as ``Connection.send_bytes`` writes it: its length (4 bytes, big-endian; -1
    and 8 bytes past 2 GiB), then the message. What ``FrameReader`` and ``Connection.recv`` read."""
    size = len(message)
    header = struct.pack("!i", size) if size < 0x7FFFFFFF else struct.pack("!iQ", -1, size)
    return header + bytes(message)


READ_CHUNK_BYTES = 1 << 20  # the most one read asks for: a message's length is the worker's word, not memory
# No message of this protocol is longer: tensors past an arena's room travel pickled, at most an arena's worth.
MAX_MESSAGE_BYTES = 2 * MAX_ARENA_BYTES


class FrameError(ValueError):
    """A message's header announced a length no message of the pipe's protocol has."""


class FrameReader:
    """A ``multiprocessing`` Connection's messages, read by the event loop without ever blocking it.

    The loop reads a worker's answer when its socket is readable (``loop.add_reader``), on a
    duplicate of the host's end of the pipe (``socket.fromfd``) with MSG_DONTWAIT, so the
    Connection's own descriptor stays blocking for the thread that may take the conversation over.
    It never reads past the message it is reading: whatever follows stays in the pipe, for the
    next ``read`` or for that thread's ``Connection.recv``. A message arrives in parts when it is
    large (the writer's two writes past 16 KiB) or when its writer was stopped mid-write; ``read``
    keeps what it has and answers None until the rest comes, and a thread given the reader reads the
    rest with it before it reads the pipe itself, so the pipe never goes out of step.
    The framing is ``Connection``'s: a 4-byte big-endian length, or -1 and an 8-byte one past 2 GiB.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock
        self._buffer = bytearray()
        self._wanted = 4  # bytes of the header, then of the message
        self._in_header = True

    def fileno(self) -> int:
        return self._socket.fileno()

    @property
    def mid_message(self) -> bool:
        """Part of a message was read: the rest must be read before anything else."""
        return bool(self._buffer) or not self._in_header

    @property
    def announced(self) -> int | None:
        """The length of the message being read, once its header is in."""
        return None if self._in_header else self._wanted

    def read(self, stop_past: int | None = None) -> bytearray | None:
        """The next whole message, or None while it is still coming, or (its header read) when it is
        longer than ``stop_past`` bytes: its body is left for ``finish``. EOFError: the other end
        closed; FrameError: a length no message of this protocol has."""
        return self._advance(stop_past)

    def _receive_now(self, size: int) -> bytes | None:
        try:
            return self._socket.recv(size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None

    def _advance(self, stop_past: int | None) -> bytearray | None:
        while True:
            if len(self._buffer) < self._wanted:
                if stop_past is not None and not self._in_header and self._wanted > stop_past:
                    return None
                chunk = self._receive_now(min(self._wanted - len(self._buffer), READ_CHUNK_BYTES))
                if chunk is None:
                    return None
                if not chunk:
                    raise EOFError("the worker's end of the pipe closed")
                self._buffer += chunk
                continue
            if not self._in_header:
                message, self._buffer = self._buffer, bytearray()  # the caller's now: not copied again
                self._wanted, self._in_header = 4, True
                return message
            (size,) = struct.unpack("!i", self._buffer[:4])
            if size == -1:
                if self._wanted == 4:
                    self._wanted = 12
                    continue
                (size,) = struct.unpack("!Q", self._buffer[4:12])
            if not 0 <= size <= MAX_MESSAGE_BYTES:
                raise FrameError(f"a message of {size} bytes announced on the pipe")
            self._buffer.clear()
            self._wanted, self._in_header = size, False
