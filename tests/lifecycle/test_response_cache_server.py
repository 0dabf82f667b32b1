"""Triton's response cache (issue 27 item 3) against a real server, in both process layouts.

A repeated request is answered without executing; statistics and metrics count it as Triton does
(a hit is a success with no execution); a reload never answers from the old copy, also under a
kept ensemble; the bound evicts; decoupled and sequence models refuse the cache in Triton's words;
and every answer, under concurrent clients and constant eviction, equals the one computed here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import ensemble_models, models, python_models, sequence_models
from tests.conftest import RunningServer, serving
from tests.polling import metric, wait_until
from tests.prometheus_text import parse, scrape

CACHE = "response_cache { enable: true }"

OFFSET_CONFIG = f"""
backend: "python"
max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{CACHE}
"""

OFFSET = """
import numpy as np
import triton_python_backend_utils as pb_utils

OFFSET = {offset}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUT", (x + OFFSET).astype(np.float32))]))
        return responses
"""


def write_offset(repo: Path, offset: float) -> None:
    python_models.write_model(repo, "offset", OFFSET_CONFIG, OFFSET.format(offset=offset))


def row(x: list[float]) -> np.ndarray:
    return np.array([x], dtype=np.float32)


def grpc_infer(server: RunningServer, model: str, x: np.ndarray) -> np.ndarray:
    with grpcclient.InferenceServerClient(server.url) as client:
        given = grpcclient.InferInput("IN", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        return client.infer(model, [given]).as_numpy("OUT")


def http_infer(server: RunningServer, model: str, x: np.ndarray) -> np.ndarray:
    with httpclient.InferenceServerClient(server.http_url) as client:
        given = httpclient.InferInput("IN", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=True)
        return client.infer(model, [given]).as_numpy("OUT")


def stats(server: RunningServer, model: str) -> dict:
    """Version 1's statistics, its counts as numbers (protobuf's JSON writes uint64 as strings)."""
    with grpcclient.InferenceServerClient(server.url) as client:
        entry = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    for field in ("execution_count", "inference_count"):
        entry[field] = int(entry.get(field, 0))
    return entry


def count(entry: dict, field: str) -> int:
    return int(entry["inference_stats"].get(field, {}).get("count", 0))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Path:
    """One per layout: the reload test rewrites a model in it."""
    return tmp_path_factory.mktemp("repo")


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    ensemble_models.add_identity(repo, "cached", extra=CACHE)
    ensemble_models.add_identity(repo, "plain")
    write_offset(repo, 1.0)
    ensemble_models.add_ensemble(
        repo, "composed", [ensemble_models.step("offset", {"IN": "IN"}, {"OUT": "OUT"})], extra=CACHE
    )
    ensemble_models.add_identity(repo, "decoupled", extra=CACHE + " model_transaction_policy { decoupled: true }")
    models.write_config(
        repo / "sequence",
        f"""
        backend: "identity"
        max_batch_size: 8
        {ensemble_models.IN_OUT}
        sequence_batching {{ }}
        {CACHE}
        """,
    )
    (repo / "sequence" / "1").mkdir()
    sequence_models.add_accumulator(repo, "accumulate")
    ensemble_models.add_ensemble(
        repo,
        "accumulating",
        [ensemble_models.step("accumulate", {"INPUT": "INPUT"}, {"OUTPUT": "OUTPUT"})],
        io='input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        extra=CACHE,
    )
    with serving(
        repo,
        tmp_path_factory.mktemp("server"),
        *layout,
        "--cache-config",
        "local,size=1048576",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--exit-on-error",
        "false",
    ) as server:
        yield server


def test_a_repeated_request_is_answered_from_the_cache_without_executing(server: RunningServer) -> None:
    x = row([1, 2, 3, 4])
    for model in ("cached", "plain"):
        for _ in range(2):
            np.testing.assert_array_equal(grpc_infer(server, model, x), x)
    cached, plain = stats(server, "cached"), stats(server, "plain")
    # Triton's statistics for a hit: a success with its queue time, no execution, inference or compute
    assert (
        count(cached, "success"),
        count(cached, "queue"),
        count(cached, "cache_hit"),
        count(cached, "cache_miss"),
    ) == (2, 2, 1, 1)
    assert (cached["execution_count"], cached["inference_count"], count(cached, "compute_infer")) == (1, 1, 1)
    assert (plain["execution_count"], count(plain, "cache_hit"), count(plain, "cache_miss")) == (2, 0, 0)
    assert int(cached["inference_stats"]["cache_hit"]["ns"]) > 0
    # The same answer over HTTP, and HTTP's own repeat a hit
    np.testing.assert_array_equal(http_infer(server, "cached", x), x)
    before = stats(server, "cached")
    np.testing.assert_array_equal(http_infer(server, "cached", x), x)
    after = stats(server, "cached")
    assert (count(after, "cache_hit"), after["execution_count"]) == (
        count(before, "cache_hit") + 1,
        before["execution_count"],
    )
    # Another input is a miss, answered by the model
    other = row([5, 6, 7, 8])
    np.testing.assert_array_equal(grpc_infer(server, "cached", other), other)
    last = stats(server, "cached")
    assert (count(last, "cache_miss"), last["execution_count"]) == (
        count(after, "cache_miss") + 1,
        after["execution_count"] + 1,
    )


def test_the_cache_metrics_are_tritons_and_only_for_the_models_that_use_it(server: RunningServer) -> None:
    x = row([9, 9, 9, 9])
    for _ in range(3):
        grpc_infer(server, "cached", x)
    entry = stats(server, "cached")
    assert metric(server, "nv_cache_num_hits_per_model", "cached") == count(entry, "cache_hit")
    assert metric(server, "nv_cache_num_misses_per_model", "cached") == count(entry, "cache_miss")
    assert (
        metric(server, "nv_cache_hit_duration_per_model", "cached")
        == int(entry["inference_stats"]["cache_hit"]["ns"]) // 1000
    )
    families = parse(scrape(server.metrics_port))
    for name in (
        "nv_cache_num_hits_per_model",
        "nv_cache_hit_duration_per_model",
        "nv_cache_num_misses_per_model",
        "nv_cache_miss_duration_per_model",
    ):
        assert families[name].type == "counter"
        enabled = {"cached", "composed", "offset", "accumulating"}  # the models whose config enables the cache
        assert {s.labels["model"] for s in families[name].samples} == enabled
    # nv_inference_count leaves the hits out; nv_inference_request_success counts them
    assert metric(server, "nv_inference_count", "cached") == entry["inference_count"]
    assert metric(server, "nv_inference_request_success", "cached") == count(entry, "success")


def test_a_reload_never_answers_from_the_old_copy_nor_does_a_kept_ensemble(server: RunningServer, repo: Path) -> None:
    x = row([1, 1, 1, 1])
    for _ in range(2):
        np.testing.assert_array_equal(grpc_infer(server, "offset", x), x + 1)
        np.testing.assert_array_equal(grpc_infer(server, "composed", x), x + 1)
    assert count(stats(server, "composed"), "cache_hit") >= 1
    write_offset(repo, 2.0)
    with grpcclient.InferenceServerClient(server.url) as client:
        client.load_model("offset")  # the ensemble still fits it: kept, with its cache entries
        assert client.is_model_ready("composed")
    for _ in range(2):
        np.testing.assert_array_equal(grpc_infer(server, "offset", x), x + 2)
        np.testing.assert_array_equal(grpc_infer(server, "composed", x), x + 2)


def test_decoupled_and_sequence_models_refuse_the_cache_in_tritons_words(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["decoupled"]["state"] == "UNAVAILABLE"
    assert (
        "Response Cache does not currently support model decoupled with 'decoupled' transaction policy. "
        "Please disable the response cache."
    ) in index["decoupled"]["reason"]
    assert index["sequence"]["state"] == "UNAVAILABLE"
    assert (
        "Response Cache does not currently support model sequence with sequence batching scheduler. "
        "Please disable the response cache."
    ) in index["sequence"]["reason"]


def test_a_caching_ensemble_over_a_sequence_model_answers_from_the_sequence_not_the_cache(
    server: RunningServer,
) -> None:
    """A sequence's answers depend on its state: a sequence id used again, with the same inputs as before,
    gets the sums of this run, not the last run's from the cache (Triton 2.51 answers the cached one)."""

    def sums(client: grpcclient.InferenceServerClient, values: list[float]) -> list[float]:
        found = []
        for index, value in enumerate(values):
            tensor = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.float32))
            result = client.infer(
                "accumulating",
                [tensor],
                sequence_id=5,
                sequence_start=index == 0,
                sequence_end=index == len(values) - 1,
            )
            found.append(float(result.as_numpy("OUTPUT")[0, 0]))
        return found

    with grpcclient.InferenceServerClient(server.url) as client:
        assert sums(client, [10.0, 1.0]) == [10.0, 11.0]
        assert sums(client, [3.0, 1.0]) == [3.0, 4.0]  # the END's request is the first run's again
        assert sums(client, [10.0, 1.0]) == [10.0, 11.0]
        stats = client.get_inference_statistics("accumulating", as_json=True)["model_stats"][0]
    assert count(stats, "cache_hit") == 0 and count(stats, "success") == 6
    said = "ensemble accumulating: its response cache is not used while its step model accumulate has a sequence"
    assert server.log().count(said) == 1  # named once, not ignored in silence


def test_every_answer_is_its_own_under_concurrent_clients_and_constant_eviction(tmp_path: Path, server_factory) -> None:
    """A cache of two entries and eight clients asking six different things: each answer is checked."""
    ensemble_models.add_identity(tmp_path, "cached", extra=CACHE)
    one_entry = 4 * 4 + 64
    server = server_factory(tmp_path, "--cache-config", f"local,size={2 * one_entry}")
    inputs = [row([i, i + 0.5, -i, i * 10]) for i in range(6)]
    wrong: list[str] = []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpcclient.InferenceServerClient(server.url) as grpc_client:
            for _ in range(25):
                x = inputs[int(rng.integers(len(inputs)))]
                given = grpcclient.InferInput("IN", list(x.shape), "FP32")
                given.set_data_from_numpy(x)
                answer = grpc_client.infer("cached", [given]).as_numpy("OUT")
                if not np.array_equal(answer, x):
                    wrong.append(f"asked {x.tolist()}, got {answer.tolist()}")

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not wrong, wrong[:3]
    entry = stats(server, "cached")
    assert count(entry, "success") == 200
    # each request was a hit or executed (two equal requests at once both execute: the second's answer
    # finds the first's in the cache, and counts neither as a hit nor as a miss, as Triton's)
    assert count(entry, "cache_hit") + entry["execution_count"] == 200
    # the bound held: inputs asked again after others came in were executed again
    assert entry["execution_count"] > len(inputs)


def test_the_bound_evicts_the_least_recently_used(tmp_path: Path, server_factory) -> None:
    ensemble_models.add_identity(tmp_path, "cached", extra=CACHE)
    server = server_factory(tmp_path, "--cache-config", f"local,size={2 * (4 * 4 + 64)}")
    a, b, c = row([1, 0, 0, 0]), row([2, 0, 0, 0]), row([3, 0, 0, 0])
    for x in (a, b, a, c):  # a was used after b: b goes when c comes
        grpc_infer(server, "cached", x)
    assert (stats(server, "cached")["execution_count"], count(stats(server, "cached"), "cache_hit")) == (3, 1)
    grpc_infer(server, "cached", a)  # still there
    grpc_infer(server, "cached", b)  # evicted: executed again
    assert (stats(server, "cached")["execution_count"], count(stats(server, "cached"), "cache_hit")) == (4, 2)


def test_a_kept_ensembles_entries_leave_the_cache_when_its_step_is_reloaded(tmp_path: Path, server_factory) -> None:
    """Entries the kept ensemble can never hit again (their key holds the old step's load number) must not
    take room from live ones. Room for two: a, then the ensemble's; the step reloads; b must then fit
    beside a, not push it out while the dead entry stays. The step caches nothing of its own."""
    ensemble_models.add_identity(tmp_path, "cached", extra=CACHE)
    python_models.write_model(tmp_path, "offset", OFFSET_CONFIG.replace(CACHE, ""), OFFSET.format(offset=1.0))
    ensemble_models.add_ensemble(
        tmp_path, "composed", [ensemble_models.step("offset", {"IN": "IN"}, {"OUT": "OUT"})], extra=CACHE
    )
    server = server_factory(
        tmp_path,
        "--cache-config",
        f"local,size={2 * (4 * 4 + 64)}",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    )
    a, b, x = row([1, 0, 0, 0]), row([2, 0, 0, 0]), row([5, 5, 5, 5])
    grpc_infer(server, "cached", a)
    np.testing.assert_array_equal(grpc_infer(server, "composed", x), x + 1)
    python_models.write_model(tmp_path, "offset", OFFSET_CONFIG.replace(CACHE, ""), OFFSET.format(offset=2.0))
    with grpcclient.InferenceServerClient(server.url) as client:
        client.load_model("offset")
        assert client.is_model_ready("composed")
    grpc_infer(server, "cached", b)
    grpc_infer(server, "cached", a)
    assert (stats(server, "cached")["execution_count"], count(stats(server, "cached"), "cache_hit")) == (2, 1)
    np.testing.assert_array_equal(grpc_infer(server, "composed", x), x + 2)


def test_a_model_that_enables_the_cache_on_a_server_without_one_executes_every_request(
    tmp_path: Path, server_factory
) -> None:
    ensemble_models.add_identity(tmp_path, "cached", extra=CACHE)
    server = server_factory(tmp_path)
    x = row([1, 2, 3, 4])
    for _ in range(2):
        grpc_infer(server, "cached", x)
    entry = stats(server, "cached")
    assert (entry["execution_count"], count(entry, "cache_hit"), count(entry, "cache_miss")) == (2, 0, 0)
    assert "nv_cache_num_hits_per_model" not in parse(scrape(server.metrics_port))
    assert "its response_cache takes effect with --cache-config" in server.log()


def test_the_cache_families_sit_where_triton_writes_them(server: RunningServer) -> None:
    """Triton 2.51 (run_triton.sh, --cache-config local,size=1048576): after the compute durations, before
    the pending count."""
    grpc_infer(server, "cached", row([4, 3, 2, 1]))
    names = [line.split()[2] for line in scrape(server.metrics_port).splitlines() if line.startswith("# TYPE nv_")]
    at = names.index("nv_inference_compute_output_duration_us")
    assert names[at + 1 : at + 6] == [
        "nv_cache_num_hits_per_model",
        "nv_cache_hit_duration_per_model",
        "nv_cache_num_misses_per_model",
        "nv_cache_miss_duration_per_model",
        "nv_inference_pending_request_count",
    ]


# OUT = IN, once the test says go (a file): the ensemble's request waits in this step meanwhile.
WAITS_FOR_GO = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        open({started!r}, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists({go!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""


def _add_constant(path: Path, constant: float) -> None:
    """An ONNX model file: OUT = IN + constant, rows of 4 FP32."""
    from onnx import TensorProto, helper, numpy_helper

    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["IN", "K"], ["OUT"])],
        "add",
        [value("IN", TensorProto.FLOAT, [None, 4])],
        [value("OUT", TensorProto.FLOAT, [None, 4])],
        [numpy_helper.from_array(np.array([constant], np.float32), "K")],
    )
    models.save_onnx(graph, path)


def test_an_ensembles_answer_computed_across_a_steps_version_change_is_not_cached(
    tmp_path: Path, server_factory
) -> None:
    """Found by the review of session 48: the answer was filed under the step versions of its lookup, but
    its step ran on the version newest when the step started. That version came and went (a canary
    rolled back) and the ensemble went on answering its output from the cache."""
    repo = tmp_path / "repo"
    started, go = tmp_path / "started", tmp_path / "go"
    python_models.write_model(
        repo, "gate", OFFSET_CONFIG.replace(CACHE, ""), WAITS_FOR_GO.format(started=str(started), go=str(go))
    )
    _add_constant(repo / "adds" / "1" / "model.onnx", 100.0)
    _add_constant(repo / "adds" / "2" / "model.onnx", 200.0)
    adds = {  # config.pbtxt and the overrides alike but for version_policy: version 1 is kept serving
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }
    models.write_config(
        repo / "adds",
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        "version_policy { specific { versions: [ 1 ] } }\n",
    )
    ensemble_models.add_ensemble(
        repo,
        "gated",
        [
            ensemble_models.step("gate", {"IN": "IN"}, {"OUT": "mid"}),
            ensemble_models.step("adds", {"IN": "mid"}, {"OUT": "OUT"}),
        ],
        extra=CACHE,
    )
    server = server_factory(
        repo, "--cache-config", "local,size=1000000", "--model-control-mode", "explicit", "--load-model", "gated"
    )
    x = row([1, 2, 3, 4])
    first: list[np.ndarray | Exception] = []

    def ask() -> None:
        try:
            first.append(grpc_infer(server, "gated", x))
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            first.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_until(started.exists, timeout_s=60, what="the ensemble's request in its first step")
    with grpcclient.InferenceServerClient(server.url) as client:
        both = {**adds, "version_policy": {"specific": {"versions": [1, 2]}}}
        client.load_model("adds", config=json.dumps(both))  # version 2 is the newest now
        go.touch()
        asking.join(60)
        assert len(first) == 1 and isinstance(first[0], np.ndarray), first
        np.testing.assert_array_equal(first[0], x + 200)  # the step ran on version 2
        client.load_model("adds", config=json.dumps({**adds, "version_policy": {"specific": {"versions": [1]}}}))
    np.testing.assert_array_equal(grpc_infer(server, "gated", x), x + 100)  # version 1's, not version 2's
