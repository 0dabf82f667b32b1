"""Both gRPC engines (``--grpc-engine``, issue 24): the log names the one serving and why; Triton's own
clients (sync, asyncio, streaming, with keepalive pings) get the same answers from each; what
pygrpc-native sends to its grpc.aio fallback (ModelStreamInfer) is not bounded across connections;
``auto`` falls back to grpcio where native cannot serve. TLS on grpcio, and its log line: test_tls."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio

from shoal.grpc import engine
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.conftest import RunningServer, serving, start_server

ENGINES = ("native", "grpcio")
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), dtype=np.int32)


def test_the_listener_names_its_engine_and_why(tmp_path: Path, server_factory) -> None:
    """``auto`` on an insecure listener is pygrpc-native, in either layout (each worker says so too)."""
    server = server_factory(models.repository(tmp_path, "simple"))
    log = server.log()
    assert "Started GRPCInferenceService at" in log
    assert "(engine native: insecure listener, pygrpc-native serves it" in log, log
    if "--grpc-workers" in server.process.args:  # type: ignore[operator]
        workers = [line for line in log.splitlines() if "serves gRPC on" in line and "(engine native:" in line]
        assert len(workers) == 2, log


def test_native_io_threads_follow_the_usable_cores_unless_given() -> None:
    """One I/O thread below 4 usable cores (a second only competes with the loop there), pygrpc-native's 2 from 4;
    a count given on the command line wins; grpcio runs no threads of its own."""
    native = engine.choose("native", tls=False)
    assert [native.with_io_threads(0, cores).io_threads for cores in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 2]
    assert native.with_io_threads(3, 2).io_threads == 3
    assert "; 3 I/O threads" in native.with_io_threads(3, 2).describe()
    assert engine.choose("grpcio", tls=False).with_io_threads(0, 2).io_threads == 0


def test_the_io_thread_count_given_is_the_one_served_and_logged(tmp_path: Path) -> None:
    """``--grpc-io-threads 3``: the native listener runs 3 I/O threads (counted in /proc), and says so."""
    (tmp_path / "server").mkdir()
    with serving(
        models.repository(tmp_path, "simple"), tmp_path / "server", "--grpc-engine", "native", "--grpc-io-threads", "3"
    ) as server:
        assert "(engine native: --grpc-engine native; 3 I/O threads)" in server.log(), server.log()
        names = [(task / "comm").read_text().strip() for task in Path(f"/proc/{server.process.pid}/task").iterdir()]
        assert names.count("grpc-native-io") == 3, names


@pytest.fixture(scope="module", params=ENGINES)
def engine_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")
    server = start_server(repo, tmp_path_factory.mktemp("server"), "--grpc-engine", request.param)
    assert f"(engine {request.param}: --grpc-engine {request.param}" in server.log()
    yield server
    assert server.stop() == 0, server.log()


def _inputs(module: object) -> list[triton.InferInput]:
    tensors = []
    for name, data in (("INPUT0", A), ("INPUT1", B)):
        tensor = module.InferInput(name, [1, 16], "INT32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    return tensors


def test_tritonclient_sync(engine_server: RunningServer) -> None:
    with triton.InferenceServerClient(engine_server.url) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
        assert client.get_model_metadata("simple").name == "simple"
        assert client.get_model_config("simple").config.max_batch_size == 8
        result = client.infer("simple", _inputs(triton), client_timeout=30)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
        with pytest.raises(triton.InferenceServerException) as caught:
            client.infer("nope", _inputs(triton))
        assert caught.value.status() == "StatusCode.NOT_FOUND"
        assert client.get_inference_statistics("simple").model_stats[0].inference_count >= 1


def test_tritonclient_aio(engine_server: RunningServer) -> None:
    async def scenario() -> None:
        async with triton_aio.InferenceServerClient(engine_server.url) as client:
            assert await client.is_server_ready()
            results = await asyncio.gather(*(client.infer("simple", _inputs(triton_aio)) for _ in range(8)))
            for result in results:
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)

    asyncio.run(scenario())


def test_tritonclient_streaming(engine_server: RunningServer) -> None:
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    with triton.InferenceServerClient(engine_server.url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for index in range(8):
            client.async_stream_infer("simple", _inputs(triton), request_id=str(index))
        client.async_stream_infer("nope", _inputs(triton), request_id="bad")
        got = [answers.get(timeout=60) for _ in range(9)]
        client.stop_stream()
    ids = [result.get_response().id for result, error in got if error is None]  # type: ignore[attr-defined]
    assert ids == [str(index) for index in range(8)]  # in the order sent
    errors = [error for _, error in got if error is not None]
    assert len(errors) == 1 and "nope" in str(errors[0])


def test_a_client_that_sends_keepalive_pings_keeps_being_answered(engine_server: RunningServer) -> None:
    """Pings every 200 ms, also between calls: grpcio's ping policy may end the connection with GOAWAY
    (too_many_pings) and the client dials again; pygrpc-native accepts them. Either way every call is answered."""
    keepalive = triton.KeepAliveOptions(
        keepalive_time_ms=200,
        keepalive_timeout_ms=10_000,
        keepalive_permit_without_calls=True,
        http2_max_pings_without_data=0,
    )
    with triton.InferenceServerClient(engine_server.url, keepalive_options=keepalive) as client:
        for _ in range(3):
            result = client.infer("simple", _inputs(triton), client_timeout=30)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
            time.sleep(1.0)  # idle on purpose: only pings cross the connection meanwhile
        assert client.is_server_live()


def test_streams_on_many_connections_are_not_bounded_together(engine_server: RunningServer) -> None:
    """pygrpc-native proxies ModelStreamInfer to its grpc.aio fallback; 150 streams held open at once on
    150 connections (more than one connection's limit of 100) each get their answer."""
    count = 150
    channels = [
        grpc.insecure_channel(engine_server.url, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)
    ]
    answered = threading.Barrier(count, timeout=60)
    failures: list[str] = []

    def hold_a_stream(channel: grpc.Channel) -> None:
        request = pb.ModelInferRequest(model_name="simple")
        for name, data in (("INPUT0", A), ("INPUT1", B)):
            request.inputs.add(name=name, datatype="INT32", shape=data.shape)
            request.raw_input_contents.append(data.tobytes())
        sending: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
        sending.put(request)
        try:
            responses = InferenceStub(channel).ModelStreamInfer(iter(sending.get, None), timeout=90)
            first = next(responses)
            answered.wait()  # every stream is open and answered at once
            sending.put(None)
            list(responses)
            if first.error_message:
                failures.append(first.error_message)
        except (grpc.RpcError, threading.BrokenBarrierError) as exc:
            sending.put(None)
            failures.append(repr(exc))

    threads = [threading.Thread(target=hold_a_stream, args=(channel,)) for channel in channels]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for channel in channels:
            channel.close()
    assert not failures, failures[:3]


def test_auto_falls_back_where_native_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS, a pygrpc-native outside the tested range, or none importable: auto is grpcio and says why;
    ``native`` is a startup error that says the same."""
    import pygrpc_native

    from shoal.errors import StartupError
    from shoal.grpc import engine

    assert engine.choose("auto", tls=False).name == "native"
    assert engine.choose("auto", tls=True) == engine.EngineChoice(
        "grpcio", "TLS is on, which pygrpc-native cannot serve"
    )
    assert engine.choose("grpcio", tls=False).name == "grpcio"
    monkeypatch.setattr(pygrpc_native, "__version__", "0.6.0")
    choice = engine.choose("auto", tls=False)
    assert choice.name == "grpcio" and "pygrpc-native 0.6.0 is outside the tested range 0.5 to 0.6" in choice.reason
    monkeypatch.setitem(sys.modules, "pygrpc_native", None)  # what a platform without its wheel sees
    choice = engine.choose("auto", tls=False)
    assert choice.name == "grpcio" and choice.reason.startswith("pygrpc-native does not import here")
    with pytest.raises(StartupError, match="--grpc-engine native: pygrpc-native does not import here"):
        engine.choose("native", tls=False)


def test_the_tested_range_is_the_pinned_one() -> None:
    import tomllib

    from shoal.grpc import engine
    from tests.models import REPO_ROOT

    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if d.startswith("pygrpc-native")]
    (low_major, low_minor), (high_major, high_minor) = engine.TESTED_NATIVE
    assert pin.split(";")[0] == f"pygrpc-native>={low_major}.{low_minor},<{high_major}.{high_minor}"
