"""An ensemble the server unloaded with a model it uses, and loads again once that model is back (its
"wake"): loaded as its client loaded it, config override included, and never one a client unloaded
meanwhile (Triton's dependency graph: model_repository_manager.cc). Both layouts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from shoal.lifecycle.manager import ModelManager
from shoal.lifecycle.state import ModelState
from tests.ensemble_models import add_ensemble, add_identity, add_onnx_add1, step
from tests.polling import wait_until

ONE_STEP = {"IN": "IN"}, {"OUT": "OUT"}


def _override(name: str, model: str) -> str:
    """An ensemble's whole config as RepositoryModelLoad's ``config``: one step, ``model``."""
    return json.dumps(
        {
            "name": name,
            "platform": "ensemble",
            "max_batch_size": 8,
            "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
            "ensemble_scheduling": {
                "step": [
                    {"model_name": model, "model_version": -1, "input_map": ONE_STEP[0], "output_map": ONE_STEP[1]}
                ]
            },
        }
    )


def _infer(client: grpcclient.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    tensor = grpcclient.InferInput("IN", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor]).as_numpy("OUT")
    assert result is not None
    return result


def _states(client: grpcclient.InferenceServerClient) -> dict[str, str]:
    return {m.name: m.state for m in client.get_model_repository_index().models}


def test_an_ensemble_loaded_with_an_override_wakes_with_it(tmp_path: Path, server_factory) -> None:
    """On disk the ensemble runs ``add1`` (x + 1); a client loaded it with an override that runs
    ``same`` (x). Unloading ``same`` unloads it; loading ``same`` again brings it back as the client
    loaded it: x, not x + 1, and ``add1`` is never loaded."""
    repo = tmp_path / "repo"
    add_onnx_add1(repo)
    add_identity(repo, "same")
    add_ensemble(repo, "ens", [step("add1", *ONE_STEP)])
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "same")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with grpcclient.InferenceServerClient(server.url) as client:
        client.load_model("ens", config=_override("ens", "same"))
        np.testing.assert_array_equal(_infer(client, "ens", x), x)
        client.unload_model("same")
        assert _states(client)["ens"] == "UNAVAILABLE"
        client.load_model("same")
        wait_until(lambda: _states(client)["ens"] == "READY", what="the ensemble to load again")
        np.testing.assert_array_equal(_infer(client, "ens", x), x)
        assert _states(client).get("add1") != "READY"
        config = client.get_model_config("ens", as_json=True)["config"]
        assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["same"]


def test_an_ensemble_a_client_unloads_while_another_wakes_stays_unloaded(tmp_path: Path) -> None:
    """Both ensembles use ``shared``; unloading it unloads both. Loading it again wakes ``ens_a`` first;
    while that load is under way a client unloads ``ens_b``, and that unload holds: the wake must not
    load ``ens_b`` again once ``ens_a`` is done (it went through the names it had listed at its start)."""
    repo = tmp_path / "repo"
    add_identity(repo, "shared")
    add_ensemble(repo, "ens_a", [step("shared", *ONE_STEP)])
    add_ensemble(repo, "ens_b", [step("shared", *ONE_STEP)])

    async def main() -> dict[str, ModelState]:
        manager = ModelManager(repo, control_mode="explicit")
        load = manager.load

        async def load_meanwhile_unloading_b(name: str, config_override: dict[str, Any] | None = None) -> None:
            if name == "ens_a":  # the wake's first load: a client's unload of ens_b lands meanwhile
                await manager.unload("ens_b", client=True)
            await load(name, config_override)

        try:
            await manager.load("ens_a")
            await manager.load("ens_b")
            await manager.unload("shared")
            manager.load = load_meanwhile_unloading_b  # type: ignore[method-assign]
            await manager.load("shared")
            return {name: manager.entry(name).state for name in manager.names()}
        finally:
            await manager.close()

    states = asyncio.run(main())
    assert states == {"shared": ModelState.READY, "ens_a": ModelState.READY, "ens_b": ModelState.UNAVAILABLE}
