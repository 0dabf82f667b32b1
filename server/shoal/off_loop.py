"""When work leaves the serving event loop: the thresholds every layer uses, in one place.

Work on the loop stalls every other request it serves; handing it to a worker thread
(``asyncio.to_thread``) costs tens of µs. So work goes off the loop only past a size where it costs
more than that: ~1 MiB of tensor data (a copy, a hash, a region read: ~2 ms a MiB here) or ~16k
elements that cost Python work each (BYTES elements encoded or decoded, JSON values, a classified
output's elements). Compression costs more per byte, so it leaves the loop sooner.
"""

from __future__ import annotations

OFF_LOOP_BYTES = 1 << 20  # bytes of tensor data copied, hashed, read or written
OFF_LOOP_ELEMENTS = 16_384  # elements that cost Python work each
OFF_LOOP_COMPRESS_BYTES = 16 << 10  # bytes of an HTTP body to compress or inflate


def costly(data_bytes: int = 0, elements: int = 0) -> bool:
    """Whether work over ``data_bytes`` of data or ``elements`` Python-costly elements should leave the loop."""
    return data_bytes > OFF_LOOP_BYTES or elements > OFF_LOOP_ELEMENTS
