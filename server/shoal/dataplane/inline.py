"""Small numeric tensors carried in a pipe's message itself, not in an arena.

An arena (``packing``) spares copies of large tensors, but for a small batch its bookkeeping costs
more than the bytes: slots, a view of the arena per tensor, the check that the model kept no view,
and on the way back the same again. For a Python process instance's batch of one FP32 [256] that
was ~45 of ~75 µs of Python per batch, hot (``bench/python_conversation.py`` measures the batch).
So when every tensor of a batch is numeric (bool, integers, floats, native byte order) and all of
them take at most ``INLINE_BYTES``, each travels as ``(dtype, shape, bytes)`` in the message, and
the reader makes an array of its own of it: writable, as a view of an arena is, and nobody else's
memory, so a model may keep it past its batch and nothing has to watch for that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

import numpy as np

INLINE_BYTES = 64 << 10  # the most bytes of tensor data a batch carries in its message, all feeds together
# One tensor in a message: its numpy dtype (``dtype.str``), its shape, its bytes in C order.
Inlined: TypeAlias = tuple[str, tuple[int, ...], bytes]
_NUMERIC_KINDS = frozenset("biuf")  # bool, signed and unsigned integers, floats: Triton's fixed-size datatypes


def inline_feeds(
    feeds: Sequence[Mapping[str, np.ndarray]], limit: int = INLINE_BYTES
) -> list[dict[str, Inlined]] | None:
    """Each feed's tensors as a message carries them, or None when any is not a numeric array of
    native byte order, or all together take more than ``limit`` bytes (they go in an arena then)."""
    total = 0
    found = []
    for feed in feeds:
        carried = {}
        for name, array in feed.items():
            if not isinstance(array, np.ndarray):
                return None
            dtype = array.dtype
            if dtype.kind not in _NUMERIC_KINDS or not dtype.isnative:
                return None
            total += array.nbytes
            if total > limit:
                return None
            carried[name] = (dtype.str, array.shape, array.tobytes())
        found.append(carried)
    return found


def arrays_of(carried: Mapping[str, Inlined]) -> dict[str, np.ndarray]:
    """The tensors of ``inline_feeds``' one feed, each a writable array of its own."""
    return {
        name: np.frombuffer(bytearray(data), dtype).reshape(shape) for name, (dtype, shape, data) in carried.items()
    }
