"""Python models' custom metrics (``pb_utils.MetricFamily`` / ``Metric``), as Triton 2.51 serves them.

Every expected text here is what Triton 2.51 answered or wrote on /metrics for the same calls (a
probe model run with ``run_triton.sh``, session 53): two instances that make the same series share
it, ``value()`` reads the shared value, refusals carry the core's words after the stub's prefix, and
a histogram is written as ``_count``, ``_sum`` and cumulative ``_bucket`` lines, ``le`` last. Shoal
refused every model that made a family until session 53 (its ``custom_metrics`` example did not load).
Both instance kinds, each with two instances; the worker layout too (the registry is the host's).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import threading
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from shoal.custom_metrics import COUNTER, GAUGE, HISTOGRAM, CustomMetricError, CustomMetrics
from shoal.instances import metrics_pipe
from tests.conftest import RunningServer, serving
from tests.python_models import write_model

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
KINDS = {"process": "", "thread": THREADS}
CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
{extra}
"""
# Made in initialize (families and series), used in execute: IN says what to do and OUT answers.
COUNTS = """
import enum
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


def attempt(what, call):
    try:
        return what, "ok", call()
    except pb_utils.TritonModelException as exc:
        return what, "refused", exc.message()


class Label(str, enum.Enum):  # a str of a class the server cannot unpickle: sent as its text
    A = "a"


def stray(kind, seen):
    family = pb_utils.MetricFamily(name=f"stray_{{kind}}", description="d", kind=pb_utils.MetricFamily.GAUGE)
    metric = family.Metric(labels={{"who": "thread"}})
    metric.set(42)
    seen.append(metric.value())


class TritonPythonModel:
    def initialize(self, args):
        kind = "{kind}"
        self.name = args["model_instance_name"]
        self.strays = []
        self.requests = requests = pb_utils.MetricFamily(
            name=f"requests_{{kind}}", description="requests seen", kind=pb_utils.MetricFamily.COUNTER
        )
        self.shared = requests.Metric(labels={{"kind": kind}})
        self.mine = requests.Metric(labels={{"kind": kind, "instance": self.name}})
        self.enumerated = requests.Metric(labels={{"enum": Label.A}})
        depth = pb_utils.MetricFamily(name=f"depth_{{kind}}", description="a gauge", kind=pb_utils.MetricFamily.GAUGE)
        self.depth = depth.Metric(labels={{"kind": kind}})
        sizes = pb_utils.MetricFamily(
            name=f"sizes_{{kind}}", description="a histogram", kind=pb_utils.MetricFamily.HISTOGRAM
        )
        self.sizes = sizes.Metric(labels={{"kind": kind}}, buckets=[0.1, 1.0, 10.0])
        self.refusals = [
            attempt("other kind", lambda: pb_utils.MetricFamily(
                name=f"requests_{{kind}}", description="requests seen", kind=pb_utils.MetricFamily.GAUGE)),
            attempt("label not a string", lambda: requests.Metric(labels={{"n": 1}})),
            attempt("counter with buckets", lambda: requests.Metric(labels={{"b": "1"}}, buckets=[1.0])),
            attempt("histogram without buckets", lambda: sizes.Metric(labels={{"b": "1"}})),
            attempt("counter decremented", lambda: self.mine.increment(-1)),
            attempt("counter set", lambda: self.mine.set(5)),
            attempt("gauge observed", lambda: self.depth.observe(1)),
            attempt("histogram value", lambda: self.sizes.value()),
            attempt("buckets out of order", lambda: sizes.Metric(labels={{"o": "1"}}, buckets=[1.0, 0.5])),
            attempt("no metric name", lambda: pb_utils.MetricFamily(
                name="bad name", description="d", kind=pb_utils.MetricFamily.GAUGE)),
            attempt("the server's name", lambda: pb_utils.MetricFamily(
                name="nv_inference_count", description="d", kind=pb_utils.MetricFamily.COUNTER)),
            attempt("no label name", lambda: requests.Metric(labels={{"a b": "1"}})),
            attempt("no UTF-8", lambda: requests.Metric(labels={{"a": "x" + chr(0xDCFF)}})),
        ]
        self.refusals = [(what, how, text if how == "refused" else None) for what, how, text in self.refusals]

    def execute(self, requests):
        responses = []
        for request in requests:
            step = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            self.shared.increment(1)
            self.enumerated.increment(1)
            self.mine.increment(0.5)
            self.depth.set(step)
            self.depth.increment(-3)
            self.sizes.observe(step)
            per_request = self.requests.Metric(labels={{"kind": "{kind}", "made": "per request"}})
            per_request.increment(1)  # a series made per request, its object then collected: one series
            made = per_request.value()
            del per_request
            seen = {{
                "instance": self.name,
                "shared": self.shared.value(),
                "depth": self.depth.value(),
                "made": made,
                "strays": self.strays,
                "refusals": self.refusals,
            }}
            if step == 0:  # a family made on a thread of the model's own, collected with it when it ends
                thread = threading.Thread(target=stray, args=("{kind}", self.strays))
                thread.start()
                thread.join()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(seen)], object))]))
        return responses
"""


@pytest.fixture(scope="module", params=["one process", "workers"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    for kind, extra in KINDS.items():
        write_model(repo, f"counts_{kind}", CONFIG.format(extra=extra), COUNTS.format(kind=kind))
    workers = ["--grpc-workers", "1" if request.param == "workers" else "0"]
    with serving(
        repo, tmp_path_factory.mktemp("server"), *workers, "--model-control-mode", "explicit", "--load-model", "*"
    ) as running:
        yield running


def _metrics(server: RunningServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as answer:
        text: str = answer.read().decode()
    return text


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _step(client: grpcclient.InferenceServerClient, model: str, step: int) -> dict:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([step], np.int32))
    answer = client.infer(model, [tensor], client_timeout=60).as_numpy("OUT")[0]
    seen: dict = json.loads(answer)
    return seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_instances_share_a_series_and_metrics_shows_it_as_triton_writes_it(
    server: RunningServer, kind: str
) -> None:
    model = f"counts_{kind}"
    with grpcclient.InferenceServerClient(server.url) as client:
        seen = [_step(client, model, step) for step in (5, 0, 20, 1)]
    assert [s["shared"] for s in seen] == [1.0, 2.0, 3.0, 4.0]  # whichever instance ran it: one series
    assert [s["depth"] for s in seen] == [2.0, -3.0, 17.0, -2.0]
    assert [s["made"] for s in seen] == [1.0, 2.0, 3.0, 4.0]  # review of session 53: failed from the 2nd
    assert seen[1]["strays"] == [42.0]
    text = _metrics(server)
    assert _lines(text, f"# HELP requests_{kind}") == [f"# HELP requests_{kind} requests seen"]
    assert _lines(text, f"# TYPE requests_{kind}") == [f"# TYPE requests_{kind} counter"]
    assert f'requests_{kind}{{kind="{kind}"}} 4' in text.splitlines()
    mine = sorted(_lines(text, f'requests_{kind}{{instance="'))
    assert len(mine) == 2 and sum(float(line.rsplit(" ", 1)[1]) for line in mine) == 2.0, mine
    assert f'depth_{kind}{{kind="{kind}"}} -2' in text.splitlines()
    assert f'requests_{kind}{{enum="a"}} 4' in text.splitlines()  # review of session 53: closed its pipe
    assert not _lines(text, f"stray_{kind}")  # its object collected with its thread: the family went with it
    assert _lines(text, f"sizes_{kind}") == [
        f'sizes_{kind}_count{{kind="{kind}"}} 4',
        f'sizes_{kind}_sum{{kind="{kind}"}} 26',
        f'sizes_{kind}_bucket{{kind="{kind}",le="0.1"}} 1',
        f'sizes_{kind}_bucket{{kind="{kind}",le="1"}} 2',
        f'sizes_{kind}_bucket{{kind="{kind}",le="10"}} 3',
        f'sizes_{kind}_bucket{{kind="{kind}",le="+Inf"}} 4',
    ]


@pytest.mark.parametrize("kind", list(KINDS))
def test_refusals_are_in_tritons_words(server: RunningServer, kind: str) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        seen = _step(client, f"counts_{kind}", 1)
    failed = f"Failed to process the request for model '{seen['instance']}', message: "
    assert dict((what, text) for what, _, text in seen["refusals"]) == {
        "other kind": f"Error when creating MetricFamily: {failed}Family name already exists with different type",
        "label not a string": f"Error when creating Metric: {failed}attempt to access JSON non-string as string",
        "counter with buckets": "Failed to create metric. Unexpected buckets found.",
        "histogram without buckets": "Failed to create metric. Missing required buckets.",
        "counter decremented": f"Failed to increment metric value: {failed}TRITONSERVER_METRIC_KIND_COUNTER can "
        "only be incremented monotonically by non-negative values.",
        "counter set": f"Failed to set metric value: {failed}TRITONSERVER_METRIC_KIND_COUNTER does not support Set",
        "gauge observed": f"Failed to observe metric value: {failed}TRITONSERVER_METRIC_KIND_GAUGE does not "
        "support Observe",
        "histogram value": f"Failed to get metric value: {failed}TRITONSERVER_METRIC_KIND_HISTOGRAM does not "
        "support Value",
        "buckets out of order": f"Error when creating Metric: {failed}Bucket Boundaries must be strictly sorted",
        "no metric name": f"Error when creating MetricFamily: {failed}Invalid metric name",
        "the server's name": f"Error when creating MetricFamily: {failed}Invalid metric name: the server's own "
        "families start with ('nv_', 'shoal_', 'process_')",
        "no label name": f"Error when creating Metric: {failed}Invalid label name",
        "no UTF-8": f"Error when creating Metric: {failed}a label value must be text that UTF-8 can encode",
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_unloaded_models_series_leave_metrics(server: RunningServer, kind: str) -> None:
    model = f"counts_{kind}"
    with grpcclient.InferenceServerClient(server.url) as client:
        _step(client, model, 1)
        assert _lines(_metrics(server), f"requests_{kind}{{")
        client.unload_model(model)
        assert not _lines(_metrics(server), f"requests_{kind}"), "the unloaded model's series are still written"
        client.load_model(model)
        assert _step(client, model, 1)["shared"] == 1.0  # made afresh


def test_the_registry_keeps_a_family_and_its_series_while_a_holder_holds_it() -> None:
    registry = CustomMetrics()
    registry.family("c", "first", COUNTER, holder="a")
    registry.family("c", "second", COUNTER, holder="b")  # found: the first description stays
    with pytest.raises(CustomMetricError, match="Family name already exists with different type"):
        registry.family("c", "first", GAUGE, holder="a")
    one, two = registry.metric("c", {"a": "1"}, None), registry.metric("c", {"a": "1"}, None)
    assert one == two
    registry.increment(one, 2)
    assert registry.value(two) == 2.0
    registry.release("c", "a")
    assert registry.text() == '# HELP c first\n# TYPE c counter\nc{a="1"} 2\n'  # "b" holds it still
    registry.release_holder("b")
    assert registry.text() == ""  # no hold left: the family goes, with its series
    with pytest.raises(CustomMetricError, match="'MetricFamily' has been deleted"):
        registry.value(one)
    registry.family("h", "sizes", HISTOGRAM)
    series = registry.metric("h", {}, [1.0, 10.0])
    for value in (1.0, 0.5, 11.0):  # a bucket counts values up to its bound, inclusive
        registry.observe(series, value)
    assert registry.text().splitlines()[2:] == [
        "h_count 3",
        "h_sum 12.5",
        'h_bucket{le="1"} 2',
        'h_bucket{le="10"} 2',
        'h_bucket{le="+Inf"} 3',
    ]


def test_junk_from_a_model_never_reaches_the_page() -> None:
    registry = CustomMetrics()
    registry.family("g", "a gauge", GAUGE)
    series = registry.metric("g", {"a": 'say "hi"\n'}, None)
    for junk in ("abc", None, [1]):
        with pytest.raises(TypeError):
            registry.set(series, junk)
    with pytest.raises(CustomMetricError, match="non-string"):
        registry.metric("g", {"a": 1}, None)
    with pytest.raises(TypeError):
        registry.family(7, "d", GAUGE)
    with pytest.raises(TypeError):  # a page UTF-8 cannot encode failed every scrape (review of session 53)
        registry.family("h", "x" + chr(0xDCFF), GAUGE)
    registry.release([1, 2])  # a worker's junk: it names no family, and fails nobody's next call
    for value, written in (
        (1e20, "1e+20"),
        (1e5, "100000"),
        (0.1 + 0.2, "0.3"),
        (2.5, "2.5"),
        (4.0, "4"),
        (float("nan"), "Nan"),
        (-math.inf, "-Inf"),
    ):
        registry.set(series, value)  # as Triton 2.51's page writes them (%.16g), compared value by value
        assert registry.text().splitlines()[-1] == f'g{{a="say \\"hi\\"\\n"}} {written}'


def test_a_workers_junk_is_refused_or_closes_its_pipe_and_its_families_go() -> None:
    """Review of session 53: a value of no number, set through the pipe by hand, made /metrics answer 500
    for every model until it was set again. The registry refuses it; a message no worker sends closes
    that worker's metrics pipe, and the families only it held go."""
    registry = CustomMetrics()
    ours, theirs = multiprocessing.Pipe()
    thread = threading.Thread(target=metrics_pipe.serve, args=(ours, registry, "a test's worker"))
    thread.start()
    worker = metrics_pipe.PipeMetrics(theirs, "junk_0")
    worker.family("junk", "d", GAUGE)
    series = worker.metric("junk", {"a": "1"}, None)
    theirs.send(("set", (series, "abc")))
    assert theirs.recv() == (False, "a metric's value is a number, not str")
    worker.set(series, 3)
    assert registry.text().splitlines()[-1] == 'junk{a="1"} 3'
    theirs.send(("exec", ("import os",)))
    thread.join(30)
    assert not thread.is_alive()
    with pytest.raises(EOFError):
        theirs.recv()
    assert registry.text() == ""
