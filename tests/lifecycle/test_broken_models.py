"""Broken models beside healthy ones: each is UNAVAILABLE with its reason; the rest serve."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.grpc_api.test_rpcs import A, B, decode, simple_request


def test_broken_models_beside_healthy(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    reasons = models.add_broken_models(repo)
    server = server_factory(repo, "--exit-on-error", "false")
    with grpc.insecure_channel(server.url) as channel:
        stub = InferenceStub(channel)
        index = {m.name: m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
        assert index["simple"].state == "READY"
        for name, phrase in reasons.items():
            assert index[name].state == "UNAVAILABLE", name
            assert phrase in index[name].reason, (name, index[name].reason)
            assert str(tmp_path) not in index[name].reason  # files named relative to the repository
            assert not stub.ModelReady(pb.ModelReadyRequest(name=name)).ready
            bad = simple_request()
            bad.model_name = name
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(bad)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # no version loaded: Triton 2.51's answer
            assert caught.value.details() == f"Request for unknown model: '{name}' has no available versions"
        ready_only = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True)).models
        assert [m.name for m in ready_only] == ["simple"]
        # Triton's strict readiness: not ready while a model failed to load; live all the same.
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready
        assert stub.ServerLive(pb.ServerLiveRequest()).live
        np.testing.assert_array_equal(decode(stub.ModelInfer(simple_request()), 0), A + B)


def test_mismatch_messages_name_the_tensor(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, old, new in [
        ("wrong_type", "TYPE_INT32", "TYPE_FP32"),
        ("wrong_name", '"OUTPUT1"', '"OUTPUT9"'),
        ("no_batch", "max_batch_size: 8", "max_batch_size: 0"),
    ]:
        models.copy_example(repo, "simple")
        (repo / "simple").rename(repo / name)
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text().replace('"simple"', f'"{name}"').replace(old, new, 1))
    server = server_factory(repo, "--strict-readiness", "false", "--exit-on-error", "false")
    with grpc.insecure_channel(server.url) as channel:
        stub = InferenceStub(channel)
        assert stub.ServerReady(pb.ServerReadyRequest()).ready  # not strict: the server itself is up
        index = {m.name: m.reason for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
    assert "input 'INPUT0' is TYPE_FP32 in the config but TYPE_INT32 in the model" in index["wrong_type"]
    assert "output 'OUTPUT9' is not an output of the model" in index["wrong_name"]
    assert "input 'INPUT0' has dims [16] in the config but shape [-1, 16] in the model" in index["no_batch"]


def test_gpu_instance_group_without_a_gpu_is_a_clear_load_error(
    tmp_path: Path, server_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a GPU host too: the server sees no CUDA device
    repo = models.repository(tmp_path, "simple")
    models.set_instance_kind(repo / "simple", "KIND_GPU")
    server = server_factory(repo, "--exit-on-error", "false")
    with grpc.insecure_channel(server.url) as channel:
        index = InferenceStub(channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
    assert index[0].state == "UNAVAILABLE"
    assert "asks for KIND_GPU but no CUDA device is available" in index[0].reason
