"""Executors over one loaded model per device.

Each instance is one thread that calls ``run`` on the shared ``LoadedModel`` of its
device: ``count: 4`` gives four concurrent executions and one copy of the weights.
Execution never happens on the event loop; the scheduler decides what runs where.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shoal.backends.base import LoadedModel
from shoal.backends.devices import Device


@dataclass
class Instance:
    """One executor: a name, its device, the shared model and its own thread."""

    name: str
    device: Device
    model: LoadedModel
    thread: ThreadPoolExecutor

    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        future = self.thread.submit(self.model.run, inputs, outputs)
        return await asyncio.wrap_future(future)


class InstancePool:
    """The scheduler's ``Runner``: hands out free instances, first come, first served.

    ``shared_copies`` are loaded copies the instances reach without holding them (process
    instances attach to their weights); the pool closes them after the instances, so closing the
    pool frees everything the version loaded.
    """

    def __init__(self, instances: list[Instance], shared_copies: Sequence[LoadedModel] = ()) -> None:
        if not instances:
            raise ValueError("an instance pool needs at least one instance")
        self.instances = instances
        self.shared_copies = tuple(shared_copies)
        self._free: asyncio.Queue[Instance] | None = None

    def _queue(self) -> asyncio.Queue[Instance]:
        # Created lazily, inside the serving event loop.
        if self._free is None:
            self._free = asyncio.Queue()
            for instance in self.instances:
                self._free.put_nowait(instance)
        return self._free

    async def acquire(self) -> Instance:
        return await self._queue().get()

    def release(self, executor: Instance) -> None:
        self._queue().put_nowait(executor)

    def can_serve(self) -> bool:
        """At least one instance can take a request (a process instance whose worker is dead or hung cannot)."""
        return any(getattr(instance.model, "healthy", True) for instance in self.instances)

    def models(self) -> list[LoadedModel]:
        """The distinct models the instances run (one per copy, or one per worker process)."""
        return list({id(i.model): i.model for i in self.instances}.values())

    def close(self) -> None:
        for instance in self.instances:
            instance.thread.shutdown(wait=True)
        for model in self.models():
            model.close()
        for copy in self.shared_copies:
            copy.close()


@dataclass(frozen=True)
class Placement:
    """``count`` executors of instance group ``group`` on ``device``."""

    group: str
    device: Device
    count: int


LoadCopy = Callable[[Device, int], LoadedModel]  # (device, threads for this copy) -> one loaded copy


def build_pool(model_name: str, placements: list[Placement], load: LoadCopy, share_weights: bool) -> InstancePool:
    """Create the executors; one copy of the weights per device, or one per executor if not sharing.

    Threads: every executor's own thread computes too, so each copy gets the device's cores
    divided by its executors (at least 1) and N concurrent executions never oversubscribe the
    machine. bench/ort_sharing.py measured one shared ONNX Runtime session against N sessions
    sharing initializers: same memory and throughput within 5%, so the simpler one is kept.
    """
    cores = os.cpu_count() or 1
    per_device: dict[Device, int] = {}
    for placement in placements:
        per_device[placement.device] = per_device.get(placement.device, 0) + placement.count
    shared: dict[Device, LoadedModel] = {}
    instances: list[Instance] = []
    try:
        for placement in placements:
            device = placement.device
            for index in range(placement.count):
                threads = max(1, cores // per_device[device])
                if share_weights:
                    if device not in shared:
                        shared[device] = load(device, threads)
                    model = shared[device]
                else:
                    model = load(device, threads)
                name = f"{placement.group}_{index}" + ("" if device.kind == "cpu" else f"_gpu{device.index}")
                thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{model_name}:{name}")
                instances.append(Instance(name, device, model, thread))
    except BaseException:
        for model in {id(m): m for m in [*shared.values(), *(i.model for i in instances)]}.values():
            model.close()
        for instance in instances:
            instance.thread.shutdown(wait=False)
        raise
    return InstancePool(instances)
