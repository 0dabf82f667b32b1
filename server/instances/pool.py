"""Executors over one loaded model per device.

Each instance is one thread that calls ``run`` on the shared ``LoadedModel`` of its
device: ``count: 4`` gives four concurrent executions and one copy of the weights.
Execution never happens on the event loop; the scheduler decides what runs where.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.backends.base import LoadedModel
from server.backends.devices import Device


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
    """The scheduler's ``Runner``: hands out free instances, first come, first served."""

    def __init__(self, instances: list[Instance]) -> None:
        if not instances:
            raise ValueError("an instance pool needs at least one instance")
        self.instances = instances
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

    def close(self) -> None:
        for instance in self.instances:
            instance.thread.shutdown(wait=True)
        for model in {id(i.model): i.model for i in self.instances}.values():
            model.close()


def build_pool(
    model_name: str, placements: list[tuple[str, Device, int]], models: dict[Device, LoadedModel]
) -> InstancePool:
    """``placements``: (group name, device, count) triples; ``models``: the one copy per device."""
    instances = []
    for group, device, count in placements:
        for index in range(count):
            name = f"{group}_{index}" if device.kind == "cpu" else f"{group}_{index}_gpu{device.index}"
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{model_name}:{name}")
            instances.append(Instance(name, device, models[device], thread))
    return InstancePool(instances)
