"""GPU paths: run only where a CUDA device and onnxruntime's CUDA provider exist."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from server.backends.devices import cuda_device_count
from server.pb import InferenceStub
from server.pb import service_pb2 as pb
from tests import models
from tests.test_rpcs import A, B, decode, simple_request


def _cuda_provider() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device on this machine"),
]


def test_kind_gpu_serves_on_the_cuda_provider(tmp_path: Path, server_factory) -> None:
    if not _cuda_provider():
        pytest.skip("the installed onnxruntime has no CUDA execution provider")
    repo = models.repository(tmp_path, "simple")
    models.set_instance_kind(repo / "simple", "KIND_GPU")
    server = server_factory(repo)
    with grpc.insecure_channel(server.url) as channel:
        stub = InferenceStub(channel)
        assert stub.ModelReady(pb.ModelReadyRequest(name="simple")).ready, server.log()
        np.testing.assert_array_equal(decode(stub.ModelInfer(simple_request()), 0), A + B)
    assert "CUDAExecutionProvider" in server.log()


def test_pytorch_kind_gpu_runs_each_executor_on_its_own_stream(tmp_path: Path, server_factory) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    from concurrent.futures import ThreadPoolExecutor

    from clients import InferenceClient

    repo = tmp_path / "repo"
    (repo / "lin" / "1").mkdir(parents=True)
    torch.jit.script(torch.nn.Linear(64, 64)).save(str(repo / "lin" / "1" / "model.pt"))
    (repo / "lin" / "config.pbtxt").write_text(
        'backend: "pytorch"\nmax_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 64 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 64 ] } ]\ninstance_group [ { count: 4 kind: KIND_GPU } ]\n'
    )
    server = server_factory(repo)
    x = np.ones((2, 64), np.float32)

    def call(_: int) -> np.ndarray:
        with InferenceClient(server.url, timeout_s=60) as client:
            return client.infer("lin", {"x": x})["y"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(32)))
    assert all(np.allclose(r, results[0]) for r in results)
    with InferenceClient(server.url, timeout_s=60) as client:
        assert client.statistics("lin")[0]["memory_usage"][0]["type"] == "GPU"
