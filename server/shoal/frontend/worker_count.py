"""How many front-end workers ``--grpc-workers auto`` starts: a rule on the cores this process may use.

The cores (``shoal.backends.devices.cpu_allowance``): those the scheduler lets this process run on
(``os.sched_getaffinity``), fewer if the cgroup v2 CPU quota (``/sys/fs/cgroup/cpu.max``) allows
fewer, a fractional quota counted down to whole cores. In a Kubernetes pod the affinity is every
core of the node and only the quota (the container's CPU limit) says what it may use, so both are
read and the smaller wins.

The rule (``workers_for_cores``), from ``bench/grpc_workers.py`` on the native gRPC engine (the
default), tiny requests at c=16:

- **Below 4 cores: 0.** Measured on 2 cores: one process served 4,210/s, 1 worker 2,861/s and
  2 workers 2,287/s (docs/benchmarks.md). A worker takes the front end's Python work out of the
  host, but the host spends about as much on the hop through shared memory (host CPU per request
  112-141 µs with workers, 169 µs in one process of which 32 µs in pygrpc-native's I/O threads),
  and the workers (176-211 µs per request) need cores of their own beside the host's.
- **From 4 cores: ``min(8, max(2, (cores - 2) // 2))``.** Two cores stay with the host (its
  event loop, the engine's and the model's threads), and workers take half of the rest, so the
  models' execution keeps the other half. Never 1: one worker is bound by its own core at
  1e6 / 176 µs = 5,700/s, below the 7,300/s one process is projected to reach alone. Two feed the host to its limit on
  tiny requests (workers' µs / host's µs = 1.5 -> 2); more pay only where the front end's share
  per request is larger (big tensors: not measured). At most 8.

Above 2 cores this is a projection from the CPU split measured on 2 cores, not a measurement: no
machine with more cores was available to this project. On tiny requests that projection gives 2
or more workers about what one process does (the host's serial work per request is about the same
in both layouts): ``python bench/grpc_workers.py`` prints it. So the default stays 0, and ``auto``
is for hosts with cores to spare; measure there before relying on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.backends.devices import CpuAllowance, cpu_allowance

AUTO = "auto"
MIN_CORES_FOR_WORKERS = 4
HOST_CORES = 2
MIN_AUTO_WORKERS = 2
MAX_AUTO_WORKERS = 8
RULE = (
    f"0 below {MIN_CORES_FOR_WORKERS} usable cores, else min({MAX_AUTO_WORKERS}, "
    f"max({MIN_AUTO_WORKERS}, (cores - {HOST_CORES}) // 2))"
)


def workers_for_cores(cores: int) -> int:
    """The worker count ``auto`` starts on ``cores`` usable cores (the rule in the module's docstring)."""
    if cores < MIN_CORES_FOR_WORKERS:
        return 0
    return min(MAX_AUTO_WORKERS, max(MIN_AUTO_WORKERS, (cores - HOST_CORES) // 2))


def whole_cores(allowance: CpuAllowance) -> int:
    """Whole cores the process may use: the affinity's, capped by the quota rounded down (a worker needs a core)."""
    return allowance.cores(round_up=False)


def describe_cores(allowance: CpuAllowance) -> str:
    quota = "no cgroup CPU quota" if allowance.quota is None else f"cgroup CPU quota {allowance.quota:g} cores"
    return f"{whole_cores(allowance)} usable cores ({allowance.affinity} in the CPU affinity, {quota})"


@dataclass(frozen=True)
class WorkerCount:
    """``--grpc-workers``: a number given, or ``auto``'s choice and what it saw."""

    count: int
    allowance: CpuAllowance | None = None  # what auto saw; None for a number given

    def describe(self) -> str:
        """For the start-up log: the count, and for auto the cores it saw and the rule."""
        if self.allowance is None:
            return f"{self.count} front-end workers (--grpc-workers {self.count})"
        return f"{self.count} front-end workers (--grpc-workers auto: {describe_cores(self.allowance)}; rule: {RULE})"


def resolve(value: int | str, allowance: CpuAllowance | None = None) -> WorkerCount:
    """``--grpc-workers``'s value as a count: an integer as given, ``auto`` from the cores ``allowance`` (default:
    this process's) gives."""
    if value != AUTO:
        return WorkerCount(int(value))
    seen = cpu_allowance() if allowance is None else allowance
    return WorkerCount(workers_for_cores(whole_cores(seen)), seen)
