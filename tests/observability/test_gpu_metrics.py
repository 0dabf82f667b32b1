"""Triton's GPU families (issue 28 item 3): ``nv_gpu_utilization``, ``nv_gpu_memory_{total,used}_bytes``,
``nv_gpu_power_{usage,limit}`` and ``nv_energy_consumption`` per GPU (``gpu_uuid``), read through NVML.

No GPU here: the families' shape and units are checked over an NVML stand-in with two boards (one that
reports no power), and a real server is checked for what this host has: none of them on a host without
a driver (and none with ``--allow-gpu-metrics false`` anywhere); on a GPU host, one sample per GPU that
``nvidia-smi`` lists, with its UUID.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.metrics import TRITON_GPU_FAMILIES, GpuMetrics
from tests import models
from tests.conftest import serving
from tests.prometheus_text import parse, scrape


class NotSupported(Exception):
    pass


class FakeNvml:
    """Two boards; the second reports no power (NVML's NotSupported), as some do."""

    def __init__(self) -> None:
        self.energy_mj = {0: 5_000_000, 1: 9_000_000}

    def nvmlInit(self) -> None:  # noqa: N802 - NVML's names
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-{handle:08d}-fake"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        return SimpleNamespace(gpu=37 if handle == 0 else 0, memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        return SimpleNamespace(total=80 << 30, used=(3 << 30) * (handle + 1), free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802
        if handle == 1:
            raise NotSupported
        return 123_456  # mW

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:  # noqa: N802
        if handle == 1:
            raise NotSupported
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:  # noqa: N802
        return self.energy_mj[handle]


def test_the_families_are_tritons_in_units_and_labels() -> None:
    nvml = FakeNvml()
    gpu = GpuMetrics(nvml)
    nvml.energy_mj[0] += 42_500  # 42.5 J used since the server started
    families = {f.name: f for f in gpu.families()}
    assert list(families) == list(TRITON_GPU_FAMILIES)  # Triton's order
    for name, (kind, text) in TRITON_GPU_FAMILIES.items():
        assert (families[name].type, families[name].help) == (kind, text)

    def values(name: str) -> dict[str, float]:
        return {labels["gpu_uuid"]: value for labels, value in families[name].samples}

    assert values("nv_gpu_utilization") == {"GPU-00000000-fake": 0.37, "GPU-00000001-fake": 0.0}
    assert values("nv_gpu_memory_used_bytes") == {"GPU-00000000-fake": 3 << 30, "GPU-00000001-fake": 6 << 30}
    assert values("nv_gpu_power_usage") == {"GPU-00000000-fake": pytest.approx(123.456)}  # board 1 has none
    assert values("nv_gpu_power_limit") == {"GPU-00000000-fake": 700.0}
    assert values("nv_energy_consumption") == {"GPU-00000000-fake": 42.5, "GPU-00000001-fake": 0.0}
    assert 'nv_gpu_utilization{gpu_uuid="GPU-00000000-fake"} 0.37' in families["nv_gpu_utilization"].text()


def test_without_nvml_there_are_no_gpu_families() -> None:
    class Missing:
        def nvmlInit(self) -> None:  # noqa: N802
            raise OSError("NVML Shared Library Not Found")

    assert GpuMetrics(Missing()).families() == []


def gpus_here() -> list[str]:
    """The UUIDs nvidia-smi lists; none without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    listed = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
    )
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


@pytest.mark.parametrize("allowed", ["true", "false"])
def test_a_server_reports_the_gpus_this_host_has(tmp_path: Path, allowed: str) -> None:
    repo = tmp_path / "repo"
    models.add_identity(repo, "identity", "INT64", dims="[ 2 ]")
    (tmp_path / "server").mkdir()
    with serving(repo, tmp_path / "server", "--allow-gpu-metrics", allowed) as server:
        families = parse(scrape(server.metrics_port))
    expected = gpus_here() if allowed == "true" else []
    reported = families.get("nv_gpu_memory_total_bytes")
    assert sorted(s.labels["gpu_uuid"] for s in reported.samples) == sorted(expected) if reported else not expected
    if not expected:
        assert not [name for name in families if name.startswith("nv_gpu_") or name == "nv_energy_consumption"]
