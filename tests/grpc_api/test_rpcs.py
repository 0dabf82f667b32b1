"""Every RPC against a real server, through Shoal's own stubs and through tritonclient."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from shoal.protocol import METHODS, InferenceStub
from shoal.protocol import service_pb2 as pb
from tests.conftest import RunningServer

pytestmark = pytest.mark.other_engine  # every gRPC test here also runs on grpcio (conftest)

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def simple_request(a: np.ndarray = A, b: np.ndarray = B, **fields) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="simple", **fields)
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        request.inputs.add(name=name, datatype="INT32", shape=value.shape)
        request.raw_input_contents.append(value.tobytes())
    return request


def decode(response: pb.ModelInferResponse, index: int) -> np.ndarray:
    out = response.outputs[index]
    return np.frombuffer(response.raw_output_contents[index], dtype=np.int32).reshape(tuple(out.shape))


@pytest.fixture
def client(example_server: RunningServer):
    with triton.InferenceServerClient(example_server.url) as client:
        yield client


# -- our stubs -------------------------------------------------------------------------------------


def test_health_and_server_metadata(stub: InferenceStub) -> None:
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="simple")).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="simple", version="1")).ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name="simple", version="2")).ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name="nope")).ready
    metadata = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert metadata.name == "shoal" and metadata.version
    assert " ".join(metadata.extensions) == (  # Triton 2.51's list, in its order (run beside it)
        "classification sequence model_repository model_repository(unload_dependents) schedule_policy "
        "model_configuration system_shared_memory cuda_shared_memory binary_tensor_data parameters statistics "
        "trace logging"
    )


def test_model_metadata_reports_batch_dimension(stub: InferenceStub) -> None:
    metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name="simple"))
    assert metadata.platform == "onnxruntime_onnx" and list(metadata.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    strings = stub.ModelMetadata(pb.ModelMetadataRequest(name="strings"))
    assert list(strings.inputs[0].shape) == [-1] and strings.inputs[0].datatype == "BYTES"


def test_model_config(stub: InferenceStub) -> None:
    config = stub.ModelConfig(pb.ModelConfigRequest(name="simple")).config
    assert config.name == "simple" and config.max_batch_size == 8 and config.backend == "onnxruntime"
    assert [i.name for i in config.input] == ["INPUT0", "INPUT1"]
    assert config.version_policy.latest.num_versions == 1


def test_infer_raw_and_every_output(stub: InferenceStub) -> None:
    response = stub.ModelInfer(simple_request(id="req-7"))
    assert response.model_name == "simple" and response.model_version == "1" and response.id == "req-7"
    assert [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(decode(response, 0), A + B)
    np.testing.assert_array_equal(decode(response, 1), A - B)


def test_infer_typed_contents_and_a_subset_of_outputs(stub: InferenceStub) -> None:
    request = pb.ModelInferRequest(model_name="simple", model_version="1")
    batch = np.arange(48, dtype=np.int32).reshape(3, 16)
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[3, 16])
        tensor.contents.int_contents.extend(batch.reshape(-1).tolist())
    request.outputs.add(name="OUTPUT1")
    response = stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["OUTPUT1"] and len(response.raw_output_contents) == 1
    np.testing.assert_array_equal(decode(response, 0), np.zeros((3, 16), dtype=np.int32))


def test_stream_infer_answers_each_request_and_survives_errors(stub: InferenceStub) -> None:
    """Responses come in completion order, so they are matched by id (tests/grpc_api/test_stream_infer.py has more)."""
    bad = simple_request(id="b")
    bad.inputs[0].datatype = "FP32"
    responses = list(stub.ModelStreamInfer(iter([simple_request(id="a"), bad, simple_request(id="c")])))
    by_id = {r.infer_response.id: r for r in responses}
    assert len(responses) == 3 and {i: r.error_message == "" for i, r in by_id.items()} == {
        "a": True,
        "b": False,
        "c": True,
    }
    assert "data-type is 'FP32'" in by_id["b"].error_message
    np.testing.assert_array_equal(decode(by_id["a"].infer_response, 0), A + B)
    # A model that is not decoupled: its answer is marked final, a failure not (Triton 2.51, run beside
    # it in session 53; Shoal marked neither, and a client waiting for the flag waited for good).
    final = {i: dict(r.infer_response.parameters) for i, r in by_id.items()}
    assert final["a"]["triton_final_response"].bool_param and final["c"]["triton_final_response"].bool_param
    assert "triton_final_response" not in final["b"]


def test_repository_index(stub: InferenceStub) -> None:
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest())
    rows = {(m.name, m.version, m.state) for m in index.models}
    assert ("simple", "1", "READY") in rows and ("mlp", "1", "READY") in rows


def test_every_rpc_runs_under_the_error_guard() -> None:
    from grpc_health.v1 import health_pb2

    from shoal.grpc.health import HealthReporter
    from shoal.grpc.server import health_handlers, method_handlers
    from shoal.grpc.servicer import InferenceServicer

    handlers = method_handlers(InferenceServicer(core=None))  # type: ignore[arg-type]
    assert set(handlers) == set(METHODS)
    health = health_handlers(HealthReporter())
    assert set(health) == {m.name for m in health_pb2.DESCRIPTOR.services_by_name["Health"].methods}
    for handler in [*handlers.values(), *health.values()]:
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_stream
        assert getattr(behaviour, "__shoal_guarded__", False)


def test_large_tensor_beyond_grpc_default_limit(stub: InferenceStub) -> None:
    """A 32 MiB request and reply: message limits are raised above grpc's 4 MiB default."""
    request = pb.ModelInferRequest(model_name="identity_uint8")
    payload = np.random.default_rng(0).integers(0, 255, (1, 32 * 2**20), dtype=np.uint8)
    request.inputs.add(name="IN", datatype="UINT8", shape=payload.shape)
    request.raw_input_contents.append(payload.tobytes())
    response = stub.ModelInfer(request)
    assert response.raw_output_contents[0] == payload.tobytes()


# -- tritonclient -----------------------------------------------------------------------------------


def test_tritonclient_health_metadata_config_index(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and not client.is_model_ready("nope")
    assert client.get_server_metadata().name == "shoal"
    metadata = client.get_model_metadata("simple", as_json=True)
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": ["-1", "16"]}
    config = client.get_model_config("simple", as_json=True)["config"]
    assert config["max_batch_size"] == 8 and config["input"][1]["name"] == "INPUT1"
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {"name": "simple", "version": "1", "state": "READY"} in index


def test_tritonclient_infer(client: triton.InferenceServerClient) -> None:
    inputs = [triton.InferInput("INPUT0", [2, 16], "INT32"), triton.InferInput("INPUT1", [2, 16], "INT32")]
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a * 2)
    result = client.infer("simple", inputs, request_id="7", outputs=[triton.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 3)
    assert result.as_numpy("OUTPUT1") is None
    assert result.get_response().id == "7"


def test_tritonclient_stream_infer(client: triton.InferenceServerClient) -> None:
    import queue

    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inputs = [triton.InferInput("INPUT0", [1, 16], "INT32"), triton.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(A)
        inputs[1].set_data_from_numpy(B)
        client.async_stream_infer("simple", inputs, request_id="s1")
        result, error = results.get(timeout=30)
    finally:
        client.stop_stream()
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def test_tritonclient_unknown_model_uses_tritons_wording(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"  # Triton 2.51's (run here)
    assert "Request for unknown model: 'nope' is not found" in caught.value.message()


def test_every_rpc_has_one_of_the_restriction_categories() -> None:
    """The flag accepts exactly the categories the RPC table uses (Triton's names)."""
    from shoal.grpc.restrict import CATEGORIES
    from shoal.protocol import METHODS
    from shoal.settings import RESTRICTION_CATEGORIES

    assert set(CATEGORIES) == set(METHODS)
    assert set(CATEGORIES.values()) == set(RESTRICTION_CATEGORIES)
