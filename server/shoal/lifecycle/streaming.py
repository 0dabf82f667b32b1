"""Requests whose responses stream: a decoupled model's zero or more responses, then FINAL.

A streaming request is an ``InferRequest`` whose ``sink`` is a ``ResponseSink``. It goes through the
model's scheduler like any request (queue, batching, statistics); the instance (a decoupled Python
model) puts each response into the sink as the model sends it, from whichever thread it runs on,
and the core reads them on the event loop. The scheduler's own answer to such a request carries
no outputs: it only says the execution ended.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from shoal.errors import ErrorCode, ShoalError

# One streamed item: outputs (name -> array) or an error, or None for a bare FINAL flag; and FINAL.
Streamed = tuple[dict[str, np.ndarray] | ShoalError | None, bool]


# Put into the sink's queue when the request's execution ended: after its FINAL flag, or instead of it.
ENDED = ShoalError(ErrorCode.INTERNAL, "the model's execution ended before it sent the FINAL flag")


class ResponseSink:
    """A streaming request's responses, put from any thread and read on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[Streamed] = asyncio.Queue()
        self._cancelled = threading.Event()

    def put(self, item: dict[str, np.ndarray] | ShoalError | None, final: bool) -> None:
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (item, final))
        except RuntimeError:  # the loop closed meanwhile: nobody reads this response any more
            pass

    @property
    def cancelled(self) -> bool:
        """The client gave up on the request (the model may read it as ``sender.is_cancelled()``)."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()
