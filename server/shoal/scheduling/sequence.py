"""Triton's sequence batcher: requests of one sequence go to one slot, in order, with control inputs and state.

One ``SequenceScheduler`` per model version (core src/sequence_batch_scheduler.cc). Each instance
(executor) has ``slots_per_instance`` sequence slots: the model's ``max_batch_size`` (at least 1), or
the oldest strategy's ``max_candidate_sequences``. A request carries its correlation id
(``sequence_id``, a uint64 or a string) and the ``sequence_start``/``sequence_end`` flags:

- a START without a slot takes the free slot with the lowest index, instance by instance, so
  sequences spread over the instances; with none free the sequence waits in the backlog, in order
  of arrival, and takes the next slot a sequence frees (its requests gather there meanwhile). A
  backlogged sequence whose request carries a ``timeout`` (µs) is refused when it runs out:
  UNAVAILABLE "timeout of the corresponding sequence has been expired", as Triton.
- a request of a sequence that holds a slot joins that slot's queue; END frees the slot once that
  request has run. A START for a sequence already running continues in its slot (Triton logs the
  conflict and the implicit state starts over).
- a sequence that sent nothing for ``max_sequence_idle_microseconds`` loses its slot (after what it
  queued has run); its next request fails as one that never started. It is released only if it is
  still idle ``IDLE_GRACE_NS`` after it was first found so: in one perf_analyzer run the event loop
  sat for a second until this timer woke it, with the sequences' next requests already sent, and
  released them all (not seen again since; the cause is not known).

The lanes (``sequence_lanes.py``) run each instance's slots: ``direct`` batches slot *i* into batch
row *i* (empty slots are "null" rows, READY false) and runs one batch at a time per instance;
``oldest`` sends each slot's next request, once the previous one is done, to a dynamic batcher of
its own instance. Control inputs and implicit state are filled in there, so a backend only sees
more inputs and outputs.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shoal.errors import ErrorCode, ShoalError, invalid
from shoal.protocol.types import DataType
from shoal.repository.sequence_config import ControlKind, SequenceBatching
from shoal.scheduling.base import Executor, OutputCheck
from shoal.scheduling.rate_limiter import Admission
from shoal.scheduling.sequence_lanes import Lane, make_lane
from shoal.scheduling.sequence_slots import RELEASE, Backlog, CorrelationId, Outputs, SequenceRequest, Slot
from shoal.statistics import FailureReason, ModelStatistics

logger = logging.getLogger(__name__)

UINT64_MASK = 2**64 - 1
IDLE_GRACE_NS = 50_000_000  # an idle sequence is released when it is still idle this long after it was found so


class InstanceRunner(Protocol):
    """What the sequence batcher needs from the instances: each executor by itself (slots belong to one)."""

    @property
    def instances(self) -> Sequence[Executor]: ...


@dataclass(frozen=True)
class Flags:
    correlation_id: CorrelationId
    start: bool
    end: bool
    timeout_us: int


class SequenceScheduler:
    def __init__(
        self,
        runner: InstanceRunner,
        statistics: ModelStatistics,
        max_batch_size: int,
        batching: SequenceBatching,
        model_name: str,
        admission: Admission | None = None,
    ) -> None:
        self.runner = runner
        self.admission = admission  # the rate limiter each execution passes, if it is on
        self.statistics = statistics
        self.max_batch_size = max_batch_size
        self.batching = batching
        self._corrid = batching.control(ControlKind.CORRID)  # looked up once: every request checks its id's kind
        self.model_name = model_name
        self.slots_per_instance = batching.slots_per_instance(max_batch_size)
        self._active: dict[CorrelationId, Slot] = {}
        self._backlogged: dict[CorrelationId, Backlog] = {}
        self._backlog: deque[Backlog] = deque()
        self._free: list[tuple[int, int]] = []  # (slot index, lane): the lowest index first
        self._slots: list[list[Slot]] = []
        self._last_seen: dict[CorrelationId, int] = {}
        # Found idle once, and when: released if still idle a grace period after that.
        self._suspects: dict[CorrelationId, int] = {}
        self._lanes: list[Lane] = []
        self._reaper: asyncio.TimerHandle | None = None
        self._reaper_at_ns: int | None = None
        self._stopping = False

    # -- submission ---------------------------------------------------------------------------------

    async def submit(
        self,
        feed: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        batch_size: int,
        parameters: Mapping[str, Any],
        context: Any = None,
        check: OutputCheck | None = None,
    ) -> Outputs:
        """Route one request to its sequence's slot (or the backlog) and wait for its outputs (through
        ``check``, if given). ``context``: the core request it came from, as the dynamic batcher takes it
        (the oldest strategy hands it on to its batcher; the direct lane runs its slots' rows as one feed)."""
        now = time.monotonic_ns()
        try:
            if self._stopping:
                raise ShoalError(
                    ErrorCode.UNAVAILABLE,
                    "Server is stopping, scheduler for model has stopped accepting new inference requests",
                )
            if batch_size > 1:
                raise invalid(
                    f"inference request to model '{self.model_name}' must specify batch-size 1 due to "
                    "requirements of sequence batcher"
                )
            flags = self._flags(parameters)
            self._check_id_kind(flags.correlation_id, context)
            self._check_started(flags)
        except ShoalError as exc:
            reason = FailureReason.REJECTED if exc.code is ErrorCode.UNAVAILABLE else FailureReason.OTHER
            self.statistics.record_failure(time.monotonic_ns() - now, reason)
            raise
        if not self._lanes:
            self._start_lanes()
        request = SequenceRequest(
            feed=feed,
            outputs=tuple(outputs),
            correlation_id=flags.correlation_id,
            start=flags.start,
            end=flags.end,
            arrival_ns=now,
            future=asyncio.get_running_loop().create_future(),
            signature=tuple((name, a.shape[1:] if batch_size else a.shape) for name, a in feed.items()),
            check=check,
            context=context,
        )
        self._route(request, flags.timeout_us)
        try:
            return await request.future
        except asyncio.CancelledError:
            # Cancelling this task cancelled the future too, so the lane skips it (and still honours its END).
            if not request.taken:  # the client gave up while it was queued
                self.statistics.record_failure(time.monotonic_ns() - now, FailureReason.CANCELED)
            request.future.cancel()
            raise

    def _flags(self, parameters: Mapping[str, Any]) -> Flags:
        """The sequence parameters, checked as Triton's front end and sequencer check them."""
        correlation_id = parameters.get("sequence_id", 0)
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, int | str):
            raise invalid("invalid value type for 'sequence_id' parameter, expected int64_param or string_param.")
        if isinstance(correlation_id, int):
            correlation_id &= UINT64_MASK  # Triton keeps a uint64; a client's int64 wraps
        if correlation_id in (0, ""):
            raise invalid(
                f"inference request to model '{self.model_name}' must specify a non-zero or non-empty correlation ID"
            )
        flags = []
        for key in ("sequence_start", "sequence_end"):
            value = parameters.get(key, False)
            if not isinstance(value, bool):
                raise invalid(f"invalid value type for '{key}' parameter, expected bool_param.")
            flags.append(value)
        timeout = parameters.get("timeout", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise invalid(f"request parameter 'timeout' must be a non-negative integer (µs), got {timeout!r}")
        return Flags(correlation_id, flags[0], flags[1], timeout)

    def _check_id_kind(self, correlation_id: CorrelationId, context: Any) -> None:
        """A string id for a model whose CORRID control takes integers, or an integer id for a TYPE_STRING
        one, is refused in the words of Triton from 25.01 (core's ``ValidateCorrelationId``). Triton 2.51
        fed the id's raw bytes instead; Shoal fed a string id as 0, so a model keying its own data on
        CORRID mixed every string-id sequence with the others (and a null row)."""
        control = self._corrid
        if control is None:
            return
        given = "BYTES" if isinstance(correlation_id, str) else "UINT64"
        if (given == "BYTES") == (control.datatype is DataType.BYTES):
            return
        request_id = getattr(context, "id", "") or "<id_unknown>"
        raise invalid(
            f"[request id: {request_id}] sequence batching control '{control.name}' data-type is '{given}', "
            f"but model '{self.model_name}' expects '{control.datatype.value}'"
        )

    def _check_started(self, flags: Flags) -> None:
        cid = flags.correlation_id
        if flags.start or cid in self._active or cid in self._backlogged:
            return
        logger.debug(
            "model %s: request for sequence %s without START, which holds no slot (%d sequences active, %d backlogged)",
            self.model_name,
            cid,
            len(self._active),
            len(self._backlogged),
        )
        raise invalid(
            f"inference request for sequence {cid} to model '{self.model_name}' must specify the START "
            "flag on the first request of the sequence"
        )

    def _route(self, request: SequenceRequest, timeout_us: int) -> None:
        """Triton's SequenceBatchScheduler::Enqueue: the sequence's slot, its backlog, a free slot, or a new backlog."""
        cid = request.correlation_id
        now = request.arrival_ns
        self._last_seen[cid] = now
        self._suspects.pop(cid, None)
        self._arm_reaper(now + self.batching.max_sequence_idle_us * 1000)
        if request.start and (cid in self._active or cid in self._backlogged):
            logger.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end before this "
                "sequence start. Previous sequence will be terminated early.",
                cid,
                self.model_name,
            )
        deadline = now + timeout_us * 1000 if timeout_us else None
        if cid in self._active:
            slot = self._active.pop(cid) if request.end else self._active[cid]
            self._enqueue(slot, request)
        elif cid in self._backlogged:
            backlog = self._backlogged.pop(cid) if request.end else self._backlogged[cid]
            backlog.requests.append(request)
            if deadline is not None:
                backlog.deadline_ns = min(deadline, backlog.deadline_ns or deadline)
                self._arm_reaper(backlog.deadline_ns)
        elif self._free:
            index, lane = heapq.heappop(self._free)
            slot = self._slots[lane][index]
            slot.correlation_id = cid
            if not request.end:
                self._active[cid] = slot
            logger.debug("model %s: sequence %s takes slot %d of instance %d", self.model_name, cid, index, lane)
            self._enqueue(slot, request)
        else:
            backlog = Backlog(cid, deque([request]), deadline)
            self._backlog.append(backlog)
            if not request.end:
                self._backlogged[cid] = backlog
            if deadline is not None:
                self._arm_reaper(deadline)

    def _enqueue(self, slot: Slot, item: SequenceRequest | None) -> None:
        slot.queue.append(item)
        self._lanes[slot.lane].wake(slot)

    # -- slots --------------------------------------------------------------------------------------

    def _start_lanes(self) -> None:
        for lane, executor in enumerate(self.runner.instances):
            slots = [Slot(lane, index) for index in range(self.slots_per_instance)]
            self._slots.append(slots)
            self._lanes.append(make_lane(self, executor, slots))
            for index in range(self.slots_per_instance):
                heapq.heappush(self._free, (index, lane))

    def release(self, slot: Slot) -> None:
        """The sequence in ``slot`` is over (END ran, or idle): requests left behind are cancelled, and the
        oldest backlogged sequence moves in, else the slot is free (Triton's ReleaseSequenceSlot)."""
        if slot.correlation_id is not None and self._active.get(slot.correlation_id) is slot:
            del self._active[slot.correlation_id]
        leftover = [r for r in slot.queue if r is not None]
        slot.queue.clear()
        for request in leftover:
            self.fail(
                request,
                ShoalError(ErrorCode.UNAVAILABLE, "the sequence was ended before this request ran"),
                FailureReason.CANCELED,
            )
        slot.correlation_id = None
        slot.states = None
        while self._backlog:
            backlog = self._backlog.popleft()
            cid = backlog.correlation_id
            if all(r.future.done() for r in backlog.requests):  # every request given up: over, not waiting
                if self._backlogged.get(cid) is backlog:
                    del self._backlogged[cid]
                continue
            slot.correlation_id = cid
            if self._backlogged.get(cid) is backlog:
                del self._backlogged[cid]
                self._active[cid] = slot
            # The given-up ones too: the lane skips them but honours an END among them, which ends the
            # sequence after the requests before it ran (nothing else would: an ended sequence is not active).
            for request in backlog.requests:
                self._enqueue(slot, request)
            return
        heapq.heappush(self._free, (slot.index, slot.lane))

    def fail(self, request: SequenceRequest, error: BaseException, reason: FailureReason) -> None:
        if request.future.done():
            return
        self.statistics.record_failure(time.monotonic_ns() - request.arrival_ns, reason)
        request.future.set_exception(error)

    # -- idle sequences and backlog timeouts --------------------------------------------------------

    def _arm_reaper(self, at_ns: int) -> None:
        if self._reaper_at_ns is not None and self._reaper_at_ns <= at_ns:
            return
        if self._reaper is not None:
            self._reaper.cancel()
        loop = asyncio.get_running_loop()
        self._reaper_at_ns = at_ns
        self._reaper = loop.call_later(max(0.0, (at_ns - time.monotonic_ns()) / 1e9), self._reap)

    def _reap(self) -> None:
        """Release the slots of idle sequences and refuse backlogged sequences past their timeout."""
        self._reaper = None
        self._reaper_at_ns = None
        now = time.monotonic_ns()
        idle_ns = self.batching.max_sequence_idle_us * 1000
        next_at: int | None = None
        for cid, seen in list(self._last_seen.items()):
            if now - seen < idle_ns:
                next_at = min(next_at or seen + idle_ns, seen + idle_ns)
                continue
            found_ns = self._suspects.get(cid)
            if cid in self._active and found_ns is None:
                # Found idle: confirmed one grace period later, after the event loop has read what reached the
                # server meanwhile (perf_analyzer lost sequences to a loop that woke only for this timer).
                self._suspects[cid] = now
                slot = self._active[cid]
                if any(item is not RELEASE for item in slot.queue):
                    logger.warning(
                        "model %s: sequence %s looks idle but has requests queued in its slot", self.model_name, cid
                    )
                self._lanes[slot.lane].wake(slot)
                next_at = min(next_at or now + IDLE_GRACE_NS, now + IDLE_GRACE_NS)
            elif cid in self._active and found_ns is not None and now - found_ns < IDLE_GRACE_NS:
                # Within its grace: another sequence's timer woke the reaper, not this one's.
                next_at = min(next_at or found_ns + IDLE_GRACE_NS, found_ns + IDLE_GRACE_NS)
            elif cid in self._active:
                logger.debug(
                    "model %s: sequence %s idle for %d µs, its slot is released",
                    self.model_name,
                    cid,
                    self.batching.max_sequence_idle_us,
                )
                self._suspects.pop(cid, None)
                self._enqueue(self._active.pop(cid), RELEASE)
                del self._last_seen[cid]
            elif cid in self._backlogged:  # waits for a slot: looked at again later (Triton: 50 ms)
                next_at = min(next_at or now + 50_000_000, now + 50_000_000)
            else:
                del self._last_seen[cid]
        for backlog in list(self._backlog):
            if backlog.deadline_ns is None:
                continue
            if backlog.deadline_ns > now:
                next_at = min(next_at or backlog.deadline_ns, backlog.deadline_ns)
                continue
            self._backlog.remove(backlog)
            if self._backlogged.get(backlog.correlation_id) is backlog:
                del self._backlogged[backlog.correlation_id]
            for request in backlog.requests:
                self.fail(
                    request,
                    ShoalError(ErrorCode.UNAVAILABLE, "timeout of the corresponding sequence has been expired"),
                    FailureReason.REJECTED,
                )
        if next_at is not None:
            self._arm_reaper(next_at)

    # -- the state of things ------------------------------------------------------------------------

    @property
    def active_sequences(self) -> int:
        """Sequences that hold a slot or wait for one."""
        return len(self._active) + len(self._backlogged)

    @property
    def queued(self) -> int:
        """Requests waiting, in slot queues and in the backlog (not those their clients gave up: nobody
        waits for them, and ``stop`` must not wait for a slot to free to drop them)."""
        in_slots = sum(
            1 for slots in self._slots for slot in slots for r in slot.queue if r is not None and not r.future.done()
        )
        backlog = sum(1 for b in self._backlog for r in b.requests if not r.future.done())
        return in_slots + backlog + sum(lane.queued for lane in self._lanes)

    async def stop(self) -> None:
        """Refuse new requests, let what is queued run, then stop the lanes."""
        self._stopping = True
        while self.queued:
            await asyncio.sleep(0.01)
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(lane.stop() for lane in self._lanes), return_exceptions=True)
