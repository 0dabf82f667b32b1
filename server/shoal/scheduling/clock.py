"""A deadline clock for the batcher: callbacks on the event loop at a ``time.monotonic_ns()`` deadline.

asyncio's own timers cannot honour a sub-millisecond ``max_queue_delay_microseconds``: the
selector rounds every epoll timeout up to a whole millisecond, so a 200 µs delay costs ~1 ms.
On Linux the clock arms one ``timerfd`` per event loop (CLOCK_MONOTONIC, absolute, nanosecond
resolution, no timer slack) for the earliest pending deadline and registers it with the loop's
selector: epoll returns when it fires, and its callback runs due entries on the loop itself. No
thread and no handoff between threads. The kernel still takes tens of µs to wake a sleeping
thread (on this project's virtual machine 35-100 µs, more after a long idle), so the timerfd is
armed that early and the loop polls the last stretch (``DeadlineClock``): at most
``MAX_LEAD_NS`` of polling per deadline, none while no deadline is pending. Where timerfd is
missing (other systems, a loop without ``add_reader``) it falls back to ``loop.call_at``.

Alternatives measured in-process on the development machine (overshoot of a 50-1000 µs wait,
median): asyncio's ``call_later`` 900-1,080 µs below 1 ms, ~100 µs at 1 ms; a waker thread on a
``threading.Condition`` with a sub-millisecond timeout, handing over by ``call_soon_threadsafe``,
95-160 µs (the thread's 50 µs timer slack, then a second wake-up, of the loop thread); the same
with its timer slack cut to 1 ns 40-125 µs; a timerfd on the loop 37-106 µs (p99 95-450 µs against
the thread's 115-530 µs). Neither sleeping design keeps 50 µs on its own; the timerfd wakes one
thread instead of two and needs no lock, hence it, plus the short poll.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import heapq
import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = 0o2000000
MAX_LEAD_NS = 100_000  # the most the clock polls before a deadline, however late its wake-ups
LEAD_STEP_NS = 2_000


class _TimeSpec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", _TimeSpec), ("value", _TimeSpec)]


class _TimerFd:
    """One Linux timerfd on CLOCK_MONOTONIC (the clock of ``time.monotonic_ns``)."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_ITimerSpec), ctypes.c_void_p]
        self._settime.restype = ctypes.c_int
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        create.restype = ctypes.c_int
        self.fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")

    def arm(self, deadline_ns: int) -> None:
        """Fire once at ``deadline_ns`` (at once when it has passed)."""
        seconds, nanoseconds = divmod(max(deadline_ns, 1), 1_000_000_000)
        spec = _ITimerSpec(_TimeSpec(0, 0), _TimeSpec(seconds, nanoseconds))
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def drain(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:  # re-armed after it fired: nothing to read
            pass


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.timerfd_create  # noqa: B018 - raises AttributeError where there is no timerfd
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def _nothing() -> None:
    """A cancelled timer's callback."""


@dataclass(order=True)
class Timer:
    """A pending callback; ``cancel()`` drops it."""

    deadline_ns: int
    sequence: int
    callback: Callable[[], object] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True
        self.callback = _nothing  # the heap may hold the timer until its deadline: not what it refers to


class DeadlineClock:
    """Runs callbacks on ``loop`` at monotonic deadlines; use ``deadline_clock(loop)`` for the loop's one.

    Waking a sleeping thread takes the kernel tens of µs (more on a virtual machine after a long
    idle), so the timerfd is armed that much early: the clock tracks the 75th percentile of how late
    its wake-ups arrive (capped at ``MAX_LEAD_NS``) and, once woken within that lead of the earliest
    deadline, polls from the event loop (``call_soon``, so I/O is still served) until it is due.
    Nothing polls while no deadline is that close, and no callback runs before its deadline.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop owns its clock (through the reader), not the reverse
        self._heap: list[Timer] = []
        self._sequence = itertools.count()
        self._armed_ns: int | None = None
        self._polling = False
        self.lead_ns = 0  # the timerfd's wake-up lateness (75th percentile), at most MAX_LEAD_NS
        self._timerfd: _TimerFd | None = None
        if _LIBC is not None:
            try:
                timerfd = _TimerFd(_LIBC)
            except OSError as exc:
                logger.debug("no timerfd (%s): the batcher's clock falls back to asyncio timers", exc)
            else:
                try:
                    loop.add_reader(timerfd.fd, self._fired)
                except NotImplementedError:
                    os.close(timerfd.fd)
                else:
                    self._timerfd = timerfd
                    weakref.finalize(self, os.close, timerfd.fd)

    @property
    def precise(self) -> bool:
        """True when deadlines are kept by the timerfd, not by asyncio's millisecond-rounded timers."""
        return self._timerfd is not None

    def call_at(self, deadline_ns: int, callback: Callable[[], object]) -> Timer:
        """Run ``callback`` on the loop once ``time.monotonic_ns()`` reaches ``deadline_ns``."""
        timer = Timer(deadline_ns, next(self._sequence), callback)
        loop = self._loop()
        assert loop is not None, "the clock's event loop is gone"
        if self._timerfd is None:
            loop.call_at(loop.time() + (deadline_ns - time.monotonic_ns()) / 1e9, self._run_one, timer)
            return timer
        heapq.heappush(self._heap, timer)
        if not self._polling and (self._armed_ns is None or deadline_ns - self.lead_ns < self._armed_ns):
            self._schedule(time.monotonic_ns())
        return timer

    def _run_one(self, timer: Timer) -> None:
        if not timer.cancelled:
            timer.callback()

    def _fired(self) -> None:
        """The timerfd is readable: learn how late it woke the loop, then run what is due."""
        assert self._timerfd is not None
        self._timerfd.drain()
        if self._armed_ns is not None:
            # The lead follows the 75th percentile of the lateness: three steps up when a wake-up came
            # later than the lead, one down otherwise (it settles where one in four is later).
            if time.monotonic_ns() - self._armed_ns > self.lead_ns:
                self.lead_ns = min(MAX_LEAD_NS, self.lead_ns + 3 * LEAD_STEP_NS)
            else:
                self.lead_ns = max(0, self.lead_ns - LEAD_STEP_NS)
            self._armed_ns = None
        self._run_due()

    def _run_due(self) -> None:
        self._polling = False
        now = time.monotonic_ns()
        due: list[Timer] = []
        while self._heap and (self._heap[0].cancelled or self._heap[0].deadline_ns <= now):
            timer = heapq.heappop(self._heap)
            if not timer.cancelled:
                due.append(timer)
        self._schedule(now)
        for timer in due:
            try:
                timer.callback()
            except Exception:  # noqa: BLE001 - one callback's failure must not stop the others
                logger.exception("a deadline callback failed")

    def _schedule(self, now: int) -> None:
        """Arm the timerfd ``lead_ns`` before the earliest deadline, or poll when that is already past."""
        assert self._timerfd is not None
        while self._heap and self._heap[0].cancelled:
            heapq.heappop(self._heap)
        if not self._heap:
            return
        wake_ns = self._heap[0].deadline_ns - self.lead_ns
        if wake_ns > now:
            self._timerfd.arm(wake_ns)
            self._armed_ns = wake_ns
            return
        loop = self._loop()
        if loop is not None and not self._polling:
            self._polling = True
            loop.call_soon(self._run_due)


_CLOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DeadlineClock] = weakref.WeakKeyDictionary()


def deadline_clock(loop: asyncio.AbstractEventLoop | None = None) -> DeadlineClock:
    """The one clock of ``loop`` (the running loop by default)."""
    loop = loop or asyncio.get_running_loop()
    clock = _CLOCKS.get(loop)
    if clock is None:
        clock = _CLOCKS[loop] = DeadlineClock(loop)
    return clock
