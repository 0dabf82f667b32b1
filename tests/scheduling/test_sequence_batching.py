"""Sequence batching end to end: a real server (both process layouts), driven by tritonclient over gRPC."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer
from tests.polling import wait_until
from tests.sequence_models import add_accumulator, add_state_only, add_torch_accumulator


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    from tests.conftest import serving

    repo = tmp_path_factory.mktemp("repo")
    add_accumulator(
        repo, "acc_direct", "direct { max_queue_delay_microseconds: 3000 minimum_slot_utilization: 0.5 }", instances=2
    )
    add_accumulator(
        repo, "acc_oldest", "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }", instances=2
    )
    add_accumulator(repo, "acc_one_slot", max_batch_size=1, idle_us=300_000)
    add_accumulator(repo, "acc_stats", max_batch_size=2)
    add_accumulator(repo, "acc_text", corrid_type="TYPE_STRING")
    add_state_only(repo, "from_hundred", 100.0)
    add_torch_accumulator(repo, "torch_acc")
    add_torch_accumulator(repo, "torch_acc_processes", processes=True)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as running:
        yield running


def infer(client: grpcclient.InferenceServerClient, model: str, value: float, **sequence: Any) -> dict[str, Any]:
    data = grpcclient.InferInput("INPUT", [1, 1] if model != "from_hundred" else [1], "FP32")
    data.set_data_from_numpy(np.full(data.shape(), value, dtype=np.float32))
    result = client.infer(model, [data], **sequence)
    return {name: result.as_numpy(name) for name in ("OUTPUT", "CORRID_OUT") if result.as_numpy(name) is not None}


def run_sequence(url: str, model: str, cid: int | str, values: list[float]) -> list[float]:
    with grpcclient.InferenceServerClient(url) as client:
        sums = []
        for index, value in enumerate(values):
            out = infer(
                client, model, value, sequence_id=cid, sequence_start=index == 0, sequence_end=index == len(values) - 1
            )
            if "CORRID_OUT" in out:
                assert out["CORRID_OUT"].item() == (cid if isinstance(cid, int) else cid.encode())
            sums.append(float(out["OUTPUT"].item()))
        return sums


@pytest.mark.parametrize("model", ["acc_direct", "acc_oldest", "torch_acc", "torch_acc_processes"])
def test_interleaved_sequences_each_get_their_own_running_sum(server: RunningServer, model: str) -> None:
    steps = {cid: [float(cid * 10 + k) for k in range(12)] for cid in range(1, 13)}
    with ThreadPoolExecutor(len(steps)) as pool:
        results = {cid: pool.submit(run_sequence, server.url, model, cid, values) for cid, values in steps.items()}
        for cid, values in steps.items():
            assert results[cid].result() == list(np.cumsum(values)), f"sequence {cid}"
    with grpcclient.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    successes = int(stats["inference_stats"]["success"]["count"])
    assert successes >= 12 * 12 and int(stats["inference_count"]) == successes
    assert int(stats["execution_count"]) < successes, stats["batch_stats"]  # the queue delay lets batches form


def test_a_stream_runs_each_sequence_in_the_order_sent(server: RunningServer) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        sent = 0
        for step in range(10):
            for cid in (101, 102, 103):
                data = grpcclient.InferInput("INPUT", [1, 1], "FP32")
                data.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
                client.async_stream_infer(
                    "acc_direct",
                    [data],
                    request_id=f"{cid}-{step}",
                    sequence_id=cid,
                    sequence_start=step == 0,
                    sequence_end=step == 9,
                )
                sent += 1
        got = [answers.get(timeout=30) for _ in range(sent)]
    finally:
        client.stop_stream()
        client.close()
    for result, error in got:
        assert error is None, error
        step = int(result.get_response().id.split("-")[1])
        assert float(result.as_numpy("OUTPUT").item()) == step + 1.0


def test_errors_use_tritons_words(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException) as missing:
            infer(client, "acc_direct", 1.0)
        assert missing.value.message() == (
            "inference request to model 'acc_direct' must specify a non-zero or non-empty correlation ID"
        )
        with pytest.raises(InferenceServerException) as not_started:
            infer(client, "acc_direct", 1.0, sequence_id=4242)
        assert not_started.value.message() == (
            "inference request for sequence 4242 to model 'acc_direct' must "
            "specify the START flag on the first request of the sequence"
        )
        assert "INVALID_ARGUMENT" in str(not_started.value.status())


def test_string_and_large_ids_and_a_restart_after_end(server: RunningServer) -> None:
    assert run_sequence(server.url, "acc_text", "session-α", [1.0, 2.0, 3.0]) == [1.0, 3.0, 6.0]
    big = 2**63 - 7
    assert run_sequence(server.url, "acc_direct", big, [5.0, 5.0]) == [5.0, 10.0]
    assert run_sequence(server.url, "acc_direct", big, [2.0, 2.0]) == [2.0, 4.0]  # restarted from zero
    with grpcclient.InferenceServerClient(server.url) as client, pytest.raises(InferenceServerException):
        infer(client, "acc_text", 1.0, sequence_id="session-α")  # ended


def test_an_id_of_the_other_kind_than_the_corrid_control_is_refused(server: RunningServer) -> None:
    """As Triton from 25.01: the model would have been fed the string id as 0 (every string id's value)."""
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException) as text_id:
            infer(client, "acc_direct", 1.0, sequence_id="7", sequence_start=True, request_id="r7")
        assert text_id.value.message() == (
            "[request id: r7] sequence batching control 'CORRID' data-type is 'BYTES', but model 'acc_direct' "
            "expects 'UINT64'"
        )
        assert "INVALID_ARGUMENT" in str(text_id.value.status())
        with pytest.raises(InferenceServerException, match="data-type is 'UINT64', but model 'acc_text' expects"):
            infer(client, "acc_text", 1.0, sequence_id=7, sequence_start=True)


def test_initial_state_from_a_data_file_without_batching(server: RunningServer) -> None:
    assert run_sequence(server.url, "from_hundred", 9, [1.0, 2.0]) == [101.0, 103.0]


def test_slot_exhaustion_waits_then_the_idle_sequence_lets_go(server: RunningServer) -> None:
    model = "acc_one_slot"  # one slot; an idle sequence holds it for 300 ms
    with grpcclient.InferenceServerClient(server.url) as client:
        assert infer(client, model, 1.0, sequence_id=1, sequence_start=True)["OUTPUT"].item() == 1.0
        with pytest.raises(InferenceServerException) as refused:  # no slot within its 50 ms timeout
            infer(client, model, 1.0, sequence_id=2, sequence_start=True, timeout=50_000)
        assert refused.value.message() == "timeout of the corresponding sequence has been expired"
        waiting: list[float] = []
        thread = threading.Thread(target=lambda: waiting.extend(run_sequence(server.url, model, 3, [7.0, 1.0])))
        thread.start()
        assert infer(client, model, 2.0, sequence_id=1, sequence_end=True)["OUTPUT"].item() == 3.0
        thread.join(timeout=30)
        assert waiting == [7.0, 8.0]  # it waited for sequence 1's slot
        assert infer(client, model, 1.0, sequence_id=4, sequence_start=True)["OUTPUT"].item() == 1.0

        def slot_free() -> bool:  # sequence 4 idles; once its slot is released a new sequence gets it
            try:
                infer(client, model, 1.0, sequence_id=5, sequence_start=True, sequence_end=True, timeout=50_000)
            except InferenceServerException:
                return False
            return True

        wait_until(slot_free, timeout_s=10, what="the idle sequence's slot")
        with pytest.raises(InferenceServerException) as idle:
            infer(client, model, 1.0, sequence_id=4)
        assert "must specify the START flag" in idle.value.message()


def test_statistics_count_null_rows_as_triton_does(server: RunningServer) -> None:
    """Sequence 2 holds slot 1; while slot 0 is empty its batch has a null row in slot 0. As a real Triton 2.51
    counts it (checked with a Python-backend accumulator): the batch size counts the null row, inferences do not."""
    with grpcclient.InferenceServerClient(server.url) as client:
        assert infer(client, "acc_stats", 1.0, sequence_id=1, sequence_start=True)["OUTPUT"].item() == 1.0  # [1]
        assert infer(client, "acc_stats", 2.0, sequence_id=2, sequence_start=True)["OUTPUT"].item() == 2.0  # [-, 2]
        assert infer(client, "acc_stats", 1.0, sequence_id=1, sequence_end=True)["OUTPUT"].item() == 2.0  # [1]
        assert infer(client, "acc_stats", 5.0, sequence_id=2, sequence_end=True)["OUTPUT"].item() == 7.0  # [-, 2]
        stats = client.get_inference_statistics("acc_stats", as_json=True)["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == ("4", "4")
    assert stats["inference_stats"]["success"]["count"] == "4"
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]} == {"1": "2", "2": "2"}
