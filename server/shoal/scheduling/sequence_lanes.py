"""The sequence batcher's lanes: one per instance, running that instance's slots (see ``sequence.py``).

``DirectLane`` (Triton's DirectSequenceBatch): one batch at a time on its instance. A batch holds
rows 0..*k*, row *i* the next request of slot *i*, *k* the highest slot with a request ready; a
slot with none, or whose request's shapes (or its sequence's state's, where a state has variable
dims) differ from the batch's, is a null row (a copy of another row with READY false and CORRID 0)
whose outputs are dropped. With
``max_queue_delay_microseconds`` and ``minimum_slot_utilization`` set, a batch waits until enough
slots are ready or the oldest request has waited the delay.

``OldestLane`` (Triton's OldestSequenceBatch): each slot sends its next request, once the previous
one is done, to a dynamic batcher over this instance alone (``preferred_batch_size``,
``max_queue_delay_microseconds``, ``preserve_ordering``), which batches the oldest ready ones.

Both fill the control inputs (shape ``[1]``, ``[rows, 1]`` when batching) and the implicit state
inputs, and keep each row's state output for the sequence's next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shoal.errors import ErrorCode, ShoalError
from shoal.repository.config import DynamicBatching
from shoal.repository.sequence_config import Control, ControlKind, SequenceBatching
from shoal.scheduling.base import Executor, checked
from shoal.scheduling.dynamic import Scheduler
from shoal.scheduling.rate_limiter import Admission
from shoal.scheduling.sequence_slots import RELEASE, Outputs, SequenceRequest, Slot
from shoal.statistics import ALSO_COUNT_PHASES, TRACED, FailureReason, ModelStatistics, Phases

logger = logging.getLogger(__name__)

Row = tuple[Slot, SequenceRequest | None]  # None: a null row


class Owner(Protocol):
    statistics: ModelStatistics
    batching: SequenceBatching
    max_batch_size: int
    admission: Admission | None

    def release(self, slot: Slot) -> None: ...

    def fail(self, request: SequenceRequest, error: BaseException, reason: FailureReason) -> None: ...


class Lane(Protocol):
    @property
    def queued(self) -> int:
        """Requests the lane took from its slots that have not started executing (the rate limiter's wait)."""
        ...

    def wake(self, slot: Slot) -> None: ...

    async def stop(self) -> None: ...


def make_lane(owner: Owner, executor: Executor, slots: list[Slot]) -> Lane:
    if owner.batching.strategy == "oldest":
        return OldestLane(owner, executor, slots)
    return DirectLane(owner, executor, slots)


# -- feeds ----------------------------------------------------------------------------------------


def _control_value(control: Control, request: SequenceRequest | None) -> object:
    if control.kind is ControlKind.CORRID:
        # The id's kind is the control's (the scheduler refuses the other: _check_id_kind). A null row's is
        # the one value no sequence has: 0, or for TYPE_STRING the empty string (Triton copies id 0 there
        # as a string of length 0), never "0", which a sequence may be.
        if request is None:
            return b"" if control.datatype.value == "BYTES" else 0
        cid = request.correlation_id
        return str(cid).encode() if control.datatype.value == "BYTES" else cid
    if request is None:  # a null row: not ready, neither start nor end
        return control.false_value
    on = {ControlKind.START: request.start, ControlKind.END: request.end, ControlKind.READY: True}[control.kind]
    return control.true_value if on else control.false_value


def _control_array(control: Control, rows: Sequence[SequenceRequest | None], batched: bool) -> np.ndarray:
    values = [_control_value(control, request) for request in rows]
    if control.datatype.value == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
    elif control.kind is ControlKind.CORRID:  # ids wrap into the tensor's type, as Triton's memcpy does
        array = np.array(values, dtype=np.uint64).astype(control.datatype.numpy_dtype)
    else:
        array = np.array(values, dtype=control.datatype.numpy_dtype)
    return array.reshape(len(values), 1) if batched else array.reshape(1)


def row_states(batching: SequenceBatching, slot: Slot, request: SequenceRequest) -> dict[str, np.ndarray]:
    """The state a request runs with: its sequence's last, or the initial one where it starts."""
    states = slot.states
    if request.start or states is None:
        states = slot.states = {state.input_name: state.start_value() for state in batching.states}
    return states


def build_feed(owner: Owner, rows: Sequence[Row], states: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The batch's inputs: the requests' own, then control inputs and state inputs, row by row."""
    batched = owner.max_batch_size > 0
    representative = next(request for _, request in rows if request is not None)
    requests = [request for _, request in rows]
    feed: dict[str, np.ndarray] = {}
    for name, value in representative.feed.items():
        parts = [value if request is None else request.feed[name] for request in requests]
        feed[name] = np.concatenate(parts, axis=0) if batched and len(parts) > 1 else parts[0]
    for control in owner.batching.controls:
        feed[control.name] = _control_array(control, requests, batched)
    for state in owner.batching.states:
        values = [row[state.input_name] for row in states]
        feed[state.input_name] = np.stack(values) if batched else values[0]
    return feed


def _keep_state(owner: Owner, slot: Slot, results: dict[str, np.ndarray], row: int | None) -> None:
    """The sequence's next state: always a copy it owns. A model's state output can be a view of
    memory the request owned (its input passed through, in a front-end worker's arena or a client's
    region) or of a buffer the model reuses; the state outlives the request, so it holds neither."""
    if not owner.batching.states:
        return
    slot.states = {
        state.input_name: np.array(
            results[state.output_name] if row is None else results[state.output_name][row],
            dtype=state.datatype.numpy_dtype,
        )
        for state in owner.batching.states
    }


def _check_results(results: dict[str, np.ndarray], wanted: Sequence[str], rows: int | None) -> None:
    """Every wanted output with ``rows`` rows when batching (None: not batching); that each is there at
    all, the executor's adapter checked (``batching.execute_as_one_feed``)."""
    for name in wanted:
        shape = np.shape(results[name])
        if rows is not None and (not shape or shape[0] != rows):
            raise ShoalError(ErrorCode.INTERNAL, f"output '{name}' has shape {list(shape)}, not a batch of {rows} rows")


def _wanted(owner: Owner, requests: Sequence[SequenceRequest]) -> list[str]:
    names = dict.fromkeys(name for request in requests for name in request.outputs)
    names.update(dict.fromkeys(state.output_name for state in owner.batching.states))
    return list(names)


# -- direct ---------------------------------------------------------------------------------------


class DirectLane:
    def __init__(self, owner: Owner, executor: Executor, slots: list[Slot]) -> None:
        self.owner = owner
        self.executor = executor
        self.slots = slots
        self.delay_ns = owner.batching.max_queue_delay_us * 1000
        self.utilization = owner.batching.minimum_slot_utilization
        self.variable_states = any(-1 in state.dims for state in owner.batching.states)
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.queued = 0  # rows taken that wait for the rate limiter

    def wake(self, slot: Slot) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sequence-direct")
        self._ready.set()

    async def _run(self) -> None:
        while True:
            self._ready.clear()
            rows, wait_s = self._take()
            if rows:
                await self._execute(rows)
                continue
            if self.owner.admission is not None:  # it stages nothing now: the limiter need not wait for it
                self.owner.admission.limiter.settle(self.owner.admission)
            if self._stopping:
                return
            try:
                await asyncio.wait_for(self._ready.wait(), wait_s)
            except TimeoutError:
                pass

    def _settle_fronts(self) -> None:
        """Release slots whose sequence ended (RELEASE) and drop requests their clients gave up."""
        for slot in self.slots:
            while slot.queue and (slot.queue[0] is RELEASE or slot.queue[0].future.done()):
                front = slot.queue.popleft()
                if front is RELEASE or front.end:
                    self.owner.release(slot)

    def _take(self) -> tuple[list[Row], float | None]:
        """The next batch's rows, or none and how long to wait (None: until a request arrives)."""
        self._settle_fronts()
        ready = [slot for slot in self.slots if slot.queue]
        if not ready:
            return [], None
        fronts = [slot.queue[0] for slot in ready]
        if self.delay_ns and self.utilization:
            age = time.monotonic_ns() - min(r.arrival_ns for r in fronts if r is not None)
            if age < self.delay_ns and len(ready) / max(1, self.owner.max_batch_size) < self.utilization:
                return [], (self.delay_ns - age) / 1e9
        representative = fronts[0]
        assert representative is not None
        shape = self._shape(ready[0], representative)
        rows: list[Row] = []
        for slot in self.slots[: ready[-1].index + 1]:
            front = slot.queue[0] if slot.queue else None
            if front is not None and self._shape(slot, front) == shape:
                slot.queue.popleft()
                front.taken = True
                rows.append((slot, front))
            else:
                rows.append((slot, None))
        return rows, None

    def _shape(self, slot: Slot, request: SequenceRequest) -> tuple[object, ...]:
        """What must be equal for rows to share a batch: the request's input shapes and, for states with
        variable dims, the shapes of the state the row would run with (sequences' states grow apart)."""
        if not self.variable_states:
            return request.signature
        if request.start or slot.states is None:
            states = tuple(np.shape(state.start_value()) for state in self.owner.batching.states)
        else:
            states = tuple(np.shape(slot.states[state.input_name]) for state in self.owner.batching.states)
        return request.signature, states

    async def _execute(self, rows: list[Row]) -> None:
        admission = self.owner.admission
        if admission is None:
            await self._execute_admitted(rows)
            return
        claim = admission.claim_of(self.executor)
        self.queued = sum(1 for _, request in rows if request is not None)
        try:
            await admission.limiter.acquire(claim)  # before the clock starts: queue time, as Triton counts it
        finally:
            self.queued = 0
        try:
            await self._execute_admitted(rows)
        finally:  # a lane with more to run stages again at once: _run takes the next rows now
            admission.limiter.release(claim, more=any(slot.queue for slot in self.slots) and not self._stopping)

    async def _execute_admitted(self, rows: list[Row]) -> None:
        owner = self.owner
        real = [(slot, request) for slot, request in rows if request is not None]
        start = time.monotonic_ns()
        try:  # whatever fails here fails this batch's requests only: the lane must go on serving its slots
            states = {id(slot): row_states(owner.batching, slot, request) for slot, request in real}
            fallback = next(iter(states.values()), {})
            feed = build_feed(owner, rows, [states.get(id(slot), fallback) for slot, _ in rows])
            gathered = time.monotonic_ns()
            # The slots' rows, states and controls are one request to the executor: the lane built its feed.
            wanted = tuple(_wanted(owner, [r for _, r in real]))
            executed = await self.executor.execute([_Rows(feed, wanted, len(rows))])
            returned = time.monotonic_ns()
            (results,) = executed.results
            if isinstance(results, ShoalError):
                raise results
            parts = self._split(rows, results, wanted)
        except Exception as exc:  # noqa: BLE001 - fails this batch's requests only
            if not isinstance(exc, ShoalError):
                logger.error("a sequence batch of %d row(s) failed", len(rows), exc_info=exc)
            for slot, request in real:
                owner.fail(request, exc, FailureReason.BACKEND)
                if request.end:
                    owner.release(slot)
            return
        done = time.monotonic_ns()
        ran = executed.phases  # the lane's own gathering counts as input time, its split as output time
        phases = Phases(gathered - start + ran.input_ns, ran.infer_ns, ran.output_ns + done - returned)
        owner.statistics.record_execution(len(rows), phases, inferences=len(parts))
        for slot, request, part in parts:
            outcome = checked(request.check, part)
            if isinstance(outcome, ShoalError):
                owner.fail(request, outcome, FailureReason.BACKEND)
            else:
                owner.statistics.record_success(done - request.arrival_ns, start - request.arrival_ns, phases)
                if request.also_count is not None:
                    request.also_count.add(phases)
                if request.traced is not None:
                    request.traced.executed(request.arrival_ns, start, phases, outcome)
                if not request.future.done():
                    request.future.set_result(outcome)
            if request.end:
                owner.release(slot)

    def _split(
        self, rows: list[Row], results: dict[str, np.ndarray], wanted: Sequence[str]
    ) -> list[tuple[Slot, SequenceRequest, Outputs]]:
        """Each real row's outputs, with its state kept for its sequence's next request; INTERNAL where the
        model did not answer one row per batch row (as the dynamic batcher's ``scatter``)."""
        owner = self.owner
        batched = owner.max_batch_size > 0
        _check_results(results, wanted, len(rows) if batched else None)
        parts = []
        for position, (slot, row) in enumerate(rows):
            if row is None:
                continue
            _keep_state(owner, slot, results, position if batched else None)
            part = {name: results[name][position : position + 1] if batched else results[name] for name in row.outputs}
            parts.append((slot, row, part))
        return parts

    async def stop(self) -> None:
        self._stopping = True
        self._ready.set()
        if self._task is not None:
            await self._task


@dataclass(frozen=True)
class _Rows:
    """A direct lane's batch as the one request its executor runs (``scheduling.base.QueuedRequest``)."""

    feed: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    size: int
    context: Any = None


# -- oldest ---------------------------------------------------------------------------------------


class _OneExecutor:
    """A runner of one executor: the oldest strategy's dynamic batcher runs on its own instance only."""

    def __init__(self, executor: Executor) -> None:
        self._free: asyncio.Queue[Executor] = asyncio.Queue()
        self._free.put_nowait(executor)

    async def acquire(self) -> Executor:
        return await self._free.get()

    def release(self, executor: Executor) -> None:
        self._free.put_nowait(executor)


class OldestLane:
    def __init__(self, owner: Owner, executor: Executor, slots: list[Slot]) -> None:
        self.owner = owner
        batching = owner.batching
        dynamic = DynamicBatching(
            preferred_batch_sizes=batching.preferred_batch_sizes,
            max_queue_delay_us=batching.max_queue_delay_us,
            preserve_ordering=batching.preserve_ordering,
        )
        self._batcher = Scheduler(
            _OneExecutor(executor), owner.statistics, owner.max_batch_size, dynamic, owner.admission
        )
        self._in_flight: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def queued(self) -> int:
        """Requests handed to this lane's batcher that have not started executing."""
        return self._batcher.queued

    def wake(self, slot: Slot) -> None:
        """Send the slot's next request unless one of its requests is in flight."""
        while slot.queue and slot.index not in self._in_flight:
            front = slot.queue.popleft()
            if front is RELEASE or front.future.done():
                if front is RELEASE or front.end:
                    self.owner.release(slot)  # may move a backlogged sequence in, and wake this slot again
                continue
            self._in_flight.add(slot.index)
            front.taken = True
            task = asyncio.create_task(self._run_one(slot, front))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_one(self, slot: Slot, request: SequenceRequest) -> None:
        owner = self.owner
        # This task runs in the context of whichever request woke the slot: the dynamic batcher must add
        # the phases to this request's caller (an ensemble's totals), not to that one's.
        ALSO_COUNT_PHASES.set(request.also_count)
        TRACED.set(request.traced)
        try:
            states = row_states(owner.batching, slot, request)
            feed = build_feed(owner, [(slot, request)], [states])
            batch_size = 1 if owner.max_batch_size > 0 else 0
            wanted = _wanted(owner, [request])
            check = request.check
            results = await self._batcher.submit(  # the request's outputs checked there; its states kept too
                feed,
                wanted,
                batch_size,
                {},
                context=request.context,
                check=None if check is None else lambda part: {**part, **check(part)},
            )
            _check_results(results, wanted, batch_size or None)
            _keep_state(owner, slot, results, 0 if owner.max_batch_size > 0 else None)
        except Exception as exc:  # noqa: BLE001 - counted by the dynamic batcher; answered here
            if not request.future.done():
                request.future.set_exception(exc)
        else:
            if not request.future.done():
                request.future.set_result({name: results[name] for name in request.outputs})
        finally:
            self._in_flight.discard(slot.index)
            if request.end:
                owner.release(slot)
            self.wake(slot)

    async def stop(self) -> None:
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._batcher.stop()
