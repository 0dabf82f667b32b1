"""Shoal as KServe starts it (issue 25): the container args of deploy/'s runtimes, verbatim but for
the ports (free ones) and the repository path, on the three layouts KServe makes of /mnt/models:
a plain copy, /mnt/models itself a symlink (an oci:// modelcar), and a symlink in place of each
top-level entry pointing outside (kserve-storage's local download). The repository is read-only and
owned by another user; when the suite runs as root (CI does) the server runs as UID 1000 with no
HOME and TMPDIR its only writable folder. As another user, the repository is only made read-only
(chmod) and the server runs as that user: the other owner and UID 1000 are then not tested.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import yaml

from tests import deploy_manifests as dm
from tests import models
from tests.models import REPO_ROOT
from tests.polling import wait_until
from tests.prometheus_text import parse, scrape

AS_ROOT = os.geteuid() == 0
SERVER_UID = 1000  # the runtimes' runAsUser
OWNER_UID = 2000  # another user owns the repository, as the storage initializer's files
LAYOUTS = ("copy", "modelcar", "kserve-storage")
LOAD_THREADS, LOAD_PER_THREAD = 4, 5
KSERVE_PYTHON = dm.REPO_ROOT / ".kserve-venv" / "bin" / "python"


def _runtime_args(name: str) -> list[str]:
    return next(args for where, args, _ in dm.shoal_containers() if where.endswith(f"Runtime/{name}"))


def _swapped(args: list[str], repository: Path, port_file: Path) -> list[str]:
    """The manifest's args with the repository and ports swapped (free ones, loopback only); the
    port file tells the test which ports the server took."""
    swaps = {"--model-store": str(repository), "--grpc-port": "0", "--http-port": "0"}
    out = []
    for arg in args:
        flag, _, value = arg.partition("=")
        out.append(f"{flag}={swaps[flag]}" if flag in swaps else arg)
    return [*out, "--grpc-address=127.0.0.1", "--metrics-port=0", f"--port-file={port_file}"]


def _add_models(folder: Path) -> None:
    models.copy_example(folder, "simple")
    models.add_delayed_identity(folder, "queued", delay_ms=20)  # one instance: concurrent requests queue


def _lay_out(base: Path, layout: str) -> Path:
    """The repository the server is given (as /mnt/models would be), laid out as ``layout``."""
    mount = base / "mnt" / "models"
    mount.parent.mkdir(parents=True)
    if layout == "copy":
        mount.mkdir()
        _add_models(mount)
    elif layout == "modelcar":
        _add_models(base / "modelcar" / "models")
        mount.symlink_to(base / "modelcar" / "models", target_is_directory=True)
    else:
        store = base / "storage" / "downloaded"
        _add_models(store)
        mount.mkdir()
        for entry in sorted(store.iterdir()):
            (mount / entry.name).symlink_to(entry, target_is_directory=True)
    return mount


def _read_only(root: Path) -> None:
    for folder, dirs, files in os.walk(root):
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
            if AS_ROOT:
                os.chown(os.path.join(folder, name), OWNER_UID, OWNER_UID)
        for name in dirs:
            path = os.path.join(folder, name)
            if AS_ROOT and not os.path.islink(path):
                os.chown(path, OWNER_UID, OWNER_UID)
    for folder, dirs, _ in os.walk(root, topdown=False):
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o555)


def _tree(root: Path) -> list[tuple[str, int, int, int]]:
    """What a write would change: every entry's path, size, mode and mtime, symlinks not followed."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            stat = os.lstat(os.path.join(folder, name))
            found.append(
                (os.path.relpath(os.path.join(folder, name), root), stat.st_size, stat.st_mode, stat.st_mtime_ns)
            )
    return sorted(found)


def _owned_by_server(roots: tuple[str, ...], skip: Path) -> set[str]:
    """Files and folders of SERVER_UID in ``roots`` (two levels down), but for ``skip`` (the test's
    folder, which holds the servers' TMPDIRs)."""
    found = set()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            if Path(folder) == skip or os.path.relpath(folder, root).count(os.sep) >= 2:
                dirs.clear()
                continue
            for name in [*dirs, *files]:
                path = os.path.join(folder, name)
                try:
                    if os.lstat(path).st_uid == SERVER_UID and Path(path) != skip:
                        found.add(path)
                except OSError:
                    continue
    return found


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    base: Path
    repository: Path
    tmpdir: Path
    log: Path
    grpc_port: int
    metrics_port: int
    http_port: int

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def _http(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _ready(port: int) -> bool:
    try:
        return _http(port, "GET", "/v2/health/ready")[0] == 200
    except OSError:
        return False


def _start(base: Path, repository: Path, args: list[str], bin_dir: Path = Path(sys.executable).parent) -> Served:
    """The server as the kubelet would start it: the args as the command line, ``shoal`` found on
    PATH (``bin_dir``, as the image's venv), UID 1000 when the suite can set it, HOME absent, TMPDIR
    of its own."""
    tmpdir = base / "tmp"
    tmpdir.mkdir()
    if AS_ROOT:
        os.chown(tmpdir, SERVER_UID, SERVER_UID)
    port_file = tmpdir / "ports"
    command = _swapped(args, repository, port_file)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(base / "no-home"),
        "TMPDIR": str(tmpdir),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
    }
    log = base / "server.log"
    assert shutil.which(command[0], path=env["PATH"]), "the venv has no `shoal` console script"
    # setpriv execs in place (the pid is the server's); Popen(user=...) is refused exec here.
    as_user = ["setpriv", f"--reuid={SERVER_UID}", f"--regid={SERVER_UID}", "--clear-groups", "--"] if AS_ROOT else []
    with open(log, "wb") as out:
        process = subprocess.Popen([*as_user, *command], stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
    served = Served(process, base, repository, tmpdir, log, 0, 0, 0)
    try:
        wait_until(
            lambda: process.poll() is not None or (port_file.exists() and len(port_file.read_text().split()) == 3),
            timeout_s=120,
            what="the server's port file",
        )
        assert process.poll() is None, served.log_text()
        served.grpc_port, served.metrics_port, served.http_port = map(int, port_file.read_text().split())
        wait_until(
            lambda: _ready(served.http_port) or process.poll() is not None, timeout_s=120, what="/v2/health/ready"
        )
        assert process.poll() is None, served.log_text()
    except BaseException:
        served.stop()
        raise
    return served


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A folder UID 1000 can reach (pytest's own tmp folders are root's, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="shoal-kserve-"))
    os.chmod(base, 0o755)
    yield base
    for folder, dirs, _ in os.walk(base):  # a non-root run must make its read-only folders writable again
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o755)
    shutil.rmtree(base)


@pytest.fixture(scope="module", params=LAYOUTS)
def served(request: pytest.FixtureRequest, scratch: Path) -> Iterator[Served]:
    base = scratch / request.param
    base.mkdir()
    repository = _lay_out(base, request.param)
    _read_only(base / "mnt")
    for other in ("modelcar", "storage"):
        if (base / other).exists():
            _read_only(base / other)
    before = _tree(base / "mnt")  # the symlinks' targets (modelcar/, storage/) are below them
    owned_before = _owned_by_server(("/tmp", "/var/tmp"), scratch)
    server = _start(base, repository, _runtime_args("shoal"))
    yield server
    assert server.stop() == 0, server.log_text()
    log = server.log_text()
    assert not re.search(r"Permission denied|Read-only file system|Traceback", log), log
    assert _tree(base / "mnt") == before, "the server wrote into its repository"
    assert not (base / "no-home").exists()
    assert _owned_by_server(("/tmp", "/var/tmp"), scratch) == owned_before


def test_the_server_runs_as_kserve_runs_it(served: Served) -> None:
    status = Path(f"/proc/{served.process.pid}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    assert uid == (SERVER_UID if AS_ROOT else os.geteuid())
    assert _http(served.http_port, "GET", "/v2/health/live")[0] == 200
    status, body = _http(served.http_port, "POST", "/v2/repository/index", b"{}")
    assert status == 200 and {m["name"]: m["state"] for m in json.loads(body)} == {"simple": "READY", "queued": "READY"}


def _simple_inputs(module: object) -> tuple[np.ndarray, list[object]]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]  # type: ignore[attr-defined]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    return a, inputs


def test_model_infer_over_grpc_and_http(served: Served) -> None:
    a, inputs = _simple_inputs(triton_grpc)
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{served.grpc_port}") as client:
        result = client.infer("simple", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
    a, inputs = _simple_inputs(triton_http)
    with triton_http.InferenceServerClient(f"127.0.0.1:{served.http_port}") as client:
        result = client.infer("simple", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 0 * a)


def _adapter_query() -> str:
    config_map = dm.documents(dm.DEPLOY / "k8s" / "prometheus-adapter.yaml")[0]
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return " ".join(rule["metricsQuery"].split())


_QUERY = re.compile(
    r"sum\(delta\((\w+)\{<<\.LabelMatchers>>\}\[\w+\]\)\) by \(<<\.GroupBy>>\) "
    r"/ clamp_min\(sum\(delta\((\w+)\{<<\.LabelMatchers>>\}\[\w+\]\)\) by \(<<\.GroupBy>>\), "
    r"([0-9.]+)\)"
)


def _evaluate(query: str, first: str, second: str) -> float:
    """The adapter's metricsQuery for one pod, on two scrapes at the edges of its window (where
    delta is the difference): sum of one counter's increases over the other's, clamped below."""
    match = _QUERY.fullmatch(query)
    assert match, f"the query is not the shape this evaluator knows: {query}"
    numerator, denominator, floor = match.group(1), match.group(2), float(match.group(3))

    def increase(name: str) -> float:
        before, after = parse(first)[name], parse(second)[name]
        old = {tuple(sorted(s.labels.items())): s.value for s in before.samples}
        return sum(s.value - old.get(tuple(sorted(s.labels.items())), 0.0) for s in after.samples)

    return increase(numerator) / max(increase(denominator), floor)


def _statistics(port: int) -> tuple[int, int]:
    """All models' (queue ns, successes) from the statistics extension."""
    status, body = _http(port, "GET", "/v2/models/stats")
    assert status == 200
    rows = json.loads(body)["model_stats"]
    return (
        sum(int(r["inference_stats"]["queue"]["ns"]) for r in rows),
        sum(int(r["inference_stats"]["success"]["count"]) for r in rows),
    )


def test_metrics_move_under_load_and_the_adapter_query_gives_the_statistics_queue_time(served: Served) -> None:
    first, (queue_ns_0, success_0) = scrape(served.metrics_port), _statistics(served.http_port)
    errors: list[BaseException] = []

    def load() -> None:
        x = np.arange(2, dtype=np.int64).reshape(1, 2)
        tensor = triton_grpc.InferInput("IN", [1, 2], "INT64")
        tensor.set_data_from_numpy(x)
        try:
            with triton_grpc.InferenceServerClient(f"127.0.0.1:{served.grpc_port}") as client:
                for _ in range(LOAD_PER_THREAD):
                    np.testing.assert_array_equal(client.infer("queued", [tensor]).as_numpy("OUT"), x)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(LOAD_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    requests = LOAD_THREADS * LOAD_PER_THREAD
    wait_until(lambda: _statistics(served.http_port)[1] == success_0 + requests, what="the statistics")
    second, (queue_ns_1, success_1) = scrape(served.metrics_port), _statistics(served.http_port)
    families = (parse(first), parse(second))
    moved = [f["nv_inference_request_success"].value(model="queued") for f in families]
    assert moved[1] - moved[0] == requests
    queued = [f["nv_inference_queue_duration_us"].value(model="queued") for f in families]
    assert queued[1] > queued[0]
    expected_us = (queue_ns_1 - queue_ns_0) / 1000 / (success_1 - success_0)
    assert expected_us > 1000  # 4 clients on one 20 ms instance: most requests wait a whole execution
    # /metrics floors each series' total to whole µs: at most 1 µs per series and scrape apart
    got = _evaluate(_adapter_query(), first, second)
    assert got == pytest.approx(expected_us, abs=2 * 2 / requests + 1e-6)


@pytest.mark.parametrize("served", ["kserve-storage"], indirect=True)
@pytest.mark.skipif(
    not KSERVE_PYTHON.exists(),
    reason=".kserve-venv is absent (.ci/run creates it: "
    "python3 -m venv .kserve-venv && .kserve-venv/bin/pip install kserve)",
)
def test_kserves_own_python_clients(served: Served) -> None:
    """KServe's InferenceRESTClient and InferenceGRPCClient, in a process of their own (on one
    layout: the clients' start-up is most of the cost, and the layouts differ only below them)."""
    done = subprocess.run(
        [
            str(KSERVE_PYTHON),
            str(REPO_ROOT / "tests" / "kserve_clients.py"),
            f"127.0.0.1:{served.http_port}",
            f"127.0.0.1:{served.grpc_port}",
            "simple",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    a = list(range(16))
    expected = {"OUTPUT0": [v + 1 for v in a], "OUTPUT1": [v - 1 for v in a]}
    for key in ("grpc_server_ready", "grpc_model_ready"):
        assert found[key] is True, key
    for key in ("rest_json", "rest_binary", "grpc"):
        assert found[key] == expected, key


def test_the_trainedmodel_flow(scratch: Path) -> None:
    """Multi-model serving: the agent downloads a model into /mnt/models/<name> and POSTs
    /v2/repository/models/<name>/load to port 8080 (unload likewise), with an empty JSON body,
    while the server serves the models it has."""
    base = scratch / "trainedmodels"
    repository = base / "mnt" / "models"
    repository.mkdir(parents=True)
    _read_only(base / "mnt")  # the agent (this test, root or the owner) writes; the server only reads
    server = _start(base, repository, _runtime_args("shoal-multi"))
    agent = {"Content-Type": "application/json"}
    try:
        assert _http(server.http_port, "POST", "/v2/repository/index", b"{}") == (200, b"[]")
        os.chmod(repository, 0o755)
        models.copy_example(repository, "simple")  # the agent's download
        os.chmod(repository, 0o555)
        assert _http(server.http_port, "POST", "/v2/repository/models/simple/load", b"", agent)[0] == 200
        assert _http(server.http_port, "GET", "/v2/models/simple/ready")[0] == 200
        a = list(range(16))
        infer = json.dumps(
            {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": a} for n in ("INPUT0", "INPUT1")]}
        ).encode()
        stop, served, failures = threading.Event(), [0], []

        def serve_while_the_agent_works() -> None:
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline and served[0] < 5000:
                status, body = _http(server.http_port, "POST", "/v2/models/simple/infer", infer, agent)
                if status != 200 or json.loads(body)["outputs"][0]["data"] != [2 * v for v in a]:
                    failures.append((status, body[:200]))
                served[0] += 1

        worker = threading.Thread(target=serve_while_the_agent_works)
        worker.start()
        try:
            wait_until(lambda: served[0] > 0 or not worker.is_alive(), what="the first inference")
            os.chmod(repository, 0o755)
            models.add_delayed_identity(repository, "second", delay_ms=0)
            os.chmod(repository, 0o555)
            at_load = served[0]
            assert _http(server.http_port, "POST", "/v2/repository/models/second/load", b"{}", agent)[0] == 200
            x = json.dumps({"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "INT64", "data": [3, 4]}]})
            status, body = _http(server.http_port, "POST", "/v2/models/second/infer", x.encode(), agent)
            assert status == 200 and json.loads(body)["outputs"][0]["data"] == [3, 4]
            assert _http(server.http_port, "POST", "/v2/repository/models/second/unload", b"", agent)[0] == 200
            wait_until(lambda: served[0] > at_load or not worker.is_alive(), what="inference after the load")
        finally:
            stop.set()
            worker.join(timeout=60)
        assert not failures, failures[:3]
        assert _http(server.http_port, "GET", "/v2/models/second/ready")[0] != 200
        assert _http(server.http_port, "POST", "/v2/models/second/infer", x.encode(), agent)[0] != 200
        assert _http(server.http_port, "POST", "/v2/repository/models/simple/unload", b"", agent)[0] == 200
        status, body = _http(server.http_port, "POST", "/v2/repository/index", b"{}")
        assert {m["name"]: m["state"] for m in json.loads(body)} == {"simple": "UNAVAILABLE", "second": "UNAVAILABLE"}
    finally:
        code = server.stop()
    assert code == 0, server.log_text()


def _docker_build_context(context: Path) -> None:
    """What the Dockerfile's build stage COPYs, copied as Docker would, from a fresh clone (the
    git-ignored generated protobuf modules left out, so the build must make them)."""
    skip = shutil.ignore_patterns("__pycache__", "*_pb2.py", "*_pb2.pyi")
    lines = (dm.REPO_ROOT / "Dockerfile").read_text().split("\nFROM ")[1].splitlines()
    copies = [line.split()[1:] for line in lines if line.startswith("COPY ") and "--from" not in line]
    assert copies, "the build stage copies nothing"
    for *sources, destination in copies:
        for source in sources:
            target = context / destination / source if destination.endswith("/") else context / destination
            if (dm.REPO_ROOT / source).is_dir():
                shutil.copytree(dm.REPO_ROOT / source, target, ignore=skip)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(dm.REPO_ROOT / source, target)


def test_the_images_install_serves_from_a_clean_venv(scratch: Path) -> None:
    """The Dockerfile's install, without Docker: the three wheels built from what its build stage copies,
    installed into a fresh venv, then ``shoal serve`` with the runtime's args from that venv, as
    UID 1000, on a read-only repository. Kept cheap: the wheel is built without build isolation
    (the suite's setuptools and grpcio-tools, not downloaded ones) and the fresh venv reaches
    Shoal's dependencies through a .pth line to the suite's venv instead of installing them (minutes
    for onnxruntime and grpcio); Shoal itself comes only from the wheel."""
    base = scratch / "image"
    _docker_build_context(base / "context")
    wheels, venv = base / "wheels", base / "opt-shoal"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    context = base / "context"
    projects = [str(context / "proto"), str(context / "clients"), str(context)]
    for command in (
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), *projects],
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    built = sorted(str(wheel) for wheel in wheels.glob("shoal*.whl"))
    assert [Path(wheel).name.split("-")[0] for wheel in built] == ["shoal", "shoal_client", "shoal_protocol"], built
    done = subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", *built],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz_shoal_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import shoal.protocol.grpc_service_pb2 as pb, shoal.clients, shoal.cli, shoal\n"
            "print(list(shoal.__path__), pb.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.split() == [
        f"['{site / 'shoal'}']",
        str(site / "shoal" / "protocol" / "grpc_service_pb2.py"),
    ], where.stdout + where.stderr
    repository = base / "mnt" / "models"
    repository.mkdir(parents=True)
    models.copy_example(repository, "simple")
    _read_only(base / "mnt")
    server = _start(base, repository, dm.dockerfile_instruction("CMD"), bin_dir=venv / "bin")
    try:
        a = list(range(16))
        infer = json.dumps(
            {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": a} for n in ("INPUT0", "INPUT1")]}
        ).encode()
        status, body = _http(server.http_port, "POST", "/v2/models/simple/infer", infer)
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2 * v for v in a]
    finally:
        code = server.stop()
    assert code == 0, server.log_text()
    assert not re.search(r"Permission denied|Read-only file system|Traceback", server.log_text())
