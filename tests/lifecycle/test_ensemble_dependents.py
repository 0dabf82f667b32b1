"""Ensembles following their composing models (Dependents), and optional inputs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.errors import ShoalError
from shoal.lifecycle.manager import ModelManager
from shoal.lifecycle.state import ModelState
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, Tensor
from tests import ensemble_models, models


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
                ("base", "inner", "outer"), ModelState.UNAVAILABLE
            )
            loads.clear()
            await manager.load("base")
            assert all(manager.entry(name).state is ModelState.READY for name in manager.names())
            return loads
        finally:
            await manager.close()

    assert sorted(asyncio.run(main())) == ["base", "inner", "outer"]


@pytest.mark.parametrize("control_mode", ["poll", "explicit"])
def test_an_ensemble_waiting_for_a_missing_model_loads_once_it_is_there(tmp_path: Path, control_mode: str) -> None:
    """As Triton 2.51 does (checked by hand, both modes): an ensemble whose model is not in the repository
    fails to load; once the model is added (poll) or loaded (explicit), the ensemble loads too. It used to
    stay UNAVAILABLE until its own folder changed or it was loaded again by hand."""
    repo = tmp_path / "repo"
    ensemble_models.add_ensemble(repo, "plus", [ensemble_models.step("base", {"IN": "IN"}, {"OUT": "OUT"})])

    async def main() -> None:
        manager = ModelManager(repo, control_mode=control_mode)
        try:
            if control_mode == "poll":
                await manager.start()
            else:
                with pytest.raises(ShoalError, match="contains models that are not available"):
                    await manager.load("plus")
            assert manager.entry("plus").state is ModelState.UNAVAILABLE
            ensemble_models.add_identity(repo, "base")
            if control_mode == "poll":
                await manager.poll_once()
            else:
                await manager.load("base")
            assert manager.entry("plus").state is ModelState.READY
            # Unloaded on purpose, it stays unloaded when its model comes back.
            await manager.unload("plus")
            await manager.load("base")
            assert manager.entry("plus").state is ModelState.UNAVAILABLE
        finally:
            await manager.close()

    asyncio.run(main())


def test_an_optional_input_left_out_is_left_out_of_its_step(tmp_path: Path) -> None:
    """As Triton 2.51 (checked by hand with a Python model): an optional ensemble input the request
    does not send is not sent to the step that reads it, which runs without it; where the composing
    model needs it, the model's own check refuses the step. It used to refuse the request ("ensemble
    tensor 'OPT' is needed by a step but was not provided")."""
    repo = tmp_path / "repo"
    fp32 = "data_type: TYPE_FP32 dims: [ 4 ]"
    models.write_config(
        repo / "pair",
        f"""
        backend: "identity"
        max_batch_size: 8
        input [ {{ name: "IN" {fp32} }}, {{ name: "OPT" {fp32} optional: true }} ]
        output [ {{ name: "OUT" {fp32} }}, {{ name: "OPT_OUT" {fp32} }} ]""",
    )
    (repo / "pair" / "1").mkdir()
    ensemble_models.add_ensemble(
        repo,
        "optional",
        [ensemble_models.step("pair", {"IN": "IN", "OPT": "OPT"}, {"OUT": "OUT"})],
        io=f'input [ {{ name: "IN" {fp32} }}, {{ name: "OPT" {fp32} optional: true }} ]\n'
        f'output [ {{ name: "OUT" {fp32} }} ]',
    )
    row = np.arange(4, dtype=np.float32).reshape(1, 4)

    async def main() -> None:
        manager = ModelManager(repo)
        try:
            await manager.start()
            ensemble = manager.resolve("optional", "")
            request = InferRequest("optional", "", "", (Tensor("IN", DataType.FP32, (1, 4), row),))
            response = await ensemble.infer(request)
            np.testing.assert_array_equal(response.outputs[0].data, row)
        finally:
            await manager.close()

    asyncio.run(main())
