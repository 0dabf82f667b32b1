"""Triton's rate limiter (``--rate-limit execution_count``): which instance, of all models, executes next.

Why: several models on one device each fit alone, but not all at once (memory, a GPU's streams); an
operator names the scarce things as resources (``instance_group { rate_limiter { resources [ { name:
"GPU_MEM" count: 1 } ] priority: 2 } }``) and the server executes an instance only when all it names
are free. Triton's semantics, read from its ``rate_limiter.cc`` (core r24.10, for 2.51):

- A resource is counted per device, or once for the server when ``global``. CPU instances count on
  device 0, as in Triton (its CPU instances have device id 0): they share GPU 0's pools.
- The server's counts come from ``--rate-limit-resource NAME:COUNT[:DEVICE]`` (no device: every
  device; the larger entry wins). Without any, each resource's count is the largest any registered
  instance asks for, per device and globally. With some, a resource not declared has count 0. An
  instance that asks for more than its pool holds fails its model's load, in Triton's words.
- An instance with a batch to run is *staged*; staged instances are ordered by ``executions x
  priority`` (priority 0 counts as 1; ties in staging order), lowest first. Only the first may take
  its resources, all of them at once or none (head-of-line: a large claim is never overtaken
  forever by small ones). Its resources are freed, and its execution count grows, when the
  execution returns.
- Starvation is impossible: a staged claim's place is fixed while every execution of another
  instance raises that instance's next key by its priority, so the others' keys pass it after a
  bounded number of executions; and nothing overtakes the first staged claim, so it starts as soon
  as the executions holding its resources return. An instance of priority 2 gets half the turns of
  one of priority 1 when both are always staged.

The limiter is shared by the serving loop (schedulers) and load threads (warm-up), so its state is
under one lock and a grant is a callback, not an awaitable.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ErrorCode, ShoalError

GLOBAL = -2  # the pool key of a global resource; per-device pools are keyed by the device index
EVERY_DEVICE = -1  # a --rate-limit-resource without a device


@dataclass(frozen=True)
class Declared:
    """One ``--rate-limit-resource``: ``device`` is EVERY_DEVICE when none was given."""

    name: str
    count: int
    device: int = EVERY_DEVICE

    @classmethod
    def parse(cls, text: str) -> Declared:
        """Triton's ``<resource_name>:<count>:<device>`` or ``<resource_name>:<count>``."""
        parts = text.split(":")
        usage = (
            "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
            f"'<resource_name>:<count>'. Got {text}"
        )
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(usage)
        try:
            count = int(parts[1])
            device = int(parts[2]) if len(parts) == 3 else EVERY_DEVICE
        except ValueError:
            raise ValueError(usage) from None
        if count < 0 or device < EVERY_DEVICE:
            raise ValueError(usage)
        return cls(parts[0], count, device)


@dataclass(eq=False)
class Claim:
    """What one instance needs to execute: ``needs`` maps (pool key, resource name) to a count."""

    instance: str
    needs: Mapping[tuple[int, str], int]
    priority: int = 1
    executions: int = 0  # grows as each execution returns (Triton's exec_count)
    owner: object = None  # what registered it (a model version's Admission)

    @property
    def key(self) -> int:
        return self.executions * max(self.priority, 1)


def claim_for(instance: str, device_index: int, resources: Iterable[tuple[str, bool, int]], priority: int) -> Claim:
    """An instance's claim from its group's ``rate_limiter`` (name, global, count); the last of a name wins."""
    needs = {(GLOBAL if is_global else device_index, name): count for name, is_global, count in resources}
    return Claim(instance, needs, priority)


class Admission:
    """How one model version's executions pass the limiter: the claim of each of its executors, in the order
    the executors are built (``bind``); it is also the owner its claims are registered under."""

    def __init__(self, limiter: RateLimiter, claims: Sequence[Claim]) -> None:
        self.limiter = limiter
        self.claims = tuple(claims)
        self._by_executor: dict[int, Claim] = {}

    def bind(self, executors: Sequence[Any]) -> None:
        """The executors, built in the claims' order (one per claim)."""
        if len(executors) != len(self.claims):
            raise ValueError(f"{len(executors)} executors for {len(self.claims)} rate-limiter claims")
        self._by_executor = {id(executor): claim for executor, claim in zip(executors, self.claims, strict=True)}

    def claim_of(self, executor: Any) -> Claim:
        return self._by_executor[id(executor)]


@dataclass(eq=False)
class _Ticket:
    claim: Claim
    grant: Callable[[], None]
    granted: bool = False
    abandoned: bool = False


@dataclass
class RateLimiter:
    """The server's pools and the staged instances of every model."""

    declared: Sequence[Declared] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _registered: dict[object, list[Claim]] = field(default_factory=dict, repr=False)
    _limits: dict[tuple[int, str], int] = field(default_factory=dict, repr=False)
    _taken: dict[tuple[int, str], int] = field(default_factory=dict, repr=False)
    _staged: list[tuple[int, int, _Ticket]] = field(default_factory=list, repr=False)
    _order: itertools.count[int] = field(default_factory=itertools.count, repr=False)
    # Owners about to stage again (``release(more=True)``) and the pools their last claim used.
    _returning: dict[object, set[tuple[int, str]]] = field(default_factory=dict, repr=False)

    # -- instances come and go with their models ----------------------------------------------------

    def register(self, owner: object, claims: Sequence[Claim]) -> None:
        """Add a loading version's instances; ShoalError (INVALID_ARGUMENT) if some could never execute."""
        with self._lock:
            for claim in claims:
                claim.owner = owner
            registered = {**self._registered, owner: list(claims)}
            limits = self._limits_for(registered)
            for claim in claims:
                for pool_name, need in claim.needs.items():
                    if need > limits.get(pool_name, 0):
                        raise ShoalError(
                            ErrorCode.INVALID_ARGUMENT,
                            f'Resource count for "{pool_name[1]}" is limited to {limits.get(pool_name, 0)} which will '
                            f"prevent scheduling of one or more model instances, the minimum required count is {need}",
                        )
            self._registered, self._limits = registered, limits

    def unregister(self, owner: object) -> None:
        with self._lock:
            self._returning.pop(owner, None)
            if self._registered.pop(owner, None) is not None:
                self._limits = self._limits_for(self._registered)
            self._allocate()

    def _limits_for(self, registered: Mapping[object, list[Claim]]) -> dict[tuple[int, str], int]:
        claims = [claim for group in registered.values() for claim in group]
        global_names = {name for claim in claims for (key, name) in claim.needs if key == GLOBAL}
        device_names = {name for claim in claims for (key, name) in claim.needs if key != GLOBAL}
        both = sorted(global_names & device_names)
        if both:
            name = both[0]
            raise ShoalError(
                ErrorCode.INVALID_ARGUMENT,
                f'Resource "{name}" is present as both global and device-specific resource in the model configuration.',
            )
        if not self.declared:  # each pool as large as the largest claim on it
            limits: dict[tuple[int, str], int] = {}
            for claim in claims:
                for pool_name, need in claim.needs.items():
                    limits[pool_name] = max(limits.get(pool_name, 0), need)
            return limits
        pools = {pool_name for claim in claims for pool_name in claim.needs}
        return {pool_name: self._declared_count(*pool_name) for pool_name in pools}

    def _declared_count(self, key: int, name: str) -> int:
        if key == GLOBAL:
            return max((d.count for d in self.declared if d.name == name), default=0)
        return max((d.count for d in self.declared if d.name == name and d.device in (key, EVERY_DEVICE)), default=0)

    # -- executions ---------------------------------------------------------------------------------

    async def acquire(self, claim: Claim) -> None:
        """Wait, on the serving loop, until ``claim``'s instance may execute; ``release`` after it ran."""
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[None] = loop.create_future()

        def grant() -> None:
            loop.call_soon_threadsafe(_resolve, granted)

        ticket = _Ticket(claim, grant)
        self._stage(ticket)
        try:
            await granted
        except BaseException:  # cancelled: give back what may have been granted meanwhile
            self._abandon(ticket)
            raise

    @contextmanager
    def holding(self, claim: Claim) -> Iterator[None]:
        """``claim``'s resources for the ``with`` block, on a thread that is not the serving loop's (a load
        thread's warm-up, which Triton also runs through the limiter)."""
        event = threading.Event()
        self._stage(_Ticket(claim, event.set))
        event.wait()
        try:
            yield
        finally:
            self.release(claim)

    def release(self, claim: Claim, more: bool = False) -> None:
        """The execution returned: its resources are free and it counts as one more execution.

        ``more``: its scheduler has a batch ready to form at once. Triton's instance is staged again, with
        its new key, before the freed resources go to anyone (its next batch is formed already); here the
        next batch is formed a few loop turns later, so no claim on the same pools is granted until a claim
        of the same owner stages or the owner ``settle``s (it found it must wait). Without that, an instance
        that is always loaded would never be staged when another's execution returns, and priorities would
        not matter. The scheduler says ``more`` only when its next batch can go at once.
        """
        with self._lock:
            claim.executions += 1
            self._free(claim)
            if more and not any(t.claim.owner is claim.owner and not t.abandoned for _, _, t in self._staged):
                # unless it staged again already, while this one still ran; only claims on these pools wait
                self._returning.setdefault(claim.owner, set()).update(claim.needs)
            self._allocate()

    def settle(self, owner: object) -> None:
        """``owner``'s scheduler will not stage at once after all (it waits for requests or its batching delay)."""
        with self._lock:
            if self._returning.pop(owner, None) is not None:
                self._allocate()

    def _stage(self, ticket: _Ticket) -> None:
        with self._lock:
            self._returning.pop(ticket.claim.owner, None)
            heapq.heappush(self._staged, (ticket.claim.key, next(self._order), ticket))
            self._allocate()

    def _abandon(self, ticket: _Ticket) -> None:
        with self._lock:
            ticket.abandoned = True
            if ticket.granted:  # granted, but its waiter was cancelled before it saw so: never executed
                self._free(ticket.claim)
                self._allocate()

    def _free(self, claim: Claim) -> None:
        for pool_name, need in claim.needs.items():
            self._taken[pool_name] -= need

    def _allocate(self) -> None:
        """Grant the first staged claims while each fits (all its resources or none); never skip one."""
        held = set().union(*self._returning.values())  # pools kept for an owner about to stage again
        while self._staged:
            ticket = self._staged[0][2]
            if ticket.abandoned:
                heapq.heappop(self._staged)
                continue
            needs = ticket.claim.needs
            if any(self._taken.get(p, 0) + n > self._limits.get(p, 0) for p, n in needs.items()):
                return
            if held.intersection(needs):
                return
            heapq.heappop(self._staged)
            try:
                ticket.grant()
            except RuntimeError:  # its event loop is closed (the server went away): nobody waits for it
                ticket.abandoned = True
                continue
            for pool_name, need in needs.items():
                self._taken[pool_name] = self._taken.get(pool_name, 0) + need
            ticket.granted = True

    @property
    def staged(self) -> int:
        """Instances waiting for their resources."""
        with self._lock:
            return sum(1 for _, _, ticket in self._staged if not ticket.abandoned)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
