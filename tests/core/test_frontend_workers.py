"""The multi-process layout (``--grpc-workers N``): what only it can get wrong.

One scheduler batches requests that came through different workers; a worker that dies is started
again and the server keeps serving; a host that dies takes its workers with it; shutdown drains
what the workers had in flight; the shared-memory pool bounds a worker's memory with a clear
UNAVAILABLE; nothing is left in /dev/shm. (Every other test that starts its server through a
fixture runs in this layout too: see ``conftest.LAYOUTS``.)
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningServer, serving, start_server
from tests.polling import metric, wait_until

WORKERS = ("--grpc-workers", "2")


def worker_pids(server: RunningServer) -> set[int]:
    """The server's front-end worker processes, from /proc."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.pid and b"shoal.frontend" in command:
            pids.add(int(entry.name))
    return pids


def established(pid: int, port: int) -> int:
    """TCP connections process ``pid`` has accepted on ``port`` (from /proc: its socket inodes)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


def own_connection(url: str) -> grpcclient.InferenceServerClient:
    """A client on a TCP connection of its own (grpc shares subchannels between channels by default)."""
    return grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def one_client_per_worker(server: RunningServer) -> dict[int, grpcclient.InferenceServerClient]:
    """Connect until every worker holds one of the connections (the kernel picks the worker)."""
    pids = worker_pids(server)
    clients: dict[int, grpcclient.InferenceServerClient] = {}
    for _ in range(64):
        before = {pid: established(pid, server.port) for pid in pids}
        client = own_connection(server.url)
        assert client.is_server_live()
        grew = [pid for pid in pids if established(pid, server.port) > before[pid]]
        if len(grew) == 1 and grew[0] not in clients:
            clients[grew[0]] = client
        else:
            client.close()
        if len(clients) == len(pids):
            return clients
    raise AssertionError(f"64 connections did not reach every worker of {pids}")


def rows(value: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [1, 2], "INT64")
    tensor.set_data_from_numpy(np.full((1, 2), value, dtype=np.int64))
    return [tensor]


@pytest.fixture
def batching_server(tmp_path: Path) -> Iterator[RunningServer]:
    repo = tmp_path / "repo"
    # A batch of 2 goes at once; anything else waits 20 s for company.
    models.add_delayed_identity(
        repo,
        "pairs",
        delay_ms=0,
        extra="""
        dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 20000000 }""",
    )
    models.add_delayed_identity(repo, "slow", delay_ms=1500)
    models.add_delayed_identity(repo, "echo", delay_ms=0)
    server = start_server(repo, tmp_path, *WORKERS)
    yield server
    server.stop()


def test_one_scheduler_batches_requests_that_came_through_different_workers(
    batching_server: RunningServer,
) -> None:
    clients = one_client_per_worker(batching_server)
    assert len(clients) == 2
    results: dict[int, np.ndarray] = {}

    def send(value: int, client: grpcclient.InferenceServerClient) -> None:
        results[value] = client.infer("pairs", rows(value), client_timeout=15).as_numpy("OUT")

    threads = [threading.Thread(target=send, args=(v, c)) for v, c in enumerate(clients.values(), start=1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert {v: r.tolist() for v, r in results.items()} == {1: [[1, 1]], 2: [[2, 2]]}
    stats = next(iter(clients.values())).get_inference_statistics("pairs", as_json=True)["model_stats"][0]
    assert [(int(b["batch_size"]), int(b["compute_infer"]["count"])) for b in stats["batch_stats"]] == [(2, 1)]


def test_a_killed_worker_is_replaced_and_only_its_requests_fail(batching_server: RunningServer) -> None:
    clients = one_client_per_worker(batching_server)
    (victim, doomed), (survivor, spared) = clients.items()
    outcome: dict[str, object] = {}

    def slow(name: str, client: grpcclient.InferenceServerClient) -> None:
        try:
            outcome[name] = client.infer("slow", rows(7), client_timeout=20).as_numpy("OUT").tolist()
        except InferenceServerException as exc:
            outcome[name] = exc.status()

    threads = [threading.Thread(target=slow, args=a) for a in (("doomed", doomed), ("spared", spared))]
    for thread in threads:
        thread.start()
    # One instance: one request executes for 1.5 s while the other waits in the queue.
    wait_until(
        lambda: metric(batching_server, "nv_inference_pending_request_count", "slow") >= 1,
        what="both slow requests to reach the host",
    )
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=20)
    assert outcome == {"spared": [[7, 7]], "doomed": "StatusCode.UNAVAILABLE"}
    wait_until(
        lambda: len(live := worker_pids(batching_server)) == 2 and victim not in live,  # one reading of /proc
        what="a new worker in place of the killed one",
    )
    assert survivor in worker_pids(batching_server)
    for value in range(8):  # new connections reach either worker, the new one included
        with own_connection(batching_server.url) as client:
            assert client.infer("echo", rows(value)).as_numpy("OUT").tolist() == [[value, value]]
    assert "exited with code -9" in batching_server.log() and "starting it again" in batching_server.log()


def _scratch(pid: int) -> Path:
    """A worker's TMPDIR, from /proc (the environment it was started with)."""
    variables = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    return Path(variables[b"TMPDIR"].decode())


def test_a_killed_workers_temporary_files_go_with_it(tmp_path: Path) -> None:
    """pygrpc-native keeps its fallback socket in a temporary folder that only a graceful stop removes: each
    worker's lives in a scratch folder of its own, which the host removes once the worker has exited (killed
    or stopped), so restarts pile nothing up in /tmp."""
    repo = tmp_path / "repo"
    models.add_delayed_identity(repo, "echo", delay_ms=0)
    server = start_server(repo, tmp_path, *WORKERS)
    try:
        scratch = {pid: _scratch(pid) for pid in worker_pids(server)}
        assert len(set(scratch.values())) == 2
        assert all(any(folder.glob("pygrpc-native-*/fallback.sock")) for folder in scratch.values()), scratch
        victim, survivor = scratch
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: len(live := worker_pids(server)) == 2 and victim not in live,  # one reading of /proc
            what="a new worker in place of the killed one",
        )
        assert not scratch[victim].exists() and scratch[survivor].exists()
        [replacement] = worker_pids(server) - {survivor}
        scratch[replacement] = _scratch(replacement)
        assert scratch[replacement].is_dir() and scratch[replacement] != scratch[victim]
    finally:
        assert server.stop() == 0
    assert not any(folder.exists() for folder in scratch.values()), scratch


def test_the_workers_die_with_the_host(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_delayed_identity(repo, "echo", delay_ms=0)
    server = start_server(repo, tmp_path, *WORKERS)
    workers = worker_pids(server)
    assert len(workers) == 2
    server.process.kill()
    server.process.wait()
    wait_until(
        lambda: not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in workers),
        what="the workers to exit after the host was killed",
    )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_shutdown_drains_requests_held_by_workers(batching_server: RunningServer) -> None:
    clients = one_client_per_worker(batching_server)
    outcome: list[object] = []

    def slow(client: grpcclient.InferenceServerClient) -> None:
        outcome.append(client.infer("slow", rows(5), client_timeout=20).as_numpy("OUT").tolist())

    threads = [threading.Thread(target=slow, args=(c,)) for c in clients.values()]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: metric(batching_server, "nv_inference_pending_request_count", "slow") >= 1,
        what="both slow requests to reach the host",
    )
    workers = worker_pids(batching_server)
    assert batching_server.stop() == 0, batching_server.log()
    for thread in threads:
        thread.join(timeout=20)
    assert outcome == [[[5, 5]], [[5, 5]]]
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_a_full_pool_answers_unavailable_and_the_worker_keeps_serving(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_identity(repo, "blob", "UINT8", max_batch_size=0)
    server = start_server(repo, tmp_path, *WORKERS, "--grpc-worker-pool-mb", "1")
    try:
        with own_connection(server.url) as client:
            big = grpcclient.InferInput("IN", [2 << 20], "UINT8")
            big.set_data_from_numpy(np.ones(2 << 20, dtype=np.uint8))
            with pytest.raises(InferenceServerException) as refused:
                client.infer("blob", [big])
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
            assert "shared-memory pool is full" in refused.value.message()
            assert "--grpc-worker-pool-mb" in refused.value.message()
            small = grpcclient.InferInput("IN", [1000], "UINT8")
            small.set_data_from_numpy(np.arange(1000, dtype=np.uint8))
            np.testing.assert_array_equal(
                client.infer("blob", [small]).as_numpy("OUT"), np.arange(1000, dtype=np.uint8)
            )
    finally:
        assert server.stop() == 0


def test_a_request_cancelled_before_the_host_starts_it_is_still_answered() -> None:
    """INFER and CANCEL read in one go: the task is cancelled before its first step, and the worker
    still gets its one answer, and the RELEASE that lets it reuse the request's input block."""
    import asyncio
    import socket

    from shoal.core import messages
    from shoal.core.host import CoreHost
    from shoal.dataplane.arena import Arena
    from shoal.dataplane.channel import Channel

    class LiveCore:
        async def live(self) -> bool:
            return True

    async def scenario() -> list[Any]:
        host_end, worker_end = socket.socketpair()
        answers: list[Any] = []
        both_answered = asyncio.Event()

        def received(message: Any) -> None:
            answers.append(message)
            if {a.id for a in answers if not isinstance(a, messages.Release)} == {1, 2} and messages.Release(
                [1]
            ) in answers:
                both_answered.set()

        requests, responses = Arena.create("t-requests", 1 << 16), Arena.create("t-responses", 1 << 16)
        host = CoreHost(LiveCore(), requests, responses)  # type: ignore[arg-type]
        await host.connect(host_end)
        worker = await Channel.open(worker_end, received, lambda: None, messages.RECORDS)
        worker.send(messages.Infer(1, "m", "", "", None, {}, {}, (), {}, [], False, []))  # both go out in one write
        worker.send(messages.Cancel(1))
        worker.send(messages.Call(2, "live", ()))  # the channel still serves after the cancel
        await asyncio.wait_for(both_answered.wait(), 10)
        host.close()
        worker.close()
        return answers

    answers = asyncio.run(scenario())
    assert messages.Release([1]) in answers  # never read: its block is the worker's again
    assert sorted((a.id, type(a).__name__) for a in answers if not isinstance(a, messages.Release)) == [
        (1, "Error"),
        (2, "Result"),
    ]


def test_a_stopped_worker_is_replaced_by_the_liveness_check(tmp_path: Path) -> None:
    """SIGSTOP keeps the process and its listening socket: only missed pings tell it is gone."""
    repo = tmp_path / "repo"
    models.add_delayed_identity(repo, "echo", delay_ms=0)
    server = start_server(repo, tmp_path, "--grpc-workers", "1", "--grpc-worker-liveness-secs", "0.3")
    try:
        [stopped] = worker_pids(server)
        os.kill(stopped, signal.SIGSTOP)
        wait_until(
            lambda: len(live := worker_pids(server)) == 1 and stopped not in live,  # one reading of /proc
            what="a new worker in place of the stopped one",
        )
        wait_until(
            lambda: "serves gRPC" in server.log().split("answered no liveness check", 1)[-1],
            what="the new worker to serve",
        )
        with own_connection(server.url) as client:
            assert client.infer("echo", rows(4)).as_numpy("OUT").tolist() == [[4, 4]]
    finally:
        assert server.stop() == 0


def test_auto_starts_the_workers_its_rule_gives_for_the_cores_here_and_says_so(tmp_path: Path) -> None:
    """``--grpc-workers auto``: the count the rule gives for this process's cores (0 on a 2-core machine, workers
    from 4), and the start-up log names it, the cores seen and the rule."""
    from shoal.frontend.worker_count import RULE, resolve

    expected = resolve("auto")  # the server inherits this process's affinity and cgroup
    repo = tmp_path / "repo"
    models.add_delayed_identity(repo, "echo", delay_ms=0)
    with serving(repo, tmp_path, "--grpc-workers", "auto") as server:
        with own_connection(server.url) as client:
            assert client.infer("echo", rows(3)).as_numpy("OUT").tolist() == [[3, 3]]
        assert len(worker_pids(server)) == expected.count
        log = server.log()
        assert f"Front-end layout: {expected.describe()}" in log, log
        assert f"{expected.count} front-end workers (--grpc-workers auto: " in log and RULE in log
        if expected.count:
            assert f"in {expected.count} front-end worker processes" in log, log
