"""GPU memory per process from ``nvidia-smi --query-compute-apps``, for the tuner and the GPU check.

nvidia-smi writes ``[N/A]`` (or ``N/A``) where it has no figure: ``used_memory`` on some GPUs
(MIG slices, unified-memory systems), a pid it cannot see from a container. Such a value
parses as unknown (None), never as a crash.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable

QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


def _number(text: str) -> float | None:
    text = text.strip().removesuffix("MiB").strip()
    try:
        return float(text)
    except ValueError:
        return None  # [N/A], N/A, [Not Supported], empty


def parse_compute_apps(text: str) -> dict[int, float | None]:
    """pid → MiB used (None where nvidia-smi gave no figure); a process on several GPUs is summed."""
    used: dict[int, float | None] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) < 2:
            continue
        pid, mb = _number(fields[0]), _number(fields[1])
        if pid is None:
            continue
        previous = used.get(int(pid), 0.0)
        used[int(pid)] = None if previous is None or mb is None else previous + mb
    return used


def used_mb(pids: Iterable[int]) -> float | None:
    """MiB the given processes hold on all GPUs; None without nvidia-smi or when a figure is unknown."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(QUERY, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    used = parse_compute_apps(result.stdout)
    figures = [used[pid] for pid in pids if pid in used]
    if any(figure is None for figure in figures):
        return None
    return sum(figure for figure in figures if figure is not None)
