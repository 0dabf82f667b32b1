"""Decoupled Python models (issue 14 part 2): zero or more responses per request over ModelStreamInfer.

The models are Triton's decoupled examples as a user writes them (tests/decoupled_models.py, the
shipped model_repository/repeat), served in both process layouts and with process and thread
instances, and called through tritonclient's ``start_stream`` / ``async_stream_infer``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import decoupled_models
from tests.conftest import RunningServer, serving
from tests.polling import wait_until

TAKE_TIMEOUT_S = 30.0
Item = tuple[Any, Any]  # (InferResult | None, InferenceServerException | None), as the callback gets them


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    decoupled_models.add_models(repo)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as running:
        yield running


class Stream:
    """One bidirectional stream of a tritonclient client; what arrives is queued in arrival order."""

    def __init__(self, client: grpcclient.InferenceServerClient) -> None:
        self.client = client
        self.arrived: queue.Queue[Item] = queue.Queue()
        client.start_stream(callback=lambda result, error: self.arrived.put((result, error)))

    def send(self, model: str, request_id: str, **arrays: np.ndarray) -> None:
        self.send_with(model, request_id, False, **arrays)

    def send_with(self, model: str, request_id: str, empty_final: bool, **arrays: np.ndarray) -> None:
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "INT32" if array.dtype == np.int32 else "UINT32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=empty_final)

    def take(self, count: int) -> list[Item]:
        return [self.arrived.get(timeout=TAKE_TIMEOUT_S) for _ in range(count)]

    def nothing_more(self, wait_s: float = 0.3) -> bool:
        """No further message within ``wait_s`` (used only after everything expected has arrived)."""
        try:
            self.arrived.get(timeout=wait_s)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.url) as opened:
        yield opened
        opened.stop_stream()


def _final(item: Item) -> bool:
    result, error = item
    assert error is None, error
    assert "triton_final_response" in result.get_response().parameters  # on every response, as Triton's
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def _repeat_inputs(values: list[int], delay_ms: int) -> dict[str, np.ndarray]:
    return {"IN": np.array(values, dtype=np.int32), "DELAY": np.full(len(values), delay_ms, dtype=np.uint32)}


@pytest.mark.parametrize("model", ["repeat", "repeat_thread"])
def test_repeat_sends_each_element_then_final(client: grpcclient.InferenceServerClient, model: str) -> None:
    stream = Stream(client)
    stream.send(model, "r1", **_repeat_inputs([4, 2, 0, 7], 5))
    items = stream.take(4)
    assert [int(result.as_numpy("OUT")[0]) for result, _ in items] == [4, 2, 0, 7]
    assert [int(result.as_numpy("IDX")[0]) for result, _ in items] == [0, 1, 2, 3]
    assert all(result.get_response().id == "r1" for result, _ in items)
    assert not any(_final(item) for item in items)  # the model sends FINAL on its own, not asked for here
    assert stream.nothing_more()

    stream.send_with(model, "r2", True, **_repeat_inputs([9], 0))
    first, last = stream.take(2)
    assert int(first[0].as_numpy("OUT")[0]) == 9 and not _final(first)
    assert _final(last) and last[0].get_response().id == "r2" and not last[0].get_response().outputs


@pytest.mark.parametrize("model", ["square", "square_thread"])
def test_square_answers_n_times_and_zero_times(client: grpcclient.InferenceServerClient, model: str) -> None:
    stream = Stream(client)
    stream.send_with(model, "three", True, IN=np.array([3], dtype=np.int32))
    items = stream.take(4)
    assert [int(result.as_numpy("OUT")[0]) for result, _ in items[:3]] == [3, 3, 3]
    assert [_final(item) for item in items] == [False, False, False, True]

    stream.send_with(model, "zero", True, IN=np.array([0], dtype=np.int32))  # no response, only the flag
    (final,) = stream.take(1)
    assert _final(final) and final[0].get_response().id == "zero" and not final[0].get_response().outputs
    stream.send(model, "zero-quiet", IN=np.array([0], dtype=np.int32))  # not asked for: nothing at all
    stream.send(model, "one", IN=np.array([1], dtype=np.int32))
    (one,) = stream.take(1)
    assert one[0].get_response().id == "one"
    assert stream.nothing_more()
    # Four requests, each a success (its responses are checked in the sink, not as one answer's outputs)
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    assert int(stats["success"].get("count", 0)) >= 4 and not stats["fail"].get("count"), stats


def test_many_requests_in_flight_on_one_stream_are_answered_as_they_come(
    client: grpcclient.InferenceServerClient,
) -> None:
    stream = Stream(client)
    stream.send("repeat_thread", "slow", **_repeat_inputs([1, 2, 3], 300))
    for index in range(8):
        stream.send("square_thread", f"quick{index}", IN=np.array([2], dtype=np.int32))
    items = stream.take(3 + 8 * 2)
    ids = [result.get_response().id for result, _ in items]
    assert ids[-1] == "slow"  # the slow request's last response comes after every quick one
    assert ids.count("slow") == 3 and all(ids.count(f"quick{index}") == 2 for index in range(8))
    assert ids.index(f"quick{7}") < ids.index("slow") + 3  # quick answers do not wait for the slow request
    assert [int(r.as_numpy("OUT")[0]) for r, _ in items if r.get_response().id == "slow"] == [1, 2, 3]


def test_an_error_mid_stream_and_a_send_after_final(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    stream = Stream(client)
    stream.send("fails_midway", "f", IN=np.array([0], dtype=np.int32))
    items = stream.take(4)
    assert int(items[0][0].as_numpy("OUT")[0]) == 1 and int(items[1][0].as_numpy("OUT")[0]) == 2
    assert items[2][0] is None and "the third one failed" in items[2][1].message()
    assert int(items[3][0].as_numpy("OUT")[0]) == 4 and _final(items[3])
    assert stream.nothing_more()
    assert "Unable to send response. Response sender has been closed." in server.log()


def test_a_stream_closed_after_final_cancels_nothing_of_the_next_request(
    server: RunningServer,
) -> None:
    """A request answered FINAL while its execute went on (cleanup) ended its stream, and the client's
    side of it was taken for a give-up: the cancellation reached the worker after the batch and was
    read as the next batch's, at the same position, so the next request (answered from a thread after
    execute returned) was cancelled and failed. Found by review; three rounds, each a new stream."""
    for _ in range(3):
        for n in (1, 2):
            with grpcclient.InferenceServerClient(server.url) as client:
                stream = Stream(client)
                stream.send("lingers", f"r{n}", IN=np.array([n], dtype=np.int32))
                ((result, error),) = stream.take(1)
                client.stop_stream()
            assert error is None, error
            assert result.as_numpy("OUT").tolist() == [n]


def test_execute_returning_responses_fails_the_request(client: grpcclient.InferenceServerClient) -> None:
    stream = Stream(client)
    stream.send("returns_responses", "x", IN=np.array([0], dtype=np.int32))
    ((result, error),) = stream.take(1)
    assert result is None and "is using the decoupled mode and the execute function must return None" in error.message()


def test_a_request_never_finished_is_bounded_by_the_execution_timeout(client: grpcclient.InferenceServerClient) -> None:
    """In process mode ``execution_timeout_ms`` bounds the wait for FINAL: the instance is restarted."""
    stream = Stream(client)
    stream.send("never_final", "stuck", IN=np.array([0], dtype=np.int32))
    (first, failed) = stream.take(2)
    assert int(first[0].as_numpy("OUT")[0]) == 0
    assert failed[0] is None and "execution_timeout_ms" in failed[1].message()
    stream.send_with("never_final", "done", True, IN=np.array([1], dtype=np.int32))  # the new instance serves
    (answer,) = stream.take(1)
    assert int(answer[0].as_numpy("OUT")[0]) == 1 and _final(answer)


@pytest.mark.parametrize("model", ["bls_decoupled", "bls_decoupled_thread"])
def test_bls_exec_decoupled_iterates_the_responses(client: grpcclient.InferenceServerClient, model: str) -> None:
    def call(n: int) -> tuple[list[int], int]:
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
        result = client.infer(model, [tensor])
        return result.as_numpy("VALUES").tolist(), int(result.as_numpy("ERRORS")[0])

    assert call(3) == ([3, 3, 3], 0)
    assert call(0) == ([], 0)
    # fails_midway sends 1, 2, an error, then 4 with FINAL: Triton's iterator leaves the error out
    assert call(-1) == ([1, 2, 4], 0)


def test_model_infer_on_a_decoupled_model_is_refused(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    in_a_region = grpcclient.InferInput("IN", [1], "INT32")
    in_a_region.set_shared_memory("no_such_region", 4)  # refused first, as Triton: its shared memory unread
    for inputs in ([tensor], [in_a_region]):
        with pytest.raises(InferenceServerException) as caught:
            client.infer("square", inputs)
        assert caught.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    with httpclient.InferenceServerClient(server.http_url) as http:
        http_tensor = httpclient.InferInput("IN", [1], "INT32")
        http_tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
        with pytest.raises(InferenceServerException) as refused:
            http.infer("square", [http_tensor])
    assert "HTTP end point doesn't support models with decoupled transaction policy" in refused.value.message()


def test_a_stream_cancelled_mid_request_frees_the_instance(server: RunningServer, tmp_path: Path) -> None:
    with grpcclient.InferenceServerClient(server.url) as first:
        stream = Stream(first)
        stream.send("repeat", "long", **_repeat_inputs(list(range(100)), 100))  # 10 s of responses
        stream.take(1)
        first.stop_stream(cancel_requests=True)
    with grpcclient.InferenceServerClient(server.url) as second:
        again = Stream(second)
        started = time.monotonic()
        again.send("repeat", "next", **_repeat_inputs([5], 0))  # the one instance is free again
        ((result, error),) = again.take(1)
        assert error is None and int(result.as_numpy("OUT")[0]) == 5
        assert time.monotonic() - started < 5.0
        second.stop_stream()


@pytest.mark.parametrize("suffix", ["", "_thread"])
@pytest.mark.parametrize("other", ["plain_caller", "doubles_step"])
def test_a_refused_call_batched_with_a_stream_request_fails_alone(
    server: RunningServer, suffix: str, other: str
) -> None:
    """Found by the review of session 48: a BLS exec() or an ensemble step into a decoupled model (no
    stream to answer on) was refused only once batched, and failed the stream request batched with it."""
    refused: list[str] = []

    def other_call() -> None:
        with grpcclient.InferenceServerClient(server.url) as client:
            tensor = grpcclient.InferInput("IN", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[5]], dtype=np.int32))
            try:
                client.infer(f"{other}{suffix}", [tensor])
            except InferenceServerException as exc:
                refused.append(exc.message())

    with grpcclient.InferenceServerClient(server.url) as client:
        stream = Stream(client)
        caller = threading.Thread(target=other_call)
        caller.start()  # both wait in the model's queue for company (300 ms)
        tensor = grpcclient.InferInput("IN", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[7]], dtype=np.int32))
        client.async_stream_infer(f"doubles{suffix}", [tensor], request_id="victim")
        ((result, error),) = stream.take(1)
        caller.join(TAKE_TIMEOUT_S)
        client.stop_stream()
    assert error is None, error
    assert result.as_numpy("OUT").tolist() == [[14]]
    assert len(refused) == 1 and "decoupled transaction policy" in refused[0], refused


@pytest.mark.parametrize("suffix", ["", "_thread"])
@pytest.mark.parametrize("kind", list(decoupled_models.UNTIL_CANCELLED_KINDS))
def test_a_model_streaming_until_its_request_is_cancelled_sees_the_cancellation(
    server: RunningServer, kind: str, suffix: str
) -> None:
    """Found by the reviews of session 48: ``request.is_cancelled()`` never turned true once the batch was
    over (the runner let go of the sender that held the flag), so the model's thread went on for good;
    nor within ``execute`` (only the wait after it asked the server); and a sender looked up after the
    batch was a fresh one, never cancelled, that piled the responses up."""
    model = f"{kind}{suffix}"
    request_id = f"leaves-{model}"
    with grpcclient.InferenceServerClient(server.url) as client:
        stream = Stream(client)
        stream.send(model, request_id, IN=np.array([1], dtype=np.int32))
        stream.take(3)  # streaming
        client.stop_stream(cancel_requests=True)
    wait_until(lambda: f"request {request_id} saw its cancellation" in server.log(), timeout_s=15)


# Each request waits on a thread of its own until it is cancelled (at most 20 s), then records it.
WAITS_FOR_CANCELLATION = """
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

    def execute(self, requests):
        for index, request in enumerate(requests):
            threading.Thread(target=self._wait, args=(index, request), daemon=True).start()

    def _wait(self, index, request):
        sender = request.get_response_sender()
        deadline = time.monotonic() + 20
        while not request.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.seen.append(index if request.is_cancelled() else -1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def test_a_later_requests_cancellation_is_passed_on_while_an_earlier_one_is_open(tmp_path: Path) -> None:
    """The batch waited on its requests one by one and passed on only the awaited one's cancellation:
    the second request's client left first, and its model thread heard of it only after the first's
    FINAL. Here the first is cancelled only once the second saw its cancellation."""
    from shoal.backends.python import runner
    from tests.python_models import write_model

    folder = write_model(tmp_path, "waits", decoupled_models.SQUARE_CONFIG, WAITS_FOR_CANCELLATION)
    config = {"name": "waits", "max_batch_size": 0}
    model_file = folder / "1" / "model.py"
    model = runner.ModelRunner(config, model_file, runner.model_args(config, model_file, "waits_0", "CPU", 0, 1))
    items = [runner.RequestData({}, ("OUT",)), runner.RequestData({}, ("OUT",))]
    try:
        model.execute_decoupled(
            items, lambda index, outcome, final: None, lambda index: index == 1 or 1 in model.model.seen
        )
        wait_until(lambda: len(model.model.seen) == 2, timeout_s=30)  # the first's thread records it next
    finally:
        model.finalize()
    assert model.model.seen == [1, 0]


PLAIN_SQUARE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", n * n)]))
        return responses
"""


def test_a_stream_serves_a_model_as_it_is_after_a_reload_changes_its_transaction_policy(
    server_factory: Any, tmp_path: Path
) -> None:
    """A stream opened before a model is reloaded as decoupled (and back) serves each request as the
    model is when it comes, as Triton's stream handler does: not as the stream first found it."""
    folder = tmp_path / "repo" / "square"
    (folder / "1").mkdir(parents=True)

    def write(decoupled: bool) -> None:
        config = decoupled_models.SQUARE_CONFIG
        if not decoupled:
            config = config.replace("model_transaction_policy { decoupled: true }\n", "")
        (folder / "config.pbtxt").write_text(config)
        (folder / "1" / "model.py").write_text(decoupled_models.SQUARE if decoupled else PLAIN_SQUARE)

    write(decoupled=False)
    server = server_factory(tmp_path / "repo", "--model-control-mode", "explicit", "--load-model", "square")
    with grpcclient.InferenceServerClient(server.url) as client:
        stream = Stream(client)
        try:
            stream.send("square", "plain", IN=np.array([3], dtype=np.int32))
            [(result, error)] = stream.take(1)
            assert error is None and int(result.as_numpy("OUT")[0]) == 9

            write(decoupled=True)
            client.load_model("square")
            stream.send("square", "decoupled", IN=np.array([3], dtype=np.int32))
            [(_, error)] = items = stream.take(1)
            assert error is None  # not refused as a request for one response
            items += stream.take(2)
            assert [int(result.as_numpy("OUT")[0]) for result, _ in items] == [3, 3, 3]
            assert stream.nothing_more()

            write(decoupled=False)
            client.load_model("square")
            stream.send("square", "plain again", IN=np.array([4], dtype=np.int32))
            [(result, error)] = stream.take(1)
            assert error is None and int(result.as_numpy("OUT")[0]) == 16
        finally:
            client.stop_stream()
