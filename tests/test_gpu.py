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
    repo = tmp_path / "repo"
    repo.mkdir()
    models.copy_example(repo, "simple")
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    server = server_factory(repo)
    with grpc.insecure_channel(server.url) as channel:
        stub = InferenceStub(channel)
        assert stub.ModelReady(pb.ModelReadyRequest(name="simple")).ready, server.log()
        np.testing.assert_array_equal(decode(stub.ModelInfer(simple_request()), 0), A + B)
    assert "CUDAExecutionProvider" in server.log()
