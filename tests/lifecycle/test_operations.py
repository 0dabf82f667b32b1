"""What operators expect: health service, reflection, Prometheus metrics, restricted repository control."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from shoal.clients import ClientError, InferenceClient
from tests import models

A = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.fixture
def running(tmp_path: Path, server_factory):
    repo = models.repository(tmp_path, "simple")
    models.add_broken_models(repo)
    return server_factory(
        repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "simple",
        "--load-model",
        "bad_syntax",
        "--grpc-restricted-protocol",
        "model-repository:admin-key=s3cret",
        "--exit-on-error",
        "false",
    )


@pytest.mark.other_engine
def test_health_service_per_model(running) -> None:
    with grpc.insecure_channel(running.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def status(service: str) -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        assert status("simple") == health_pb2.HealthCheckResponse.SERVING
        assert status("inference.GRPCInferenceService") == health_pb2.HealthCheckResponse.NOT_SERVING  # strict
        assert status("bad_syntax") == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            status("never-heard-of-it")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.other_engine
def test_reflection_lists_and_describes_the_wire_service(running) -> None:
    with grpc.insecure_channel(running.url) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("inference.GRPCInferenceService")
        infer = service.methods_by_name["ModelInfer"]
        assert infer.input_type.full_name == "inference.ModelInferRequest"
        assert infer.input_type.fields_by_name["raw_input_contents"].number == 7


def test_metrics_use_tritons_names(running) -> None:
    with InferenceClient(running.url, timeout_s=30) as client:
        for _ in range(3):
            client.infer("simple", {"INPUT0": A, "INPUT1": A})
        with pytest.raises(ClientError):
            client.infer("simple", {"INPUT0": A, "INPUT1": A, "EXTRA": A})
    text = urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=10).read().decode()
    labels = '{model="simple",version="1"}'
    assert f"nv_inference_request_success{labels} 3\n" in text
    assert f"nv_inference_count{labels} 3\n" in text
    assert f"nv_inference_exec_count{labels} 3\n" in text
    assert 'nv_inference_request_failure{model="simple",reason="OTHER",version="1"} 1\n' in text  # the EXTRA input
    for name in (
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
    ):
        assert f"{name}{labels}" in text
    assert "_total{" not in text.split("# HELP shoal_")[0]  # Triton's families: no _total suffix
    assert f"nv_inference_pending_request_count{labels} 0\n" in text
    assert 'shoal_model_memory_bytes{device="cpu",model="simple",version="1"}' in text
    assert "process_resident_memory_bytes" in text


def test_metrics_can_be_turned_off(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo, "--allow-metrics", "false")
    assert server.metrics_port == 0


@pytest.mark.other_engine
def test_repository_control_needs_the_configured_header(running) -> None:
    with InferenceClient(running.url, timeout_s=30) as anonymous:
        for call in (
            lambda: anonymous.load_model("simple"),
            lambda: anonymous.unload_model("simple"),
            anonymous.repository_index,
        ):
            with pytest.raises(ClientError) as caught:
                call()
            assert caught.value.status == grpc.StatusCode.UNAVAILABLE  # as Triton 2.51 answers
            expected = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
            assert caught.value.message == expected
        assert anonymous.is_model_ready("simple")  # other categories stay open
    with InferenceClient(running.url, timeout_s=30, headers={"triton-grpc-protocol-admin-key": "s3cret"}) as admin:
        admin.load_model("simple")
        assert any(e.name == "simple" and e.state == "READY" for e in admin.repository_index())


@pytest.mark.other_engine
def test_message_size_limit(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    models.add_identity(repo, "bytes", "UINT8", max_batch_size=0)
    server = server_factory(repo, "--grpc-max-message-mb", "1")
    with InferenceClient(server.url, timeout_s=30) as client:
        assert client.infer("bytes", {"IN": np.zeros(1000, np.uint8)})["OUT"].shape == (1000,)
        with pytest.raises(ClientError) as caught:
            client.infer("bytes", {"IN": np.zeros(2 * 2**20, np.uint8)})
        assert caught.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.is_live()
