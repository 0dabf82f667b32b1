"""Latency summaries (issue 28 item 2): ``--metrics-config summary_latencies=true`` writes Triton 2.51's
five ``nv_inference_*_summary_us`` families (names, HELP, line order and labels as captured from
tritonserver 2.51), their quantiles over the last minute within 1% of latencies the server saw.

The server's latencies are checked from both sides: never below what the model itself spent (it
sleeps a known time), never above what the client measured around each call; in both layouts.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from shoal.settings import DEFAULT_QUANTILES, MetricsSettings, parse_metrics_config
from shoal.statistics import WINDOW_S, WindowedQuantiles
from tests import python_models
from tests.conftest import RunningServer, serving
from tests.polling import wait_until
from tests.prometheus_text import parse, scrape

SUMMARIES = [
    "nv_inference_request_summary_us",
    "nv_inference_queue_summary_us",
    "nv_inference_compute_input_summary_us",
    "nv_inference_compute_infer_summary_us",
    "nv_inference_compute_output_summary_us",
]
SLEEP_S = 0.02
REQUESTS = 30

NAP_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

NAP = f"""
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({SLEEP_S})
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
"""


# -- settings --------------------------------------------------------------------------------------


def test_the_metrics_config_takes_tritons_settings() -> None:
    assert parse_metrics_config([]) == MetricsSettings()
    chosen = parse_metrics_config(
        ["summary_latencies=true", "summary_quantiles=0.5:0.05,0.99:0.001", "counter_latencies=false"]
    )
    assert chosen == MetricsSettings(True, ((0.5, 0.05), (0.99, 0.001)), False)
    assert MetricsSettings().summary_quantiles == DEFAULT_QUANTILES


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("summary_latencies", "option format is <setting>=<value>. Got summary_latencies"),
        ("summary_latencies=maybe", "summary_latencies is true or false"),
        ("summary_quantiles=0.5", "expected <quantile>:<error>"),
        ("summary_quantiles=1.5:0.01", "each from 0 to 1"),
        ("summary_quantiles=abc:0.1", "got 'abc:0.1'"),
        ("histogram_latencies=true", "Triton 2.52's"),
        ("foo=bar", "Shoal takes summary_latencies"),
    ],
)
def test_a_setting_shoal_would_not_honour_is_refused(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_metrics_config([text])


# -- the window ------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_quantiles_are_within_one_percent_of_what_was_added() -> None:
    window = WindowedQuantiles(Clock())
    values = np.random.default_rng(7).lognormal(7, 1, 5000)
    for value in values:
        window.add(float(value))
    qs = (0.5, 0.9, 0.99, 0.999)
    for q, got in zip(qs, window.quantiles(qs), strict=True):
        exact = float(np.quantile(values, q, method="lower"))
        assert abs(got - exact) <= 0.011 * exact + 1e-9, (q, got, exact)


def test_a_latency_leaves_the_quantiles_within_a_minute() -> None:
    clock = Clock()
    window = WindowedQuantiles(clock)
    window.add(100.0)
    clock.now += WINDOW_S * 0.79  # within the window whatever the bucket edges: still there
    window.add(200.0)
    assert window.quantiles((0.0, 1.0)) == pytest.approx([100.0, 200.0], rel=0.011)
    clock.now += WINDOW_S * 0.21 + 1e-3  # the first is a minute old: gone, the second stays
    assert window.quantiles((0.0, 1.0)) == pytest.approx([200.0, 200.0], rel=0.011)
    clock.now += WINDOW_S
    assert all(math.isnan(v) for v in window.quantiles((0.5, 0.99)))


def test_reading_while_the_loop_adds_is_safe() -> None:
    window = WindowedQuantiles()
    stop = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                window.quantiles((0.5, 0.99))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for value in np.random.default_rng(3).lognormal(3, 3, 20_000):  # spans many sketch buckets: they grow
        window.add(float(value))
    stop.set()
    reader.join(timeout=30)
    assert not errors and not reader.is_alive()


# -- a real server, both layouts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def nap_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    python_models.write_model(repo, "nap", NAP_CONFIG, NAP)
    with serving(
        repo, tmp_path_factory.mktemp("server"), *layout, "--metrics-config", "summary_latencies=true"
    ) as server:
        yield server


def client_latencies_us(server: RunningServer, count: int) -> list[float]:
    """Each call's time as the client saw it, around the whole call."""
    taken = []
    with grpcclient.InferenceServerClient(server.url) as client:
        given = grpcclient.InferInput("IN", [2], "FP32")
        given.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
        for _ in range(count):
            started = time.perf_counter()
            assert client.infer("nap", [given]).as_numpy("OUT").tolist() == [2.0, 4.0]
            taken.append((time.perf_counter() - started) * 1e6)
    return taken


def test_summaries_are_tritons_and_hold_the_latencies_the_server_saw(nap_server: RunningServer) -> None:
    client = sorted(client_latencies_us(nap_server, REQUESTS))
    wait_until(
        lambda: parse(scrape(nap_server.metrics_port))["nv_inference_request_success"].value(model="nap") == REQUESTS,
        what="the requests counted",
    )
    text = scrape(nap_server.metrics_port)
    families = parse(text)
    names = list(families)
    assert [n for n in names if n.endswith("_summary_us")] == SUMMARIES
    assert names.index(SUMMARIES[0]) > names.index("nv_cpu_memory_used_bytes")  # after the CPU's, as Triton
    assert families[SUMMARIES[0]].help == (
        "Summary of inference request duration in microseconds (includes cached requests)"
    )
    # prometheus-cpp's lines: _count, _sum, then the quantiles, the quantile label last.
    lines = [line for line in text.splitlines() if line.startswith("nv_inference_request_summary_us")]
    assert lines[0] == f'nv_inference_request_summary_us_count{{model="nap",version="1"}} {REQUESTS}'
    assert lines[1].startswith('nv_inference_request_summary_us_sum{model="nap",version="1"} ')
    assert [re.sub(r" \d+$", "", line) for line in lines[2:]] == [
        f'nv_inference_request_summary_us{{model="nap",version="1",quantile="{q}"}}'
        for q in ("0.5", "0.9", "0.95", "0.99", "0.999")
    ]
    request = families[SUMMARIES[0]]
    assert request.value(model="nap", quantile="0.5") >= 0  # a number, not Nan
    assert families["nv_inference_request_duration_us"].value(model="nap") == float(lines[1].split()[-1])
    floor_us = SLEEP_S * 1e6 * 0.99  # the model slept that long in every request, so each took longer
    for q in (0.5, 0.9, 0.99):
        served = request.value(model="nap", quantile=str(q))
        seen = client[min(len(client) - 1, math.ceil(q * len(client)) - 1)]
        assert floor_us <= served <= seen * 1.011 + 1, (q, served, seen)
        assert families[SUMMARIES[3]].value(model="nap", quantile=str(q)) >= floor_us  # compute infer
        assert families[SUMMARIES[1]].value(model="nap", quantile=str(q)) <= served  # queue within it
    assert {f.name for f in text_string_to_metric_families(text) if f.type == "summary"} == set(SUMMARIES)


def test_without_the_setting_there_are_no_summaries_and_counters_can_go(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_models.write_model(repo, "nap", NAP_CONFIG, NAP)
    (tmp_path / "server").mkdir()
    with serving(repo, tmp_path / "server", "--metrics-config", "counter_latencies=false") as server:
        client_latencies_us(server, 1)
        families = parse(scrape(server.metrics_port))
        assert not [n for n in families if n.startswith("nv_") and n.endswith(("_summary_us", "_duration_us"))]
        assert families["nv_inference_request_success"].value(model="nap") == 1  # the rest stays
