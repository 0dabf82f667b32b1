"""Triton's trace extension (issue 28 item 1): the settings of ``/v2/trace/setting`` and gRPC
``TraceSetting`` in Triton 2.51's shapes and words (captured from tritonserver 2.51), the sampling
they decide, Triton's JSON trace file, and OpenTelemetry spans received at a real OTLP/HTTP endpoint
on loopback: names, parents, attributes and events as Triton's, the client's W3C trace kept, an
ensemble's steps under it; in both process layouts (a front-end worker's receive time starts the span).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shoal.errors import ErrorCode, ShoalError
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from shoal.settings import parse_trace_config
from shoal.statistics import Phases
from shoal.tracing import tracer as tracer_module
from shoal.tracing.export import OpenTelemetrySpans, TraceFile
from shoal.tracing.settings import TraceSettings, check_start
from shoal.tracing.trace import Origin, RequestTrace, tensor_record
from shoal.tracing.tracer import Tracer, valid_traceparent
from tests import decoupled_models, ensemble_models, python_models
from tests.conftest import RunningServer, serving
from tests.polling import wait_until

TRITON_DEFAULT = {
    "trace_level": ["OFF"],
    "trace_rate": "1000",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_file": "",
    "trace_mode": "triton",
}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


# -- settings, without a server --------------------------------------------------------------------


def test_the_command_line_takes_tritons_trace_config() -> None:
    config = parse_trace_config(
        ["triton,file=/tmp/t.json", "level=TIMESTAMPS", "rate=1", "count=5", "triton,log-frequency=2"]
    )
    assert (config.mode, config.level, config.rate, config.count, config.file, config.log_frequency) == (
        "triton",
        frozenset({"TIMESTAMPS"}),
        1,
        5,
        "/tmp/t.json",
        2,
    )
    otel = parse_trace_config(
        [
            "mode=opentelemetry",
            "opentelemetry,url=127.0.0.1:4318/v1/traces",
            "opentelemetry,resource=service.name=mine",
            "opentelemetry,bsp_schedule_delay=50",
        ]
    )
    assert (otel.url, otel.resource, otel.bsp["bsp_schedule_delay"]) == (
        "127.0.0.1:4318/v1/traces",
        (("service.name", "mine"),),
        50,
    )
    for bad in ("level=bogus", "rate=abc", "mode=jaeger", "foo=1", "triton,foo=1", "rate", "count=-2"):
        with pytest.raises(ValueError):
            parse_trace_config([bad])
    with pytest.raises(ShoalError, match="trace file name is not given"):
        check_start(parse_trace_config(["level=TIMESTAMPS"]))  # triton mode writes a file: which?


def settings(*flags: str) -> TraceSettings:
    return TraceSettings(parse_trace_config(list(flags)))


def test_a_model_overrides_fields_and_clearing_one_follows_the_global_again() -> None:
    traces = settings("triton,file=/tmp/t.json")
    assert traces.answer() == {**TRITON_DEFAULT, "trace_file": "/tmp/t.json"}
    traces.update("add", {"trace_rate": ["7"]})
    traces.update("", {"trace_count": ["5"], "trace_rate": ["3"]})
    assert (traces.answer("add")["trace_rate"], traces.answer("add")["trace_count"]) == ("7", "5")
    assert traces.answer("other")["trace_rate"] == "3"
    traces.update("add", {"trace_rate": None})  # cleared: the global one again, and it follows it
    traces.update("", {"trace_rate": ["9"]})
    assert traces.answer("add")["trace_rate"] == "9"
    traces.update("", {"trace_rate": None})  # globally: the start value
    assert traces.answer()["trace_rate"] == "1000"


@pytest.mark.parametrize(
    ("changes", "code", "words"),
    [
        ({"trace_rate": ["abc"]}, ErrorCode.INVALID_ARGUMENT, "Unable to parse 'trace_rate', got: abc"),
        (
            {"trace_count": ["-2"]},
            ErrorCode.INVALID_ARGUMENT,
            "Unable to parse 'trace_count'. Expecting value >= -1, got: -2",
        ),
        ({"trace_rate": ["3000000000000"]}, ErrorCode.INVALID_ARGUMENT, "value is out of range [ 0, 4294967295 ]"),
        ({"trace_rate": ["1", "2"]}, ErrorCode.INVALID_ARGUMENT, "expect only 1 value for 'trace_rate'"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, ErrorCode.INVALID_ARGUMENT, "Expect only one trace level 'OFF'"),
        ({"trace_level": ["timestamps"]}, ErrorCode.INVALID_ARGUMENT, "unknown trace level 'timestamps'"),
        ({"trace_file": ["/tmp/x"]}, ErrorCode.UNSUPPORTED, "trace file location can not be updated through network"),
        ({"trace_mode": ["opentelemetry"]}, ErrorCode.UNSUPPORTED, "trace mode can not be updated"),
        ({"trace_ratee": ["1"]}, ErrorCode.INVALID_ARGUMENT, "unknown trace setting 'trace_ratee'"),
        (
            {"trace_level": ["TIMESTAMPS"], "trace_rate": ["0"]},
            ErrorCode.INVALID_ARGUMENT,
            "Attempting to set invalid trace setting :sample rate must be non-zero",
        ),
    ],
)
def test_a_bad_change_is_refused_and_changes_nothing(changes: dict[str, Any], code: ErrorCode, words: str) -> None:
    traces = settings("triton,file=/tmp/t.json")
    with pytest.raises(ShoalError) as caught:
        traces.update("", {"trace_count": ["4"], **changes})
    assert caught.value.code is code and words in caught.value.message
    assert traces.answer()["trace_count"] == "-1"


def test_a_model_cleared_back_to_a_command_line_rate_of_zero_is_not_refused() -> None:
    """Found by the TENSORS test: the global rate 0 (clients' traces only) passed at start, and a model
    that took a rate of its own could not be given back to it (its check found the rate 0)."""
    traces = settings("mode=opentelemetry", "level=TIMESTAMPS", "rate=0")
    traces.update("add", {"trace_level": ["TENSORS"], "trace_rate": ["1"]})
    traces.update("add", {"trace_rate": None})  # its own level stays: it follows the rate 0 again
    assert traces.answer("add")["trace_rate"] == "0" and traces.answer("add")["trace_level"] == ["TENSORS"]
    traces.update("add", {"trace_level": None})
    assert traces.answer("add")["trace_level"] == ["TIMESTAMPS"]
    traces.update("", {"trace_count": ["3"]})  # a global change beside the command line's rate 0
    assert traces.answer()["trace_count"] == "3"
    with pytest.raises(ShoalError, match="sample rate must be non-zero"):  # setting 0 itself stays refused
        traces.update("add", {"trace_rate": ["0"]})


def test_enabling_without_a_file_in_triton_mode_is_refused_in_tritons_words() -> None:
    with pytest.raises(ShoalError, match="Attempting to set invalid trace setting :trace file name is not given"):
        settings().update("", {"trace_level": ["TIMESTAMPS"]})


def test_the_rate_samples_one_in_n_and_the_count_counts_down() -> None:
    traces = settings("triton,file=/tmp/t.json", "level=TIMESTAMPS", "rate=3", "count=2")
    taken = [traces.sample("add", has_parent=False) is not None for _ in range(9)]
    assert taken == [True, False, False, True, False, False, False, False, False]
    assert traces.answer()["trace_count"] == "0"
    with pytest.raises(ShoalError, match="trace count is 0"):  # an update that leaves it at 0, as Triton refuses
        traces.update("", {"trace_rate": ["1"]})


def test_at_rate_zero_only_a_request_with_a_clients_trace_is_traced() -> None:
    traces = settings("mode=opentelemetry", "level=TIMESTAMPS", "rate=0")
    assert [traces.sample("add", has_parent=p) is not None for p in (False, True, False)] == [False, True, False]


def test_a_clients_trace_is_traced_at_any_rate_and_count_and_takes_none_of_it() -> None:
    traces = settings("mode=opentelemetry", "level=TIMESTAMPS", "rate=1000", "count=1")
    assert traces.sample("add", has_parent=False) == {"TIMESTAMPS"}  # the first of a thousand, the count's last
    assert [traces.sample("add", has_parent=True) for _ in range(3)] == [{"TIMESTAMPS"}] * 3
    assert traces.answer()["trace_count"] == "0" and traces.sample("add", has_parent=False) is None
    assert settings("mode=opentelemetry").sample("add", has_parent=True) is None  # unless tracing is off


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        (TRACEPARENT, True),
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", True),
        ("garbage", False),
        ("", False),
        (f"00-{'0' * 32}-{CLIENT_SPAN}-01", False),
        (f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01", False),
        (f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", False),
    ],
)
def test_only_a_valid_traceparent_counts_as_a_clients_trace(text: str, valid: bool) -> None:
    assert valid_traceparent(text) is valid


def test_a_trace_file_that_cannot_be_written_drops_its_traces_and_says_so_once(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    frequency = [1]
    writer = TraceFile(str(tmp_path / "missing" / "t.json"), lambda: frequency[0])
    for _ in range(3):
        writer(trace_of("add1"))
    writer.close()
    failures = [r for r in caplog.records if "could not write the trace file" in r.getMessage()]
    assert len(failures) == 3  # one line per file (t.json.0, .1, .2), none repeated, no traceback
    assert not any(r.exc_info for r in caplog.records)


def test_the_log_frequency_followed_is_the_current_one(tmp_path: Path) -> None:
    frequency = [0]
    writer = TraceFile(str(tmp_path / "t.json"), lambda: frequency[0])
    writer(trace_of("add1"))
    frequency[0] = 2  # changed over the API while serving
    writer(trace_of("add1"))
    writer.close()
    written = json.loads((tmp_path / "t.json.0").read_text())
    assert len([r for r in written if "model_name" in r]) == 2 and not (tmp_path / "t.json").exists()


def test_a_trace_file_in_a_folder_it_cannot_write_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ShoalError, match="is not a folder this server may write"):
        check_start(parse_trace_config([f"triton,file={tmp_path / 'missing' / 't.json'}", "level=TIMESTAMPS"]))


def trace_of(model: str) -> RequestTrace:
    trace = RequestTrace(model, "1", "", Origin("GRPC", time.monotonic_ns()))
    trace.stamp("REQUEST_START")
    trace.stamp("REQUEST_END")
    return trace


def traced_to_a_list(tmp_path: Path) -> tuple[Tracer, list[RequestTrace]]:
    """A tracer that traces every request, its exports kept in a list."""
    tracer = Tracer(parse_trace_config([f"triton,file={tmp_path / 't.json'}", "level=TIMESTAMPS", "rate=1"]))
    exported: list[RequestTrace] = []
    tracer._export = exported.append  # type: ignore[assignment]
    return tracer, exported


def test_a_trace_waits_for_its_send_and_carries_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        tracer, exported = traced_to_a_list(tmp_path)
        trace = tracer.start("add1", "1", "", Origin("HTTP", time.monotonic_ns()))
        assert trace is not None
        tracer.finish(trace, sending=True)
        assert exported == []  # its answer is not written yet
        tracer.sent(trace.id, 5, 7, last=True)
        assert exported == [trace] and trace.stamps[-2:] == [("HTTP_SEND_START", 5), ("HTTP_SEND_END", 7)]
        tracer.sent(trace.id, 8, 9, last=True)  # a late report of an exported trace changes nothing
        assert len(trace.stamps) == 5

    asyncio.run(scenario())


def test_sends_reported_before_the_end_are_kept_and_the_last_ends_it_at_once(tmp_path: Path) -> None:
    """A decoupled model's responses go out while it runs: the trace ends with its execution."""

    async def scenario() -> None:
        tracer, exported = traced_to_a_list(tmp_path)
        trace = tracer.start("square", "1", "", Origin("GRPC", time.monotonic_ns()))
        assert trace is not None
        tracer.sent(trace.id, 1, 2, last=False)
        tracer.sent(trace.id, 3, 0, last=True)  # the last one was not written (the client went)
        tracer.finish(trace, responded=False, sending=True)
        assert exported == [trace]
        assert [n for n, _ in trace.stamps if "SEND" in n] == ["GRPC_SEND_START", "GRPC_SEND_END"]

    asyncio.run(scenario())


def test_a_send_never_reported_costs_the_trace_its_send_not_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front-end worker that died, a stream closed with answers queued: the trace goes out anyway."""
    monkeypatch.setattr(tracer_module, "SEND_WAIT_S", 0.05)

    async def scenario() -> None:
        tracer, exported = traced_to_a_list(tmp_path)
        first, second = (tracer.start("add1", "1", "", Origin("GRPC", time.monotonic_ns())) for _ in range(2))
        assert first is not None and second is not None
        tracer.finish(first, sending=True)
        tracer.finish(second, sending=True)
        deadline = time.monotonic() + 30
        while len(exported) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the loop runs the tracer's timer; polled, never a fixed wait
        assert exported == [first, second] and not any("SEND" in n for n, _ in first.stamps)
        third = tracer.start("add1", "1", "", Origin("GRPC", time.monotonic_ns()))
        assert third is not None
        tracer.finish(third, sending=True)
        tracer.stop_waiting()  # at shutdown: what still waits is exported as it is
        assert exported == [first, second, third]

    asyncio.run(scenario())


def test_off_is_one_check() -> None:
    traces = settings()
    assert traces.on is False  # LocalCore asks nothing more of an untraced request


# -- a real OTLP/HTTP endpoint ---------------------------------------------------------------------


class Collector:
    """An OTLP/HTTP receiver on loopback: every span posted to /v1/traces, with its resource."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for resource_spans in message.resource_spans:
                        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                        for scope in resource_spans.scope_spans:
                            for span in scope.spans:
                                collector.spans.append(_span(span, resource))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, count: int) -> list[dict[str, Any]]:
        """The spans of one trace, once ``count`` of them arrived."""

        def arrived() -> bool:
            with self.lock:
                return len([s for s in self.spans if s["trace_id"] == trace_id]) >= count

        wait_until(arrived, timeout_s=60, what=f"{count} spans of trace {trace_id}")
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


def _span(span: Any, resource: dict[str, str]) -> dict[str, Any]:
    def value(v: Any) -> Any:
        return getattr(v, v.WhichOneof("value"))

    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "kind": span.kind,
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "trace_state": span.trace_state,
        "attributes": {a.key: value(a.value) for a in span.attributes},
        "events": [e.name for e in span.events],
        "times": [e.time_unix_nano for e in span.events],
        "resource": resource,
    }


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    receiver = Collector()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def test_a_malformed_tracestate_is_dropped_without_a_word(
    collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    spans = OpenTelemetrySpans(parse_trace_config([f"opentelemetry,url=127.0.0.1:{collector.port}/v1/traces"]))
    trace_id = secrets.token_hex(16)
    trace = RequestTrace(
        "add1",
        "1",
        "",
        Origin("GRPC", time.monotonic_ns(), f"00-{trace_id}-{CLIENT_SPAN}-01", "bad key=!!," + "x" * 100),
    )
    trace.stamp("REQUEST_START")
    trace.stamp("REQUEST_END")
    with caplog.at_level(logging.DEBUG):
        spans(trace)
    spans.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text  # the SDK warned per member
    assert {s["trace_state"] for s in collector.trace(trace_id, 2)} == {""}


CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# Calls add1 twice: once passing its request's trace (Triton nests that call's trace under the request's),
# once without (Triton does not trace that one).
CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN")
            traced = pb_utils.InferenceRequest(model_name="add1", inputs=[pb_utils.Tensor("IN", x.as_numpy())],
                                               requested_output_names=["OUT"], trace=request.trace()).exec()
            plain = pb_utils.InferenceRequest(model_name="add1", inputs=[pb_utils.Tensor("IN", x.as_numpy())],
                                              requested_output_names=["OUT"]).exec()
            out = pb_utils.get_output_tensor_by_name(traced, "OUT").as_numpy()
            out = out + pb_utils.get_output_tensor_by_name(plain, "OUT").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", out)]))
        return responses
"""


CONTEXT_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "CONTEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# Answers what Triton's pb_utils gives a model to continue its request's trace with ("None" when nothing).
CONTEXT = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("CONTEXT", np.array([str(request.trace().get_context())], dtype=object))
            ])
            for request in requests
        ]
"""


@pytest.fixture(scope="module")
def traced_server(
    tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...], collector: Collector
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    ensemble_models.add_onnx_add1(repo)
    python_models.write_model(repo, "square", decoupled_models.SQUARE_CONFIG, decoupled_models.SQUARE)
    python_models.write_model(repo, "caller", CALLER_CONFIG, CALLER)
    python_models.write_model(repo, "caller_thread", CALLER_CONFIG + decoupled_models.THREADS, CALLER)
    python_models.write_model(repo, "context", CONTEXT_CONFIG, CONTEXT)
    python_models.write_model(repo, "context_thread", CONTEXT_CONFIG + decoupled_models.THREADS, CONTEXT)
    ensemble_models.add_ensemble(
        repo,
        "twice",
        [
            ensemble_models.step("add1", {"IN": "IN"}, {"OUT": "mid"}),
            ensemble_models.step("add1", {"IN": "mid"}, {"OUT": "OUT"}),
        ],
    )
    with serving(
        repo,
        tmp_path_factory.mktemp("server"),
        *layout,
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        f"opentelemetry,url=127.0.0.1:{collector.port}/v1/traces",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=20",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=0",
    ) as server:
        yield server


def grpc_add1(server: RunningServer, model: str, traceparent: str, request_id: str = "") -> list[float]:
    with grpcclient.InferenceServerClient(server.url) as client:
        given = grpcclient.InferInput("IN", [1, 4], "FP32")
        given.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        answer = client.infer(model, [given], request_id=request_id, headers={"traceparent": traceparent})
        return answer.as_numpy("OUT").ravel().tolist()


def by_name(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        found.setdefault(span["name"], []).append(span)
    return found


@pytest.mark.other_engine  # the send is reported from each engine's end of the RPC
def test_a_grpc_request_is_spans_under_the_clients_trace(traced_server: RunningServer, collector: Collector) -> None:
    trace_id = secrets.token_hex(16)  # the collector serves both layouts: a trace of its own
    started = time.time_ns()
    assert grpc_add1(traced_server, "add1", f"00-{trace_id}-{CLIENT_SPAN}-01", request_id="r-1") == [1, 2, 3, 4]
    spans = by_name(collector.trace(trace_id, 3))
    root, model, compute = spans["InferRequest"][0], spans["add1"][0], spans["compute"][0]
    assert root["parent"] == CLIENT_SPAN  # the client's span is the root's parent; its trace id is kept
    assert model["parent"] == root["span_id"] and compute["parent"] == model["span_id"]
    assert {s["kind"] for s in (root, model, compute)} == {2}  # SERVER
    assert root["events"] == [  # Triton's, with its send: the span ends when the engine wrote the answer
        "GRPC_WAITREAD_START",
        "GRPC_WAITREAD_END",
        "INFER_RESPONSE_COMPLETE",
        "GRPC_SEND_START",
        "GRPC_SEND_END",
    ]
    assert root["times"] == sorted(root["times"]) and root["end"] == root["times"][-1] >= model["end"]
    assert model["events"] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert compute["events"] == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
    attributes = model["attributes"]
    assert (
        attributes["triton.model_name"],
        attributes["triton.model_version"],
        attributes["triton.request_id"],
        attributes["triton.trace_parent_id"],
    ) == ("add1", 1, "r-1", 0)
    assert root["start"] <= model["start"] <= compute["start"] <= compute["end"] <= model["end"] <= root["end"]
    assert started <= root["start"] and root["end"] <= time.time_ns()
    assert root["resource"]["service.name"] == "shoal"


def test_an_http_request_keeps_the_clients_trace_and_state(traced_server: RunningServer, collector: Collector) -> None:
    trace_id = secrets.token_hex(16)  # the collector serves both layouts: a trace of its own
    with httpclient.InferenceServerClient(traced_server.http_url) as client:
        given = httpclient.InferInput("IN", [1, 4], "FP32")
        given.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        client.infer(
            "add1",
            [given],
            headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01", "tracestate": "vendor=shoal-test"},
        )
    spans = by_name(collector.trace(trace_id, 3))
    root = spans["InferRequest"][0]
    assert root["events"] == [
        "HTTP_RECV_START",
        "HTTP_RECV_END",
        "INFER_RESPONSE_COMPLETE",
        "HTTP_SEND_START",
        "HTTP_SEND_END",
    ]
    assert root["times"] == sorted(root["times"]) and root["end"] == root["times"][-1] >= spans["add1"][0]["end"]
    assert root["start"] == root["times"][0]  # the span holds its first event, HTTP_RECV_START
    assert {s["trace_state"] for s in collector.trace(trace_id, 3)} == {"vendor=shoal-test"}


def test_an_ensembles_steps_hang_under_its_span(traced_server: RunningServer, collector: Collector) -> None:
    trace_id = secrets.token_hex(16)  # the collector serves both layouts: a trace of its own
    assert grpc_add1(traced_server, "twice", f"00-{trace_id}-{CLIENT_SPAN}-01") == [2, 3, 4, 5]
    spans = by_name(collector.trace(trace_id, 6))  # InferRequest, twice, 2 x (add1, compute)
    ensemble = spans["twice"][0]
    assert "compute" not in {s["name"] for s in spans["compute"] if s["parent"] == ensemble["span_id"]}
    steps = spans["add1"]
    assert len(steps) == 2 and {s["parent"] for s in steps} == {ensemble["span_id"]}
    assert {s["attributes"]["triton.trace_parent_id"] for s in steps} == {ensemble["attributes"]["triton.trace_id"]}
    assert {c["parent"] for c in spans["compute"]} == {s["span_id"] for s in steps}


@pytest.mark.parametrize("model", ["caller", "caller_thread"])
def test_a_bls_call_given_its_requests_trace_hangs_under_the_callers_span(
    traced_server: RunningServer, collector: Collector, model: str
) -> None:
    trace_id = secrets.token_hex(16)
    assert grpc_add1(traced_server, model, f"00-{trace_id}-{CLIENT_SPAN}-01") == [2, 4, 6, 8]  # (x + 1) twice
    spans = by_name(collector.trace(trace_id, 5))  # InferRequest, caller, its compute, add1, add1's compute
    caller = spans[model][0]
    assert [s["parent"] for s in spans["add1"]] == [caller["span_id"]]  # the call without trace= is not traced
    assert spans["add1"][0]["attributes"]["triton.trace_parent_id"] == caller["attributes"]["triton.trace_id"]
    computes = {s["parent"] for s in spans["compute"]}
    assert computes == {caller["span_id"], spans["add1"][0]["span_id"]}
    assert len(collector.trace(trace_id, 5)) == 5  # one export per request tree: the untraced call has none


def model_context(server: RunningServer, model: str, headers: dict[str, str]) -> str:
    with grpcclient.InferenceServerClient(server.url) as client:
        given = grpcclient.InferInput("IN", [1, 4], "FP32")
        given.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
        return str(client.infer(model, [given], headers=headers).as_numpy("CONTEXT").ravel()[0].decode())


@pytest.mark.parametrize("model", ["context", "context_thread"])
def test_a_python_model_gets_its_spans_context_as_tritons_get_context(
    traced_server: RunningServer, collector: Collector, model: str
) -> None:
    """Triton's ``request.trace().get_context()``: a JSON object whose traceparent names the model's span
    (the span exported later), the client's tracestate with it; None for a request that is not traced."""
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01", "tracestate": "vendor=shoal-test"}
    context = json.loads(model_context(traced_server, model, headers))
    spans = by_name(collector.trace(trace_id, 3))
    assert context == {
        "traceparent": f"00-{trace_id}-{spans[model][0]['span_id']}-01",
        "tracestate": "vendor=shoal-test",
    }
    assert model_context(traced_server, model, {}) == "None"  # rate 0 and no client's trace: not traced


@pytest.mark.parametrize(
    "traceparent",
    [
        "",  # a trace of the server's own: sampled by rate
        "garbage",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case: not W3C's
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # a later version's
        TRACEPARENT,  # the client's, continued
    ],
)
def test_the_spans_exported_have_the_ids_get_context_gave(collector: Collector, traceparent: str) -> None:
    """The model span's id and the trace id a Python model was given are the exported ones, whether the
    trace is the server's own or a client's, and whatever the client sent (once: no spans at all)."""
    url = f"opentelemetry,url=127.0.0.1:{collector.port}/v1/traces"
    tracer = Tracer(parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1", url]))
    memory = InMemorySpanExporter()
    tracer._export.provider.add_span_processor(SimpleSpanProcessor(memory))  # type: ignore[union-attr]
    trace = tracer.start("add1", "1", "", Origin("HTTP", time.monotonic_ns(), traceparent))
    assert trace is not None
    _, trace_id, span_id, _ = json.loads(trace.context())["traceparent"].split("-")
    tracer.finish(trace)  # nobody writes it: exported now
    spans = {span.name: span for span in memory.get_finished_spans()}
    assert sorted(spans) == ["InferRequest", "add1"]
    model, root = spans["add1"].context, spans["InferRequest"].context
    assert (f"{model.trace_id:032x}", f"{model.span_id:016x}", root.trace_id) == (trace_id, span_id, model.trace_id)
    if traceparent == TRACEPARENT:
        assert trace_id == CLIENT_TRACE
    tracer.close()


def test_a_trace_of_its_own_gives_its_own_ids_to_get_context() -> None:
    """Without a client's trace the trace id is the server's, chosen at the start and kept by the spans."""
    tracer = Tracer(parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"]))
    trace = tracer.start("add1", "1", "", Origin("GRPC", time.monotonic_ns()))
    assert trace is not None
    step = trace.child("add1", "1")
    parent, step_parent = (json.loads(t.context())["traceparent"].split("-") for t in (trace, step))
    assert parent[1] == step_parent[1] == f"{trace.otel_trace_id:032x}" and parent[2] != step_parent[2]
    in_triton_mode = RequestTrace("add1", "1", "", Origin("GRPC", time.monotonic_ns()))
    assert in_triton_mode.context() == ""  # pb_utils answers None


def test_a_clients_unsampled_trace_is_still_continued(traced_server: RunningServer, collector: Collector) -> None:
    trace_id = secrets.token_hex(16)
    grpc_add1(traced_server, "add1", f"00-{trace_id}-{CLIENT_SPAN}-00")  # flags 00: Triton exports it too
    assert by_name(collector.trace(trace_id, 3))["InferRequest"][0]["parent"] == CLIENT_SPAN


def stream_square(server: RunningServer, n: int, traceparent: str = "", empty_final: bool = True) -> list[int]:
    """``square`` over a gRPC stream: its ``n`` responses (each ``n``), read up to the FINAL flag (or, when
    the client does not ask for an empty final response, the ``n``-th)."""
    answers: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.url) as client:
        client.start_stream(
            callback=lambda result, error: answers.put((result, error)),
            headers={"traceparent": traceparent} if traceparent else None,
        )
        given = grpcclient.InferInput("IN", [1], "INT32")
        given.set_data_from_numpy(np.array([n], dtype=np.int32))
        client.async_stream_infer("square", [given], request_id="s", enable_empty_final_response=empty_final)
        got: list[int] = []
        while len(got) < n or empty_final:
            result, error = answers.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            got += result.as_numpy("OUT").tolist()
        client.stop_stream()
    return got


@pytest.mark.other_engine  # the send is reported from each engine's end of the RPC
def test_a_decoupled_models_request_is_one_trace_as_tritons(traced_server: RunningServer, collector: Collector) -> None:
    """As Triton 2.51 traces a decoupled model's request (captured): one trace, the batch's times once,
    INFER_RESPONSE_COMPLETE once (at the first response), under the client's span (it was once not traced)."""
    trace_id = secrets.token_hex(16)
    assert stream_square(traced_server, 3, f"00-{trace_id}-{CLIENT_SPAN}-01") == [3, 3, 3]
    spans = by_name(collector.trace(trace_id, 3))
    assert sorted(spans) == ["InferRequest", "compute", "square"]
    root, model, compute = spans["InferRequest"][0], spans["square"][0], spans["compute"][0]
    assert (
        root["parent"] == CLIENT_SPAN and model["parent"] == root["span_id"] and compute["parent"] == model["span_id"]
    )
    # A send per response written, the empty final one asked for included (Triton's: 4 pairs for 3 + FINAL)
    sends = ["GRPC_SEND_START", "GRPC_SEND_END"] * 4
    assert root["events"] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE", *sends]
    assert root["times"] == sorted(root["times"]) and root["end"] >= root["times"][-1]
    assert model["events"] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert compute["events"] == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
    assert model["attributes"]["triton.request_id"] == "s" and model["attributes"]["triton.model_version"] == 1
    assert root["start"] <= model["start"] <= compute["start"] <= compute["end"] <= model["end"] <= root["end"]
    # tritonclient's default: no empty final response; the FINAL flag's send, not written, once the 3 went out
    trace_id = secrets.token_hex(16)
    assert stream_square(traced_server, 3, f"00-{trace_id}-{CLIENT_SPAN}-01", empty_final=False) == [3, 3, 3]
    root = by_name(collector.trace(trace_id, 3))["InferRequest"][0]
    assert root["events"][3:] == ["GRPC_SEND_START", "GRPC_SEND_END"] * 3


def test_without_a_clients_trace_at_rate_zero_nothing_is_sent(
    traced_server: RunningServer, collector: Collector
) -> None:
    before = len(collector.spans)
    with grpcclient.InferenceServerClient(traced_server.url) as client:
        given = grpcclient.InferInput("IN", [1, 4], "FP32")
        given.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        client.infer("add1", [given])
    trace_id = secrets.token_hex(16)  # the collector serves both layouts: a trace of its own
    grpc_add1(traced_server, "add1", f"00-{trace_id}-{CLIENT_SPAN}-01")  # one that is traced, to wait for
    collector.trace(trace_id, 3)
    assert len(collector.spans) == before + 3


# -- Triton's trace file and the settings over both transports -------------------------------------


def add1_and_square(tmp_path: Path) -> tuple[Path, Path]:
    """A repository of add1 (ONNX) and square (a decoupled Python model), and where its trace file goes;
    the server's folder made."""
    repo = tmp_path / "repo"
    ensemble_models.add_onnx_add1(repo)
    python_models.write_model(repo, "square", decoupled_models.SQUARE_CONFIG, decoupled_models.SQUARE)
    (tmp_path / "server").mkdir()
    return repo, tmp_path / "trace.json"


def test_triton_mode_writes_tritons_trace_file_and_counts_down(tmp_path: Path) -> None:
    repo, trace_file = add1_and_square(tmp_path)
    with serving(
        repo,
        tmp_path / "server",
        "--grpc-workers",
        "2",
        "--trace-config",
        f"triton,file={trace_file}",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=1",
        "--trace-config",
        "count=4",
    ) as server:
        assert stream_square(server, 2) == [2, 2]
        for _ in range(2):
            grpc_add1(server, "add1", "")
        with httpclient.InferenceServerClient(server.http_url) as client:
            given = httpclient.InferInput("IN", [1, 4], "FP32")
            given.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
            client.infer("add1", [given])
            grpc_add1(server, "add1", "")  # past the count: not traced
            assert client.get_trace_settings() == {
                **TRITON_DEFAULT,
                "trace_level": ["TIMESTAMPS"],
                "trace_rate": "1",
                "trace_count": "0",
                "trace_file": str(trace_file),
            }
    records = json.loads(trace_file.read_text())
    models = [r for r in records if "model_name" in r]
    assert [(m["model_name"], m["model_version"]) for m in models] == [("square", 1)] + [("add1", 1)] * 3

    def stamps(model: dict[str, Any]) -> list[tuple[str, int]]:
        return [tuple(r["timestamps"][0].values()) for r in records if r["id"] == model["id"] and "timestamps" in r]

    streamed = dict(stamps(models[0]))
    assert sorted(streamed) == sorted(  # a decoupled model's request: its first response completes it, once
        ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "INFER_RESPONSE_COMPLETE"]
        + ["REQUEST_END", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
        + ["GRPC_SEND_START", "GRPC_SEND_END"]
    )
    assert streamed["REQUEST_START"] < streamed["INFER_RESPONSE_COMPLETE"] < streamed["REQUEST_END"]
    assert streamed["COMPUTE_START"] < streamed["INFER_RESPONSE_COMPLETE"] < streamed["COMPUTE_END"]
    sends = [name for name, _ in stamps(models[0]) if "_SEND_" in name]
    assert sends == ["GRPC_SEND_START", "GRPC_SEND_END"] * 3  # 2 responses and the empty FINAL asked for
    request = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"]
    request += ["COMPUTE_END", "REQUEST_END", "INFER_RESPONSE_COMPLETE"]
    first = stamps(models[1])
    assert [name for name, _ in first] == [  # what Triton's trace_summary.py reads for gRPC, all there
        "GRPC_WAITREAD_START",
        "GRPC_WAITREAD_END",
        *request,
        "GRPC_SEND_START",
        "GRPC_SEND_END",
    ]
    over_http = stamps(models[3])
    assert [name for name, _ in over_http] == [  # and for HTTP (in a front-end worker: its send reported)
        "HTTP_RECV_START",
        "HTTP_RECV_END",
        *request,
        "HTTP_SEND_START",
        "HTTP_SEND_END",
    ]
    for timeline in (first, over_http):  # one clock in every process: the worker's stamps are in order too
        assert [ns for _, ns in timeline] == sorted(ns for _, ns in timeline)


@pytest.mark.parametrize(
    ("array", "data", "shape", "dtype"),
    [  # Triton 2.51's trace file, captured, for the same values
        (np.arange(16, dtype=np.int32).reshape(1, 16), ",".join(map(str, range(16))), "1,16", "INT32"),
        (np.array([1, 2, 3, -4], dtype=np.int64), "1,2,3,-4", "4", "INT64"),
        (np.array([True, False, True]), "1,0,1", "3", "BOOL"),
        (
            np.array([0.1, 1e-7, 123456789, 3.14159265, -0.0, 100, 1234567], dtype=np.float32),
            "0.1,1e-07,1.23457e+08,3.14159,-0,100,1.23457e+06",
            "7",
            "FP32",
        ),
        (np.array([0.1, 1 / 3, 1e20]), "0.1,0.333333,1e+20", "3", "FP64"),
        (np.array([b"hello", b"a,b", b""], dtype=object).reshape(3, 1), '"hello","a,b",""', "3,1", "BYTES"),
    ],
)
def test_a_tensor_is_written_as_tritons_trace_file_writes_it(
    array: np.ndarray, data: str, shape: str, dtype: str
) -> None:
    assert tensor_record("TENSOR_QUEUE_INPUT", "X", array) == ("TENSOR_QUEUE_INPUT", "X", data, shape, dtype)


def test_where_shoal_writes_tensors_better_than_triton() -> None:
    """Triton writes INT8/UINT8 as characters, FP16 as "", and a string's quotes and backslashes raw (its
    file is then not JSON, and its elements cannot be told apart): here each element reads back."""
    assert tensor_record("A", "X", np.array([72, 105], dtype=np.uint8)).data == "72,105"
    assert tensor_record("A", "X", np.array([0.5, 2], dtype=np.float16)).data == "0.5,2"
    strings = np.array([b'a","b', rb"a\xff", b"\xff", "café"], dtype=object)
    assert tensor_record("A", "X", strings).data == r'"a\",\"b","a\\xff","\xff","café"'


def test_a_tensor_that_cannot_be_written_drops_the_traces_tensors_not_the_request() -> None:
    """Found by review: an error there was raised into the scheduler, which then settled no request of
    the batch. It is logged, and the trace keeps no tensors."""
    trace = RequestTrace("m", "1", "", None, tensors=[])
    trace.queued({"X": np.array([1 + 2j])})  # no request carries complex numbers: a stand-in for any failure
    trace.executed(0, 1, Phases(1, 1, 1), {"Y": np.ones(2, np.float32)})
    assert trace.tensors is None and trace.computed
    trace = RequestTrace("m", "1", "", None, tensors=[])
    trace.queued({"X": np.ones(2, np.int32)})
    trace.queued({"X": np.ones(2, np.int32), "CONTROL": np.ones(1, np.int32)})  # a lane's built feed: not again
    assert [(t.activity, t.name) for t in trace.tensors or []] == [("TENSOR_QUEUE_INPUT", "X")]


def test_what_changes_in_a_trace_after_its_export_is_not_written(tmp_path: Path) -> None:
    """A cancelled request's trace is exported at once, and its batch still ends later (its compute
    stamps and outputs): the file holds the trace as it was exported, whenever it is written."""
    writer = TraceFile(str(tmp_path / "t.json"), lambda: 0)
    trace = RequestTrace("add1", "1", "", Origin("GRPC", time.monotonic_ns()), tensors=[])
    trace.stamp("REQUEST_START")
    trace.stamp("REQUEST_END")
    writer(trace)
    trace.executed(1, 2, Phases(1, 1, 1), {"OUT": np.ones(2, np.float32)})
    writer.close()
    written = json.loads((tmp_path / "t.json").read_text())
    names = [r["timestamps"][0]["name"] for r in written if "timestamps" in r]
    assert names == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "REQUEST_END"]
    assert not [r for r in written if "tensor" in r]


def test_the_tensors_level_writes_a_requests_tensors_as_triton_does(tmp_path: Path) -> None:
    """TENSORS with TIMESTAMPS: the header (with the request's id), the stamps and the tensors; TENSORS
    alone: the tensors only, as Triton 2.51 writes them (captured); a decoupled model's outputs per response."""
    repo, trace_file = add1_and_square(tmp_path)
    with serving(
        repo, tmp_path / "server", "--trace-config", f"triton,file={trace_file}", "--trace-config", "rate=1"
    ) as server:
        for level in (["TIMESTAMPS", "TENSORS"], ["TENSORS"]):
            status, answer = http(server, "/v2/trace/setting", json.dumps({"trace_level": level}).encode())
            assert status == 200 and answer["trace_level"] == level
            assert grpc_add1(server, "add1", "", request_id=f"r-{len(level)}") == [1, 2, 3, 4]
        assert stream_square(server, 2) == [2, 2]
    records = json.loads(trace_file.read_text())
    ids = sorted({r["id"] for r in records})
    assert len(ids) == 3
    both, alone, streamed = ([r for r in records if r["id"] == i] for i in ids)
    assert both[0] == {"id": ids[0], "model_name": "add1", "model_version": 1, "request_id": "r-2"}
    assert [r["timestamps"][0]["name"] for r in both if "timestamps" in r][2:4] == ["REQUEST_START", "QUEUE_START"]
    tensors = [(r["activity"], r["tensor"]) for r in both if "activity" in r]
    assert tensors == [
        ("TENSOR_QUEUE_INPUT", {"name": "IN", "data": "0,1,2,3", "shape": "1,4", "dtype": "FP32"}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "OUT", "data": "1,2,3,4", "shape": "1,4", "dtype": "FP32"}),
    ]
    assert [(r["activity"], r["tensor"]) for r in alone] == tensors  # nothing else at TENSORS alone
    assert [(r["activity"], r["tensor"]["data"]) for r in streamed] == [
        ("TENSOR_QUEUE_INPUT", "2"),
        ("TENSOR_BACKEND_OUTPUT", "2"),
        ("TENSOR_BACKEND_OUTPUT", "2"),
    ]


def test_the_tensors_level_in_opentelemetry_mode_exports_the_bare_request_as_triton(
    traced_server: RunningServer, collector: Collector
) -> None:
    """Triton 2.51 takes TENSORS in OpenTelemetry mode, exports the request's root span alone and logs that
    it cannot trace tensors (Triton: once per tensor; Shoal: once)."""
    setting = b'{"trace_level": ["TENSORS"], "trace_rate": "1"}'  # the global rate is 0: clients' traces only
    status, _ = http(traced_server, "/v2/models/add1/trace/setting", setting)
    assert status == 200
    try:
        trace_id = secrets.token_hex(16)
        grpc_add1(traced_server, "add1", f"00-{trace_id}-{CLIENT_SPAN}-01")
        (root,) = collector.trace(trace_id, 1)
        assert (root["name"], root["events"], root["attributes"]) == ("InferRequest", [], {})
        later = secrets.token_hex(16)
        grpc_add1(traced_server, "twice", f"00-{later}-{CLIENT_SPAN}-01")  # exported after add1's would be
        collector.trace(later, 6)
        assert len(collector.trace(trace_id, 1)) == 1
    finally:
        cleared = b'{"trace_level": null, "trace_rate": null}'
        assert http(traced_server, "/v2/models/add1/trace/setting", cleared)[0] == 200
    wait_until(
        lambda: "Tensor level tracing is not supported by the mode: opentelemetry" in traced_server.log(),
        timeout_s=30,
        what="the server to say it traces no tensors in opentelemetry mode",
    )


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    ensemble_models.add_onnx_add1(repo)
    with serving(
        repo,
        tmp_path_factory.mktemp("server"),
        *layout,
        "--trace-config",
        f"triton,file={tmp_path_factory.mktemp('traces') / 't.json'}",
    ) as server:
        yield server


def http(server: RunningServer, path: str, body: bytes | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=body, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_settings_round_trip_over_both_transports(plain_server: RunningServer) -> None:
    status, answer = http(plain_server, "/v2/models/add1/trace/setting", b'{"trace_rate": "7"}')
    assert status == 200 and answer["trace_rate"] == "7"
    with grpc.insecure_channel(plain_server.url) as channel:
        stub = InferenceStub(channel)
        got = stub.TraceSetting(pb.TraceSettingRequest(model_name="add1"), timeout=30)
        assert list(got.settings["trace_rate"].value) == ["7"] and list(got.settings["trace_level"].value) == ["OFF"]
        clear = pb.TraceSettingRequest(model_name="add1")
        clear.settings["trace_rate"].SetInParent()  # an empty value clears it: the global one again
        assert list(stub.TraceSetting(clear, timeout=30).settings["trace_rate"].value) == ["1000"]
        with pytest.raises(grpc.RpcError) as caught:
            bad = pb.TraceSettingRequest()
            bad.settings["trace_rate"].value.append("abc")
            stub.TraceSetting(bad, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "Unable to parse 'trace_rate', got: abc"
    assert http(plain_server, "/v2/models/nosuch/trace/setting") == (
        400,
        {"error": "Request for unknown model : nosuch"},
    )
    assert http(plain_server, "/v2/trace/setting", b'{"trace_file": "/tmp/x"}')[0] == 501
    assert http(plain_server, "/v2/trace/setting", b'{"trace_rate": 5}') == (
        400,
        {"error": "expect a string for 'trace_rate', as Triton writes every trace setting but the level"},
    )
    with httpclient.InferenceServerClient(plain_server.http_url) as client:
        assert "trace" in client.get_server_metadata()["extensions"]
        assert client.get_trace_settings()["trace_rate"] == "1000"
