"""The asyncio event loop each serving process runs: uvloop's where it is installed, asyncio's otherwise.

Every request crosses the event loop of the process that serves it (the host, or a front-end worker):
its socket reads and writes (HTTP, the front-end workers' channel), its tasks, its hand-offs from the
instance threads (``call_soon_threadsafe``) and the batcher's timerfd. uvloop runs that loop in C on
libuv, and asyncio's in Python: measured in one run here (``python bench/event_loops.py``,
docs/benchmarks.md), uvloop serves HTTP with less CPU per request, and a Python model on a thread
instance with fewer wake-ups. Nothing in Shoal depends on the loop's kind: transports, ``add_reader``
(the batcher's clock, the Python process instances' pipes), signals and ``to_thread`` are asyncio's
interface, which uvloop implements.

``--event-loop auto`` (the default) takes uvloop where it imports (it has no Windows build) and says
which loop serves in the start-up log; ``asyncio`` is the way back when a loop-specific fault is
suspected. A Python model's own loop (an ``async def execute``, ``backends/python/runner.py``) stays
asyncio's: model code written for Triton's Python backend runs on asyncio's loop there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shoal.errors import StartupError

CHOICES = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def resolve(choice: str) -> str:
    """``uvloop`` or ``asyncio``: what ``choice`` serves on here; StartupError when uvloop is asked for
    and does not import."""
    if choice not in CHOICES:
        raise StartupError(f"--event-loop {choice}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return choice
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:
        if choice == "uvloop":
            raise StartupError(f"--event-loop uvloop: uvloop does not import here ({exc})") from None
        return "asyncio"
    return "uvloop"


def _factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: str) -> T:
    """``asyncio.run(main)`` on a new loop of ``kind`` (a ``resolve`` result)."""
    with asyncio.Runner(loop_factory=_factory(kind)) as runner:
        return runner.run(main)
