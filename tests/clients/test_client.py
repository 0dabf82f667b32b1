"""Shoal's client library against a real server: sync and asyncio, every datatype, one error type."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from shoal.clients import AsyncInferenceClient, ClientError, InferenceClient, TlsOptions
from shoal.clients.stubs import InferenceStub, service_pb2
from shoal.tools import local_server
from tests import models
from tests.conftest import RunningServer
from tests.models import ALL_DATATYPES
from tests.protocol.test_datatypes import sample

pytestmark = pytest.mark.other_engine  # every gRPC test here also runs on grpcio (conftest)

A = np.arange(32, dtype=np.int32).reshape(2, 16)


@pytest.fixture
def client(example_server: RunningServer):
    with InferenceClient(example_server.url, timeout_s=30) as client:
        yield client


def test_health_metadata_config_index_statistics(client: InferenceClient) -> None:
    assert client.is_live() and client.is_ready() and client.is_model_ready("simple")
    assert not client.is_model_ready("nope")
    assert "statistics" in client.server_metadata().extensions
    metadata = client.model_metadata("simple")
    assert metadata.versions == ("1",) and metadata.inputs[0].shape == (-1, 16)
    assert client.model_config("simple")["max_batch_size"] == 8
    assert any(e.name == "simple" and e.state == "READY" for e in client.repository_index())
    client.infer("simple", {"INPUT0": A, "INPUT1": A})
    stats = client.statistics("simple")
    assert stats[0]["name"] == "simple" and int(stats[0]["inference_count"]) >= 2


def test_infer_returns_numpy(client: InferenceClient) -> None:
    outputs = client.infer("simple", {"INPUT0": A, "INPUT1": A}, ["OUTPUT1"], request_id="x", priority=1)
    assert list(outputs) == ["OUTPUT1"]
    np.testing.assert_array_equal(outputs["OUTPUT1"], np.zeros_like(A))


@pytest.mark.parametrize("datatype", ALL_DATATYPES)
def test_every_datatype_round_trips(client: InferenceClient, datatype: str) -> None:
    data = sample(datatype)
    out = client.infer(f"identity_{datatype.lower()}", {"IN": data})["OUT"]
    if datatype == "BYTES":
        assert out.tolist() == data.tolist()
    else:
        assert out.dtype == data.dtype
        np.testing.assert_array_equal(out, data)
    if datatype == "BF16":
        assert out.dtype == np.dtype(ml_dtypes.bfloat16)


def test_errors_carry_the_grpc_status(client: InferenceClient) -> None:
    with pytest.raises(ClientError) as caught:
        client.infer("nope", {"INPUT0": A})
    assert caught.value.status == grpc.StatusCode.NOT_FOUND
    assert "Request for unknown model: 'nope'" in caught.value.message
    with pytest.raises(ClientError) as caught:
        client.infer("simple", {"INPUT0": A.astype(np.float32), "INPUT1": A})
    assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ClientError) as caught:
        client.unload_model("simple")  # control mode none: no repository control
    assert caught.value.status == grpc.StatusCode.UNAVAILABLE and "not allowed" in caught.value.message
    moved = service_pb2.TraceSettingRequest()
    moved.settings["trace_file"].value.append("/tmp/elsewhere.json")  # not over the network, as Triton
    with pytest.raises(ClientError) as caught:
        client._call("TraceSetting", moved)
    assert caught.value.status == grpc.StatusCode.UNIMPLEMENTED


def test_async_client(example_server: RunningServer) -> None:
    async def scenario() -> None:
        async with AsyncInferenceClient(example_server.url, timeout_s=30) as client:
            assert await client.is_live() and await client.is_model_ready("simple")
            results = await asyncio.gather(*[client.infer("simple", {"INPUT0": A * i, "INPUT1": A}) for i in range(8)])
            for i, outputs in enumerate(results):
                np.testing.assert_array_equal(outputs["OUTPUT0"], A * i + A)
            assert (await client.model_metadata("mlp")).inputs[0].shape == (-1, 256)
            with pytest.raises(ClientError) as caught:
                await client.model_config("nope")
            assert caught.value.status == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_tls_client_against_a_plaintext_server_fails_cleanly(example_server: RunningServer) -> None:
    with InferenceClient(example_server.url, tls=TlsOptions(server_name="localhost"), timeout_s=5) as client:
        with pytest.raises(ClientError) as caught:
            client.is_live()
    assert caught.value.status == grpc.StatusCode.UNAVAILABLE


def test_stubs_are_importable_alone(example_server: RunningServer) -> None:
    with grpc.insecure_channel(example_server.url) as channel:
        assert InferenceStub(channel).ServerLive(service_pb2.ServerLiveRequest()).live


def test_local_server_start_leaves_no_server_behind_when_interrupted(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C while local_server.start waits for the server (as in `shoal config tune`) kills the child."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(local_server.subprocess, "Popen", recording_popen)
    monkeypatch.setattr(local_server.time, "sleep", interrupt)  # the first wait for the port file
    with pytest.raises(KeyboardInterrupt):
        local_server.start(models.repository(tmp_path, "simple"), work_dir=tmp_path)
    monkeypatch.undo()
    assert len(started) == 1 and started[0].poll() is not None, "the server outlived the interrupted start"
