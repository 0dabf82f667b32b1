"""A served version's requests in flight: a closing version serves what entered it before it stops."""

from __future__ import annotations

import asyncio


class InFlight:
    """The requests inside a served version, from the start of its ``infer`` (some wait before they are
    queued: a large request's cache lookup, an ensemble's steps). A closing version waits until none is
    left (``drained``) before it stops: what entered it is served. ``with in_flight:`` counts one."""

    def __init__(self) -> None:
        self.count = 0
        self._none_left: asyncio.Event | None = None

    def __enter__(self) -> None:  # a method pair, not a generator per request: it is on every request's path
        self.count += 1

    def __exit__(self, *exc_info: object) -> None:
        self.count -= 1
        if not self.count and self._none_left is not None:
            self._none_left.set()

    async def drained(self) -> None:
        if self.count:
            self._none_left = asyncio.Event()
            await self._none_left.wait()
