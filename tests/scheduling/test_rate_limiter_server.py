"""The rate limiter in a real server (issue 27 item 1): models that name the same resource never execute at the
same time, priorities order them, none starves; off, they overlap. Both process layouts, Python models on
process instances (the default), whose executions each return when they started and ended (CLOCK_MONOTONIC,
one clock for every process of the machine).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.polling import metric, wait_until
from tests.python_models import write_model
from tests.sequence_models import add_accumulator

TIMED = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"SPAN = [start, end] of this execution in ns; it lasts IN ms, or until the file IN names exists.\"\"\"

    def execute(self, requests):
        start = time.monotonic_ns()
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0]
            if isinstance(value, bytes):  # a gate: say it holds the resource, hold it until the test opens it
                open(value.decode() + ".held", "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(value.decode()) and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                time.sleep(int(value) / 1000)
        end = time.monotonic_ns()
        for _ in requests:
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SPAN", np.array([start, end], np.int64))]))
        return responses
"""
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: {datatype} dims: [ 1 ] }} ]
output [ {{ name: "SPAN" data_type: TYPE_INT64 dims: [ 2 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU {limiter} }} ]
"""


def add_timed(repo: Path, name: str, limiter: str, datatype: str = "TYPE_INT32") -> None:
    write_model(repo, name, CONFIG.format(name=name, datatype=datatype, limiter=limiter), TIMED)


def limited(priority: int = 1, count: int = 1, name: str = "GPU_MEM") -> str:
    return f'rate_limiter {{ resources [ {{ name: "{name}" count: {count} }} ] priority: {priority} }}'


def span(url: str, model: str, value: int | str) -> tuple[int, int]:
    with grpcclient.InferenceServerClient(url) as client:
        if isinstance(value, str):
            tensor = grpcclient.InferInput("IN", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
        else:
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        start, end = client.infer(model, [tensor], client_timeout=120).as_numpy("SPAN").tolist()
        return start, end


def spans_at_once(url: str, requests: list[tuple[str, int]]) -> dict[str, list[tuple[int, int]]]:
    """Every request at the same time (a thread each); the spans per model."""
    found: dict[str, list[tuple[int, int]]] = {}
    lock = threading.Lock()

    def one(model: str, value: int) -> None:
        result = span(url, model, value)
        with lock:
            found.setdefault(model, []).append(result)

    threads = [threading.Thread(target=one, args=request) for request in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sum(len(v) for v in found.values()) == len(requests)
    return found


def overlaps(first: list[tuple[int, int]], second: list[tuple[int, int]]) -> int:
    return sum(1 for a in first for b in second if a[0] < b[1] and b[0] < a[1])


@pytest.mark.parametrize("rate_limit", ["execution_count", "off"])
def test_models_that_name_one_resource_never_execute_at_once(tmp_path: Path, server_factory, rate_limit: str) -> None:
    repo = tmp_path / "repo"
    add_timed(repo, "a", limited())
    add_timed(repo, "b", limited())
    add_timed(repo, "free", "")  # names no resource: never waits for one
    server = server_factory(repo, "--rate-limit", rate_limit)
    spans = spans_at_once(server.url, [("a", 100)] * 4 + [("b", 100)] * 4 + [("free", 400)])
    if rate_limit == "off":
        assert overlaps(spans["a"], spans["b"]) > 0  # one instance each: a and b run side by side
        return
    assert overlaps(spans["a"], spans["b"]) == 0, spans
    assert overlaps(spans["free"], spans["a"] + spans["b"]) > 0  # 'free' ran beside the limited ones


def test_the_lower_priority_value_goes_first_once_both_wait(tmp_path: Path, server_factory) -> None:
    """Both have executed once (keys: executions x priority = 1 for 'urgent', 4 for 'patient'); while 'gate' holds
    the resource, 'patient' is staged first, then 'urgent': 'urgent' still executes first."""
    repo = tmp_path / "repo"
    add_timed(repo, "urgent", limited(priority=1))
    add_timed(repo, "patient", limited(priority=4))
    add_timed(repo, "gate", limited(priority=1), datatype="TYPE_STRING")
    server = server_factory(repo, "--rate-limit", "execution_count")
    span(server.url, "urgent", 0)
    span(server.url, "patient", 0)
    opened = tmp_path / "open"
    results: dict[str, tuple[int, int]] = {}

    def ask(model: str, value: int | str) -> None:
        results[model] = span(server.url, model, value)

    gate = threading.Thread(target=ask, args=("gate", str(opened)))
    gate.start()
    wait_until(lambda: (tmp_path / "open.held").exists(), what="the gate to hold the resource")
    threads = []
    for model in ("patient", "urgent"):
        threads.append(threading.Thread(target=ask, args=(model, 0)))
        threads[-1].start()
        wait_until(
            lambda m=model: metric(server, "nv_inference_pending_request_count", m) == 1,
            what=f"'{model}' to wait for the resource",
        )
    opened.touch()
    for thread in [gate, *threads]:
        thread.join(timeout=120)
    assert results["gate"][1] <= results["urgent"][0] < results["patient"][0], results


def test_under_sustained_load_the_higher_priority_runs_more_and_the_other_still_runs(
    tmp_path: Path, server_factory
) -> None:
    """Priority 1 against 8, both kept waiting by four clients each: weighted turns (40 to 8 here), so the
    low-priority model executes while the other is still loaded (no starvation), and less often."""
    repo = tmp_path / "repo"
    add_timed(repo, "high", limited(priority=1))
    add_timed(repo, "low", limited(priority=8))
    server = server_factory(repo, "--rate-limit", "execution_count")
    spans: dict[str, list[tuple[int, int]]] = {"high": [], "low": []}
    stop = threading.Event()

    def client(model: str) -> None:
        for _ in range(200):  # bounded; ended by 'stop' long before
            if stop.is_set():
                return
            spans[model].append(span(server.url, model, 20))

    threads = [threading.Thread(target=client, args=(model,)) for model in ("high", "low") for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(spans["high"]) >= 36, timeout_s=120, what="36 executions of 'high'")
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    last_high_start = max(start for start, _ in spans["high"])
    assert any(start < last_high_start for start, _ in spans["low"][1:]), "'low' waited while 'high' was loaded"
    counts = {m: len(s) for m, s in spans.items()}
    assert len(spans["high"]) >= 2 * len(spans["low"]), counts
    assert overlaps(spans["high"], spans["low"]) == 0


def test_an_instance_that_asks_more_than_the_server_has_fails_its_load_in_tritons_words(
    tmp_path: Path, server_factory
) -> None:
    repo = tmp_path / "repo"
    add_timed(repo, "fits", limited(count=2))
    add_timed(repo, "greedy", limited(count=3))
    add_timed(repo, "undeclared", limited(name="OTHER"))
    server = server_factory(
        repo, "--rate-limit", "execution_count", "--rate-limit-resource", "GPU_MEM:2", "--exit-on-error", "false"
    )
    with grpcclient.InferenceServerClient(server.url) as client:
        index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["fits"].state == "READY"
    assert index["greedy"].state == "UNAVAILABLE"
    assert (
        'Resource count for "GPU_MEM" is limited to 2 which will prevent scheduling of one or more model '
        "instances, the minimum required count is 3"
    ) in index["greedy"].reason
    assert 'Resource count for "OTHER" is limited to 0' in index["undeclared"].reason
    assert span(server.url, "fits", 0)[1] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--rate-limit", "execution_count", "--rate-limit-resource", "GPU_MEM"],
            "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or '<resource_name>:<count>'. "
            "Got GPU_MEM",
        ),
        (["--rate-limit-resource", "GPU_MEM:1"], "--rate-limit-resource needs --rate-limit execution_count"),
        (["--rate-limit", "sometimes"], "argument --rate-limit: invalid choice: 'sometimes'"),
    ],
)
def test_the_flags_refuse_what_they_cannot_mean(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shoal", "serve", "--model-repository", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("strategy", ["direct { }", "oldest { max_candidate_sequences: 2 }"])
def test_a_sequence_models_executions_wait_for_the_resource_too(tmp_path: Path, server_factory, strategy: str) -> None:
    """While 'gate' holds GPU_MEM, a sequence's request waits (pending), then runs once the gate returns."""
    repo = tmp_path / "repo"
    add_accumulator(repo, "acc", strategy)
    config = repo / "acc" / "config.pbtxt"
    config.write_text(config.read_text().replace("kind: KIND_CPU }", f"kind: KIND_CPU {limited()} }}"))
    add_timed(repo, "gate", limited(), datatype="TYPE_STRING")
    server = server_factory(repo, "--rate-limit", "execution_count")
    opened = tmp_path / "open"
    gate = threading.Thread(target=span, args=(server.url, "gate", str(opened)))
    gate.start()
    wait_until(lambda: (tmp_path / "open.held").exists(), what="the gate to hold the resource")
    answers: list[float] = []

    def sequence() -> None:
        with grpcclient.InferenceServerClient(server.url) as client:
            data = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            data.set_data_from_numpy(np.full((1, 1), 5.0, dtype=np.float32))
            result = client.infer(
                "acc", [data], sequence_id=7, sequence_start=True, sequence_end=True, client_timeout=120
            )
            answers.append(float(result.as_numpy("OUTPUT").item()))

    waiting = threading.Thread(target=sequence)
    waiting.start()
    wait_until(
        lambda: metric(server, "nv_inference_pending_request_count", "acc") == 1,
        what="the sequence's request to wait for the resource",
    )
    assert answers == []  # still waiting: the gate holds GPU_MEM
    opened.touch()
    for thread in (gate, waiting):
        thread.join(timeout=120)
    assert answers == [5.0]
