"""How a model version's executors run over its weights: the one place that chooses.

- ``THREADS`` (the default): one loaded copy per device, every executor of the device a thread
  over it. The backends' ``run`` is thread-safe, so ``count: 4`` costs one copy of the weights.
- ``COPIES`` (``share_weights: false``): a copy per executor, for models that keep state between
  calls (and as the contrast in ``bench/memory.py``).
- ``PROCESSES`` (``process_instances: true``): one copy per device in the server, its weights
  shared through the backend's ``share_weights`` hook, and every executor a worker process that
  attaches to them (``shoal.instances.process``), for models whose Python-side work holds the GIL.
  Only backends with the ``share_weights`` and ``attach`` hooks can; ``execution_timeout_ms`` and
  ``liveness_check_interval_ms`` need it, since a worker can be killed and restarted and a thread
  cannot. ``process_instances`` wins over ``share_weights: false``: the workers exist to share.

The choice reads only the spec's parameters and the backend's hooks, so lifecycle composes a
version without knowing a framework, and a new strategy (a Python backend's stub processes) is
added here. Every refusal is LOAD_FAILED, raised before any weight is loaded.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.backends.base import Backend, LoadedModel, backends_that
from shoal.backends.devices import Device
from shoal.errors import load_failed
from shoal.instances.pool import InstancePool, Placement, build_pool
from shoal.instances.process import WORKER_PARAMETERS, ProcessModel, WorkerLimits
from shoal.instances.python import build_python_instances
from shoal.repository.config import ModelSpec


class Strategy(enum.Enum):
    THREADS = "threads over one copy per device"
    COPIES = "a copy per executor"
    PROCESSES = "worker processes over one copy per device"
    PYTHON_PROCESSES = "a Python model in a worker process per instance"
    PYTHON_THREADS = "a Python model on a thread per instance"


@dataclass(frozen=True)
class InstancePlan:
    """The strategy chosen for a version, and the worker limits when its executors are processes."""

    strategy: Strategy
    limits: WorkerLimits | None = None


@dataclass(frozen=True)
class BuiltInstances:
    """A version's executors and the weight bytes its loaded copies hold per device (for budgets)."""

    pool: InstancePool
    memory_bytes: dict[Device, int]
    strategy: Strategy
    copies: int  # loaded copies of the weights


def _flag(spec: ModelSpec, key: str, default: bool) -> bool:
    value = spec.parameters.get(key, "true" if default else "false").lower()
    if value not in {"true", "false"}:
        raise load_failed(f"model '{spec.name}': parameter {key} must be true or false")
    return value == "true"


def choose(spec: ModelSpec, backend: Backend) -> InstancePlan:
    """The strategy the spec's parameters ask for, refused where ``backend`` cannot provide it."""
    if backend.declared.own_instances:  # the Python backend: a process per instance unless told otherwise
        return _python_plan(spec)
    share = _flag(spec, "share_weights", True)
    processes = _flag(spec, "process_instances", False)
    if processes and not backend.declared.process_instances:
        able = " or ".join(backends_that("process_instances"))
        raise load_failed(f"model '{spec.name}': process_instances needs the {able} backend")
    if processes:
        return InstancePlan(Strategy.PROCESSES, WorkerLimits.from_spec(spec))
    _refuse_worker_parameters(spec)
    return InstancePlan(Strategy.THREADS if share else Strategy.COPIES)


def _python_plan(spec: ModelSpec) -> InstancePlan:
    if _flag(spec, "process_instances", True):
        return InstancePlan(Strategy.PYTHON_PROCESSES, WorkerLimits.from_spec(spec))
    _refuse_worker_parameters(spec)
    return InstancePlan(Strategy.PYTHON_THREADS)


def _refuse_worker_parameters(spec: ModelSpec) -> None:
    for key in WORKER_PARAMETERS:
        if key in spec.parameters:
            raise load_failed(
                f"model '{spec.name}': parameter {key} needs process_instances: true "
                "(a worker process can be killed and restarted, a thread cannot)"
            )


def build_instances(
    spec: ModelSpec, model_path: Path, placements: list[Placement], backend: Backend, plan: InstancePlan
) -> BuiltInstances:
    """Load the weights and start the executors ``plan`` calls for; on failure nothing stays loaded."""
    if plan.strategy in (Strategy.PYTHON_PROCESSES, Strategy.PYTHON_THREADS):
        pool = build_python_instances(spec, model_path, placements, plan.limits)
        return BuiltInstances(pool, {}, plan.strategy, len(pool.instances))
    if plan.strategy is Strategy.PROCESSES:
        assert plan.limits is not None
        return _worker_processes(spec, model_path, placements, backend, plan.limits)

    def load_copy(device: Device, threads: int) -> LoadedModel:
        return backend.load(spec, model_path, device, threads)

    pool = build_pool(spec.name, placements, load_copy, share_weights=plan.strategy is Strategy.THREADS)
    memory_bytes: dict[Device, int] = {}
    models = {id(i.model): i for i in pool.instances}
    for instance in models.values():
        memory_bytes[instance.device] = memory_bytes.get(instance.device, 0) + instance.model.weight_bytes
    return BuiltInstances(pool, memory_bytes, plan.strategy, len(models))


def _worker_processes(
    spec: ModelSpec, model_path: Path, placements: list[Placement], backend: Backend, limits: WorkerLimits
) -> BuiltInstances:
    """One copy per device in this process, its weights shared; a worker process per executor."""
    shared: dict[Device, tuple[LoadedModel, Any]] = {}

    def start_worker(device: Device, threads: int) -> LoadedModel:
        if device not in shared:
            parent = backend.load(spec, model_path, device, threads)
            try:
                shared[device] = (parent, backend.share_weights(parent))
            except BaseException:
                parent.close()
                raise
        handle = shared[device][1]
        return ProcessModel(spec, model_path, device, handle, threads, limits, backend.worker_preload)

    try:
        pool = build_pool(spec.name, placements, start_worker, share_weights=False)
    except BaseException:
        for parent, _ in shared.values():
            parent.close()
        raise
    parents = {device: parent for device, (parent, _) in shared.items()}
    memory_bytes = {device: parent.weight_bytes for device, parent in parents.items()}
    return BuiltInstances(
        InstancePool(pool.instances, shared_copies=list(parents.values())),
        memory_bytes,
        Strategy.PROCESSES,
        len(parents),
    )
