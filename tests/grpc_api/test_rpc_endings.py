"""How RPCs end when the client leaves or the server stops: a clean status, and a log without tracebacks."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import cast

import grpc
import pytest
from grpc._cython import cygrpc

from shoal.core import Core
from shoal.grpc.servicer import InferenceServicer
from shoal.grpc.status import GRPC_SERVER_LOGGER, guard_stream, quiet_answers_not_sent
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from shoal.request_types import InferRequest, InferResponse
from tests import models
from tests.conftest import open_channel

pytestmark = pytest.mark.other_engine  # every gRPC test here also runs on grpcio (conftest)

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
    assert first.getMessage() == (
        f"{method}: the answer was not sent: the client cancelled, its deadline passed or it disconnected"
    )
    assert second.levelno == logging.ERROR and second.exc_info is not None, "other errors keep their traceback"


# -- the server stops ------------------------------------------------------------------------------


class _AnsweringCore:
    """A core that answers every request at once (only ``infer`` is called by a stream)."""

    async def infer(self, request: InferRequest, origin: object = None) -> InferResponse:
        return InferResponse(request.model_name, "1", request.id, ())


class _Context:
    """What the guard and the servicer ask of grpc's servicer context: ``abort``, which raises as grpc's
    does, and the call's metadata (none)."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.aborted = (code, message)
        raise grpc.aio.AbortError("Locally aborted.")


def test_a_stream_read_as_grpc_stops_serving_ends_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    """A stream still sending as the server shuts down: grpc's next read raises ``Server already stopped.``
    (grpc's ``_ServerStoppedError``). The stream ends UNAVAILABLE, not INTERNAL, and no error is logged."""

    async def requests() -> AsyncIterator[bytes]:
        yield _request("m").SerializeToString()
        raise cygrpc._ServerStoppedError("Server already stopped.")

    async def scenario() -> tuple[list[pb.ModelStreamInferResponse], _Context]:
        context = _Context()
        stream = guard_stream(InferenceServicer(cast(Core, _AnsweringCore())).ModelStreamInfer, pb.ModelInferRequest)
        answers = []
        with pytest.raises(grpc.aio.AbortError):
            async for answer in stream(requests(), context):
                answers.append(answer)
        return answers, context

    with caplog.at_level(logging.WARNING):
        answers, context = asyncio.run(scenario())
    assert [a.error_message for a in answers] == [""], "the request read before the stop is answered"
    assert context.aborted == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_sigterm_ends_a_stream_that_is_still_sending_with_unavailable(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    models.add_delayed_identity(repo, "slow", DELAY_MS, count=2)
    server = server_factory(repo, "--exit-timeout-secs", "10")
    sending = threading.Event()
    sending.set()

    def requests() -> Iterator[pb.ModelInferRequest]:
        while sending.is_set():
            yield _request("slow")
            time.sleep(0.002)

    errors: collections.Counter[str] = collections.Counter()
    with open_channel(server.url) as channel:
        stream = InferenceStub(channel).ModelStreamInfer(requests(), timeout=60)
        answered = 0
        with pytest.raises(grpc.RpcError) as ended:
            for answer in stream:
                answered += 1
                if answered == 20:
                    server.process.send_signal(signal.SIGTERM)
                if answer.error_message:
                    errors[answer.error_message] += 1
        sending.clear()
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
    assert set(errors) <= {"the server is shutting down"} and errors, errors  # requests sent after SIGTERM
    assert server.process.wait(timeout=30) == 0
    assert "unexpected error" not in server.log() and "INTERNAL" not in server.log(), server.log()
