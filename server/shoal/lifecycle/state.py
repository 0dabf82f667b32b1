"""Triton's five model states, the one table of moves between them, and the registry's entries.

A model version and a model entry each start UNKNOWN and change state only through
``transition()``, which refuses any move that ``TRANSITIONS`` does not list::

    UNKNOWN ─▶ LOADING ─▶ READY ─▶ UNLOADING ─▶ UNAVAILABLE
                  └──────────────────────────────────▲
                  (the load failed, or a budget refused what it loaded)

A reload builds new entries (UNKNOWN again) beside the serving ones, as Triton's model
lifecycle does, so nothing ever moves out of UNAVAILABLE. A READY version holds its loaded
``ModelVersion`` (``served``); ``detach`` takes it away before the drain, and
``lifecycle.manager.release`` is the one path that frees it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.lifecycle.fingerprint import Fingerprint
    from shoal.lifecycle.model import ModelVersion
    from shoal.repository.config import ModelSpec


class ModelState(enum.Enum):
    UNKNOWN = "UNKNOWN"  # known (in the repository, or about to load), not loaded
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"  # no new requests; the queued and running ones finish
    UNAVAILABLE = "UNAVAILABLE"  # failed to load, refused, or unloaded: the reason says which


TRANSITIONS: frozenset[tuple[ModelState, ModelState]] = frozenset(
    {
        (ModelState.UNKNOWN, ModelState.LOADING),  # a load starts
        (ModelState.LOADING, ModelState.READY),  # loaded, within budget, warmed up
        (ModelState.LOADING, ModelState.UNAVAILABLE),  # the load failed, or a budget refused it
        (ModelState.READY, ModelState.UNLOADING),  # unload, replaced by a reload, shutdown
        (ModelState.UNLOADING, ModelState.UNAVAILABLE),  # drained and released
    }
)

UNLOADED = "unloaded"  # the reason shown for a version that was let go on purpose


class IllegalTransition(RuntimeError):
    """A move that ``TRANSITIONS`` does not allow: a bug in Shoal, never a client's doing."""


class Lifecycle:
    """A state, the reason for it, and the one way to change the state."""

    def __init__(self) -> None:
        self._state = ModelState.UNKNOWN
        self.reason = ""  # also updated alone, e.g. a failed reload beside a READY model

    @property
    def state(self) -> ModelState:
        return self._state

    def transition(self, to: ModelState, reason: str = "") -> None:
        if (self._state, to) not in TRANSITIONS:
            raise IllegalTransition(f"{type(self).__name__}: {self._state.name} -> {to.name} is not allowed")
        self._check(to)
        self._state = to
        self.reason = reason

    def _check(self, to: ModelState) -> None:
        """What else a move needs, beyond the table (none here)."""


class VersionEntry(Lifecycle):
    """One version of one load: its state, and the loaded ``ModelVersion`` while it holds one."""

    def __init__(self, version: int) -> None:
        super().__init__()
        self.version = version
        self._served: ModelVersion | None = None

    @property
    def served(self) -> ModelVersion | None:
        return self._served

    def attach(self, served: ModelVersion) -> None:
        """The load produced ``served``; READY only once the budgets accept it."""
        if self.state is not ModelState.LOADING or self._served is not None:
            raise IllegalTransition(f"version {self.version}: attach while {self.state.name}")
        self._served = served

    def _check(self, to: ModelState) -> None:
        if to is ModelState.READY and self._served is None:
            raise IllegalTransition(f"version {self.version}: READY without a loaded model")

    def detach(self) -> ModelVersion | None:
        """Stop routing requests here (READY becomes UNLOADING); the caller frees what it returns."""
        served, self._served = self._served, None
        if served is not None and self.state is ModelState.READY:
            self.transition(ModelState.UNLOADING)
        return served


class ModelEntry(Lifecycle):
    """One load of one model: READY while at least one of its versions is."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.spec: ModelSpec | None = None
        self.versions: dict[int, VersionEntry] = {}
        self.chosen: frozenset[int] = frozenset()  # the versions this load builds, known before they are built
        self.fingerprint: Fingerprint | None = None  # the folder as this load read it (poll, reload)
        # The folder as a reload that failed read it, this entry serving on: polls leave it be until it changes.
        self.failed_fingerprint: Fingerprint | None = None
        self.unloaded = False  # unloaded on purpose: strict readiness no longer waits for it
        # The client's config override this load used (RepositoryModelLoad's ``config``), which the
        # server's own reloads of it (an ensemble woken once its steps fit again) use too, as Triton's.
        self.config_override: dict[str, Any] | None = None

    def ready_versions(self) -> list[int]:
        return sorted(v for v, e in self.versions.items() if e.state is ModelState.READY)

    def newest_ready(self) -> int | None:
        """The highest READY version (what a request naming none is served by), or None; once per request."""
        return max((v for v, e in self.versions.items() if e.state is ModelState.READY), default=None)


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: ModelState  # UNKNOWN: in the repository, never loaded (Triton's name-only row)
    reason: str
