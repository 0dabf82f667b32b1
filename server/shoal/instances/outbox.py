"""Messages to a worker process, written in order by a thread of their own.

The server's thread that serves a Python instance's batch must never stop reading the worker's
pipe. A BLS reply too big for the arena travels pickled on the pipe; if the worker is writing a big
BLS call of its own at that moment, it reads nothing until the server has read that call. Were the
server's thread writing its reply then, each side would wait for the other to read, for good (a
pipe holds a few hundred KiB; CI once hung so). So while a batch runs, what the server says goes
through an ``Outbox`` and the thread that owns the conversation only reads.

The outbox writes on a duplicate of the pipe's descriptor: when the worker is killed and replaced
meanwhile, the outbox's writes fail on the dead pipe (and are dropped) and can never reach the
new worker, whatever descriptor numbers the new pipe gets.
"""

from __future__ import annotations

import collections
import os
import threading
from multiprocessing import connection
from typing import Any

from shoal.instances.worker_pipe import pickled

_CLOSE = object()


class Outbox:
    """Sends messages on a pipe, in order, from a daemon thread; ``wait_sent`` says when all went."""

    def __init__(self, conn: connection.Connection, name: str) -> None:
        self.target = conn  # the pipe it writes to (on a duplicate of its descriptor)
        self.error: BaseException | None = None  # why a message could not be sent, other than a dead pipe
        self._conn = connection.Connection(os.dup(conn.fileno()))
        self._queue: collections.deque[Any] = collections.deque()
        self._unsent = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        with self._changed:
            self._queue.append(message)
            self._unsent += 1
            self._changed.notify_all()

    def wait_sent(self, timeout_s: float) -> bool:
        """True once every message sent so far is written to the pipe (or dropped, the pipe being dead)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._unsent == 0, timeout_s)

    def close(self) -> None:
        """No more messages: the thread writes what is queued (or drops it on a dead pipe) and ends."""
        with self._changed:
            self._queue.append(_CLOSE)
            self._changed.notify_all()

    def _run(self) -> None:
        broken = False
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: bool(self._queue))
                    message = self._queue.popleft()
                if message is _CLOSE:
                    return
                try:
                    if not broken:
                        self._conn.send_bytes(pickled(message))
                except OSError:  # the worker is gone: whoever waits on it finds it dead
                    broken = True
                except BaseException as exc:  # noqa: BLE001 - e.g. MemoryError pickling a reply: the owner decides
                    broken, self.error = True, exc
                finally:
                    with self._changed:
                        self._unsent -= 1
                        self._changed.notify_all()
        finally:
            self._conn.close()
