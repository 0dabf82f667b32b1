"""Triton's CUDA shared-memory extension.

Everywhere: the extension is listed, registration without GPUs is refused as Triton built without
GPU support refuses it, status and unregister answer Triton's codes and words (an unknown name, a
name registered as system shared memory), the shared-memory restriction guards the three calls,
in both process layouts; and the registry's CUDA path (windows, copies, when a mapping closes)
over a fake runtime backed by host memory. With a CUDA device (``gpu`` marker):
``tritonclient.utils.cuda_shared_memory`` regions feed a PyTorch model and receive its outputs.
"""

from __future__ import annotations

import base64
import ctypes
import gc
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from shoal.backends.devices import cuda_device_count
from shoal.core import shared_memory
from shoal.dataplane import cuda
from shoal.dataplane.regions import RegionRegistry
from shoal.errors import ErrorCode, ShoalError
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, RegionInput, RegionSlice, Tensor
from tests import models
from tests.conftest import RunningServer
from tests.polling import metric, wait_until

HANDLE = base64.b64encode(bytes(64))  # a cudaIpcMemHandle_t as tritonclient sends it (base64, decoded by the client)


def expect_error(status: str, text: str, call: Callable[[], object]) -> None:
    with pytest.raises(InferenceServerException) as failure:
        call()
    assert failure.value.status() == f"StatusCode.{status}", failure.value
    assert text in failure.value.message(), failure.value.message()


@pytest.fixture
def client(example_server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(example_server.url) as triton:
        yield triton
        triton.unregister_cuda_shared_memory()
        triton.unregister_system_shared_memory()


# -- everywhere ------------------------------------------------------------------------------------


def test_the_extension_is_listed_and_status_and_unregister_answer_as_triton(
    client: grpcclient.InferenceServerClient,
) -> None:
    assert "cuda_shared_memory" in client.get_server_metadata().extensions
    assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
    expect_error(
        "NOT_FOUND",
        "Unable to find cuda shared memory region: 'nope'",
        lambda: client.get_cuda_shared_memory_status("nope"),
    )
    client.unregister_cuda_shared_memory("never registered")  # not an error, as in Triton
    client.unregister_cuda_shared_memory()


def test_a_system_region_is_not_a_cuda_one(client: grpcclient.InferenceServerClient) -> None:
    tag = uuid.uuid4().hex[:12]
    handle = shm.create_shared_memory_region(f"sys_{tag}", f"/shoal_test_{tag}", 64)
    try:
        client.register_system_shared_memory(f"sys_{tag}", f"/shoal_test_{tag}", 64)
        expect_error(
            "NOT_FOUND",
            f"The region named 'sys_{tag}' is registered as system shared memory, not CUDA shared memory",
            lambda: client.get_cuda_shared_memory_status(f"sys_{tag}"),
        )
        client.unregister_cuda_shared_memory(f"sys_{tag}")  # another kind's name: left alone, as in Triton
        client.unregister_cuda_shared_memory()
        assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {f"sys_{tag}"}
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


@pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has a CUDA device")
def test_registration_without_gpus_is_refused_as_tritons_cpu_build(client: grpcclient.InferenceServerClient) -> None:
    expect_error(
        "INVALID_ARGUMENT",
        "failed to register CUDA shared memory region: 'r', GPUs not supported",
        lambda: client.register_cuda_shared_memory("r", HANDLE, 0, 64),
    )
    assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}


def test_the_cuda_calls_are_restricted(server_factory, tmp_path: Path) -> None:
    server = server_factory(
        models.repository(tmp_path, "simple"), "--grpc-restricted-protocol", "shared-memory:admin=yes"
    )
    allowed = {"triton-grpc-protocol-admin": "yes"}
    with grpcclient.InferenceServerClient(server.url) as triton:
        for call in (
            lambda **h: triton.register_cuda_shared_memory("r", HANDLE, 0, 64, **h),
            lambda **h: triton.get_cuda_shared_memory_status(**h),
            lambda **h: triton.unregister_cuda_shared_memory(**h),
        ):
            expect_error(
                "UNAVAILABLE", "This protocol is restricted, expecting header 'triton-grpc-protocol-admin'", call
            )
        triton.unregister_cuda_shared_memory(headers=allowed)
        assert triton.get_cuda_shared_memory_status(headers=allowed, as_json=True).get("regions", {}) == {}
        if cuda_device_count() == 0:
            expect_error(
                "INVALID_ARGUMENT",
                "GPUs not supported",
                lambda: triton.register_cuda_shared_memory("r", HANDLE, 0, 64, headers=allowed),
            )


# -- the registry's CUDA path over a fake runtime --------------------------------------------------


class FakeRuntime:
    """Device memory played by host buffers: a handle names an allocation; records what is open."""

    def __init__(self, allocations: dict[bytes, bytearray]) -> None:
        self.allocations = allocations
        self.open_addresses: set[int] = set()
        self._buffers: dict[int, Any] = {}
        self.copies = 0

    def device_count(self) -> int:
        return 1

    def open(self, handle: bytes, device_id: int) -> int:
        if handle not in self.allocations:
            raise cuda.CudaError("cudaIpcOpenMemHandle: cudaErrorInvalidValue")
        buffer = (ctypes.c_char * len(self.allocations[handle])).from_buffer(self.allocations[handle])
        address = ctypes.addressof(buffer)
        self._buffers[address] = buffer
        self.open_addresses.add(address)
        return address

    def allocation_size(self, address: int) -> int:
        return len(self._buffers[address])

    def close(self, address: int, device_id: int) -> None:
        self.open_addresses.remove(address)

    def copy(self, target: int, source: int, byte_size: int, device_id: int) -> None:
        self.copies += 1
        ctypes.memmove(target, source, byte_size)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    runtime = FakeRuntime({b"a" * 64: bytearray(range(64)), b"b" * 64: bytearray(16)})
    monkeypatch.setattr(cuda, "_loaded", runtime)
    return runtime


def refused(code: ErrorCode, text: str, call: Callable[[], object]) -> None:
    with pytest.raises(ShoalError) as failure:
        call()
    assert failure.value.code is code and text in failure.value.message, failure.value.message


def test_cuda_windows_copy_through_the_runtime_and_keep_the_mapping_open(fake: FakeRuntime) -> None:
    registry = RegionRegistry(1 << 20)
    registry.register_cuda("in", b"a" * 64, 0, 64)
    registry.register_cuda("out", b"b" * 64, 0, 16)
    assert [(s.name, s.device_id, s.byte_size) for s in registry.cuda_status("")] == [("in", 0, 64), ("out", 0, 16)]
    assert registry.on_device("in") and not registry.on_device("nope")
    assert registry.window("in", 8, 4).read().tolist() == [8, 9, 10, 11]
    window = registry.window("out", 4, 8)
    window.write(b"\x01\x02")
    assert bytes(fake.allocations[b"b" * 64][:8]) == b"\0\0\0\0\x01\x02\0\0"
    assert len(fake.open_addresses) == 2
    registry.unregister_cuda("out")  # a request still holds a window: the handle stays open
    assert len(fake.open_addresses) == 2
    del window
    gc.collect()
    assert len(fake.open_addresses) == 1
    registry.unregister("in")  # the system kind's unregister leaves CUDA regions alone
    assert len(fake.open_addresses) == 1
    registry.unregister_cuda("")
    assert not fake.open_addresses


def test_cuda_registration_errors_in_tritons_words(fake: FakeRuntime) -> None:
    registry = RegionRegistry(1 << 20)
    registry.register_cuda("r", b"a" * 64, 0, 64)
    refused(
        ErrorCode.ALREADY_EXISTS,
        "shared memory region 'r' already in manager",
        lambda: registry.register_cuda("r", b"b" * 64, 0, 16),
    )
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "failed to register shared memory region 'big': invalid args",
        lambda: registry.register_cuda("big", b"b" * 64, 0, 17),
    )  # past the client's allocation
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "failed to register shared memory region: invalid args",
        lambda: registry.register_cuda("bad", b"c" * 64, 0, 16),
    )  # cudaIpcOpenMemHandle fails
    refused(ErrorCode.INVALID_ARGUMENT, "invalid args", lambda: registry.register_cuda("dev", b"b" * 64, 3, 16))
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "failed to register shared memory region 'zero': invalid args",
        lambda: registry.register_cuda("zero", b"b" * 64, 0, 0),
    )
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "raw_handle must be the 64 bytes",
        lambda: registry.register_cuda("short", b"b" * 8, 0, 16),
    )
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "--shared-memory-max-mb",
        lambda: RegionRegistry(8).register_cuda("r", b"b" * 64, 0, 16),
    )
    refused(
        ErrorCode.NOT_FOUND,
        "The region named 'r' is registered as CUDA shared memory, not system shared memory",
        lambda: registry.status("r"),
    )
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "Invalid offset + byte size for shared memory region: 'r'",
        lambda: registry.window("r", 60, 8),
    )
    assert len(fake.open_addresses) == 1  # every refused registration closed what it opened


def test_a_request_reads_and_writes_cuda_regions_through_the_core_flow(fake: FakeRuntime) -> None:
    """The host's flow (core.shared_memory) with a CUDA input, a CUDA output and an inline output."""
    registry = RegionRegistry(1 << 20)
    registry.register_cuda("in", b"a" * 64, 0, 64)
    registry.register_cuda("out", b"b" * 64, 0, 16)
    source = RegionInput("IN", DataType.INT32, (1, 2), RegionSlice("in", 8, 8))
    request = InferRequest("m", "", "", (), None, {}, {}, (source,), {"OUT": RegionSlice("out", 0, 16)})
    assert shared_memory.costly(registry, request)  # device copies: off the event loop
    read = shared_memory.with_region_inputs(registry, request)
    np.testing.assert_array_equal(read.inputs[0].data, np.frombuffer(bytes(range(8, 16)), np.int32).reshape(1, 2))
    windows = shared_memory.output_windows(registry, request)
    assert shared_memory.costly_outputs(windows)
    out = np.array([[5, 6]], np.int64)
    response = InferResponse(
        "m",
        "1",
        "",
        (Tensor("OUT", DataType.INT64, (1, 2), out), Tensor("EXTRA", DataType.INT32, (1,), np.array([1], np.int32))),
    )
    written = shared_memory.write_region_outputs(windows, response)
    assert bytes(fake.allocations[b"b" * 64]) == out.tobytes()
    assert written.in_regions == {"OUT"} and written.outputs[0].data.size == 0 and written.outputs[1].data.size == 1
    small = {"OUT": registry.window("out", 0, 8)}
    refused(
        ErrorCode.INTERNAL,
        "should be at least 16 bytes to hold the results",
        lambda: shared_memory.write_region_outputs(small, response),
    )


def test_nothing_cuda_is_loaded_before_a_cuda_registration() -> None:
    code = (
        "import sys, shoal.app, shoal.core.local, shoal.dataplane.regions; "
        "assert not any(m == 'torch' or m.startswith(('cuda', 'torch.')) for m in sys.modules), "
        "sorted(m for m in sys.modules if 'cuda' in m or 'torch' in m); "
        "maps = open('/proc/self/maps').read(); assert 'libcudart' not in maps and 'libcuda.' not in maps"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# A stand-in for libcudart and libcuda with the real C signatures, so the ctypes binding's argument
# and result types (the handle passed by value, pointers, sizes) are exercised without a GPU. Two
# allocations of 256 bytes: a handle whose first byte is 'A' or 'B' opens one; others fail.
FAKE_CUDART_C = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
static char memory[2][256];
int opened = 0, closed = 0, synchronized = 0, device = -1;
int cuInit(unsigned int flags) { return 100; }  /* CUDA_ERROR_NO_DEVICE: models stay on the CPU */
int cudaGetDeviceCount(int *count) { *count = 1; return 0; }
int cudaSetDevice(int d) { if (d != 0) return 101; device = d; return 0; }
const char *cudaGetErrorString(int err) { return err == 1 ? "invalid argument" : "invalid device ordinal"; }
int cudaIpcOpenMemHandle(void **ptr, cudaIpcMemHandle_t handle, unsigned int flags) {
    int which = handle.reserved[0] - 'A';
    if (which < 0 || which > 1 || handle.reserved[63] != 'z' || flags != 1) return 1;
    *ptr = memory[which]; opened++; return 0;
}
int cudaIpcCloseMemHandle(void *ptr) { closed++; return 0; }
int cudaStreamCreateWithFlags(void **stream, unsigned int flags) { *stream = (void *)0x5; return flags == 1 ? 0 : 1; }
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (kind != 4 || stream != (void *)0x5) return 1;
    memcpy(dst, src, n); return 0;
}
int cudaStreamSynchronize(void *stream) { synchronized++; return 0; }
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t ptr) {
    for (int i = 0; i < 2; i++) {
        uint64_t start = (uint64_t)(uintptr_t)memory[i];
        if (ptr >= start && ptr < start + 256) { *base = start; *size = 256; return 0; }
    }
    return 1;
}
"""


def _build_fake_cudart(folder: Path) -> Path:
    source, library = folder / "fake_cudart.c", folder / "lib" / "libfake_cudart.so"
    library.parent.mkdir()
    source.write_text(FAKE_CUDART_C)
    try:
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no working C compiler to build the stand-in CUDA runtime: {exc}")
    return library


@pytest.fixture
def fake_cudart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    loaded = ctypes.CDLL(str(_build_fake_cudart(tmp_path)))
    monkeypatch.setattr(cuda, "_loaded", cuda._Ctypes(loaded, loaded))
    return loaded


def test_the_ctypes_binding_passes_cudas_types(fake_cudart: ctypes.CDLL) -> None:
    registry = RegionRegistry(1 << 20)
    registry.register_cuda("a", b"A" + bytes(62) + b"z", 0, 256)
    registry.register_cuda("b", b"B" + bytes(62) + b"z", 0, 128)
    window = registry.window("a", 16, 4)
    window.write(b"\x01\x02\x03\x04")
    assert registry.window("a", 14, 8).read().tolist() == [0, 0, 1, 2, 3, 4, 0, 0]
    assert ctypes.c_int.in_dll(fake_cudart, "synchronized").value == 2  # each copy waited for
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "failed to register shared memory region 'big': invalid args",
        lambda: registry.register_cuda("big", b"B" + bytes(62) + b"z", 0, 257),
    )  # past the allocation
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "failed to register shared memory region: invalid args",
        lambda: registry.register_cuda("c", b"C" + bytes(62) + b"z", 0, 16),
    )  # the open fails
    with pytest.raises(cuda.CudaError, match="cudaSetDevice: invalid device ordinal"):
        cuda._loaded.open(b"A" * 64, 1)  # type: ignore[union-attr]
    registry.unregister_cuda("")
    assert ctypes.c_int.in_dll(fake_cudart, "closed").value == 2  # the window above is gone too
    del window
    gc.collect()
    assert ctypes.c_int.in_dll(fake_cudart, "closed").value == 3
    assert ctypes.c_int.in_dll(fake_cudart, "opened").value == 3


def test_cuda_regions_through_a_real_server_over_the_stand_in_runtime(
    server_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end, both layouts: the server loads the stand-in as libcudart/libcuda (no CUDA here), an
    output goes into one CUDA region and comes back as the next request's input from it."""
    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is here: the server would use it, not the stand-in")
    library = _build_fake_cudart(tmp_path)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(library.parent))  # found before the system's libraries
    first = cuda._libcudart_candidates()[0]  # the name the server loads first (a system runtime's, maybe)
    if "/" in first:
        pytest.skip(f"a CUDA runtime is installed with Python packages ({first}): the server would load it")
    (library.parent / first).symlink_to(library)
    (library.parent / "libcuda.so.1").symlink_to(library)
    repo = tmp_path / "repo"
    models.add_identity(repo, "identity_fp32", "FP32")
    server = server_factory(repo)
    values = np.array([[1.5, -2.0, 3.25, 8.0]], dtype=np.float32)
    with grpcclient.InferenceServerClient(server.url) as triton:
        triton.register_cuda_shared_memory("a", base64.b64encode(b"A" + bytes(62) + b"z"), 0, 256)
        regions = triton.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert regions == {"a": {"name": "a", "byte_size": "256"}}  # device 0: proto3 JSON leaves it out
        tensor = grpcclient.InferInput("IN", [1, 4], "FP32")
        tensor.set_data_from_numpy(values)
        output = grpcclient.InferRequestedOutput("OUT")
        output.set_shared_memory("a", 16, offset=32)
        result = triton.infer("identity_fp32", [tensor], outputs=[output])
        assert result.get_response().raw_output_contents == [b""]  # written into the CUDA region
        tensor.set_shared_memory("a", 16, offset=32)
        np.testing.assert_array_equal(triton.infer("identity_fp32", [tensor]).as_numpy("OUT"), values)
        expect_error(
            "INVALID_ARGUMENT",
            "failed to register shared memory region 'big': invalid args",
            lambda: triton.register_cuda_shared_memory("big", base64.b64encode(b"B" + bytes(62) + b"z"), 0, 257),
        )
        triton.unregister_cuda_shared_memory()
        assert triton.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}


def test_without_a_runtime_every_registration_is_refused_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "_loaded", "no CUDA runtime library could be loaded")
    refused(
        ErrorCode.INVALID_ARGUMENT,
        "failed to register CUDA shared memory region: '', GPUs not supported",
        lambda: RegionRegistry(0).register_cuda("", b"", 0, 0),
    )


# -- on a CUDA device ------------------------------------------------------------------------------


def _cudashm() -> Any:
    """tritonclient's CUDA helpers; they need cuda-python (``pip install -e .[gpu]``)."""
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"tritonclient's CUDA shared-memory helpers are unavailable: {exc}")
    return cudashm


def needs_cuda(test: Callable[..., None]) -> Callable[..., None]:
    skip = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device on this machine")
    return pytest.mark.gpu(skip(test))


def _torch_repository(tmp_path: Path) -> Path:
    """``double_<type>``: a TorchScript model on the GPU returning x + x, for INT32, FP32 and FP16;
    ``identity_bytes`` for BYTES (torch has no string tensors); ``slow``: a delayed identity."""
    torch = pytest.importorskip("torch")
    repo = tmp_path / "repo"

    class Double(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x + x

    for datatype in ("INT32", "FP32", "FP16"):
        models.write_config(
            repo / f"double_{datatype.lower()}",
            f"""
            backend: "pytorch"
            max_batch_size: 8
            input [ {{ name: "x" data_type: TYPE_{datatype} dims: [ -1 ] }} ]
            output [ {{ name: "y" data_type: TYPE_{datatype} dims: [ -1 ] }} ]
            instance_group [ {{ count: 1 kind: KIND_GPU }} ]
            """,
        )
        (repo / f"double_{datatype.lower()}" / "1").mkdir()
        torch.jit.script(Double()).save(str(repo / f"double_{datatype.lower()}" / "1" / "model.pt"))
    models.add_identity(repo, "identity_bytes", "BYTES")
    models.add_delayed_identity(repo, "slow", delay_ms=800)
    return repo


@pytest.fixture
def gpu_client(
    server_factory, tmp_path: Path
) -> Iterator[tuple[grpcclient.InferenceServerClient, Any, list[Any], RunningServer]]:
    """A client of a server on ``_torch_repository``, tritonclient's CUDA helpers, the regions made."""
    cudashm = _cudashm()
    server = server_factory(_torch_repository(tmp_path))
    made: list[Any] = []
    with grpcclient.InferenceServerClient(server.url) as triton:
        yield triton, cudashm, made, server
        triton.unregister_cuda_shared_memory()
    for handle in made:
        cudashm.destroy_shared_memory_region(handle)


def _region(
    triton: grpcclient.InferenceServerClient,
    cudashm: Any,
    made: list[Any],
    byte_size: int,
    values: np.ndarray | None = None,
) -> tuple[str, Any]:
    name = f"cuda_{uuid.uuid4().hex[:12]}"
    handle = cudashm.create_shared_memory_region(name, byte_size, 0)
    made.append(handle)
    if values is not None:
        cudashm.set_shared_memory_region(handle, [values])
    triton.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, byte_size)
    return name, handle


@needs_cuda
@pytest.mark.parametrize("datatype", ["INT32", "FP32", "FP16", "BYTES"])
def test_a_model_reads_and_writes_cuda_regions(gpu_client, datatype: str) -> None:
    triton, cudashm, made, server = gpu_client
    if datatype == "BYTES":
        values = np.array([[b"ab", b"", b"\x00\xffz"]], dtype=np.object_)
        serialized = serialize_byte_tensor(values)
        size, model, output, expected = len(serialized.item()), "identity_bytes", "OUT", values
        source, _ = _region(triton, cudashm, made, size, serialized)
    else:
        values = (np.arange(6).reshape(1, 6) * 1.5).astype(
            {"INT32": np.int32, "FP32": np.float32, "FP16": np.float16}[datatype]
        )
        size, model, output, expected = values.nbytes, f"double_{datatype.lower()}", "y", values + values
        source, _ = _region(triton, cudashm, made, size, values)
    target, target_handle = _region(triton, cudashm, made, size)
    tensor = grpcclient.InferInput("IN" if datatype == "BYTES" else "x", list(values.shape), datatype)
    tensor.set_shared_memory(source, size)
    requested = grpcclient.InferRequestedOutput(output)
    requested.set_shared_memory(target, size)
    result = triton.infer(model, [tensor], outputs=[requested])
    assert result.get_response().raw_output_contents == [b""]  # the output travelled in device memory
    back = cudashm.get_contents_as_numpy(target_handle, values.dtype, list(values.shape))
    np.testing.assert_array_equal(back, expected)
    status = triton.get_cuda_shared_memory_status(target, as_json=True)["regions"][target]
    assert status["name"] == target and status["byte_size"] == str(size) and status.get("device_id", "0") == "0"


@needs_cuda
def test_cuda_errors_in_tritons_words(gpu_client) -> None:
    triton, cudashm, made, server = gpu_client
    values = np.arange(6, dtype=np.float32).reshape(1, 6)
    source, source_handle = _region(triton, cudashm, made, 24, values)
    expect_error(
        "ALREADY_EXISTS",
        f"shared memory region '{source}' already in manager",
        lambda: triton.register_cuda_shared_memory(source, cudashm.get_raw_handle(source_handle), 0, 24),
    )
    other = cudashm.create_shared_memory_region("other", 64, 0)
    made.append(other)
    expect_error(
        "INVALID_ARGUMENT",
        "failed to register shared memory region 'huge': invalid args",
        lambda: triton.register_cuda_shared_memory("huge", cudashm.get_raw_handle(other), 0, 1 << 30),
    )
    expect_error(
        "INVALID_ARGUMENT",
        "failed to register shared memory region: invalid args",
        lambda: triton.register_cuda_shared_memory("zeros", HANDLE, 0, 64),
    )
    small, _ = _region(triton, cudashm, made, 8)
    tensor = grpcclient.InferInput("x", [1, 6], "FP32")
    tensor.set_shared_memory(source, 24)
    requested = grpcclient.InferRequestedOutput("y")
    requested.set_shared_memory(small, 8)
    expect_error(
        "INTERNAL",
        "shared memory size specified with the request for output 'y' (8 bytes) should be at "
        "least 24 bytes to hold the results",
        lambda: triton.infer("double_fp32", [tensor], outputs=[requested]),
    )
    tensor.set_shared_memory("gone", 24)
    expect_error(
        "NOT_FOUND", "Unable to find shared memory region: 'gone'", lambda: triton.infer("double_fp32", [tensor])
    )
    expect_error(
        "NOT_FOUND",
        f"The region named '{source}' is registered as CUDA shared memory, not system shared memory",
        lambda: triton.get_system_shared_memory_status(source),
    )


@needs_cuda
def test_a_cuda_region_unregistered_while_a_request_waits_still_serves_it(gpu_client) -> None:
    triton, cudashm, made, server = gpu_client
    values = np.array([[7, 8]], dtype=np.int64)
    name, _ = _region(triton, cudashm, made, 16, values)
    results: list[np.ndarray] = []

    def call(source: str | None) -> None:
        tensor = grpcclient.InferInput("IN", [1, 2], "INT64")
        if source is None:
            tensor.set_data_from_numpy(np.zeros((1, 2), np.int64))
        else:
            tensor.set_shared_memory(source, 16)
        results.append(triton.infer("slow", [tensor], client_timeout=20).as_numpy("OUT"))

    threads = [threading.Thread(target=call, args=(None,)), threading.Thread(target=call, args=(name,))]
    for thread in threads:
        thread.start()
    # One instance: one request runs for 0.8 s while the other waits; either way the region's is in flight.
    wait_until(
        lambda: metric(server, "nv_inference_pending_request_count", "slow") == 1,
        what="one request running and one waiting",
    )
    triton.unregister_cuda_shared_memory(name)
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(r.tolist() for r in results) == [[[0, 0]], [[7, 8]]]
