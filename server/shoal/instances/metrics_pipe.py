"""A Python process instance's custom metrics: the worker's calls and the server's answers, on a pipe
of their own (``pb_utils.MetricFamily`` and ``Metric``; the registry is ``shoal.custom_metrics``).

Triton's stub sends each metric operation to its server and waits for the answer; so does a worker,
on a pipe beside its batches' (made with each worker, ``PythonProcessModel._start``), answered by a
server thread of its own whatever the batch pipe is doing: a model may count in ``initialize``,
in ``execute``, in ``finalize`` or on a thread of its own between batches. A ``Metric`` collected in
the worker gives its hold back with the worker's next call (a collection may run in the middle of a
call, on the calling thread); the worker's end gives back every hold it still had.
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
RELEASE = "release"  # a hold given back: not answered


class PipeMetrics:
    """In a worker: the model's metric operations, each sent to the server and its answer awaited."""

    def __init__(self, conn: Any, instance_name: str) -> None:
        self._conn, self.instance_name = conn, instance_name
        self._lock = threading.Lock()  # one call at a time: the model's threads share the pipe
        self._released: collections.deque[int] = collections.deque()

    def _call(self, operation: str, *args: Any) -> Any:
        with self._lock:
            while self._released:
                self._conn.send((RELEASE, (self._released.popleft(),)))
            self._conn.send((operation, args))
            answered, result = self._conn.recv()
        if not answered:
            raise CustomMetricError(result)
        return result

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

    def release(self, series_id: int) -> None:
        self._released.append(series_id)  # sent with the next call (see the module's docstring)


def serve(conn: Any, registry: CustomMetrics, worker: str) -> None:
    """On a server thread: answer one worker's metric calls until its end of the pipe closes, then give
    back the holds it still had. A call it may not make ends the conversation (its model is refused
    nothing else: the worker's next call finds the pipe closed)."""
    held: collections.Counter[int] = collections.Counter()
    try:
        while True:
            message = conn.recv()
            if not (isinstance(message, tuple) and len(message) == 2 and isinstance(message[1], tuple)):
                logger.error("%s sent the metrics registry a message no worker sends; its pipe is closed", worker)
                return
            operation, args = message
            if operation == RELEASE:
                if args and held[args[0]] > 0:
                    held[args[0]] -= 1
                    registry.release(args[0])
                continue
            if operation not in OPERATIONS:
                logger.error("%s asked the metrics registry for %r; its metrics pipe is closed", worker, operation)
                return
            try:
                result = getattr(registry, operation)(*args)
            except CustomMetricError as exc:
                conn.send((False, str(exc)))
                continue
            except (TypeError, ValueError) as exc:  # arguments no model's pb_utils sends
                conn.send((False, f"{type(exc).__name__}: {exc}"))
                continue
            if operation == "metric":
                held[result] += 1
            conn.send((True, result))
    except (EOFError, OSError):
        pass  # the worker ended
    finally:
        conn.close()
        registry.release_all(held.elements())
