"""Executors over one loaded model per device.

Each instance is one thread that runs batches on the shared ``LoadedModel`` of its device (the
scheduler's ``Executor``): ``count: 4`` gives four concurrent executions and one copy of the weights.
Execution never happens on the event loop; the scheduler decides what runs where.

Whatever a call raises on an instance thread goes to its caller as an ``Exception``: a
``BaseException`` that is none (SystemExit, KeyboardInterrupt, asyncio.CancelledError,
GeneratorExit) comes from the model's code, never from the event loop's own cancellation, so it
arrives wrapped in ``RaisedOnInstance`` and fails that batch like any backend error; unwrapped it
would stop the server's loop, or read as a request the client cancelled.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from shoal.backends.base import FeedModel, LoadedModel, RequestModel
from shoal.backends.devices import Device, usable_cores
from shoal.errors import ShoalError
from shoal.repository.config import RateLimiterSpec
from shoal.scheduling.base import Executed, Outputs, QueuedRequest
from shoal.scheduling.batching import execute_as_one_feed
from shoal.statistics import Phases

logger = logging.getLogger(__name__)
Call = tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]]


class RaisedOnInstance(Exception):
    """A call on an instance thread raised a BaseException that is no Exception (its ``__cause__``)."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(f"{type(raised).__name__}: {raised}")
        self.__cause__ = raised


def _for_caller(exc: BaseException) -> Exception:
    return exc if isinstance(exc, Exception) else RaisedOnInstance(exc)


class InstanceThread:
    """An executor's own thread: runs calls one at a time, in order, and answers each on its event loop.

    The hop costs one queue put and one ``call_soon_threadsafe`` per batch: no
    ``concurrent.futures.Future`` chained to an asyncio one (``ThreadPoolExecutor.submit`` plus
    ``asyncio.wrap_future`` took twice the event loop's time, bench/request_path.py).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._stopped = False
        self._stopping = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Queue ``function(*args)``; the future, of the running loop, gets its result or exception."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.run_into(future, function, *args)
        return future

    def run_into(self, future: asyncio.Future[Any], function: Callable[..., Any], *args: Any) -> None:
        """Run ``function(*args)`` here; ``future`` (of the running loop) gets its outcome, unless it
        was cancelled before the call started. After ``shutdown`` the call runs on a thread of its own:
        one may hold what only it releases (a worker's conversation taken over from the event loop)."""
        call = (asyncio.get_running_loop(), future, function, args)
        with self._stopping:  # a call is queued before the end, or runs on a thread of its own: never lost
            if not self._stopped:
                self._calls.put(call)
                return
        threading.Thread(target=_run_call, args=(call,), name=self._thread.name, daemon=True).start()

    def shutdown(self, wait: bool = True) -> None:
        """Finish the calls queued so far, then end the thread. A later call runs on a thread of its own."""
        with self._stopping:
            self._stopped = True
            self._calls.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            _run_call(call)
            del call


def _run_call(call: Call) -> None:
    loop, future, function, args = call
    del call
    if future.cancelled():  # its caller gave up before it started
        return
    try:
        result, error = function(*args), None
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor does
        result, error = None, _for_caller(exc)
    try:
        loop.call_soon_threadsafe(settle, future, result, error)
    except RuntimeError:  # the loop is closed: nobody waits for the answer
        pass


def settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Give ``future`` its outcome, unless its caller gave up on it (cancelled) meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class OnLoop(abc.ABC):
    """A request model whose batches the event loop can carry itself (``instances.python_process``):
    sending a batch to a worker process and reading its answer need no thread of the server, and each
    thread a batch passes through costs a wake-up of it."""

    @abc.abstractmethod
    def start_on_loop(self, batch: Sequence[QueuedRequest]) -> asyncio.Future[Any] | None:
        """The batch's outcome to come, its conversation under way; None: run it on the instance's
        thread as usual (``run_requests``)."""


@dataclass
class Instance:
    """One executor: a name, its device, the shared model and its own thread."""

    name: str
    device: Device
    model: LoadedModel
    thread: InstanceThread

    async def execute(self, batch: Sequence[QueuedRequest]) -> Executed:
        """The batch on this instance's thread: as its list of requests to a model that runs them so (the
        Python backend), else as one feed (``batching.execute_as_one_feed``). A model in a worker process
        may hold the batch's conversation on the event loop instead (``OnLoop``), handing it to the
        thread only when it needs one."""
        model = self.model
        if not model.runs_requests:
            return await execute_as_one_feed(self._run_feed, batch)
        start = time.monotonic_ns()
        running = model.start_on_loop(batch) if isinstance(model, OnLoop) else None
        if running is None:
            running = self.thread.submit(cast(RequestModel, model).run_requests, batch)
        results: list[Outputs | ShoalError] = await running
        return Executed(results, Phases(0, time.monotonic_ns() - start, 0))

    async def _run_feed(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = await self.thread.submit(cast(FeedModel, self.model).run, inputs, outputs)
        return result


class InstancePool:
    """The scheduler's ``Runner``: hands out free instances, first come, first served.

    ``shared_copies`` are loaded copies the instances reach without holding them (process
    instances attach to their weights); the pool closes them after the instances, so closing the
    pool frees everything the version loaded.
    """

    def __init__(self, instances: list[Instance], shared_copies: Sequence[LoadedModel] = ()) -> None:
        if not instances:
            raise ValueError("an instance pool needs at least one instance")
        self.instances = instances
        self.shared_copies = tuple(shared_copies)
        self._free: asyncio.Queue[Instance] | None = None

    def _queue(self) -> asyncio.Queue[Instance]:
        # Created lazily, inside the serving event loop.
        if self._free is None:
            self._free = asyncio.Queue()
            for instance in self.instances:
                self._free.put_nowait(instance)
        return self._free

    async def acquire(self) -> Instance:
        return await self._queue().get()

    def release(self, executor: Instance) -> None:
        self._queue().put_nowait(executor)

    def can_serve(self) -> bool:
        """At least one instance can take a request (a process instance whose worker is dead or hung cannot)."""
        return any(getattr(instance.model, "healthy", True) for instance in self.instances)

    def models(self) -> list[LoadedModel]:
        """The distinct models the instances run (one per copy, or one per worker process)."""
        return list({id(i.model): i.model for i in self.instances}.values())

    def close(self) -> None:
        """Each instance's model, then the shared weights; one that fails to close (logged) leaves the
        others to close: a worker left running, or weights never freed, would outlive the unload."""
        for instance in self.instances:
            instance.thread.shutdown(wait=True)
        names = {id(instance.model): f"instance {instance.name}" for instance in self.instances}
        for closable in [*self.models(), *self.shared_copies]:
            try:
                closable.close()
            except Exception:  # noqa: BLE001 - whatever its teardown raised, the next one still closes
                logger.exception("%s: it failed to close", names.get(id(closable), "a shared copy of the weights"))


@dataclass(frozen=True)
class Placement:
    """``count`` executors of instance group ``group`` on ``device``, with the group's ``rate_limiter``."""

    group: str
    device: Device
    count: int
    rate_limiter: RateLimiterSpec = RateLimiterSpec()


def instance_name(placement: Placement, index: int) -> str:
    """The name of executor ``index`` of ``placement`` (what statistics and a Python model's args show)."""
    device = placement.device
    return f"{placement.group}_{index}" + ("" if device.kind == "cpu" else f"_gpu{device.index}")


LoadCopy = Callable[[Device, int], LoadedModel]  # (device, threads for this copy) -> one loaded copy


def build_pool(model_name: str, placements: list[Placement], load: LoadCopy, share_weights: bool) -> InstancePool:
    """Create the executors; one copy of the weights per device, or one per executor if not sharing.

    Threads: every executor's own thread computes too, so each copy gets the cores this process may
    use (``usable_cores``: affinity and CPU quota) divided by its executors (at least 1), and N
    concurrent executions never oversubscribe the machine. bench/ort_sharing.py measured one shared
    ONNX Runtime session against N sessions sharing initializers: same memory and throughput within
    5%, so the simpler one is kept.
    """
    cores = usable_cores()
    per_device: dict[Device, int] = {}
    for placement in placements:
        per_device[placement.device] = per_device.get(placement.device, 0) + placement.count
    shared: dict[Device, LoadedModel] = {}
    instances: list[Instance] = []
    try:
        for placement in placements:
            device = placement.device
            for index in range(placement.count):
                threads = max(1, cores // per_device[device])
                if share_weights:
                    if device not in shared:
                        shared[device] = load(device, threads)
                    model = shared[device]
                else:
                    model = load(device, threads)
                name = instance_name(placement, index)
                thread = InstanceThread(f"{model_name}:{name}")
                instances.append(Instance(name, device, model, thread))
    except BaseException:
        for model in {id(m): m for m in [*shared.values(), *(i.model for i in instances)]}.values():
            model.close()
        for instance in instances:
            instance.thread.shutdown(wait=False)
        raise
    return InstancePool(instances)
