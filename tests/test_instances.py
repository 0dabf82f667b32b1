"""Instance pools: how many copies of the weights get loaded, and how the cores are split."""

from __future__ import annotations

import os

import pytest

from server.backends.devices import CPU, Device
from server.instances.pool import Placement, build_pool


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
    assert loads[0].threads == max(1, (os.cpu_count() or 1) // 4)
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
    assert all(copy.threads == max(1, (os.cpu_count() or 1) // 4) for copy in loads)
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
