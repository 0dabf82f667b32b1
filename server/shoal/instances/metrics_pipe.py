"""A Python process instance's custom metrics: the worker's calls and the server's answers, on a pipe
of their own (``pb_utils.MetricFamily`` and ``Metric``; the registry is ``shoal.custom_metrics``).

Triton's stub sends each metric operation to its server and waits for the answer; so does a worker,
on a pipe beside its batches' (made with each worker, ``PythonProcessModel._start``), answered by a
server thread of its own whatever the batch pipe is doing: a model may count in ``initialize``,
in ``execute``, in ``finalize`` or on a thread of its own between batches. A ``MetricFamily``
collected in the worker gives its hold back at once, or when the call that has the pipe is over (a
collection may run in the middle of a call, on the calling thread); the worker's end gives back
every hold it still had. The
registry checks every argument (types, names, numbers): nothing a worker sends can break /metrics.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from shoal.custom_metrics import CustomMetricError, CustomMetrics

logger = logging.getLogger(__name__)

# What a worker may ask the registry: the name of each ``CustomMetrics`` method it calls.
OPERATIONS = frozenset({"family", "metric", "increment", "set", "observe", "value"})
RELEASE = "release"  # a family's hold given back: not answered


class PipeMetrics:
    """In a worker: the model's metric operations, each sent to the server and its answer awaited."""

    def __init__(self, conn: Any, instance_name: str) -> None:
        self._conn, self.instance_name = conn, instance_name
        self._lock = threading.Lock()  # one call at a time: the model's threads share the pipe
        self._released: collections.deque[str] = collections.deque()

    def _call(self, operation: str, *args: Any) -> Any:
        try:
            with self._lock:
                try:
                    self._conn.send((operation, args))
                    answered, result = self._conn.recv()
                finally:
                    self._send_released()
        except (EOFError, OSError) as exc:  # the server closed the pipe (it is stopping, or refused a message)
            raise CustomMetricError(f"the server's metrics pipe is closed ({type(exc).__name__})") from None
        self._release_if_free()  # one given back by another thread while this call held the pipe
        if not answered:
            raise CustomMetricError(result)
        return result

    def _send_released(self) -> None:
        """Lock held: the holds given back since the pipe was last free."""
        while self._released:
            self._conn.send((RELEASE, (self._released.popleft(),)))

    def _release_if_free(self) -> None:
        """Send what was given back, unless a call has the pipe (it sends them as it ends). Checked again
        once the lock is let go: one given back while this thread held it would otherwise wait."""
        while self._released and self._lock.acquire(blocking=False):
            try:
                self._send_released()
            except OSError:
                return  # the server went away: the worker ends
            finally:
                self._lock.release()

    def family(self, name: str, description: str, kind: int) -> None:
        self._call("family", name, description, kind)

    def metric(self, name: str, labels: dict[str, str], buckets: list[float] | None) -> int:
        series_id: int = self._call("metric", name, labels, buckets)
        return series_id

    def increment(self, series_id: int, value: float) -> None:
        self._call("increment", series_id, value)

    def set(self, series_id: int, value: float) -> None:
        self._call("set", series_id, value)

    def observe(self, series_id: int, value: float) -> None:
        self._call("observe", series_id, value)

    def value(self, series_id: int) -> float:
        found: float = self._call("value", series_id)
        return found

    def release(self, name: str) -> None:
        """A ``MetricFamily`` collected: sent now, or, if the pipe is busy (a call of this thread or
        another's, which a collection may interrupt), as soon as that call is over."""
        self._released.append(name)
        self._release_if_free()


def serve(conn: Any, registry: CustomMetrics, worker: str) -> None:
    """On a server thread: answer one worker's metric calls until its end of the pipe closes, then give
    back the holds it still had. A message no worker's ``PipeMetrics`` sends ends the conversation
    (its model's next metric call finds the pipe closed); a refused argument is answered as refused."""
    holder = object()  # this worker's holds, in the registry
    try:
        while True:
            message = conn.recv()
            if not (isinstance(message, tuple) and len(message) == 2 and isinstance(message[1], tuple)):
                logger.error("%s sent its metrics pipe a message no worker sends; the pipe is closed", worker)
                return
            operation, args = message
            if operation == RELEASE and len(args) == 1 and isinstance(args[0], str):
                registry.release(args[0], holder)
                continue
            if operation not in OPERATIONS:
                logger.error("%s asked the metrics registry for %r; its metrics pipe is closed", worker, operation)
                return
            try:
                result = None
                if operation == "family":
                    name, description, kind = args
                    registry.family(name, description, kind, holder)
                else:
                    result = getattr(registry, operation)(*args)
            except (CustomMetricError, TypeError, ValueError) as exc:
                conn.send((False, str(exc)))
                continue
            conn.send((True, result))
    except (EOFError, OSError):
        pass  # the worker ended
    except Exception:  # noqa: BLE001 - whatever else a worker's message makes of the registry: not the server's end
        logger.exception("%s: its metrics pipe failed; it is closed", worker)
    finally:
        conn.close()
        registry.release_holder(holder)
