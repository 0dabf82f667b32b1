"""A load whose client gives up runs to its end, on a thread that no request needs (review of session 47).

A client's deadline cancels its RPC's handler. A load cancelled with it let go of its model's lock
while its thread went on in the model's ``initialize``, so each retry started another build: the
builds held asyncio's default threads, which also convert large requests, so every model's large
requests stalled behind a model stuck in ``initialize``, and what the abandoned builds made was
never served nor closed (instances leaked for good).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from shoal.errors import ErrorCode, ShoalError
from shoal.lifecycle.manager import ModelManager
from tests.ensemble_models import add_ensemble, step
from tests.models import add_identity
from tests.polling import wait_until
from tests.python_models import FP32_4_ON_A_THREAD_CONFIG, write_model

RETRIES = 8  # past asyncio's default threads here (cores + 4)

# initialize waits for the test's word (a file), bounded; each instance alive is a file of its own.
SLOW_START = """
import os
import time
import uuid
from pathlib import Path

import triton_python_backend_utils as pb_utils

FOLDER = Path({folder!r})


class TritonPythonModel:
    def initialize(self, args):
        self.mark = FOLDER / "alive" / uuid.uuid4().hex
        self.mark.write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not (FOLDER / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]

    def finalize(self):
        self.mark.unlink()
        (FOLDER / "finalized" / self.mark.name).touch()
"""

CONFIG = FP32_4_ON_A_THREAD_CONFIG


def _large_request(grpc_url: str, http_url: str) -> None:
    """A 4 MB request to another model, over gRPC and HTTP: both convert it off the event loop."""
    value = np.arange(1 << 20, dtype=np.float32)
    data = grpcclient.InferInput("IN", [1 << 20], "FP32")
    data.set_data_from_numpy(value)
    with grpcclient.InferenceServerClient(grpc_url) as client:
        assert np.array_equal(client.infer("big", [data], client_timeout=30).as_numpy("OUT"), value)
    data = httpclient.InferInput("IN", [1 << 20], "FP32")
    data.set_data_from_numpy(value)
    with httpclient.InferenceServerClient(http_url, network_timeout=30) as client:
        assert np.array_equal(client.infer("big", [data]).as_numpy("OUT"), value)


def test_loads_the_client_gave_up_on_finish_and_stall_nothing_else(tmp_path: Path, server_factory: Any) -> None:
    marks = tmp_path / "marks"
    (marks / "alive").mkdir(parents=True)
    (marks / "finalized").mkdir()
    repo = tmp_path / "repo"
    write_model(repo, "slow_start", CONFIG, SLOW_START.format(folder=str(marks)))
    add_identity(repo, "big", "FP32", max_batch_size=0)
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "big")
    with grpcclient.InferenceServerClient(server.url) as client:
        for _ in range(RETRIES):
            with pytest.raises(InferenceServerException) as gave_up:
                client.load_model("slow_start", client_timeout=0.3)
            assert gave_up.value.status() == "StatusCode.DEADLINE_EXCEEDED", gave_up.value
        wait_until(lambda: any((marks / "alive").iterdir()), 30, "the model's initialize to start")
        _large_request(server.url, server.http_url)  # while initialize still waits: it stalled here

        (marks / "go").touch()
        client.load_model("slow_start", client_timeout=120)  # after every load queued before it
        assert client.is_model_ready("slow_start")
        alive = list((marks / "alive").iterdir())
        assert len(alive) == 1, f"{len(alive)} instances alive, one served"
        client.unload_model("slow_start", client_timeout=60)
        wait_until(lambda: not any((marks / "alive").iterdir()), 30, "the served instance to be finalized")


def test_an_unload_waits_for_the_load_its_client_gave_up_on(tmp_path: Path, server_factory: Any) -> None:
    """An ensemble's load given up while its composing model loaded, then its unload: the unload comes
    after the load, as Triton orders them (the unload found nothing loaded, and the load then ended
    with the ensemble served)."""
    marks = tmp_path / "marks"
    (marks / "alive").mkdir(parents=True)
    (marks / "finalized").mkdir()
    repo = tmp_path / "repo"
    write_model(repo, "slow_start", CONFIG, SLOW_START.format(folder=str(marks)))
    four = "data_type: TYPE_FP32 dims: [ 4 ]"
    add_ensemble(
        repo,
        "slow_ensemble",
        [step("slow_start", {"IN": "IN"}, {"OUT": "OUT"})],
        io=f'input [ {{ name: "IN" {four} }} ]\noutput [ {{ name: "OUT" {four} }} ]',
        max_batch_size=0,
    )
    server = server_factory(repo, "--model-control-mode", "explicit")
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException) as gave_up:
            client.load_model("slow_ensemble", client_timeout=0.3)
        assert gave_up.value.status() == "StatusCode.DEADLINE_EXCEEDED", gave_up.value
        go = threading.Timer(1.0, (marks / "go").touch)  # the load ends a moment after the unload is asked for
        go.start()
        try:
            client.unload_model("slow_ensemble", client_timeout=120)
        finally:
            go.join()
        assert not client.is_model_ready("slow_ensemble")
        assert client.is_model_ready("slow_start")  # its composing model stays (no unload_dependents)


def test_clients_loads_and_unloads_of_a_model_run_in_the_order_asked(tmp_path: Path, server_factory: Any) -> None:
    """Load, unload, load, each given up by its client while the first load waits in initialize: they
    run in that order and the model ends loaded (the second load ran before the unload once)."""
    marks = tmp_path / "marks"
    (marks / "alive").mkdir(parents=True)
    (marks / "finalized").mkdir()
    repo = tmp_path / "repo"
    write_model(repo, "slow_start", CONFIG, SLOW_START.format(folder=str(marks)))
    server = server_factory(repo, "--model-control-mode", "explicit")
    with grpcclient.InferenceServerClient(server.url) as client:
        for call in (client.load_model, client.unload_model, client.load_model):
            with pytest.raises(InferenceServerException):
                call("slow_start", client_timeout=0.3)
        (marks / "go").touch()
        wait_until(lambda: any((marks / "finalized").iterdir()), 60, "the unload to finalize the first instance")
        wait_until(lambda: client.is_model_ready("slow_start"), 60, "the last load to serve the model again")
        assert len(list((marks / "alive").iterdir())) == 1


def test_calls_about_made_up_names_leave_nothing_behind(tmp_path: Path) -> None:
    """Review of session 47: each load of a name with no folder kept an entry for good (a client could
    grow the server's memory with made-up names); so did each unload (which answers OK, as Triton's)."""
    manager = ModelManager(tmp_path, control_mode="explicit")

    async def calls() -> None:
        for index in range(50):
            with pytest.raises(ShoalError):
                await manager.load(f"made_up_{index}", client=True)
            await manager.unload(f"made_up_{index}", client=True)

    asyncio.run(calls())
    assert not manager._client_order and not manager._locks  # noqa: SLF001 - what the server keeps per name


def test_a_request_that_waits_before_its_queue_is_served_through_a_reload(tmp_path: Path) -> None:
    """Found by the review of session 48: a request chose its version, then waited before it was queued
    (a large request's cache lookup runs on a thread; a shared-memory read, in the core); a reload
    retiring that version meanwhile stopped its queue, and the request failed as "the model is
    unloading" while the new version served. The retired version now serves what it took in."""
    from shoal.lifecycle.response_cache import ResponseCache
    from shoal.protocol.types import DataType
    from shoal.request_types import InferRequest, Tensor

    add_identity(tmp_path, "echo", "INT32")
    config = tmp_path / "echo" / "config.pbtxt"
    config.write_text(config.read_text() + "response_cache { enable: true }\n")
    manager = ModelManager(tmp_path, control_mode="explicit", response_cache=ResponseCache(1 << 20))
    value = np.arange(4, dtype=np.int32).reshape(1, 4)
    request = InferRequest("echo", "", "held", (Tensor("IN", DataType.INT32, (1, 4), value),))

    async def main() -> None:
        await manager.load("echo")
        chosen = manager.resolve("echo", "")
        assert chosen.cache is not None
        looked_up = chosen.cache.look_up
        waiting, go = asyncio.Event(), asyncio.Event()

        async def held(*args: Any) -> Any:
            waiting.set()
            await go.wait()  # as a thread's lookup of a large request takes its time
            return await looked_up(*args)

        chosen.cache.look_up = held  # type: ignore[method-assign]
        asked = asyncio.create_task(chosen.infer(request))
        await waiting.wait()
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))  # rebuilt
        reload = asyncio.create_task(manager.load("echo"))
        while manager.resolve("echo", "") is chosen:  # polled: the reload builds on a thread
            await asyncio.sleep(0.01)
        go.set()
        response = await asked
        await reload
        assert response.outputs[0].data.tolist() == value.tolist()
        await manager.close()

    asyncio.run(main())


def test_a_request_reading_shared_memory_through_a_reload_is_served_by_the_new_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, in the core: a request chose its version, then read its large shared-memory inputs on a
    thread; a reload retired that version meanwhile. The version is chosen again after the read."""
    from dataclasses import replace

    from shoal.core import local, shared_memory
    from shoal.protocol.types import DataType
    from shoal.request_types import InferRequest, RegionInput, RegionSlice, Tensor

    add_identity(tmp_path, "echo", "INT32")
    config = tmp_path / "echo" / "config.pbtxt"
    manager = ModelManager(tmp_path, control_mode="explicit")
    value = np.arange(4, dtype=np.int32).reshape(1, 4)
    reading, read = threading.Event(), threading.Event()

    def slow_read(regions: Any, request: InferRequest) -> InferRequest:
        reading.set()
        read.wait(60)  # as a large region's read takes its time
        return replace(request, inputs=(Tensor("IN", DataType.INT32, (1, 4), value),), region_inputs=())

    monkeypatch.setattr(shared_memory, "costly", lambda regions, request: True)
    monkeypatch.setattr(shared_memory, "with_region_inputs", slow_read)
    request = InferRequest(
        "echo",
        "",
        "from-a-region",
        (),
        region_inputs=(RegionInput("IN", DataType.INT32, (1, 4), RegionSlice("r", 0, 16)),),
    )

    async def main() -> None:
        await manager.load("echo")
        core = local.LocalCore(manager)
        chosen = manager.resolve("echo", "")
        asked = asyncio.create_task(core.infer(request))
        while not reading.is_set():  # polled: the read runs on a thread
            await asyncio.sleep(0.01)
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))  # rebuilt
        await manager.load("echo")  # the chosen version is retired: nothing of it was queued yet
        assert manager.resolve("echo", "") is not chosen
        read.set()
        response = await asked
        assert response.outputs[0].data.tolist() == value.tolist()
        await manager.close()

    asyncio.run(main())


def test_a_load_under_way_at_shutdown_installs_nothing_and_finalizes_what_it_built(tmp_path: Path) -> None:
    """Found by the review of session 49: a load still in ``initialize`` when ``close()`` began finished
    after it and installed its model, which nothing then unloaded (its ``finalize`` never ran, its
    instances outlived the server's own shutdown). ``close()`` now waits for it; it installs nothing,
    lets its instance go, and its client hears UNAVAILABLE; a load asked for after ``close()`` is refused."""
    marks = tmp_path / "marks"
    (marks / "alive").mkdir(parents=True)
    (marks / "finalized").mkdir()
    write_model(tmp_path / "repo", "slow_start", CONFIG, SLOW_START.format(folder=str(marks)))
    manager = ModelManager(tmp_path / "repo", control_mode="explicit")

    async def main() -> None:
        loading = asyncio.create_task(manager.load("slow_start", client=True))
        while not any((marks / "alive").iterdir()):  # polled: initialize runs on a thread
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(manager.close())
        await asyncio.sleep(0)  # close() has begun
        (marks / "go").touch()
        with pytest.raises(ShoalError) as refused:
            await loading
        assert refused.value.code is ErrorCode.UNAVAILABLE and "shutting down" in refused.value.message
        await closing
        assert manager.names() == [] and not manager.is_ready("slow_start", "")
        with pytest.raises(ShoalError) as late:
            await manager.load("slow_start", client=True)
        assert late.value.code is ErrorCode.UNAVAILABLE

    asyncio.run(main())
    assert not any((marks / "alive").iterdir()), "the instance built during the shutdown was not finalized"
    assert len(list((marks / "finalized").iterdir())) == 1
