"""A Python model version's instances: one worker process each (default), or one thread each.

Every instance imports the model file and runs ``initialize`` with its own ``args`` (its name,
kind and device), as Triton's Python backend does; nothing is loaded once and shared.
"""

from __future__ import annotations

from pathlib import Path

from shoal.backends.base import LoadedModel
from shoal.backends.devices import Device
from shoal.backends.python import ThreadInstance, version_of
from shoal.errors import load_failed
from shoal.instances.pool import InstancePool, Placement, build_pool, instance_name
from shoal.instances.process import WorkerLimits
from shoal.instances.python_process import PythonProcessModel
from shoal.repository.config import ModelSpec


def build_python_instances(
    spec: ModelSpec, model_file: Path, placements: list[Placement], limits: WorkerLimits | None
) -> InstancePool:
    """Start the instances; ``limits`` None: threads in this process, else worker processes."""
    if spec.sequence_batching is not None:
        raise load_failed(
            f"model '{spec.name}': sequence_batching for Python models is not supported by this server yet"
        )
    names = iter([instance_name(placement, index) for placement in placements for index in range(placement.count)])
    version = version_of(model_file)

    def start(device: Device, threads: int) -> LoadedModel:
        name = next(names)  # build_pool starts them in placement order, as listed above
        if limits is None:
            return ThreadInstance(spec, model_file, device, name, version)
        return PythonProcessModel(spec, model_file, device, name, version, limits)

    return build_pool(spec.name, placements, start, share_weights=False)
