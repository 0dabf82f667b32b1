"""``--event-loop``: every serving process runs the loop chosen (uvloop's by default where it imports,
asyncio's on request), says so in its log, and answers right on either, in both process layouts."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from shoal import cli, event_loops
from shoal.errors import StartupError
from tests import models
from tests.conftest import start_server
from tests.grpc_api.test_transport_abuse import children

REQUESTS = 32


def _inputs(module: object, a: np.ndarray, b: np.ndarray) -> list[object]:
    tensors = []
    for name, data in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, [1, 16], "INT32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_each_loop_is_the_one_logged_and_answers_concurrent_requests_right(
    tmp_path: Path, server_factory, loop: str
) -> None:
    """Concurrent requests over HTTP and gRPC, each with its own inputs, get their own sums and
    differences; the host (and each front-end worker) logs the loop it runs."""
    server = server_factory(models.repository(tmp_path, "simple"), "--event-loop", loop)
    log = server.log()
    assert f"Event loop: {loop}" in log, log
    if "--grpc-workers" in server.process.args:  # type: ignore[operator]
        workers = [line for line in log.splitlines() if "serves gRPC on" in line and "; event loop " in line]
        assert len(workers) == 2 and all(line.endswith(f"; event loop {loop}") for line in workers), log
    rng = np.random.default_rng(7)
    pairs = [
        (rng.integers(-1000, 1000, (1, 16), dtype=np.int32), rng.integers(-1000, 1000, (1, 16), dtype=np.int32))
        for _ in range(REQUESTS)
    ]
    with httpclient.InferenceServerClient(server.http_url, concurrency=8) as http:
        pending = [http.async_infer("simple", _inputs(httpclient, a, b)) for a, b in pairs]
        answers = [request.get_result() for request in pending]
    grpc = grpcclient.InferenceServerClient(server.url)
    try:
        answers += [grpc.infer("simple", _inputs(grpcclient, a, b)) for a, b in pairs]
    finally:
        grpc.close()
    for (a, b), answer in zip(pairs * 2, answers, strict=True):
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT1"), a - b)


def test_auto_is_uvloop_where_it_imports() -> None:
    pytest.importorskip("uvloop")  # a dependency on Linux and macOS: CI always has it
    assert event_loops.resolve("auto") == "uvloop"
    assert event_loops.resolve("asyncio") == "asyncio"


def test_without_uvloop_auto_is_asyncio_and_uvloop_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loops.resolve("auto") == "asyncio"
    with pytest.raises(StartupError, match="uvloop does not import here"):
        event_loops.resolve("uvloop")
    repo = models.repository(tmp_path, "simple")
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--model-repository", str(repo), "--event-loop", "uvloop"])
    assert exited.value.code == 2
    assert "--event-loop uvloop: uvloop does not import here" in capsys.readouterr().err


def test_front_end_workers_keep_the_signals_their_host_ignores(tmp_path: Path) -> None:
    """Started under ``nohup`` (SIGHUP ignored), a SIGHUP to the process group must not end the workers
    and the requests they hold: each worker ignores what its host ignores, on either loop. uvloop's
    own spawn reset every signal to its default."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what the server inherits, as from nohup
    try:
        (tmp_path / "server").mkdir()
        server = start_server(models.repository(tmp_path, "simple"), tmp_path / "server", "--grpc-workers", "2")
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        workers = [pid for pid in children(server.pid) if b"shoal.frontend" in _cmdline(pid)]
        assert len(workers) == 2, workers
        for pid in (server.pid, *workers):
            assert _ignored(pid) & (1 << (signal.SIGHUP - 1)), f"process {pid} does not ignore SIGHUP"
    finally:
        assert server.stop() == 0, server.log()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _ignored(pid: int) -> int:
    """The process's mask of ignored signals (SigIgn in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn for {pid}")
