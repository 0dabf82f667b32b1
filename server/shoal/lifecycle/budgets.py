"""Memory budgets: per device for all models together, and a model's own ``memory_budget_mb``.

Before a version loads, its model file's size stands in for what it will take; after the load
the measured bytes decide. A load *reserves* what it passed in the one ``MemoryLedger`` under a
lock, so two loads that run at once (different models build in parallel threads) cannot both
pass a budget that only one of them fits. The reservation ends when the load's entry is
installed in the registry, where ``in_use`` then counts it, or when the load fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.repository.config import ModelSpec

MB = 2**20


def _add(a: dict[str, int], b: dict[str, int], sign: int = 1) -> dict[str, int]:
    out = dict(a)
    for device, byte_size in b.items():
        out[device] = out.get(device, 0) + sign * byte_size
    return {d: n for d, n in out.items() if n}


class MemoryLedger:
    """The device budgets, what loaded models hold (``in_use``), and what loads in progress reserved."""

    def __init__(self, budgets: dict[str, int], in_use: Callable[[], dict[str, int]]) -> None:
        self.budgets = budgets
        self._in_use = in_use
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}

    def reserve(self, model: str, needed: dict[str, int], qualifier: str) -> str:
        """Reserve ``needed`` bytes per device, or return why a budget refuses them."""
        with self._lock:
            used = _add(self._in_use(), self._reserved)
            for device, byte_size in needed.items():
                budget = self.budgets.get(device)
                in_use = used.get(device, 0)
                if budget is not None and in_use + byte_size > budget:
                    return (
                        f"memory budget: model '{model}' needs {qualifier}{byte_size / MB:.1f} MB on "
                        f"{device}, but {in_use / MB:.1f} MB of the {budget / MB:.1f} MB budget are in use"
                    )
            self._reserved = _add(self._reserved, needed)
            return ""

    def release(self, amounts: dict[str, int]) -> None:
        with self._lock:
            self._reserved = _add(self._reserved, amounts, -1)

    @contextmanager
    def settling(self, amounts: dict[str, int]) -> Iterator[None]:
        """Install a finished load's entry inside the block; its reservation ends at the same moment."""
        with self._lock:
            try:
                yield
            finally:
                self._reserved = _add(self._reserved, amounts, -1)


class LoadBudget:
    """One model load's view of the budgets: the ledger, the model's own cap, what it reserved."""

    def __init__(self, ledger: MemoryLedger, spec: ModelSpec, devices: set[str]) -> None:
        self.ledger = ledger
        self.spec = spec
        self.devices = devices
        own = spec.parameters.get("memory_budget_mb", "")
        try:
            self.own = int(float(own) * MB) if own else None
        except ValueError:
            self.own = None
        self.taken = 0  # measured bytes of this load's versions, for the model's own cap
        self.reserved: dict[str, int] = {}  # what the manager releases when the entry is installed
        self._estimate: dict[str, int] = {}  # the reservation of the version being loaded

    def refuse_before(self, model_path: Path) -> str:
        """Reserve the model file's size on each device before loading (``model_path`` is checked)."""
        estimate = model_path.stat().st_size if model_path.is_file() else 0
        needed = {d: estimate for d in self.devices}
        refusal = self._reserve(needed, "about ")
        self._estimate = {} if refusal else needed
        return refusal

    def refuse_after(self, measured: dict[str, int]) -> str:
        """Swap the estimate for the measured bytes; refuse (and keep nothing) if they do not fit."""
        self.forget_estimate()
        refusal = self._reserve(measured, "")
        if not refusal:
            self.taken += sum(measured.values())
        return refusal

    def forget_estimate(self) -> None:
        """The version did not load: give its estimate back."""
        self.ledger.release(self._estimate)
        self.reserved = _add(self.reserved, self._estimate, -1)
        self._estimate = {}

    def _reserve(self, needed: dict[str, int], qualifier: str) -> str:
        if self.own is not None and self.taken + sum(needed.values()) > self.own:
            return (
                f"memory budget: model '{self.spec.name}' needs {qualifier}{sum(needed.values()) / MB:.1f} MB, "
                f"over its memory_budget_mb of {self.own / MB:.1f} MB"
            )
        refusal = self.ledger.reserve(self.spec.name, needed, qualifier)
        if not refusal:
            self.reserved = _add(self.reserved, needed)
        return refusal
