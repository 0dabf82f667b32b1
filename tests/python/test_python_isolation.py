"""Python models in one server stay apart (issue 22): each instance imports its own folder's files,
and a BaseException raised by a model's code fails that request or that load, never the server.

Models are written inline here: each ships files beside ``model.py`` (``helper.py``, a package
``subpkg``, a module imported only at execute time) whose constants differ per model or version,
so an answer computed with another model's files is a wrong number.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import python_models as pm
from tests.conftest import RunningServer
from tests.polling import wait_until

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
TIMEOUT_S = 60.0  # generous: the test machine's cores are shared

FILES_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "F" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "G" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "H" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# F comes from helper.py (which imports subpkg.mod itself), G from subpkg/mod.py, H from lazy.py,
# which model.py imports only when execute runs; lazy.py reads its constant from a folder without
# __init__.py (a namespace package) and imports json, which the folder's json.py must not shadow.
FILES_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils
from helper import f
import subpkg.mod


class TritonPythonModel:
    def execute(self, requests):
        import lazy  # imported after the load, at execute time

        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("F", f(x).astype(np.float32)), pb_utils.Tensor("G", subpkg.mod.g(x)),
                pb_utils.Tensor("H", lazy.h(x).astype(np.float32))]))
        return responses
"""


def _helper(k: int) -> str:
    return f"import subpkg.mod\n\n\ndef f(x):\n    return subpkg.mod.g(x) * {k}\n"


def _write_version(folder: Path, k: int) -> None:
    """A version folder whose files all use the constant ``k``."""
    (folder / "subpkg").mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(textwrap.dedent(FILES_MODEL).lstrip())
    (folder / "helper.py").write_text(_helper(k))
    (folder / "subpkg" / "__init__.py").write_text("")
    (folder / "subpkg" / "mod.py").write_text(f"def g(x):\n    return x + {k}\n")
    (folder / "nsdir").mkdir(exist_ok=True)
    (folder / "nsdir" / "thing.py").write_text(f"K = {k}\n")
    (folder / "json.py").write_text("raise ImportError('the standard library was shadowed')\n")
    (folder / "lazy.py").write_text(
        "import json\n\nimport nsdir.thing\nfrom helper import f\n\n\n"
        "def h(x):\n    return f(x) - nsdir.thing.K + len(json.dumps([]))\n"
    )


def add_files_model(repo: Path, name: str, k: int, extra: str = THREADS) -> Path:
    folder = repo / name
    folder.mkdir(parents=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(FILES_CONFIG).lstrip() + extra + "\n")
    _write_version(folder / "1", k)
    return folder


def expected(x: np.ndarray, k: int, k_helper: int | None = None) -> dict[str, np.ndarray]:
    """The outputs computed here: ``k_helper`` is helper.py's constant where it differs from the others'."""
    g = x + k
    f = g * (k if k_helper is None else k_helper)
    return {"F": f, "G": g, "H": f - k + 2}


X = np.array([1.0, 2.5, -4.0], dtype=np.float32)


def _infer(client: grpcclient.InferenceServerClient, model: str, x: np.ndarray = X) -> dict[str, np.ndarray]:
    tensor = grpcclient.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor], client_timeout=TIMEOUT_S)
    return {name: result.as_numpy(name) for name in ("F", "G", "H")}


def _assert_outputs(got: dict[str, np.ndarray], want: dict[str, np.ndarray], model: str) -> None:
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{model} {name}")


# Reports the sys.modules entries of the server's process whose file is under the folder it is sent.
PROBE_CONFIG = (
    """
backend: "python"
max_batch_size: 0
input [ { name: "FOLDER" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "NAMES" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
    + THREADS
)

PROBE = """
import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            folder = pb_utils.get_input_tensor_by_name(request, "FOLDER").as_numpy()[0].decode()
            names = sorted(name for name, module in list(sys.modules.items())
                           if (getattr(module, "__file__", None) or "").startswith(folder))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("NAMES", np.array([json.dumps(names).encode()], dtype=np.object_))]))
        return responses
"""


def _modules_from(client: grpcclient.InferenceServerClient, folder: Path) -> list[str]:
    tensor = grpcclient.InferInput("FOLDER", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([str(folder).encode()], dtype=np.object_))
    result = client.infer("probe", [tensor], client_timeout=TIMEOUT_S)
    names: list[str] = json.loads(result.as_numpy("NAMES")[0])
    return names


def test_models_loaded_together_each_run_their_own_files(tmp_path: Path, server_factory: Any) -> None:
    """Thread models loaded at the same time, each with its own helper.py, subpkg and lazy module,
    answer with their own files (and so does a process-instance twin), called concurrently; an
    unloaded model's modules leave the server's sys.modules."""
    repo = tmp_path / "repo"
    constants = {"plus_two": 2, "times_ten": 10, "seven": 7, "in_process": 5}
    for name, k in constants.items():
        add_files_model(repo, name, k, extra="" if name == "in_process" else THREADS)
    pm.write_model(repo, "probe", PROBE_CONFIG, PROBE)
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "probe")
    with grpcclient.InferenceServerClient(server.url) as client, ThreadPoolExecutor(len(constants)) as pool:
        list(pool.map(lambda name: client.load_model(name, client_timeout=TIMEOUT_S), constants))
        calls = [(name, X + i) for i in range(6) for name in constants]
        answers = list(pool.map(lambda call: _infer(client, call[0], call[1]), calls))
        for (name, x), got in zip(calls, answers, strict=True):
            _assert_outputs(got, expected(x, constants[name]), name)
        loaded = _modules_from(client, repo / "plus_two" / "1")
        # Each of the two instances loaded model, helper, subpkg and subpkg.mod; one that executed, lazy too.
        assert len(loaded) >= 2 * 4 and any(name.endswith(".lazy") for name in loaded), loaded
        assert not {"helper", "lazy", "subpkg", "subpkg.mod", "model", "nsdir.thing", "json"} & set(loaded), loaded
        client.unload_model("plus_two", client_timeout=TIMEOUT_S)
        wait_until(lambda: not client.is_model_ready("plus_two"), TIMEOUT_S, "plus_two to unload")
        assert _modules_from(client, repo / "plus_two" / "1") == []
        _assert_outputs(_infer(client, "times_ten"), expected(X, 10), "times_ten")
    assert server.stop() == 0, server.log()


def test_poll_mode_runs_a_new_versions_files_and_a_changed_helper(tmp_path: Path, server_factory: Any) -> None:
    """A new version's changed helper.py is the one that runs, and so is a helper.py edited in place."""
    repo = tmp_path / "repo"
    folder = add_files_model(repo, "versions", 2)
    server = server_factory(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3")
    with grpcclient.InferenceServerClient(server.url) as client:
        _assert_outputs(_infer(client, "versions"), expected(X, 2), "version 1")
        _write_version(tmp_path / "staged", 3)  # written whole, then moved in: a poll never sees half of it
        (tmp_path / "staged").rename(folder / "2")
        wait_until(
            lambda: client.is_model_ready("versions", "2") and not client.is_model_ready("versions", "1"),
            TIMEOUT_S,
            "version 2 to replace version 1",
        )
        _assert_outputs(_infer(client, "versions"), expected(X, 3), "version 2")
        (tmp_path / "helper.py").write_text(_helper(4))  # same size, new constant, moved in whole
        os.replace(tmp_path / "helper.py", folder / "2" / "helper.py")
        want = expected(X, 3, k_helper=4)
        wait_until(
            lambda: np.array_equal(_infer(client, "versions")["F"], want["F"]), TIMEOUT_S, "the edited helper.py to run"
        )
        _assert_outputs(_infer(client, "versions"), want, "version 2, edited")
    assert server.stop() == 0, server.log()


# -- a model's BaseException ----------------------------------------------------------------------

RAISER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""

# X[0] picks what execute raises (0: nothing, Y = 2 X); 6: a generator of responses that raises as it
# is read; 7: a response whose output_tensors raises, read by the server after execute returned.
RAISER = """
import asyncio
import sys

import triton_python_backend_utils as pb_utils


class ModelStop(BaseException):
    pass


class LateResponse(pb_utils.InferenceResponse):
    def output_tensors(self):
        sys.exit(7)


RAISED = {1: lambda: sys.exit(3), 2: KeyboardInterrupt, 3: asyncio.CancelledError, 4: GeneratorExit, 5: ModelStop}


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            code = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            if code in RAISED:
                raise RAISED[code]()
            if code == 6:
                return (sys.exit(6) for _ in requests)
            if code == 7:
                return [LateResponse([]) for _ in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(request, "X").as_numpy() * 2)]) for request in requests]
"""

RAISER_ASYNC = RAISER.replace("    def execute(", "    async def execute(")
RAISED_NAMES = {
    1: "SystemExit: 3",
    2: "KeyboardInterrupt",
    3: "CancelledError",
    4: "GeneratorExit",
    5: "ModelStop",
    6: "SystemExit: 6",
}


def _call(client: grpcclient.InferenceServerClient, model: str, value: float) -> np.ndarray:
    tensor = grpcclient.InferInput("X", [1], "FP32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.float32))
    result: np.ndarray = client.infer(model, [tensor], client_timeout=TIMEOUT_S).as_numpy("Y")
    return result


def test_a_base_exception_in_execute_fails_that_request_only(tmp_path: Path, server_factory: Any) -> None:
    """sys.exit, KeyboardInterrupt, CancelledError, GeneratorExit or any BaseException raised by
    execute (plain or async, thread or process instance) fails that request at once with INTERNAL
    naming it, logged once; the instance and the server go on serving."""
    repo = tmp_path / "repo"
    models_ = {
        "raiser": RAISER_CONFIG + THREADS,
        "raiser_async": RAISER_CONFIG + THREADS,
        "raiser_process": RAISER_CONFIG,
    }
    for name, config in models_.items():
        pm.write_model(repo, name, config, RAISER_ASYNC if name == "raiser_async" else RAISER)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        for model in models_:
            for code, exception in RAISED_NAMES.items():
                with pytest.raises(InferenceServerException) as caught:
                    _call(client, model, code)
                assert caught.value.status() == "StatusCode.INTERNAL", (model, caught.value)
                assert (
                    f"Failed to process the request(s) for model '{model}_0', message: {exception}"
                    in caught.value.message()
                ), (model, caught.value.message())
                np.testing.assert_array_equal(_call(client, model, 0.5), [1.0])
        with httpclient.InferenceServerClient(server.http_url) as http:
            tensor = httpclient.InferInput("X", [1], "FP32")
            tensor.set_data_from_numpy(np.array([1.0], dtype=np.float32))
            with pytest.raises(InferenceServerException) as over_http:  # a JSON error body, parsed
                http.infer("raiser", [tensor])
            assert "message: SystemExit: 3" in over_http.value.message(), over_http.value
            assert http.is_server_live() and http.is_model_ready("raiser")
    assert server.stop() == 0, server.log()
    log = server.log()
    for model in ("raiser", "raiser_async"):  # process instances log in their worker
        calls = len(RAISED_NAMES) + (model == "raiser")  # and the one over HTTP
        assert log.count(f"model instance {model}_0: execute raised ") == calls, log
        for exception in RAISED_NAMES.values():
            assert f"model instance {model}_0: execute raised {exception}" in log, (model, exception, log)


def test_a_base_exception_after_execute_fails_that_request_only(tmp_path: Path, server_factory: Any) -> None:
    """What the server reads of a thread model's responses runs the model's code too: a SystemExit
    there fails that request (INTERNAL, logged once) on its way off the instance thread."""
    repo = tmp_path / "repo"
    pm.write_model(repo, "raiser", RAISER_CONFIG + THREADS, RAISER)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException) as caught:
            _call(client, "raiser", 7)
        assert caught.value.status() == "StatusCode.INTERNAL", caught.value
        assert "model 'raiser' version 1 failed: SystemExit: 7" in caught.value.message(), caught.value.message()
        np.testing.assert_array_equal(_call(client, "raiser", 0.25), [0.5])
    assert server.stop() == 0, server.log()
    assert server.log().count("a batch of 1 request(s) failed") == 1, server.log()


INIT_EXITS = """
import argparse
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        {body}

    def execute(self, requests):
        return []

    def finalize(self):
        sys.exit(5)
"""

LOAD_FAILURES = {
    "exits_on_init": ("sys.exit(4)", "SystemExit: 4"),
    "argparse_on_init": ("argparse.ArgumentParser().parse_args(['--no-such-flag'])", "SystemExit: 2"),
    "interrupted_on_init": ("raise KeyboardInterrupt('stop')", "KeyboardInterrupt: stop"),
}


def _http_load(server: RunningServer, model: str) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/repository/models/{model}/load",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("instances", ["threads", "processes"])
def test_a_base_exception_in_initialize_fails_that_load_only(
    tmp_path: Path, server_factory: Any, instances: str
) -> None:
    """A load whose initialize calls sys.exit (argparse on bad arguments does) or raises
    KeyboardInterrupt fails with the reason over gRPC and HTTP (a JSON error); finalize calling
    sys.exit does not stop an unload; the server keeps serving."""
    repo = tmp_path / "repo"
    extra = THREADS if instances == "threads" else ""
    for name, (body, _) in LOAD_FAILURES.items():
        pm.write_model(repo, name, RAISER_CONFIG + extra, INIT_EXITS.replace("{body}", body))
    pm.write_model(repo, "exits_on_finalize", RAISER_CONFIG + extra, INIT_EXITS.replace("{body}", "pass"))
    pm.write_model(repo, "raiser", RAISER_CONFIG + extra, RAISER)
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "raiser")
    with grpcclient.InferenceServerClient(server.url) as client:
        for name, (_, reason) in LOAD_FAILURES.items():
            with pytest.raises(InferenceServerException) as caught:
                client.load_model(name, client_timeout=TIMEOUT_S)
            assert f"load failed for model '{name}'" in caught.value.message() and reason in caught.value.message(), (
                caught.value.message()
            )
            assert not client.is_model_ready(name)
            status, body = _http_load(server, name)
            assert status == 400 and reason in body["error"], (status, body)  # INVALID_ARGUMENT, as Triton's
            index = {entry["name"]: entry for entry in client.get_model_repository_index(as_json=True)["models"]}
            assert index[name]["state"] == "UNAVAILABLE" and reason in index[name]["reason"], index[name]
        for _ in range(2):  # finalize's sys.exit: the unload completes, and the model loads again
            client.load_model("exits_on_finalize", client_timeout=TIMEOUT_S)
            assert client.is_model_ready("exits_on_finalize")
            client.unload_model("exits_on_finalize", client_timeout=TIMEOUT_S)
            wait_until(lambda: not client.is_model_ready("exits_on_finalize"), TIMEOUT_S, "the unload")
        np.testing.assert_array_equal(_call(client, "raiser", 0.75), [1.5])
    assert server.stop() == 0, server.log()


class _ExitsWhenUnpickled:
    """Pickled as a call of sys.exit(4): what a hostile or broken pickled module runs at load."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return sys.exit, (4,)


def test_a_pickled_pytorch_model_calling_sys_exit_fails_its_load_only(tmp_path: Path, server_factory: Any) -> None:
    """Other backends load on the same load threads: a SystemExit raised while one loads fails that
    model (UNAVAILABLE, with the reason) and the server starts and serves the rest."""
    torch = pytest.importorskip("torch")
    repo = tmp_path / "repo"
    (repo / "exits" / "1").mkdir(parents=True)
    torch.save(_ExitsWhenUnpickled(), repo / "exits" / "1" / "model.pt")
    (repo / "exits" / "config.pbtxt").write_text(
        'backend: "pytorch"\nmax_batch_size: 0\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        'parameters { key: "pickled_module" value: { string_value: "true" } }\n'
    )
    pm.write_model(repo, "raiser", RAISER_CONFIG + THREADS, RAISER)
    server = server_factory(repo, "--strict-readiness", "false", "--exit-on-error", "false")
    with grpcclient.InferenceServerClient(server.url) as client:
        index = {entry["name"]: entry for entry in client.get_model_repository_index(as_json=True)["models"]}
        assert index["exits"]["state"] == "UNAVAILABLE" and "SystemExit: 4" in index["exits"]["reason"], index
        np.testing.assert_array_equal(_call(client, "raiser", 0.25), [0.5])
    assert server.stop() == 0, server.log()


def test_a_decoupled_models_sys_exit_closes_its_stream_with_the_reason(tmp_path: Path, server_factory: Any) -> None:
    """A decoupled model that sent a response and then calls sys.exit: the request ends with an
    error response naming SystemExit after the one it sent, and the model keeps answering."""
    from tests.decoupled_models import SQUARE, SQUARE_CONFIG
    from tests.python.test_decoupled import Stream

    source = SQUARE.replace(
        "            sender = request.get_response_sender()\n",
        "            sender = request.get_response_sender()\n"
        "            if n == 13:\n"
        "                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor('OUT', "
        "np.array([1], dtype=np.int32))]))\n"
        "                raise SystemExit(3)\n",
    )
    assert "SystemExit" in source
    repo = tmp_path / "repo"
    pm.write_model(repo, "square_thread", SQUARE_CONFIG + THREADS, source)
    pm.write_model(repo, "square_process", SQUARE_CONFIG, source)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        stream = Stream(client)
        try:
            for model in ("square_thread", "square_process"):
                stream.send(model, "exits", IN=np.array([13], dtype=np.int32))
                (sent, no_error), (nothing, error) = stream.take(2)
                assert no_error is None and int(sent.as_numpy("OUT")[0]) == 1, no_error
                assert nothing is None and f"for model '{model}_0_0', message: SystemExit: 3" in error.message(), error
                stream.send(model, "two", IN=np.array([2], dtype=np.int32))
                assert [int(result.as_numpy("OUT")[0]) for result, _ in stream.take(2)] == [2, 2]
        finally:
            client.stop_stream()
    assert server.stop() == 0, server.log()


FORKING_MODEL = """
import os
import signal

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            # What multiprocessing's fork start method does, then Pool.terminate(): SIGTERM to the child.
            child = os.fork()
            if child == 0:
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(0)  # reached only if the child outlived its SIGTERM
            _, status = os.waitpid(child, 0)
            # Ended by a signal: its SIGTERM (or a crash in a library's fork handler, which a process forked
            # from the threads of a server may meet before it runs any code: see docs/security.md).
            outlived_sigterm = os.WIFEXITED(status)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * (-1 if outlived_sigterm else 3))]))
        return responses
"""


def test_a_thread_model_that_forks_does_not_stop_the_server(tmp_path: Path, server_factory: Any) -> None:
    """A process forked by a thread instance inherited the server loop's signal wakeup descriptor and
    handlers: the SIGTERM that ``Pool.terminate`` sends its forked processes reached the server's loop
    and shut the server down, and the child outlived it. Now the child ends on it, the server serves on."""
    repo = tmp_path / "repo"
    pm.write_model(repo, "forks", pm.DOUBLE_CONFIG + THREADS, FORKING_MODEL)
    pm.write_model(repo, "double", pm.DOUBLE_CONFIG, pm.DOUBLE)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        for round_ in range(6):
            x = np.arange(4, dtype=np.float32) + round_
            tensor = grpcclient.InferInput("X", [4], "FP32")
            tensor.set_data_from_numpy(x)
            assert client.infer("forks", [tensor], client_timeout=TIMEOUT_S).as_numpy("Y").tolist() == (x * 3).tolist()
            assert client.infer("double", [tensor], client_timeout=TIMEOUT_S).as_numpy("Y").tolist() == (x * 2).tolist()
        assert client.is_server_live()
    assert "shutting down" not in server.log()


# Writes over the log-settings page through every descriptor of it the worker holds; OUT = how many took.
LOG_PAGE_WRITER = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        written = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                if "shoal-log-settings" in os.readlink(f"/proc/self/fd/{fd}"):
                    written += os.pwrite(int(fd), bytes([255]) * 32, 0) > 0
            except OSError:
                pass
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([written], np.int32))]) for _ in requests]
"""

LOG_PAGE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_a_worker_cannot_write_the_servers_log_settings(tmp_path: Path, server_factory: Any) -> None:
    """Review of session 47: a process instance's worker held a writable descriptor of the page every
    process reads its log settings from; a model's stray write there turned the server's logging off
    and broke the logging endpoints. A worker now holds a read-only mapping and descriptor."""
    pm.write_model(tmp_path, "log_page_writer", LOG_PAGE_CONFIG, LOG_PAGE_WRITER)
    server = server_factory(tmp_path)
    with grpcclient.InferenceServerClient(server.url) as client:
        before = client.get_log_settings(as_json=True)
        data = grpcclient.InferInput("IN", [1], "INT32")
        data.set_data_from_numpy(np.zeros(1, np.int32))
        assert client.infer("log_page_writer", [data]).as_numpy("OUT").tolist() == [0]
        assert client.get_log_settings(as_json=True) == before


# Starts a process of its own (subprocess) and forks another, both sleeping; OUT = their pids.
STARTS_PROCESSES = """
import os
import subprocess
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        helper = subprocess.Popen(["sleep", "300"])
        child = os.fork()
        if child == 0:
            time.sleep(300)
            os._exit(0)
        pids = np.array([helper.pid, child], np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pids)]) for _ in requests]
"""

STARTS_PROCESSES_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_processes_a_worker_model_started_end_with_its_unload(tmp_path: Path, server_factory: Any) -> None:
    """Review of session 47: they outlived the worker, the unload and the server, holding its arenas."""
    pm.write_model(tmp_path, "starts_processes", STARTS_PROCESSES_CONFIG, STARTS_PROCESSES)
    server = server_factory(tmp_path, "--model-control-mode", "explicit", "--load-model", "starts_processes")
    with grpcclient.InferenceServerClient(server.url) as client:
        data = grpcclient.InferInput("IN", [1], "INT32")
        data.set_data_from_numpy(np.zeros(1, np.int32))
        pids = client.infer("starts_processes", [data]).as_numpy("OUT").tolist()
        try:
            assert all(_running(pid) for pid in pids)
            client.unload_model("starts_processes")
            wait_until(lambda: not any(_running(pid) for pid in pids), TIMEOUT_S, "the model's processes to end")
        finally:
            for pid in pids:
                if _running(pid):
                    os.kill(pid, 9)
