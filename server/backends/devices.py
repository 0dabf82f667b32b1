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


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's cpuset), capped
    by the cgroup v2 CPU quota (a Kubernetes CPU limit: ``cpu.max`` "quota period", rounded up).

    ``os.cpu_count()`` is the machine's: in a pod limited to 2 CPUs on a 64-core node it would give
    every model 64 threads, which the quota then throttles."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup v2 here, or a file of another shape: affinity alone
        pass
    return max(1, cores)
