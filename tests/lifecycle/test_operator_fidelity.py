"""What an operator sees at the terminal, as with Triton: a model that fails at start ends the
server (``--exit-on-error``), Ctrl-C stops it without a traceback, ``config check`` refuses what
``serve`` refuses, and ``config generate`` states the instance count it writes (issue 23)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import python_models
from tests.conftest import serving
from tests.models import EXAMPLES, REPO_ROOT
from tests.polling import live_members, wait_until

EXIT_TIMEOUT_S = 120.0  # the 2-core machine is shared: start-up and stop get a generous bound


def _repository(tmp_path: Path, *, broken: bool) -> Path:
    """``good`` (Python's add_sub), and with ``broken`` a ``broken`` model whose model.py does not parse."""
    repo = tmp_path / "repo"
    python_models.add_add_sub(repo, "good")
    if broken:
        python_models.add_add_sub(
            repo, "broken", source=python_models.ADD_SUB.replace(*python_models.FAULTS["syntax_error"])
        )
    return repo


@contextmanager
def _serve_in_own_session(repo: Path, tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``shoal serve`` on loopback port 0 in a session (process group) of its own, its log in
    ``tmp_path/server.log``; whatever is left of the group is killed on the way out. Only the gRPC
    address is given: HTTP and metrics follow it (what the README's first screen says)."""
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shoal",
                "serve",
                "--model-repository",
                str(repo),
                "--port-file",
                str(tmp_path / "port"),
                "--exit-timeout-secs",
                "30",
                "--grpc-address",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--http-port",
                "0",
                "--metrics-port",
                "0",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        yield server
    finally:
        if live_members(group=server.pid):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _exit_code(server: subprocess.Popen[bytes]) -> int:
    try:
        return server.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within {EXIT_TIMEOUT_S:.0f} s") from None


# -- item 5: --exit-on-error ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    [
        (),
        ("--grpc-workers", "1"),
        ("--model-control-mode", "poll", "--repository-poll-secs", "0.2"),
        ("--model-control-mode", "explicit", "--load-model", "good", "--load-model", "broken"),
        ("--model-control-mode", "explicit", "--load-model", "absent"),
    ],
    ids=["none", "none-with-workers", "poll", "explicit", "explicit-absent"],
)
def test_a_model_that_fails_at_start_ends_the_server(tmp_path: Path, mode: tuple[str, ...]) -> None:
    """Triton 2.51 logs each failure, unloads the rest and exits 1 ("error: creating server:
    Internal - failed to load all models"); so does Shoal, leaving no process of its group behind."""
    repo = _repository(tmp_path, broken=True)
    with _serve_in_own_session(repo, tmp_path, *mode) as server:
        assert _exit_code(server) == 1, (tmp_path / "server.log").read_text()
        assert wait_until(lambda: not live_members(group=server.pid), timeout_s=30, what="the worker processes to end")
    log = (tmp_path / "server.log").read_text()
    failed = "absent" if "absent" in mode else "broken"
    assert f"shoal: error: failed to load all models: {failed} " in log, log
    assert "Traceback" not in log, log
    assert not (tmp_path / "port").exists()  # it never served
    # Triton's words: a version that fails to load, or a model the repository does not have.
    reason = "load failed for model" if failed == "broken" else "failed to load"
    assert f"E shoal.lifecycle.manager: model {failed}: {reason} '{failed}'" in log, log  # before the exit


@pytest.mark.parametrize("flag", [("--exit-on-error=false",), ("--exit-on-error", "false")])
def test_exit_on_error_false_serves_the_models_that_loaded(tmp_path: Path, flag: tuple[str, ...]) -> None:
    with serving(_repository(tmp_path, broken=True), tmp_path, *flag) as server:
        with grpc.insecure_channel(server.url) as channel:
            stub = InferenceStub(channel)
            assert stub.ModelReady(pb.ModelReadyRequest(name="good")).ready
            assert not stub.ModelReady(pb.ModelReadyRequest(name="broken")).ready
            assert not stub.ServerReady(pb.ServerReadyRequest()).ready  # strict readiness, as Triton


def test_a_model_that_breaks_while_polling_leaves_the_server_serving(tmp_path: Path) -> None:
    """Poll mode: only start-up failures end the server; a later one is the model's alone (as Triton)."""
    repo = _repository(tmp_path, broken=False)
    with serving(repo, tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0.2") as server:
        (repo / "good" / "1" / "model.py").write_text("class TritonPythonModel:\n    def execute(self, r)\n")
        python_models.add_add_sub(repo, "late")
        with grpc.insecure_channel(server.url) as channel:
            stub = InferenceStub(channel)
            wait_until(
                lambda: stub.ModelReady(pb.ModelReadyRequest(name="late")).ready,
                timeout_s=60,
                what="the poll to load the added model",
            )
            assert server.process.poll() is None


# -- item 7: Ctrl-C ------------------------------------------------------------------------------


def test_ctrl_c_stops_python_workers_without_a_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: instance workers, the fork server and
    front-end workers ignore it and stop when the host tells them; the host exits 0."""
    repo = tmp_path / "repo"
    python_models.add_add_sub(repo, "repeat", count=2)
    with _serve_in_own_session(repo, tmp_path, "--grpc-workers", "1") as server:
        wait_until(
            lambda: (tmp_path / "port").exists() or server.poll() is not None,
            timeout_s=EXIT_TIMEOUT_S,
            what="the server to serve",
        )
        assert server.poll() is None, (tmp_path / "server.log").read_text()
        os.killpg(server.pid, signal.SIGINT)
        assert _exit_code(server) == 0, (tmp_path / "server.log").read_text()
        assert wait_until(lambda: not live_members(group=server.pid), timeout_s=30, what="the worker processes to end")
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "stopped" in log, log
    assert "HTTPService at 127.0.0.1:" in log and "Metrics Service at 127.0.0.1:" in log, log


# -- item 8: config check refuses what serve refuses ---------------------------------------------


def _shoal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fault", ["syntax_error", "import_error"])
def test_config_check_reports_the_load_error_serve_reports(tmp_path: Path, fault: str) -> None:
    repo = _repository(tmp_path, broken=False)
    python_models.add_fault(repo, fault)
    checked = _shoal("config", "check", str(repo))
    with serving(repo, tmp_path, "--exit-on-error", "false") as server:
        with grpc.insecure_channel(server.url) as channel:
            index = InferenceStub(channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
            reason = next(model.reason for model in index if model.name == fault)
    assert checked.returncode == 1, checked
    assert f"FAIL  {fault}: {reason.splitlines()[0]}\n" in checked.stdout, (checked.stdout, reason)
    assert "ok    good\n" in checked.stdout


def test_config_check_imports_a_python_model_but_never_runs_it(tmp_path: Path) -> None:
    """Import-time code runs (as at load); ``initialize`` and ``execute`` do not."""
    repo = tmp_path / "repo"
    marker = tmp_path / "ran"
    python_models.write_model(
        repo,
        "watched",
        python_models.ECHO_CONFIG,
        f"""
        import pathlib
        pathlib.Path({str(marker)!r}).with_suffix(".imported").touch()

        class TritonPythonModel:
            def initialize(self, args):
                pathlib.Path({str(marker)!r}).touch()

            def execute(self, requests):
                pathlib.Path({str(marker)!r}).touch()
        """,
    )
    checked = _shoal("config", "check", str(repo))
    assert checked.returncode == 0 and "ok    watched" in checked.stdout, checked
    assert marker.with_suffix(".imported").exists() and not marker.exists()


# -- item 10: one default instance count in --help, the generated file and the docs --------------


def test_generate_help_states_the_instance_count_the_generated_file_has(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "simple" / "1" / "model.onnx", tmp_path / "simple.onnx")
    helped = _shoal("config", "generate", "--help")
    generated = _shoal("config", "generate", str(tmp_path / "simple.onnx"), "--kind", "KIND_CPU", "--output", "-")
    assert helped.returncode == 0 and generated.returncode == 0, (helped, generated)
    rule = "2 for an onnxruntime model on the CPU, else 1, as Triton"
    assert rule in " ".join(helped.stdout.split()), helped.stdout
    comment = " ".join(line.removeprefix("# ") for line in generated.stdout.splitlines() if line.startswith("#"))
    assert rule in comment, generated.stdout
    assert "count: 2\n" in generated.stdout and "kind: KIND_CPU" in generated.stdout, generated.stdout
    assert rule in " ".join((REPO_ROOT / "docs" / "model-repository.md").read_text().split())


# -- item 11: the README's first screen ----------------------------------------------------------


def test_readme_first_screen_names_the_interfaces_and_quotes_extras() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    first_screen = readme.split("\n---\n", 1)[0]
    assert first_screen.count("```bash\n") == 2  # serve model_repository/, run the tests
    assert "every interface" in first_screen and "--grpc-address 127.0.0.1" in first_screen
    pages = [readme, *(page.read_text() for page in (REPO_ROOT / "docs").glob("*.md"))]
    installs = [line for page in pages for line in page.splitlines() if "pip install" in line and "[" in line]
    assert installs and all(re.search(r"pip install [^\[]*\"[^\"]*\[", line) for line in installs), installs
