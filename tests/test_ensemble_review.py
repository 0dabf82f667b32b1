"""Ensembles follow their composing models (lifecycle/ensemble.py's Dependents), through the model manager."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from shoal.lifecycle.manager import ModelManager
from shoal.lifecycle.state import ModelState
from tests import ensemble_models


def test_nested_ensembles_come_back_once_each(tmp_path: Path) -> None:
    """Unloading the model under two nested ensembles unloads both; loading it again loads each of them
    once (the outer one used to load twice: by the inner one's load, then again by the first wake)."""
    repo = tmp_path / "repo"
    ensemble_models.add_identity(repo, "base")
    ensemble_models.add_ensemble(repo, "inner", [ensemble_models.step("base", {"IN": "IN"}, {"OUT": "OUT"})])
    ensemble_models.add_ensemble(repo, "outer", [ensemble_models.step("inner", {"IN": "IN"}, {"OUT": "OUT"})])

    async def main() -> list[str]:
        manager = ModelManager(repo, control_mode="explicit")
        loads: list[str] = []
        load = manager.load

        async def counted(name: str, config_override: dict[str, Any] | None = None) -> None:
            loads.append(name)
            await load(name, config_override)

        manager.load = counted  # type: ignore[method-assign]
        try:
            await manager.load("outer")
            await manager.unload("base")
            assert {name: manager.entry(name).state for name in manager.names()} == dict.fromkeys(
                ("base", "inner", "outer"), ModelState.UNAVAILABLE)
            loads.clear()
            await manager.load("base")
            assert all(manager.entry(name).state is ModelState.READY for name in manager.names())
            return loads
        finally:
            await manager.close()

    assert sorted(asyncio.run(main())) == ["base", "inner", "outer"]
