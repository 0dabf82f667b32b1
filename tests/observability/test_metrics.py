"""/metrics as Triton writes it: families, TYPE and HELP lines, label names and failure reasons, diffed against a
capture of a real Triton 2.51 (tests/data/triton_metrics.txt; bench/triton_metrics_peer.py takes it again)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from shoal.metrics import TRITON_GPU_FAMILIES, CpuMetrics
from tests import models
from tests.conftest import RunningServer, serving
from tests.models import REPO_ROOT
from tests.polling import wait_until
from tests.prometheus_text import Family, parse, scrape
from tests.scheduling.test_batching_server import gather_model, infer, slow_identity, wait_executing, wait_queued

# bench/triton_metrics_peer.py points TRITON_METRICS_CAPTURE at a fresh capture.
CAPTURE = Path(os.environ.get("TRITON_METRICS_CAPTURE", REPO_ROOT / "tests" / "data" / "triton_metrics.txt"))
TRITON = parse(CAPTURE.read_text())
# Triton families Shoal does not have, and why (docs/operations.md, Metrics).
NOT_IN_SHOAL = {
    "nv_pinned_memory_pool_total_bytes",  # Shoal keeps no pinned host-memory pool
    "nv_pinned_memory_pool_used_bytes",
}
REASONS = {"REJECTED", "CANCELED", "BACKEND", "OTHER"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    models.add_identity(repo, "identity", "INT64", dims="[ 2 ]")
    slow_identity(repo, "bounded", "dynamic_batching { default_queue_policy { max_queue_size: 1 } }", 1)
    expiring = "dynamic_batching { default_queue_policy { default_timeout_microseconds: 100000 } }"
    slow_identity(repo, "expiring", expiring, 1)
    slow_identity(repo, "abandoned", "dynamic_batching { }", 1)
    gather_model(repo)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as running:
        yield running


def shoal_families(server: RunningServer) -> dict[str, Family]:
    return parse(scrape(server.metrics_port))


def test_the_capture_is_tritons() -> None:
    """The reference holds what the diff relies on: Triton's per-model families and all four reasons."""
    assert TRITON["nv_inference_request_success"].type == "counter"
    failure = TRITON["nv_inference_request_failure"]
    assert {s.labels["reason"] for s in failure.samples} == REASONS
    assert failure.value(model="timeout", reason="REJECTED") == 2
    assert failure.value(model="raising", reason="BACKEND") == 1
    assert failure.value(model="slow", reason="CANCELED") == 1


def test_families_type_help_and_labels_are_tritons(server: RunningServer) -> None:
    assert (infer(server.url, "identity", 7) == 7).all()
    shoal = shoal_families(server)
    assert set(TRITON) - set(shoal) == NOT_IN_SHOAL
    # The GPU families (a GPU host's; the capture was taken on a CPU host) are checked in
    # tests/observability/test_gpu_metrics.py.
    invented = {name for name in shoal if name.startswith("nv_")} - set(TRITON) - set(TRITON_GPU_FAMILIES)
    assert not invented, f"nv_ families Triton does not have: {invented}"
    for name in set(TRITON) & set(shoal):
        ours, theirs = shoal[name], TRITON[name]
        assert (ours.type, ours.help) == (theirs.type, theirs.help), name
        assert ours.label_names() == theirs.label_names(), name
        assert {s.name for s in ours.samples} == {name}, f"{name}: a sample named otherwise (a _total suffix?)"
    assert shoal["nv_inference_request_success"].value(model="identity", version="1") == 1
    assert shoal["nv_inference_count"].value(model="identity") == 1
    for reason in REASONS:  # every reason from the start, as Triton
        assert shoal["nv_inference_request_failure"].value(model="identity", reason=reason) == 0


def test_the_response_is_plain_text_like_tritons(server: RunningServer) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/elsewhere", timeout=10)
    assert caught.value.code == 404
    caught.value.close()


def failures(server: RunningServer, model: str) -> dict[str, float]:
    family = shoal_families(server)["nv_inference_request_failure"]
    return {reason: family.value(model=model, reason=reason) for reason in REASONS}


def expect_failures(server: RunningServer, model: str, **counts: int) -> None:
    expected = {reason: counts.get(reason, 0) for reason in REASONS}
    wait_until(lambda: failures(server, model) == expected, what=f"{model} failures {expected}")
    with triton.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    assert int(stats["fail"].get("count", 0)) == sum(counts.values())  # ModelStatistics agrees


def test_a_full_queue_is_rejected(server: RunningServer) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer, server.url, "bounded", 1)
        wait_executing(server, "bounded")
        queued = pool.submit(infer, server.url, "bounded", 2)
        wait_queued(server, "bounded", 1)
        with pytest.raises(InferenceServerException, match="Exceeds maximum queue size"):
            infer(server.url, "bounded", 3)
        running.result(timeout=60)
        queued.result(timeout=60)
    expect_failures(server, "bounded", REJECTED=1)


def test_a_queue_timeout_is_rejected(server: RunningServer) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer, server.url, "expiring", 1)
        wait_executing(server, "expiring")
        with pytest.raises(InferenceServerException, match="Request timeout expired"):
            infer(server.url, "expiring", 2)
        running.result(timeout=60)
    expect_failures(server, "expiring", REJECTED=1)


def test_a_client_that_gives_up_while_queued_is_canceled(server: RunningServer) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer, server.url, "abandoned", 1)
        wait_executing(server, "abandoned")
        with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
            infer(server.url, "abandoned", 2, client_timeout=0.1)
        running.result(timeout=60)
    expect_failures(server, "abandoned", CANCELED=1)


def test_a_failed_execution_is_a_backend_failure(server: RunningServer) -> None:
    with triton.InferenceServerClient(server.url) as client:
        tensor = triton.InferInput("IN", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[99]], dtype=np.int64))  # out of the table's range
        with pytest.raises(InferenceServerException, match="failed"):
            client.infer("gather", [tensor])
    expect_failures(server, "gather", BACKEND=1)


def test_a_bad_input_is_other(server: RunningServer) -> None:
    """Triton 2.51 counts a bad input nowhere; Shoal counts it as a failure of the model, reason OTHER."""
    with triton.InferenceServerClient(server.url) as client:
        tensor = triton.InferInput("IN", [1, 3], "INT64")
        tensor.set_data_from_numpy(np.zeros((1, 3), dtype=np.int64))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("identity", [tensor])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    expect_failures(server, "identity", OTHER=1)


def test_cpu_families_read_proc_as_triton(tmp_path: Path) -> None:
    """Utilization is busy jiffies over all jiffies (idle and iowait are not busy) since the previous scrape;
    used memory is MemTotal - MemAvailable."""
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")

    def scrape_with(user: int, idle: int, iowait: int) -> dict[str, float]:
        (tmp_path / "stat").write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
        return {family.name: family.samples[0][1] for family in cpu.families()}

    cpu = CpuMetrics(tmp_path)
    first = scrape_with(user=300, idle=600, iowait=100)
    assert first == {
        "nv_cpu_utilization": 0.3,
        "nv_cpu_memory_total_bytes": 1_024_000,
        "nv_cpu_memory_used_bytes": 768_000,
    }
    assert scrape_with(user=390, idle=610, iowait=100)["nv_cpu_utilization"] == 0.9  # 90 of 100 new jiffies busy
    assert CpuMetrics(tmp_path / "absent").families() == []  # no /proc: no CPU families, as Triton off Linux
