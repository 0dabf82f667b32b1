"""ModelStreamInfer: many requests in flight on one stream, answered as each completes, bounded per stream."""

from __future__ import annotations

import queue
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton

from shoal.core.stream import MAX_IN_FLIGHT_PER_STREAM
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.conftest import RunningServer, open_channel, serving
from tests.polling import wait_until

pytestmark = pytest.mark.other_engine  # every gRPC test here also runs on grpcio (conftest)

SLOW_MS = 500  # long enough that every request of a test is read while the first still executes
RESPONSE_TIMEOUT_S = 60


def identity(repo: Path, name: str, delay_ms: int, max_batch_size: int, extra: str = "") -> None:
    """One instance: requests wait in the queue while one executes."""
    models.add_delayed_identity(repo, name, delay_ms, max_batch_size, extra=extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    identity(repo, "batched", SLOW_MS, max_batch_size=8, extra="dynamic_batching { }")
    identity(repo, "slow", SLOW_MS, max_batch_size=0)
    identity(repo, "ticking", 50, max_batch_size=0)  # many requests through one instance, quickly
    identity(repo, "fast", 0, max_batch_size=0)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as running:
        yield running


def rows(value: int, batched: bool) -> np.ndarray:
    data = np.array([value, -value], dtype=np.int64)
    return data.reshape(1, 2) if batched else data


def triton_input(data: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("IN", list(data.shape), "INT64")
    tensor.set_data_from_numpy(data)
    return tensor


def raw_request(model: str, request_id: str, data: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="IN", datatype="INT64", shape=data.shape)
    request.raw_input_contents.append(data.tobytes())
    return request


class Stream:
    """tritonclient's stream; results (or errors) land in a queue in the order they arrive."""

    def __init__(self, client: triton.InferenceServerClient) -> None:
        self.client = client
        self.arrived: queue.Queue[triton.InferResult | Exception] = queue.Queue()
        client.start_stream(callback=lambda result, error: self.arrived.put(error or result))

    def send(self, model: str, request_id: str, data: np.ndarray) -> None:
        self.client.async_stream_infer(model, [triton_input(data)], request_id=request_id)

    def take(self, count: int) -> list[triton.InferResult]:
        results = [self.arrived.get(timeout=RESPONSE_TIMEOUT_S) for _ in range(count)]
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors
        return results


@pytest.fixture
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.url) as client:
        yield client


def scrape(server: RunningServer) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    return str(urllib.request.urlopen(url, timeout=10).read().decode())


def in_flight(server: RunningServer, model: str) -> int:
    """Queued plus executing requests of ``model``, from one scrape (two could count a request twice)."""
    total = 0.0
    for line in scrape(server).splitlines():
        for name in ("nv_inference_pending_request_count", "shoal_model_executing_requests"):
            if line.startswith(f'{name}{{model="{model}",version="1"}} '):
                total += float(line.rsplit(" ", 1)[1])
    return int(total)


def statistics(client: triton.InferenceServerClient, model: str) -> dict:
    return client.get_inference_statistics(model, as_json=True)["model_stats"][0]


def successes(client: triton.InferenceServerClient, model: str) -> int:
    return int(statistics(client, model)["inference_stats"]["success"].get("count", 0))  # JSON omits a zero


def test_back_to_back_requests_on_one_stream_are_batched(server: RunningServer, client) -> None:
    """Read while the first executes, the other requests queue together: fewer executions than requests."""
    count = 8
    stream = Stream(client)
    for value in range(count):
        stream.send("batched", f"req-{value}", rows(value, batched=True))
    results = stream.take(count)
    client.stop_stream()
    by_id = {result.get_response().id: result.as_numpy("OUT") for result in results}
    assert sorted(by_id) == sorted(f"req-{value}" for value in range(count))
    for value in range(count):
        np.testing.assert_array_equal(by_id[f"req-{value}"], rows(value, batched=True))
    stats = statistics(client, "batched")
    assert successes(client, "batched") == count
    assert int(stats["execution_count"]) < count, stats["batch_stats"]


def test_responses_come_back_in_arrival_order_while_requests_run_concurrently(server: RunningServer, client) -> None:
    """Triton's order for models that are not decoupled (src/grpc/stream_infer_handler.cc: each
    request's response is queued "so that its response is sent in the same order as the request was
    received"), while the requests run at once: the quick ones sent after a slow one finish first."""
    stream = Stream(client)
    stream.send("slow", "slow", rows(7, batched=False))
    quick_ids = [f"quick-{value}" for value in range(3)]
    for value, request_id in enumerate(quick_ids):
        stream.send("fast", request_id, rows(value, batched=False))
    results = stream.take(4)
    client.stop_stream()
    assert [result.get_response().id for result in results] == ["slow", *quick_ids]
    np.testing.assert_array_equal(results[0].as_numpy("OUT"), rows(7, batched=False))
    # Ran at once: the quick ones' last execution ended before the slow one's (one at a time, after it).
    assert int(statistics(client, "fast")["last_inference"]) < int(statistics(client, "slow")["last_inference"])


def test_a_failed_request_is_answered_with_its_id_and_the_stream_goes_on(server: RunningServer) -> None:
    wrong_type = raw_request("fast", "wrong-type", rows(1, batched=False))
    wrong_type.inputs[0].datatype = "INT32"
    wrong_type.raw_input_contents[0] = np.zeros(2, np.int32).tobytes()
    requests = [
        raw_request("slow", "good-slow", rows(1, batched=False)),
        wrong_type,
        raw_request("nowhere", "unknown-model", rows(2, batched=False)),
        raw_request("fast", "good-fast", rows(3, batched=False)),
    ]
    with open_channel(server.url) as channel:
        responses = list(InferenceStub(channel).ModelStreamInfer(iter(requests), timeout=RESPONSE_TIMEOUT_S))
    by_id = {response.infer_response.id: response for response in responses}
    assert len(responses) == 4 and len(by_id) == 4
    assert "data-type is 'INT32'" in by_id["wrong-type"].error_message
    assert "unknown model" in by_id["unknown-model"].error_message
    for request_id, value in (("good-slow", 1), ("good-fast", 3)):
        good = by_id[request_id]
        assert good.error_message == ""
        out = np.frombuffer(good.infer_response.raw_output_contents[0], dtype=np.int64)
        np.testing.assert_array_equal(out, rows(value, batched=False))


def test_requests_in_flight_on_one_stream_are_bounded(server: RunningServer, client) -> None:
    """Queued plus executing requests of one stream reach the bound and never pass it; all are answered."""
    count = MAX_IN_FLIGHT_PER_STREAM + 8
    stream = Stream(client)
    for value in range(count):
        stream.send("ticking", f"req-{value}", rows(value, batched=False))
    seen = []
    deadline = time.monotonic() + RESPONSE_TIMEOUT_S
    while stream.arrived.qsize() < count and time.monotonic() < deadline:
        seen.append(in_flight(server, "ticking"))
    assert max(seen) == MAX_IN_FLIGHT_PER_STREAM, seen
    results = stream.take(count)
    client.stop_stream()
    assert sorted(result.get_response().id for result in results) == sorted(f"req-{v}" for v in range(count))


def test_half_close_with_requests_in_flight_delivers_every_response(server: RunningServer, client) -> None:
    """The client half-closes while every request is in flight: the stream ends only after all are answered."""
    count = 3
    stream = Stream(client)
    for value in range(count):
        stream.send("slow", f"req-{value}", rows(value, batched=False))
    wait_until(lambda: in_flight(server, "slow") == count, what="every request in flight")
    client.stop_stream()  # half-close, then wait until the server ends the stream
    assert stream.arrived.qsize() == count
    results = stream.take(count)
    by_id = {result.get_response().id: result.as_numpy("OUT") for result in results}
    for value in range(count):
        np.testing.assert_array_equal(by_id[f"req-{value}"], rows(value, batched=False))


def test_cancelling_the_stream_cancels_its_queued_requests(server: RunningServer, client) -> None:
    """Cancelled, the stream's queued requests leave the queue without executing."""
    count = 4
    before = successes(client, "slow")
    stream = Stream(client)
    for value in range(count):
        stream.send("slow", f"req-{value}", rows(value, batched=False))
    wait_until(lambda: in_flight(server, "slow") == count, what="every request in flight")
    client.stop_stream(cancel_requests=True)
    wait_until(lambda: in_flight(server, "slow") == 0, what="the stream's requests gone")
    answered = successes(client, "slow") - before
    assert answered < count


def test_a_malformed_message_ends_the_stream_with_invalid_argument(server: RunningServer) -> None:
    with grpc.insecure_channel(server.url) as channel:
        call = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        good = raw_request("fast", "good", rows(1, batched=False)).SerializeToString()
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter([good, b"\xff\xff\xff\xff\x0f garbage"]), timeout=RESPONSE_TIMEOUT_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("malformed inference.ModelInferRequest message: ")
        assert "shoal" not in caught.value.details()


def test_the_restricted_protocol_covers_the_stream(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    identity(repo, "fast", 0, max_batch_size=0)
    restricted = server_factory(repo, "--grpc-restricted-protocol", "inference:infer-key=s3cret")
    request = raw_request("fast", "one", rows(1, batched=False))
    with open_channel(restricted.url) as channel:
        stub = InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ModelStreamInfer(iter([request]), timeout=RESPONSE_TIMEOUT_S))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        allowed = stub.ModelStreamInfer(
            iter([request]), metadata=(("triton-grpc-protocol-infer-key", "s3cret"),), timeout=RESPONSE_TIMEOUT_S
        )
        assert [response.infer_response.id for response in allowed] == ["one"]
