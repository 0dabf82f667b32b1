"""The sequence batcher's records: a queued request, a slot, a backlogged sequence."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.scheduling.base import OutputCheck
from shoal.statistics import ALSO_COUNT_PHASES, TRACED, PhaseTotals, Traced

Outputs = dict[str, np.ndarray]
CorrelationId = int | str


@dataclass(eq=False)
class SequenceRequest:
    """One queued request of a sequence."""

    feed: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]
    correlation_id: CorrelationId
    start: bool
    end: bool
    arrival_ns: int
    future: asyncio.Future[Outputs] = field(repr=False)
    signature: tuple[tuple[str, tuple[int, ...]], ...] = ()
    taken: bool = False  # a lane took it into a batch: no longer queued
    # The caller's aggregator (an ensemble's: statistics.ALSO_COUNT_PHASES), taken as the request is made.
    also_count: PhaseTotals | None = field(default_factory=ALSO_COUNT_PHASES.get)
    traced: Traced | None = field(default_factory=TRACED.get)  # its trace, when it is sampled
    check: OutputCheck | None = None  # its outputs checked before it counts as a success
    context: Any = None  # the core request it came from (the oldest strategy's batcher hands it on)

    def __post_init__(self) -> None:
        if self.traced is not None:
            self.traced.queued(self.feed)  # its inputs, as they are queued (the TENSORS level)


# A slot's queue holds requests, and ``RELEASE`` where the reaper ended an idle sequence.
RELEASE = None


@dataclass(eq=False)
class Slot:
    lane: int  # the instance's index
    index: int  # the slot's index in its instance: its batch row under ``direct``
    correlation_id: CorrelationId | None = None
    queue: deque[SequenceRequest | None] = field(default_factory=deque)
    states: dict[str, np.ndarray] | None = None  # state input name -> value, without the batch dimension


@dataclass(eq=False)
class Backlog:
    """A sequence waiting for a slot, with the requests it sent so far."""

    correlation_id: CorrelationId
    requests: deque[SequenceRequest] = field(default_factory=deque)
    deadline_ns: int | None = None
