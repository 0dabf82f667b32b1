"""Where loads and unloads run: on threads of their own, and to their end whoever gave up waiting.

A model's ``initialize`` and ``finalize`` (and a backend's load) are the model's code: they may take
as long as they like, or never end. Two rules keep that from reaching anything else:

- **Threads of their own** (``in_thread``). asyncio's default executor (cores + 4 threads) also
  converts large requests and responses, reads clients' shared memory and the response cache: with
  a few models stuck in ``initialize`` or ``finalize`` holding its threads, every large request of
  every model waited behind them (found by the review of session 47).
- **Run to the end** (``to_the_end``). A client's deadline cancels its RPC's handler; a load or
  unload cancelled with it let go of its model's lock while its thread went on building, so a
  retry built the model again beside it, and what the abandoned build made was never served nor
  closed: instances and worker processes leaked for good. Triton finishes a load or unload whose
  client left; so does Shoal: the caller's wait is cancelled, not the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shoal.errors import ShoalError
from shoal.instances.pool import settle

logger = logging.getLogger(__name__)

T = TypeVar("T")

_unattended: set[asyncio.Task[Any]] = set()  # work whose caller gave up, held until it ends


async def in_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a thread of its own, in this context's variables (as ``asyncio.to_thread``).
    A daemon thread, made per call (loads are few): a model stuck in ``initialize`` or ``finalize``
    never holds another load, a request, or the server's exit (an executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            result, error = context.run(function, *args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor does
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed (the server stopped): nobody waits for it
            loop.call_soon_threadsafe(settle, future, result, error)

    threading.Thread(target=run, name=f"shoal-model-{getattr(function, '__name__', 'work')}", daemon=True).start()
    return await future


async def to_the_end(work: Coroutine[Any, Any, T] | asyncio.Future[T], what: str) -> T:
    """``work``'s result; if the caller is cancelled meanwhile, ``work`` goes on to its end anyway
    (``what`` names it in the log if it then fails unexpectedly: a load's refusal is logged where it
    is made)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _unattended.add(task)
        task.add_done_callback(functools.partial(_ended_unattended, what))
        raise


def _ended_unattended(what: str, task: asyncio.Task[Any]) -> None:
    _unattended.discard(task)
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, ShoalError):
        logger.warning("%s, whose caller stopped waiting, failed: %s: %s", what, type(error).__name__, error)
