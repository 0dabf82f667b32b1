"""Fixtures that start a real Shoal server (subprocess, loopback, port 0) and connect clients."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from shoal.protocol import InferenceStub
from shoal.tools import local_server
from shoal.tools.local_server import LocalServer
from tests import models

STARTUP_TIMEOUT_S = 60.0
# Every test that starts its server through a fixture runs in both process layouts (issue 12):
# gRPC served by the process that holds the models, and by two front-end worker processes; both on
# the default engine (--grpc-engine auto: pygrpc-native on these insecure listeners).
LAYOUTS = {"one-process": (), "two-workers": ("--grpc-workers", "2")}
# Tests marked ``other_engine`` (the gRPC-focused modules and tests, issue 24) also run on the other
# engine, in the one-process layout: grpc.aio, which serves TLS and any host without pygrpc-native.
OTHER_ENGINE = {"one-process-grpcio": ("--grpc-engine", "grpcio")}


RunningServer = LocalServer


def start_server(
    repository: Path, tmp_path: Path, *extra_args: str, credentials: grpc.ChannelCredentials | None = None
) -> RunningServer:
    """A real server on a free loopback port, its log kept in ``tmp_path`` for failure messages."""
    return local_server.start(
        repository,
        "--exit-timeout-secs",
        "5",
        *extra_args,
        work_dir=tmp_path,
        log_path=tmp_path / "server.log",
        credentials=credentials,
        timeout_s=STARTUP_TIMEOUT_S,
    )


@contextmanager
def serving(
    repository: Path, tmp_path: Path, *extra_args: str, credentials: grpc.ChannelCredentials | None = None
) -> Iterator[RunningServer]:
    """A served repository for the ``with`` block (a module's fixture, a test): ``start_server``, then a
    graceful stop that must exit 0 (its log in the failure); after a failure in the block, stopped and
    the block's failure raised."""
    server = start_server(repository, tmp_path, *extra_args, credentials=credentials)
    try:
        yield server
    except BaseException:
        server.stop()
        raise
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="session", autouse=True)
def one_temporary_folder_for_what_the_tests_start() -> Iterator[None]:
    """The processes tests start (servers, their workers, tuners) keep their temporary files in one folder,
    removed at the end of the session: a server a test kills with SIGKILL cannot remove its own (pygrpc-native's
    fallback socket folder), and would otherwise leave it in /tmp. This process keeps its own temporary folder."""
    tempfile.gettempdir()  # fixed now, before TMPDIR changes: pytest's tmp_path lives there
    folder = tempfile.mkdtemp(prefix="shoal-tests-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = previous
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_dev_shm() -> Iterator[None]:
    """Shared memory is released, also by the servers and workers tests kill with SIGKILL (issue 12).

    Named semaphores (``sem.*``) are not counted: every Python process on the machine that uses
    multiprocessing makes ``sem.mp-*`` files and its resource tracker removes them, so another test
    session or benchmark running meanwhile (CI shares the machine) would fail this one. Shoal's own
    memory is memfds and names nothing; what a session leaves is a segment. Nor is a segment that a
    process outside this session holds open (another program on the machine made it: a Triton's
    Python backend makes ``triton_python_backend_shm_region_*``); one nobody holds, or a process of
    this session holds, is counted."""
    shm = Path("/dev/shm")

    def segments() -> set[str]:
        found = {name for name in os.listdir(shm) if not name.startswith("sem.")}
        return found - _held_outside_this_session(found) if found else found

    before = segments() if shm.is_dir() else set()
    yield
    if not shm.is_dir():
        return
    deadline = time.monotonic() + 5  # processes ending right now release theirs on exit
    while (left := segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"left in /dev/shm by the test session: {sorted(left)}"


def _held_outside_this_session(names: set[str]) -> set[str]:
    """Which of these /dev/shm segments a process that does not descend from this one has open or mapped."""
    wanted = {f"/dev/shm/{name}": name for name in names}
    held: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or _descends_from_this_process(int(entry.name)):
            continue
        try:
            paths = {
                line.split(maxsplit=5)[-1] for line in (entry / "maps").read_text().splitlines() if "/dev/shm/" in line
            }
            paths |= {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:  # gone, or not ours to read
            continue
        held |= {wanted[path] for path in paths if path in wanted}
    return held


def _descends_from_this_process(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``layout`` takes every layout; with the ``other_engine`` mark, the other engine's too."""
    if "layout" in metafunc.fixturenames:
        names = list(LAYOUTS)
        if metafunc.definition.get_closest_marker("other_engine") is not None:
            names += list(OTHER_ENGINE)
        metafunc.parametrize("layout", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def layout(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The command-line arguments of one process layout (and engine)."""
    return {**LAYOUTS, **OTHER_ENGINE}[request.param]


@pytest.fixture
def server_factory(
    tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]
) -> Iterator[Callable[..., RunningServer]]:
    started: list[RunningServer] = []

    def factory(
        repository: Path, *extra_args: str, credentials: grpc.ChannelCredentials | None = None
    ) -> RunningServer:
        server = start_server(
            repository, tmp_path_factory.mktemp("server"), *layout, *extra_args, credentials=credentials
        )
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def example_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    """The shipped model_repository plus identity models for every datatype and a string model."""
    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")
    models.copy_example(repo, "mlp")
    for datatype in models.ALL_DATATYPES:
        models.add_identity(repo, f"identity_{datatype.lower()}", datatype)
    models.add_onnx_strings(repo)
    server = start_server(repo, tmp_path_factory.mktemp("server"), *layout)
    yield server
    assert server.stop() == 0, server.log()


def open_channel(url: str) -> grpc.Channel:
    """A channel that, like tritonclient's, accepts messages up to INT32_MAX bytes."""
    limit = 2**31 - 1
    return grpc.insecure_channel(
        url, options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    )


@pytest.fixture
def stub(example_server: RunningServer) -> Iterator[InferenceStub]:
    with open_channel(example_server.url) as channel:
        yield InferenceStub(channel)
