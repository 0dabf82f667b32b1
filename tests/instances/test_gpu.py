"""GPU paths: run only where a CUDA device and onnxruntime's CUDA provider exist; the GPU host's
tooling (nvidia-smi parsing, the GPU check's guard) is checked everywhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from shoal.backends.devices import cuda_device_count
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.grpc_api.test_rpcs import A, B, decode, simple_request


def _cuda_provider() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def needs_cuda(test: Callable[..., None]) -> Callable[..., None]:
    skip = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device on this machine")
    return pytest.mark.gpu(skip(test))


# Captured from nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits: an
# H100 process, a process on a GPU without per-process figures, and one listed twice (two GPUs).
NVIDIA_SMI_COMPUTE_APPS = "4121, 2050\n4188, [N/A]\n4200, 300\n4200, 700\n[N/A], 12\n\n"


def test_nvidia_smi_output_with_missing_figures_parses() -> None:
    from shoal.tools import nvidia_smi

    used = nvidia_smi.parse_compute_apps(NVIDIA_SMI_COMPUTE_APPS)
    assert used == {4121: 2050.0, 4188: None, 4200: 1000.0}
    assert nvidia_smi.parse_compute_apps("No running processes found\n") == {}
    assert nvidia_smi.parse_compute_apps("17, N/A\n17, 5\n") == {17: None}


def test_the_gpu_check_fails_where_torch_cannot_see_the_drivers_gpus() -> None:
    from bench.gpu_check import cuda_problem

    assert "CUDA build of torch" in (cuda_problem(0, 1, "2.13.0+cpu") or "")
    assert cuda_problem(1, 1, "2.13.0+cu128") is None
    assert cuda_problem(0, 0, "2.13.0+cpu") is None  # no GPU at all: nothing to check, not a failure


@needs_cuda
def test_kind_auto_places_a_model_on_the_gpu(tmp_path: Path, server_factory) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    from shoal.clients import InferenceClient

    repo = tmp_path / "repo"
    (repo / "lin" / "1").mkdir(parents=True)
    torch.jit.script(torch.nn.Linear(8, 8)).save(str(repo / "lin" / "1" / "model.pt"))
    (repo / "lin" / "config.pbtxt").write_text(
        'backend: "pytorch"\nmax_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 8 ] } ]\ninstance_group [ { count: 1 } ]\n'
    )
    server = server_factory(repo)
    with InferenceClient(server.url, timeout_s=60) as client:
        assert client.infer("lin", {"x": np.ones((1, 8), np.float32)})["y"].shape == (1, 8)
        assert client.statistics("lin")[0]["memory_usage"][0]["type"] == "GPU"  # KIND_AUTO: torch can use it


@needs_cuda
def test_kind_auto_is_the_gpu_only_for_a_backend_that_can_use_it(tmp_path: Path, server_factory) -> None:
    """As Triton: an ONNX model goes to the GPU only when onnxruntime offers the CUDA execution
    provider (a CPU-only onnxruntime serves it on the CPU), the identity backend always to the CPU."""
    from shoal.clients import InferenceClient

    repo = models.repository(tmp_path, "simple")
    models.set_instance_kind(repo / "simple", "KIND_AUTO")
    models.add_identity(repo, "copy", "FP32")  # no instance group: KIND_AUTO
    server = server_factory(repo)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with InferenceClient(server.url, timeout_s=60) as client:
        np.testing.assert_array_equal(client.infer("simple", {"INPUT0": a, "INPUT1": a})["OUTPUT0"], 2 * a)
        simple = client.statistics("simple")[0]["memory_usage"]
        identity = client.statistics("copy")[0]["memory_usage"]
    assert {u["type"] for u in simple} == {"GPU" if _cuda_provider() else "CPU"}, server.log()
    assert [u["type"] for u in identity] == ["CPU"]


@needs_cuda
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


@needs_cuda
def test_pytorch_kind_gpu_runs_each_executor_on_its_own_stream(tmp_path: Path, server_factory) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    from concurrent.futures import ThreadPoolExecutor

    from shoal.clients import InferenceClient

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
