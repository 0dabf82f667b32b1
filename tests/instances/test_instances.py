"""Instance pools: where the instances go (KIND_AUTO's resolution), how many copies of the weights
get loaded, and how the cores are split."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.backends import base
from shoal.backends.devices import CPU, Device, usable_cores
from shoal.errors import ShoalError
from shoal.instances.pool import Placement, build_pool
from shoal.lifecycle import model
from shoal.repository.config import ModelSpec, normalize, parse_config, to_spec, validate


class Copy:
    def __init__(self, device: Device, threads: int) -> None:
        self.device, self.threads, self.closed = device, threads, False

    def run(self, inputs, outputs):  # pragma: no cover - not executed here
        return {}

    def close(self) -> None:
        self.closed = True


def test_shared_weights_load_one_copy_per_device_for_all_groups() -> None:
    loads: list[Copy] = []

    def load(device: Device, threads: int) -> Copy:
        loads.append(Copy(device, threads))
        return loads[-1]

    pool = build_pool("m", [Placement("a", CPU, 3), Placement("b", CPU, 1)], load, share_weights=True)
    assert len(pool.instances) == 4 and len(loads) == 1
    assert {id(i.model) for i in pool.instances} == {id(loads[0])}
    assert loads[0].threads == max(1, usable_cores() // 4)
    assert [i.name for i in pool.instances] == ["a_0", "a_1", "a_2", "b_0"]
    pool.close()
    assert loads[0].closed


def test_without_sharing_each_executor_loads_a_copy_and_the_cores_are_split() -> None:
    loads: list[Copy] = []

    def load(device: Device, threads: int) -> Copy:
        loads.append(Copy(device, threads))
        return loads[-1]

    pool = build_pool("m", [Placement("a", CPU, 4)], load, share_weights=False)
    assert len(loads) == 4 and len({id(i.model) for i in pool.instances}) == 4
    assert all(copy.threads == max(1, usable_cores() // 4) for copy in loads)
    pool.close()
    assert all(copy.closed for copy in loads)


def test_a_failed_load_closes_the_copies_already_loaded() -> None:
    loads: list[Copy] = []

    def load(device: Device, threads: int) -> Copy:
        if len(loads) == 2:
            raise RuntimeError("out of memory")
        loads.append(Copy(device, threads))
        return loads[-1]

    with pytest.raises(RuntimeError, match="out of memory"):
        build_pool("m", [Placement("a", CPU, 3)], load, share_weights=False)
    assert len(loads) == 2 and all(copy.closed for copy in loads)


def spec_of(backend: str, instance_group: str) -> ModelSpec:
    text = (
        f'backend: "{backend}"\nmax_batch_size: 8\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n' + instance_group
    )
    config = normalize(parse_config(text), "m")
    validate(config, "m")
    return to_spec(config)


def fake_host(monkeypatch: pytest.MonkeyPatch, gpus: int, backend_can_use_them: bool) -> list[str]:
    """``gpus`` CUDA devices and a backend answer for KIND_AUTO; returns the backends asked."""
    asked: list[str] = []

    def answer(backend: str) -> bool:
        asked.append(backend)
        return backend_can_use_them

    monkeypatch.setattr(model, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(base, "backend_gpu_available", answer)  # what resolve_kind asks
    return asked


def test_kind_auto_is_the_cpu_without_a_gpu_and_the_backend_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_host(monkeypatch, gpus=0, backend_can_use_them=True)
    assert model.placements(spec_of("pytorch", "instance_group [ { count: 2 } ]")) == [Placement("m_0", CPU, 2)]
    assert asked == []  # no framework import on a host without CUDA devices


@pytest.mark.parametrize(
    "config", ["", "instance_group [ { count: 2 } ]", "instance_group [ { count: 2 kind: KIND_AUTO } ]"]
)
def test_kind_auto_is_each_gpu_where_the_backend_can_use_them(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    asked = fake_host(monkeypatch, gpus=2, backend_can_use_them=True)
    count = 2 if config else 1  # no instance group: one of KIND_AUTO, count 1, named after the model (Triton's)
    group = "m_0" if config else "m"
    assert model.placements(spec_of("pytorch", config)) == [
        Placement(group, Device("gpu", 0), count),
        Placement(group, Device("gpu", 1), count),
    ]
    assert asked == ["pytorch"]


def test_kind_auto_is_the_cpu_where_the_backend_cannot_use_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's rule: a GPU only when GPUs exist AND the backend supports them (e.g. onnxruntime
    without the CUDA execution provider on a GPU host)."""
    fake_host(monkeypatch, gpus=2, backend_can_use_them=False)
    assert model.placements(spec_of("onnxruntime", "instance_group [ { count: 2 } ]")) == [Placement("m_0", CPU, 2)]


def test_kind_auto_listing_a_missing_gpu_is_the_cpu_where_kind_gpu_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, gpus=1, backend_can_use_them=True)
    auto = spec_of("pytorch", "instance_group [ { count: 1 kind: KIND_AUTO gpus: [ 1 ] } ]")
    assert model.placements(auto) == [Placement("m_0", CPU, 1)]
    gpu = spec_of("pytorch", "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 1 ] } ]")
    with pytest.raises(ShoalError, match=r"lists GPU 1, but 1 GPU\(s\) exist"):
        model.placements(gpu)


def test_kind_cpu_and_kind_gpu_are_placed_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, gpus=1, backend_can_use_them=False)
    spec = spec_of("pytorch", "instance_group [ { count: 1 kind: KIND_CPU }, { count: 3 kind: KIND_GPU } ]")
    # KIND_GPU is not second-guessed: the backend's load refuses it with its own message.
    assert model.placements(spec) == [Placement("m_0", CPU, 1), Placement("m_1", Device("gpu", 0), 3)]
    monkeypatch.setattr(model, "cuda_device_count", lambda: 0)
    with pytest.raises(ShoalError, match="asks for KIND_GPU but no CUDA device is available"):
        model.placements(spec)


def test_the_identity_backend_stays_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.backends import identity

    monkeypatch.setattr(model, "cuda_device_count", lambda: 1)  # the backend's own answer: never a GPU
    assert model.placements(spec_of("identity", "")) == [Placement("m", CPU, 1)]
    spec = spec_of("identity", "instance_group [ { kind: KIND_GPU } ]")
    with pytest.raises(ShoalError, match="the identity backend runs on the CPU only"):
        identity.load(spec, Path("unused"), Device("gpu", 0), 1)


def test_onnxruntime_can_use_a_gpu_only_with_the_cuda_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.backends import onnxruntime

    monkeypatch.setattr(onnxruntime.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert not base.backend_gpu_available("onnxruntime")
    monkeypatch.setattr(
        onnxruntime.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    assert base.backend_gpu_available("onnxruntime")
    assert not base.backend_gpu_available("identity") and not base.backend_gpu_available("tensorflow")


def test_pytorch_can_use_a_gpu_only_as_a_cuda_build_that_sees_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not base.backend_gpu_available("pytorch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not base.backend_gpu_available("pytorch")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert base.backend_gpu_available("pytorch")


# -- the request path: the executor hop, ONNX Runtime's spinning, per-spec lookups ---------------


def test_an_instance_thread_answers_each_call_on_the_loop_in_order_and_passes_errors_on() -> None:
    import asyncio
    import threading

    from shoal.instances.pool import InstanceThread

    ran: list[tuple[int, str]] = []

    def call(index: int) -> int:
        ran.append((index, threading.current_thread().name))
        if index == 2:
            raise ValueError("two")
        return index * 10

    async def main() -> list[object]:
        thread = InstanceThread("m:i_0")
        try:
            return await asyncio.gather(*(thread.submit(call, i) for i in range(4)), return_exceptions=True)
        finally:
            thread.shutdown()

    results = asyncio.run(main())
    assert results[:2] == [0, 10] and results[3] == 30
    assert isinstance(results[2], ValueError)
    assert ran == [(i, "m:i_0") for i in range(4)]


def test_onnx_runtime_spins_as_its_own_default_unless_the_config_says_not() -> None:
    from shoal.backends.onnxruntime import session_options

    def entry(parameters: str) -> str:
        spec = spec_of("onnxruntime", "instance_group [ { count: 1 kind: KIND_CPU } ]" + parameters)
        return session_options(spec, 2).get_session_config_entry("session.intra_op.allow_spinning")

    assert entry("") == "1"
    assert entry('parameters { key: "allow_spinning" value: { string_value: "true" } }') == "1"
    assert entry('parameters { key: "allow_spinning" value: { string_value: "false" } }') == "0"
    with pytest.raises(ShoalError, match="allow_spinning must be"):
        entry('parameters { key: "allow_spinning" value: { string_value: "sometimes" } }')


def test_a_spec_finds_its_tensors_by_name_and_lists_its_outputs_in_order() -> None:
    spec = spec_of("identity", "instance_group [ { count: 1 kind: KIND_CPU } ]")
    assert spec.input("IN") is spec.inputs[0] and spec.input("OUT") is None
    assert spec.output("OUT") is spec.outputs[0] and spec.output("IN") is None
    assert spec.output_names == tuple(t.name for t in spec.outputs)


def test_cores_are_the_ones_this_process_may_use_not_the_machines(tmp_path: Path) -> None:
    """A process pinned to one core (taskset, a container's cpuset) gives its one executor 1 thread,
    not os.cpu_count()'s; a cgroup CPU quota (a Kubernetes CPU limit) caps the count too."""
    script = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from shoal.backends.devices import CPU\n"
        "from shoal.instances.pool import Placement, build_pool\n"
        "threads = []\n"
        "pool = build_pool('m', [Placement('a', CPU, 1)], lambda device, n: threads.append(n) or object(), True)\n"
        "print(threads[0])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"

    cpu_max = tmp_path / "cpu.max"
    affinity = len(os.sched_getaffinity(0))
    for text, expected in (
        ("100000 100000\n", 1),
        ("150000 100000\n", min(affinity, 2)),
        ("max 100000\n", affinity),
        ("nonsense\n", affinity),
    ):
        cpu_max.write_text(text)
        assert usable_cores(cpu_max) == expected, text
    assert usable_cores(tmp_path / "absent") == affinity
