"""Which devices exist: CUDA devices counted through the driver, with no framework import; the CPU
cores this process may use."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Device:
    """Where one copy of a model's weights lives: ``cpu`` (index 0) or ``gpu`` with its index."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"gpu:{self.index}"


CPU = Device("cpu")


@functools.cache
def cuda_device_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver or no device."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if libcuda.cuInit(0) != 0:
        return 0
    count = ctypes.c_int(0)
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


@dataclass(frozen=True)
class CpuAllowance:
    """What this process may run on: the cores of its CPU affinity, and the cgroup CPU quota in cores."""

    affinity: int
    quota: float | None  # cgroup v2 ``cpu.max`` quota / period; None when it is "max" or unreadable

    def cores(self, round_up: bool) -> int:
        """The affinity's cores capped by the quota, at least 1; a fractional quota rounded up or down."""
        if self.quota is None:
            return self.affinity
        quota = math.ceil(self.quota) if round_up else math.floor(self.quota)
        return max(1, min(self.affinity, quota))


def cpu_allowance(cpu_max: Path = CGROUP_CPU_MAX, affinity: set[int] | None = None) -> CpuAllowance:
    """This process's CPU affinity (``taskset``, a container's cpuset; ``affinity`` instead when given) and the
    cgroup v2 CPU quota in ``cpu_max`` (a Kubernetes CPU limit: "quota period", or "max" for none). cgroup v1's
    ``cpu.cfs_quota_us`` is not read: there the quota counts as none."""
    if affinity is not None:
        cores = len(affinity)
    else:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # no affinity on this platform
            cores = os.cpu_count() or 1
    quota: float | None = None
    try:
        quota_text, period_text = cpu_max.read_text().split()[:2]
        if quota_text != "max" and int(period_text) > 0 and int(quota_text) > 0:
            quota = int(quota_text) / int(period_text)
    except (OSError, ValueError):  # no cgroup v2 here, or a file of another shape: affinity alone
        pass
    return CpuAllowance(max(1, cores), quota)


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's cpuset), capped
    by the cgroup v2 CPU quota (a Kubernetes CPU limit: ``cpu.max`` "quota period", rounded up).

    ``os.cpu_count()`` is the machine's: in a pod limited to 2 CPUs on a 64-core node it would give
    every model 64 threads, which the quota then throttles."""
    return cpu_allowance(cpu_max).cores(round_up=True)
