"""Process instances of the PyTorch backend: one copy of the weights, workers that die, hang or are
stopped are replaced, readiness follows them, shutdown stays bounded, .pt2 workers copy no weights;
tensors of every datatype cross in memfd arenas that grow, and a killed worker leaves nothing in /dev/shm.
The models pin KIND_CPU (a GPU host would put KIND_AUTO on the GPU); the GPU variant is marked gpu."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from shoal.clients import ClientError, InferenceClient
from shoal.errors import ErrorCode, ShoalError
from shoal.instances.worker_pipe import INITIAL_ARENA_BYTES, MAX_ARENA_BYTES, arena_bytes
from shoal.protocol.types import DataType
from tests.polling import wait_until

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch (installed by .ci/run)")

from tests.instances.test_pytorch import Linear, _config  # noqa: E402 - after the skip when torch is missing


class Heavy(torch.nn.Module):
    """About 1 s of matrix products per call on this machine: long enough to kill a worker mid-request
    even while the test's own polling waits for a core."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(384) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight
        for _ in range(500):
            y = torch.mm(self.weight, y)
        return x * 2.0 + y[0, 0] * 0.0


def _process_repo(repo: Path) -> None:
    for name, processes in (("threads", "false"), ("processes", "true")):
        (repo / name / "1").mkdir(parents=True)
        torch.manual_seed(0)
        torch.jit.script(Linear(32)).save(str(repo / name / "1" / "model.pt"))
        (repo / name / "config.pbtxt").write_text(
            _config(
                name,
                [("x", "TYPE_FP32", "[ 32 ]")],
                [("y", "TYPE_FP32", "[ 32 ]")],
                f'instance_group [ {{ count: 2 kind: KIND_CPU }} ]\nparameters {{ key: "process_instances" value: '
                f'{{ string_value: "{processes}" }} }}',
            )
        )


def _heavy_repo(repo: Path) -> None:
    (repo / "heavy" / "1").mkdir(parents=True)
    torch.jit.script(Heavy()).save(str(repo / "heavy" / "1" / "model.pt"))
    (repo / "heavy" / "config.pbtxt").write_text(
        'backend: "pytorch"\nmax_batch_size: 0\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n'
        'parameters { key: "process_instances" value: { string_value: "true" } }\n'
    )


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _worker_pids(server_pid: int) -> list[int]:
    """Workers are forked by the server's fork server (a child of the server)."""
    servers = [p for p in _children(server_pid) if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return sorted(worker for fork_server in servers for worker in _children(fork_server))


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _computing_worker(workers: list[int], before: dict[int, int]) -> int:
    """A worker computing a request now: its CPU time grew since ``before`` and since the last look (one
    that grew since ``before`` only may have finished its request while this test waited for a core)."""
    last = dict(before)
    found: list[int] = []

    def computing() -> bool:
        now = {pid: _cpu_ticks(pid) for pid in workers}
        found[:] = [pid for pid in workers if now[pid] > before[pid] + 2 and now[pid] > last[pid]]
        last.update(now)
        return bool(found)

    wait_until(computing, timeout_s=10, what="a worker computing a request")
    return found[0]


def test_process_instances_give_the_same_outputs_as_threads(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _process_repo(repo)
    server = server_factory(repo)
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    with InferenceClient(server.url, timeout_s=60) as client:
        np.testing.assert_allclose(
            client.infer("processes", {"x": x})["y"], client.infer("threads", {"x": x})["y"], rtol=1e-6
        )
        assert client.statistics("processes")[0]["memory_usage"] == client.statistics("threads")[0]["memory_usage"]
    assert len(_worker_pids(server.pid)) == 2


def test_a_killed_worker_fails_only_its_request_and_is_restarted(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _heavy_repo(repo)
    server = server_factory(repo)
    workers = _worker_pids(server.pid)
    assert len(workers) == 2

    def heavy(value: float) -> object:
        with InferenceClient(server.url, timeout_s=60) as client:
            try:
                return float(client.infer("heavy", {"x": np.full(4, value, np.float32)})["y"][0])
            except ClientError as error:
                return error

    with ThreadPoolExecutor(2) as pool:
        before = {pid: _cpu_ticks(pid) for pid in workers}
        running = [pool.submit(heavy, 1.0), pool.submit(heavy, 2.0)]
        killed = _computing_worker(workers, before)
        os.kill(killed, signal.SIGKILL)
        results = [f.result(timeout=120) for f in running]
    failures = [r for r in results if isinstance(r, ClientError)]
    assert len(failures) == 1 and failures[0].status == grpc.StatusCode.UNAVAILABLE
    assert "instance process running this request died" in failures[0].message
    assert [r for r in results if not isinstance(r, ClientError)][0] in (2.0, 4.0)
    with InferenceClient(server.url, timeout_s=60) as client:  # restarted: the model serves again
        assert [float(client.infer("heavy", {"x": np.full(4, 3.0, np.float32)})["y"][0]) for _ in range(4)] == [6.0] * 4
    live = _worker_pids(server.pid)
    assert len(live) == 2 and killed not in live


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (fork server, workers, front-end workers)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            todo += _children(current)
        except FileNotFoundError:
            continue
    return found


def _held_shm_files(pids: list[int]) -> set[str]:
    """Files in /dev/shm that still have a name, mapped or open in any of ``pids``: what a kill could leak.

    (PyTorch's shared weights are unlinked as soon as they are made: they show as ``(deleted)``.)
    """
    held = set()
    for pid in pids:
        try:
            paths = [
                line.split(maxsplit=5)[5]
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if len(line.split(maxsplit=5)) == 6
            ]
            paths += [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        held |= {p for p in paths if p.startswith("/dev/shm/") and not p.endswith("(deleted)")}
    return held


def test_a_worker_killed_mid_request_leaves_nothing_in_dev_shm(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _heavy_repo(repo)
    server = server_factory(repo)
    shm_before = set(os.listdir("/dev/shm"))
    workers = _worker_pids(server.pid)

    def heavy() -> object:
        with InferenceClient(server.url, timeout_s=60) as client:
            try:
                return client.infer("heavy", {"x": np.full(4, 1.0, np.float32)})
            except ClientError as error:
                return error

    with ThreadPoolExecutor(1) as pool:
        before = {pid: _cpu_ticks(pid) for pid in workers}
        running = pool.submit(heavy)
        busy = _computing_worker(workers, before)
        # Mid-request: the tensors sit in the worker's memfd arenas, nothing with a name in /dev/shm.
        assert not _held_shm_files(_process_tree(server.pid))
        maps = Path(f"/proc/{busy}/maps").read_text()
        assert "/memfd:shoal-instance-requests" in maps and "/memfd:shoal-instance-responses" in maps
        os.kill(busy, signal.SIGKILL)
        result = running.result(timeout=120)
    assert isinstance(result, ClientError) and result.status == grpc.StatusCode.UNAVAILABLE, result
    with InferenceClient(server.url, timeout_s=60) as client:  # the replacement serves over the same arenas
        assert [float(client.infer("heavy", {"x": np.full(4, 3.0, np.float32)})["y"][0]) for _ in range(3)] == [6.0] * 3
    wait_until(lambda: not set(os.listdir("/dev/shm")) - shm_before, timeout_s=10, what="nothing new in /dev/shm")


TORCH_DATATYPES = ("BF16", "FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "BOOL")


class Echo(torch.nn.Module):
    """Returns its inputs: one of each datatype the PyTorch backend takes."""

    def forward(
        self,
        x_bf16: torch.Tensor,
        x_fp16: torch.Tensor,
        x_fp32: torch.Tensor,
        x_fp64: torch.Tensor,
        x_int8: torch.Tensor,
        x_int16: torch.Tensor,
        x_int32: torch.Tensor,
        x_int64: torch.Tensor,
        x_uint8: torch.Tensor,
        x_bool: torch.Tensor,
    ) -> list[torch.Tensor]:
        return [x_bf16, x_fp16, x_fp32, x_fp64, x_int8, x_int16, x_int32, x_int64, x_uint8, x_bool]


class EchoNumeric(torch.nn.Module):
    """Returns its inputs: a float, an integer and a bool, which a small batch carries in its pipe
    messages (``inline``; every numeric datatype's round trip: tests/core/test_inline_tensors.py)."""

    def forward(self, x_fp16: torch.Tensor, x_int64: torch.Tensor, x_bool: torch.Tensor) -> list[torch.Tensor]:
        return [x_fp16, x_int64, x_bool]


def _sample(datatype: str, count: int, rng: np.random.Generator) -> np.ndarray:
    dtype = DataType(datatype).numpy_dtype
    if datatype == "BOOL":
        return rng.integers(0, 2, count).astype(bool)
    if dtype.kind == "i" or dtype.kind == "u":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    return (rng.standard_normal(count) * 100).astype(dtype)


def test_every_datatype_and_batches_bigger_than_the_arenas_cross_to_a_worker(tmp_path: Path, server_factory) -> None:
    """Every datatype (BF16 among them: the batch goes through the arenas), then three that a small batch
    carries in its messages (``inline``): five elements each, then 300,000, then five again."""
    repo = tmp_path / "repo"
    models = {"echo": (Echo(), TORCH_DATATYPES), "echo_numeric": (EchoNumeric(), ("FP16", "INT64", "BOOL"))}
    for name, (module, datatypes) in models.items():
        (repo / name / "1").mkdir(parents=True)
        torch.jit.script(module).save(str(repo / name / "1" / "model.pt"))
        tensors = [(f"x_{d.lower()}", f"TYPE_{d}", "[ -1 ]") for d in datatypes]
        (repo / name / "config.pbtxt").write_text(
            _config(
                name,
                tensors,
                [(f"OUTPUT__{i}", t, dims) for i, (_, t, dims) in enumerate(tensors)],
                "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
                'parameters { key: "process_instances" value: { string_value: "true" } }',
            ).replace("max_batch_size: 8", "max_batch_size: 0")
        )
    server = server_factory(repo)
    rng = np.random.default_rng(0)
    # 5 elements, then 300,000 of each (9.9 MB each way: the 1 MiB arenas grow), then 5 again.
    for name, (_, datatypes) in models.items():
        for count in (5, 300_000, 5):
            feed = {f"x_{d.lower()}": _sample(d, count, rng) for d in datatypes}
            with InferenceClient(server.url, timeout_s=60) as client:
                out = client.infer(name, feed)
            for index, (input_name, sent) in enumerate(feed.items()):
                assert out[f"OUTPUT__{index}"].dtype == sent.dtype, (name, input_name)
                np.testing.assert_array_equal(out[f"OUTPUT__{index}"], sent, err_msg=f"{name} {input_name}")
    log = server.log()
    assert "a process instance's requests arena grows to 16 MiB" in log
    assert "a process instance's responses arena grows to 16 MiB" in log


def test_an_arena_grows_by_doubling_up_to_a_bound() -> None:
    assert arena_bytes(1, "inputs") == INITIAL_ARENA_BYTES
    assert arena_bytes(INITIAL_ARENA_BYTES + 1, "inputs") == 2 * INITIAL_ARENA_BYTES
    assert arena_bytes(MAX_ARENA_BYTES, "outputs") == MAX_ARENA_BYTES
    with pytest.raises(ShoalError) as inputs:
        arena_bytes(MAX_ARENA_BYTES + 1, "inputs")
    assert inputs.value.code is ErrorCode.INVALID_ARGUMENT
    assert f"the batch's inputs need {MAX_ARENA_BYTES + 1} bytes" in inputs.value.message
    assert f"at most {MAX_ARENA_BYTES >> 20} MiB each way per batch" in inputs.value.message
    with pytest.raises(ShoalError) as outputs:
        arena_bytes(MAX_ARENA_BYTES + 1, "outputs")
    assert outputs.value.code is ErrorCode.INTERNAL


def test_pickled_eager_module_in_threads_and_processes(tmp_path: Path, server_factory) -> None:
    from bench.python_model import PythonHeavy

    repo = tmp_path / "repo"
    torch.manual_seed(0)
    module = PythonHeavy(rounds=10)
    for name, processes in (("eager_threads", "false"), ("eager_processes", "true"), ("not_opted_in", None)):
        (repo / name / "1").mkdir(parents=True)
        torch.save(module, repo / name / "1" / "model.pt")
        opt_in = 'parameters { key: "pickled_module" value: { string_value: "true" } }\n' if processes else ""
        (repo / name / "config.pbtxt").write_text(
            'backend: "pytorch"\nmax_batch_size: 0\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 4 ] } ]\n'
            'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3, 8 ] } ]\n'
            "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
            + opt_in
            + (
                f'parameters {{ key: "process_instances" value: {{ string_value: "{processes}" }} }}\n'
                if processes
                else ""
            )
        )
    server = server_factory(repo, "--strict-readiness", "false", "--exit-on-error", "false")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    expected = module(torch.from_numpy(x)).detach().numpy()
    with InferenceClient(server.url, timeout_s=60) as client:
        for name in ("eager_threads", "eager_processes"):
            np.testing.assert_allclose(client.infer(name, {"x": x})["OUTPUT__0"], expected, rtol=1e-6)
        refused = next(e for e in client.repository_index() if e.name == "not_opted_in")
    assert refused.state == "UNAVAILABLE" and "PyTorch cannot load" in refused.reason


def _one_process_model(repo: Path, name: str, parameters: dict[str, str], count: int = 1) -> Path:
    """A TorchScript Linear(8) served by ``count`` worker processes; returns its model file."""
    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(Linear(8)).save(str(repo / name / "1" / "model.pt"))
    extra = "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        for key, value in {"process_instances": "true", **parameters}.items()
    )
    (repo / name / "config.pbtxt").write_text(
        _config(
            name,
            [("x", "TYPE_FP32", "[ 8 ]")],
            [("y", "TYPE_FP32", "[ 8 ]")],
            f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n{extra}",
        )
    )
    return repo / name / "1" / "model.pt"


def _resume_and_kill(pids: list[int]) -> None:
    """Leave nothing stopped behind, whatever the test's outcome."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


def test_execution_timeout_fails_the_request_of_a_stopped_worker_and_replaces_it(
    tmp_path: Path, server_factory
) -> None:
    repo = tmp_path / "repo"
    _one_process_model(repo, "guarded", {"execution_timeout_ms": "1500", "liveness_check_interval_ms": "0"})
    server = server_factory(repo)
    (stopped,) = _worker_pids(server.pid)
    x = np.ones((1, 8), np.float32)
    try:
        os.kill(stopped, signal.SIGSTOP)
        with InferenceClient(server.url, timeout_s=60) as client:
            with pytest.raises(ClientError) as caught:
                client.infer("guarded", {"x": x})
            assert caught.value.status == grpc.StatusCode.UNAVAILABLE
            assert (
                "did not answer within 1500 ms (execution_timeout_ms); it was killed and restarted"
                in caught.value.message
            )
            assert client.infer("guarded", {"x": x})["y"].shape == (1, 8)  # the new worker serves
            stats = client.statistics("guarded")[0]["inference_stats"]
        assert int(stats["fail"]["count"]) == 1 and int(stats["success"]["count"]) == 1
        workers = _worker_pids(server.pid)
        assert len(workers) == 1 and stopped not in workers
    finally:
        _resume_and_kill([stopped])


def test_a_stopped_idle_worker_is_found_and_readiness_follows_its_replacement(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    model_file = _one_process_model(repo, "watched", {"liveness_check_interval_ms": "300"})
    server = server_factory(repo)
    (stopped,) = _worker_pids(server.pid)
    x = np.ones((1, 8), np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            assert client.is_model_ready("watched")
            model_file.rename(model_file.with_suffix(".away"))  # a replacement worker cannot load it now
            os.kill(stopped, signal.SIGSTOP)
            wait_until(lambda: not client.is_model_ready("watched"), what="ModelReady false")
            assert not client.is_model_ready("watched", "1")
            with pytest.raises(ClientError) as caught:
                client.infer("watched", {"x": x})
            assert caught.value.status == grpc.StatusCode.UNAVAILABLE
            assert "did not answer a liveness check within 300 ms" in caught.value.message
            assert "could not be restarted" in caught.value.message
            model_file.with_suffix(".away").rename(model_file)
            wait_until(lambda: client.is_model_ready("watched"), what="ModelReady true again")
            assert client.infer("watched", {"x": x})["y"].shape == (1, 8)
        workers = _worker_pids(server.pid)
        assert len(workers) == 1 and stopped not in workers
    finally:
        _resume_and_kill([stopped])


def test_a_dead_idle_worker_is_replaced_before_any_request(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _one_process_model(repo, "watched", {"liveness_check_interval_ms": "300"})
    server = server_factory(repo)
    (dead,) = _worker_pids(server.pid)
    os.kill(dead, signal.SIGKILL)
    with InferenceClient(server.url, timeout_s=60) as client:
        wait_until(
            lambda: (
                dead not in _worker_pids(server.pid)
                and len(_worker_pids(server.pid)) == 1
                and client.is_model_ready("watched")
            ),
            what="a new worker, ready",
        )
        assert client.infer("watched", {"x": np.ones((1, 8), np.float32)})["y"].shape == (1, 8)
        assert int(client.statistics("watched")[0]["inference_stats"]["fail"].get("count", 0)) == 0
    # The check finds the worker dead, or, on a busy machine where the killed process takes longer than the
    # interval to exit, silent: either way it is replaced before any request.
    assert re.search(
        rf"worker process {dead} (died \(exit code -9\)|did not answer a liveness check within 300 ms); "
        "restarting",
        server.log(),
    ), server.log()


def test_without_liveness_checks_a_dead_idle_worker_fails_one_request_and_is_replaced(
    tmp_path: Path, server_factory
) -> None:
    repo = tmp_path / "repo"
    _one_process_model(repo, "unwatched", {"liveness_check_interval_ms": "0"})
    server = server_factory(repo)
    (dead,) = _worker_pids(server.pid)
    os.kill(dead, signal.SIGKILL)
    x = np.ones((1, 8), np.float32)
    with InferenceClient(server.url, timeout_s=60) as client:
        with pytest.raises(ClientError) as caught:
            client.infer("unwatched", {"x": x})
        assert caught.value.status == grpc.StatusCode.UNAVAILABLE
        assert "died (exit code -9); it has been restarted" in caught.value.message
        assert client.infer("unwatched", {"x": x})["y"].shape == (1, 8)


def test_shutdown_is_bounded_when_workers_are_stopped(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _one_process_model(repo, "frozen", {}, count=2)
    server = server_factory(repo)
    workers = _worker_pids(server.pid)
    assert len(workers) == 2
    try:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        assert server.stop(timeout_s=60) == 0, server.log()
        assert time.monotonic() - start < 10, "closing stopped workers must not wait long for each"
        assert not [
            pid
            for pid in workers
            if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1]
        ]
    finally:
        _resume_and_kill(workers)


def _memory_kb(pid: int, field: str) -> int:
    """A line of /proc/PID/smaps_rollup; "Anonymous:" is private memory, which weights in shared memory are not."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise AssertionError(f"no {field} line in smaps_rollup")


def _exported(repo: Path, name: str, width: int, kind: str = "KIND_CPU") -> torch.nn.Module:
    (repo / name / "1").mkdir(parents=True)
    module = torch.nn.Linear(width, width, bias=False).eval()
    program = torch.export.export(
        module, (torch.zeros(2, width),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},)
    )
    torch.export.save(program, str(repo / name / "1" / "model.pt2"))
    (repo / name / "config.pbtxt").write_text(
        _config(
            name,
            [("x", "TYPE_FP32", f"[ {width} ]")],
            [("y", "TYPE_FP32", f"[ {width} ]")],
            f'default_model_filename: "model.pt2"\ninstance_group [ {{ count: 1 kind: {kind} }} ]\n'
            'parameters { key: "process_instances" value: { string_value: "true" } }',
        )
    )
    return module


def test_an_exported_program_worker_holds_no_copy_of_the_weights(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _exported(repo, "small", 8)
    big = _exported(repo, "big", 4096)  # 64 MB of weights
    server = server_factory(repo)
    x = np.random.default_rng(0).standard_normal((2, 4096)).astype(np.float32)
    with InferenceClient(server.url, timeout_s=60) as client:
        expected = big(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(client.infer("big", {"x": x})["y"], expected, rtol=1e-4, atol=1e-4)
        assert client.infer("small", {"x": np.ones((1, 8), np.float32)})["y"].shape == (1, 8)
    # The big model's worker maps its 64 MB of shared weights, the small one's does not.
    small_worker, big_worker = sorted(_worker_pids(server.pid), key=lambda pid: _memory_kb(pid, "Rss:"))
    extra_kb = _memory_kb(big_worker, "Anonymous:") - _memory_kb(small_worker, "Anonymous:")
    assert extra_kb < 16 * 1024, f"the big model's worker holds {extra_kb} kB more private memory (weights 64 MB)"


def _gpu_memory_mb(pid: int) -> int:
    """Device memory a process holds, as nvidia-smi reports it (its CUDA context included)."""
    listing = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    used = [int(mb) for line in listing.splitlines() for owner, mb in [line.split(",")] if int(owner) == pid]
    assert used, f"process {pid} holds no device memory"
    return sum(used)


@pytest.mark.gpu
def test_an_exported_program_gpu_worker_holds_no_copy_of_the_weights(tmp_path: Path, server_factory) -> None:
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        pytest.skip("needs a CUDA build of torch, a GPU and nvidia-smi")
    repo = tmp_path / "repo"
    _exported(repo, "big", 8192, "KIND_GPU")  # 256 MB of weights, held by the server, shared by CUDA IPC
    server = server_factory(repo)
    with InferenceClient(server.url, timeout_s=120) as client:
        assert client.infer("big", {"x": np.ones((1, 8192), np.float32)})["y"].shape == (1, 8192)
    (worker,) = _worker_pids(server.pid)
    own_mb, server_mb = _gpu_memory_mb(worker), _gpu_memory_mb(server.pid)
    # Both hold a CUDA context; only the server holds the weights.
    assert own_mb < server_mb - 128, f"the worker holds {own_mb} MB of device memory, the server {server_mb} MB"
