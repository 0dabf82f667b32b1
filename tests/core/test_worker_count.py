"""``--grpc-workers auto`` (issue 24): the rule on usable cores, the cores read from the affinity and the cgroup
v2 CPU quota, and the command line's values. The server started with ``auto`` is in test_frontend_workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.backends.devices import CpuAllowance, cpu_allowance, usable_cores
from shoal.cli import MAX_GRPC_WORKERS, build_parser
from shoal.frontend import worker_count
from shoal.frontend.worker_count import RULE, resolve, workers_for_cores

SIXTEEN = set(range(16))


@pytest.mark.parametrize(
    ("cores", "workers"),
    [
        (1, 0),
        (2, 0),
        (3, 0),  # one process measured fastest on 2 cores; workers need cores beside the host
        (4, 2),
        (5, 2),
        (6, 2),
        (7, 2),  # never 1: one worker is bound by its own core
        (8, 3),
        (10, 4),
        (16, 7),
        (18, 8),
        (64, 8),
        (256, 8),
    ],
)
def test_the_rule(cores: int, workers: int) -> None:
    assert workers_for_cores(cores) == workers


def test_the_rule_leaves_the_host_two_cores_and_never_starts_one_worker() -> None:
    counts = [workers_for_cores(cores) for cores in range(1, 300)]
    assert counts == sorted(counts)
    assert 1 not in counts
    assert all(n == 0 or n <= cores - 2 for cores, n in enumerate(counts, start=1))


def write_cpu_max(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpu.max"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "quota"),
    [
        ("max 100000\n", None),
        ("200000 100000\n", 2.0),
        ("150000 100000\n", 1.5),
        ("50000 100000\n", 0.5),
        ("1600000 100000\n", 16.0),
        ("nonsense\n", None),
        ("", None),
        ("200000 0\n", None),
    ],
)
def test_the_cgroup_quota_is_read_from_cpu_max(tmp_path: Path, text: str, quota: float | None) -> None:
    assert cpu_allowance(write_cpu_max(tmp_path, text), SIXTEEN) == CpuAllowance(16, quota)


def test_no_cpu_max_means_no_quota(tmp_path: Path) -> None:
    assert cpu_allowance(tmp_path / "absent", {0, 1, 2}) == CpuAllowance(3, None)


@pytest.mark.parametrize(
    ("affinity", "text", "workers"),
    [
        (SIXTEEN, "max 100000\n", 7),  # no quota: the affinity's 16 cores
        (SIXTEEN, "200000 100000\n", 0),  # a pod limited to 2 CPUs on a 16-core node: the quota's 2
        (SIXTEEN, "450000 100000\n", 2),  # 4.5 CPUs: 4 whole cores for workers
        (SIXTEEN, "350000 100000\n", 0),  # 3.5: 3, below the 4 workers need
        (SIXTEEN, "800000 100000\n", 3),
        ({0, 1, 2, 3}, "1600000 100000\n", 2),  # a cpuset of 4 under a quota of 16: the affinity's 4
        ({0}, "50000 100000\n", 0),  # under a core: still counted as one
    ],
)
def test_auto_takes_the_smaller_of_affinity_and_quota(
    tmp_path: Path, affinity: set[int], text: str, workers: int
) -> None:
    allowance = cpu_allowance(write_cpu_max(tmp_path, text), affinity)
    chosen = resolve("auto", allowance)
    assert chosen.count == workers
    assert (
        f"{worker_count.whole_cores(allowance)} usable cores ({len(affinity)} in the CPU affinity" in chosen.describe()
    )
    assert RULE in chosen.describe()


def test_threads_round_a_fractional_quota_up_and_workers_down(tmp_path: Path) -> None:
    """ONNX Runtime's threads may use a part core (the quota throttles them); a worker needs a whole one."""
    allowance = cpu_allowance(write_cpu_max(tmp_path, "450000 100000\n"), SIXTEEN)
    assert (allowance.cores(round_up=True), worker_count.whole_cores(allowance)) == (5, 4)
    assert usable_cores(write_cpu_max(tmp_path, "450000 100000\n")) == min(5, usable_cores(tmp_path / "absent"))


def test_a_number_is_taken_as_given() -> None:
    chosen = resolve(3, CpuAllowance(2, None))
    assert chosen.count == 3 and chosen.describe() == "3 front-end workers (--grpc-workers 3)"


def test_auto_describes_what_it_saw() -> None:
    assert resolve("auto", CpuAllowance(16, 2.5)).describe() == (
        "0 front-end workers (--grpc-workers auto: 2 usable cores (16 in the CPU affinity, cgroup CPU quota 2.5 "
        f"cores); rule: {RULE})"
    )


def parse(*args: str) -> object:
    return build_parser().parse_args(["serve", "--model-repository", ".", *args]).grpc_workers


@pytest.mark.parametrize(
    ("args", "value"),
    [
        ((), 0),  # the default: one process, the fastest measured here
        (("--grpc-workers", "auto"), "auto"),
        (("--grpc-workers=AUTO",), "auto"),
        (("--frontend-workers", "auto"), "auto"),
        (("--grpc-workers", "0"), 0),
        (("--grpc-workers", "2"), 2),
        (("--frontend-workers=7",), 7),
        (("--grpc-workers", str(MAX_GRPC_WORKERS)), MAX_GRPC_WORKERS),
    ],
)
def test_the_command_line_takes_auto_and_counts(args: tuple[str, ...], value: object) -> None:
    assert parse(*args) == value


@pytest.mark.parametrize("text", ["-1", str(MAX_GRPC_WORKERS + 1), "two", "", "2.5", "auto2"])
def test_a_bad_worker_count_is_refused_in_words(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse("--grpc-workers", text)
    assert caught.value.code == 2
    assert f"expected auto or an integer in 0..{MAX_GRPC_WORKERS}, got {text!r}" in capsys.readouterr().err
