"""How RPCs end when the client leaves or the server stops: a clean status, and a log without tracebacks."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import grpc
import pytest
from grpc._cython import cygrpc

from shoal.grpc.status import GRPC_SERVER_LOGGER, quiet_answers_not_sent
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.conftest import open_channel

DELAY_MS = 20


def _request(model: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="IN", datatype="INT64", shape=[1, 2]).contents.int64_contents.extend([1, 2])
    return request


def test_calls_cancelled_as_they_are_answered_leave_no_traceback(tmp_path: Path, server_factory) -> None:
    """Client deadlines spread around a 20 ms model's execution: many calls are cancelled as their answer
    is sent. grpc logged each one it had not yet seen cancelled as an ExecuteBatchError with a traceback
    (about one in 300 here); now it is one debug line, and the log has no traceback."""
    repo = tmp_path / "repo"
    repo.mkdir()
    models.add_delayed_identity(repo, "slow", DELAY_MS, count=8)
    server = server_factory(repo)
    request = _request("slow")
    rng = random.Random(0)
    outcomes = {"answered": 0, "cancelled": 0}
    with open_channel(server.url) as channel:
        stub = InferenceStub(channel)
        stub.ModelInfer(request, timeout=30)
        for _ in range(250):
            calls = [stub.ModelInfer.future(request, timeout=rng.uniform(0.9, 1.3) * DELAY_MS / 1000) for _ in range(8)]
            for call in calls:
                try:
                    call.result()
                    outcomes["answered"] += 1
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
                    outcomes["cancelled"] += 1
        for _ in range(20):  # streams cancelled with requests in flight
            stream = stub.ModelStreamInfer(iter([request] * 64), timeout=rng.uniform(0.5, 3) * DELAY_MS / 1000)
            with pytest.raises(grpc.RpcError):
                list(stream)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
    assert min(outcomes.values()) > 100, outcomes  # the deadlines did race the answers
    log = server.log()
    assert "Traceback" not in log and " E " not in log, log[-5000:]


def test_an_answer_grpc_could_not_send_is_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    """The record grpc's aio server makes for it (``_handle_exceptions``), rewritten; other records kept."""
    quiet_answers_not_sent()
    quiet_answers_not_sent()  # once per process, however many servers are built
    grpc_logger = logging.getLogger(GRPC_SERVER_LOGGER)
    assert sum(type(f).__name__ == "AnswerNotSentFilter" for f in grpc_logger.filters) == 1
    method = "/inference.GRPCInferenceService/ModelInfer"

    def log_as_grpc_does(error: Exception) -> None:  # grpc formats the message itself
        try:
            raise error
        except Exception:
            grpc_logger.exception(f"ExecuteBatchError raised in core by servicer method [{method}]")

    with caplog.at_level(logging.INFO):
        log_as_grpc_does(cygrpc.ExecuteBatchError('Failed "execute_batch"'))
        assert not caplog.records, "a debug line, below INFO"
        with caplog.at_level(logging.DEBUG, logger=GRPC_SERVER_LOGGER):
            log_as_grpc_does(cygrpc.ExecuteBatchError('Failed "execute_batch"'))
        grpc_logger.error("Unexpected [ValueError] raised by servicer method [%s]", method, exc_info=ValueError("x"))
    first, second = caplog.records
    assert first.levelno == logging.DEBUG and first.exc_info is None
    assert first.getMessage() == (f"{method}: the answer was not sent: the client cancelled, its deadline passed "
                                  "or it disconnected")
    assert second.levelno == logging.ERROR and second.exc_info is not None, "other errors keep their traceback"
