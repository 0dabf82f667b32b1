"""Nothing outside the repository is opened, no server path is disclosed, and client mistakes about
repositories get a clean status: through a real server, real clients and the command line."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from shoal.clients import ClientError, InferenceClient
from shoal.errors import shown
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.polling import wait_until

IDENTITY_CONFIG = """
backend: "identity"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
OUTSIDE = "is not a path inside the model repository"


def copy_simple(repo: Path, name: str) -> Path:
    """The shipped `simple` ONNX model under another name (its config names no model)."""
    shutil.copytree(models.EXAMPLES / "simple", repo / name)
    config = repo / name / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "simple"\n', ""))
    return repo / name


def index_of(url: str) -> dict[str, tuple[str, str]]:
    with InferenceClient(url, timeout_s=60) as client:
        return {e.name: (e.state, e.reason) for e in client.repository_index()}


def assert_no_traceback(log: str) -> None:
    assert "Traceback" not in log and "unexpected error" not in log, log


# -- item 1: every path checked before any open ------------------------------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the repository holding a valid model file, config and version folder."""
    folder = tmp_path / "outside"
    copy_simple(folder, "model")
    (folder / "identity_config.pbtxt").write_text(IDENTITY_CONFIG)
    (folder / "version").mkdir()
    return folder


def test_symlinks_out_of_the_repository_are_refused_alike(tmp_path: Path, outside: Path, server_factory) -> None:
    """A symlinked version folder, model file, other file in a version folder or config.pbtxt that
    leads outside is refused with the same message whether its target exists or not; the target is
    never named."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for suffix, exists in (("there", True), ("missing", False)):
        version = repo / f"version_{suffix}"
        models.write_config(version, IDENTITY_CONFIG)
        (version / "1").symlink_to(outside / ("version" if exists else "nothing"), target_is_directory=True)

        model_file = copy_simple(repo, f"model_file_{suffix}")
        (model_file / "1" / "model.onnx").unlink()
        (model_file / "1" / "model.onnx").symlink_to(outside / "model" / "1" / ("model.onnx" if exists else "no.onnx"))

        config = repo / f"config_{suffix}"
        (config / "1").mkdir(parents=True)
        (config / "config.pbtxt").symlink_to(outside / ("identity_config.pbtxt" if exists else "no.pbtxt"))

        extra = copy_simple(repo, f"extra_{suffix}")  # e.g. ONNX external weights beside the model file
        (extra / "1" / "weights.bin").symlink_to(outside / "model" / "1" / ("model.onnx" if exists else "no.bin"))
    server = server_factory(repo, "--exit-on-error", "false")
    index = index_of(server.url)
    expected = {
        "version": "'version_{}/1' " + OUTSIDE,
        "model_file": "'model_file_{}/1/model.onnx' " + OUTSIDE,
        "config": "'config_{}/config.pbtxt' " + OUTSIDE,
        "extra": "'extra_{}/1/weights.bin' " + OUTSIDE,
    }
    for kind, phrase in expected.items():
        there, missing = index[f"{kind}_there"], index[f"{kind}_missing"]
        assert there[0] == missing[0] == "UNAVAILABLE", (there, missing)
        assert phrase.format("there") in there[1], there
        assert there[1] == missing[1].replace("missing", "there"), (there, missing)
        assert str(tmp_path) not in there[1] + missing[1]
    with grpc.insecure_channel(server.url) as channel:
        assert not InferenceStub(channel).ModelReady(pb.ModelReadyRequest(name="model_file_there")).ready
    assert_no_traceback(server.log())


def test_override_filename_outside_is_refused_before_any_open(tmp_path: Path, outside: Path, server_factory) -> None:
    """An absolute or `..` default_model_filename in a load's config override: refused before
    auto-complete reads anything, with the same answer whether the target exists or not."""
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    secret = outside / "model" / "1" / "model.onnx"
    server = server_factory(repo, "--model-control-mode", "explicit")
    answers = []
    with InferenceClient(server.url, timeout_s=60) as client:
        for there, missing in [
            ("/etc/passwd", "/etc/no_such_file"),
            (str(secret), str(secret.with_name("nothing.onnx"))),
            ("../../outside/model/1/model.onnx", "../../outside/model/1/nothing.onnx"),
        ]:
            for filename in (there, missing):
                with pytest.raises(ClientError) as caught:
                    client.load_model("m", config={"backend": "onnxruntime", "default_model_filename": filename})
                message = caught.value.message
                assert message.endswith(f"got {shown(filename)!r}"), message  # only what the client sent
                answers.append((caught.value.status, message.rpartition(", got ")[0]))
    assert len(set(answers)) == 1, "\n".join(map(str, answers))
    status, message = answers[0]
    assert status == grpc.StatusCode.INVALID_ARGUMENT  # a load that fails, as Triton answers it
    assert "default_model_filename must be a file name inside the version folder" in message
    assert "Protobuf" not in message and "not found" not in message
    assert_no_traceback(server.log())


def test_symlinks_inside_the_repository_still_work(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    shared = repo / ".shared"  # a hidden folder is no model
    copy_simple(shared, "simple")
    (shared / "identity_config.pbtxt").write_text(IDENTITY_CONFIG)
    (shared / "empty_version").mkdir()

    (repo / "linked_file" / "1").mkdir(parents=True)
    shutil.copy(shared / "simple" / "config.pbtxt", repo / "linked_file" / "config.pbtxt")
    (repo / "linked_file" / "1" / "model.onnx").symlink_to(Path("../../.shared/simple/1/model.onnx"))
    models.write_config(repo / "linked_version", IDENTITY_CONFIG)
    (repo / "linked_version" / "1").symlink_to(shared / "empty_version", target_is_directory=True)
    (repo / "linked_config" / "1").mkdir(parents=True)
    (repo / "linked_config" / "config.pbtxt").symlink_to(shared / "identity_config.pbtxt")
    server = server_factory(repo)
    assert {name: state for name, (state, _) in index_of(server.url).items()} == {
        "linked_file": "READY",
        "linked_version": "READY",
        "linked_config": "READY",
    }
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    x = np.arange(4, dtype=np.float32)
    with InferenceClient(server.url, timeout_s=60) as client:
        np.testing.assert_array_equal(client.infer("linked_file", {"INPUT0": a, "INPUT1": a})["OUTPUT0"], 2 * a)
        for name in ("linked_version", "linked_config"):
            np.testing.assert_array_equal(client.infer(name, {"IN": x})["OUT"], x)


def test_poll_mode_fingerprint_does_not_follow_symlinks_out(tmp_path: Path, outside: Path, server_factory) -> None:
    """Poll mode reads and stats only checked paths: a config.pbtxt symlinked out is refused on each
    scan and the poller keeps running (no traceback)."""
    repo = models.repository(tmp_path, "simple")
    (repo / "escape" / "1").mkdir(parents=True)
    (repo / "escape" / "config.pbtxt").symlink_to(outside / "identity_config.pbtxt")
    models.add_broken_models(repo)
    server = server_factory(
        repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2", "--exit-on-error", "false"
    )
    models.copy_example(repo, "mlp")  # a later scan must still work
    with InferenceClient(server.url, timeout_s=60) as client:
        assert wait_until(lambda: client.is_model_ready("mlp"))
        escape = [e for e in client.repository_index() if e.name == "escape"][0]
    assert escape.state == "UNAVAILABLE" and OUTSIDE in escape.reason
    log = server.log()
    assert_no_traceback(log)
    # Unchanged broken models are not retried on every scan (the scan that found mlp saw them first).
    assert log.count("model escape:") == 1 and log.count("model bad_syntax:") == 1, log


# -- item 2: no absolute server path in reasons or errors ---------------------------------------------


def test_reasons_and_errors_name_files_relative_to_the_repository(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    models.add_broken_models(repo)
    (repo / "no_file" / "1").mkdir(parents=True)
    (repo / "no_file" / "config.pbtxt").write_text(
        (models.EXAMPLES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"no_file"')
    )
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "*", "--exit-on-error", "false")
    index = index_of(server.url)
    assert index["bad_syntax"][1].startswith("bad_syntax/config.pbtxt:"), index["bad_syntax"]
    assert "no_file/1/model.onnx" in index["no_file"][1], index["no_file"]
    assert "corrupt_file/1/model.onnx" in index["corrupt_file"][1], index["corrupt_file"]
    messages = [reason for _, reason in index.values()]
    with InferenceClient(server.url, timeout_s=60) as client:
        # A load that fails: Triton's INVALID_ARGUMENT; a name that is no model folder's (missing, too
        # long, with a slash): its INTERNAL "failed to poll from model repository" (2.51, run here).
        codes = grpc.StatusCode
        for name, status in (
            ("bad_syntax", codes.INVALID_ARGUMENT),
            ("corrupt_file", codes.INVALID_ARGUMENT),
            ("no_file", codes.INVALID_ARGUMENT),
            ("a" * 10_000, codes.INTERNAL),
            ("a" * 255, codes.INTERNAL),
            ("b" * 255 + "/x", codes.INTERNAL),
        ):
            with pytest.raises(ClientError) as caught:
                client.load_model(name)
            assert caught.value.status == status, caught.value
            messages.append(caught.value.message)
    for message in messages:
        assert str(repo) not in message and str(repo.resolve()) not in message, message
        assert len(message) < 1000  # far below gRPC's 8 KB metadata limit
    assert all("failed to poll from model repository: no such model folder" in m for m in messages[-3:])
    assert_no_traceback(server.log())


# -- item 3: client mistakes answered with a clean status ---------------------------------------------


def test_a_version_string_that_is_no_number_is_refused(tmp_path: Path, server_factory) -> None:
    """'²' is a digit to str.isdigit but no integer: refused as 'abc' is, INVALID_ARGUMENT in Triton 2.51's
    words (run here), by ModelReady too; the rest as std::stol reads it: '01', ' 1' and '1abc' are version 1,
    '0' a version no model has."""
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo)
    client = triton.InferenceServerClient(server.url)
    try:
        for version in ("1", "01", " 1", "+1", "1abc", "0" * 5000 + "1"):
            assert client.is_model_ready("simple", version), version
            assert client.get_model_metadata("simple", version).versions == ["1"]  # the number, as Triton
        assert not client.is_model_ready("simple", "9") and not client.is_model_ready("simple", "0")
        data = np.zeros((1, 16), dtype=np.int32)
        inputs = [triton.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(data)
        for version, words in (
            ("²", "failed to get model version from specified version string '²' (details: stol), version should"),
            ("١", "failed to get model version from specified version string '١' (details: stol)"),
            ("abc", "failed to get model version from specified version string 'abc' (details: stol)"),
            ("-1", "invalid model version specified '-1' , version should be an integral value > 0"),
            ("9" * 19, "(details: stol)"),  # past 64 bits
            ("9" * 5000, "(details: stol)"),  # past what Python's int() reads: no INTERNAL
        ):
            for call in (
                functools.partial(client.infer, "simple", inputs, model_version=version),
                functools.partial(client.is_model_ready, "simple", version),
            ):
                with pytest.raises(InferenceServerException) as caught:
                    call()
                assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
                assert words in caught.value.message()
        for version, shown in (("9", "9"), ("0", "0"), ("00", "0")):
            with pytest.raises(InferenceServerException) as caught:
                client.infer("simple", inputs, model_version=version)
            assert caught.value.status() == "StatusCode.NOT_FOUND"
            assert caught.value.message() == f"Request for unknown model: 'simple' version {shown} is not found"
        assert client.infer("simple", inputs, model_version="1abc").as_numpy("OUTPUT0") is not None
    finally:
        client.close()
    assert_no_traceback(server.log())


def test_reshape_must_hold_as_many_elements_as_dims(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    for name, dims, reshape in [
        ("bad_count", "[ 4 ]", "[ 3 ]"),
        ("bad_runs", "[ 2, -1 ]", "[ -1, 2 ]"),
        ("good_variable", "[ -1, 4 ]", "[ -1, 2, 2 ]"),
    ]:
        models.write_config(
            repo / name,
            f"""
            backend: "identity"
            max_batch_size: 2
            input [ {{ name: "IN" data_type: TYPE_FP32 dims: {dims} reshape {{ shape: {reshape} }} }} ]
            output [ {{ name: "OUT" data_type: TYPE_FP32 dims: {dims} reshape {{ shape: {reshape} }} }} ]
            """,
        )
        (repo / name / "1").mkdir()
    server = server_factory(repo, "--strict-readiness", "false", "--exit-on-error", "false")
    index = index_of(server.url)
    assert index["good_variable"][0] == "READY"
    for name in ("bad_count", "bad_runs"):
        assert index[name][0] == "UNAVAILABLE" and "different size for dims" in index[name][1], index[name]
    x = np.arange(16, dtype=np.float32).reshape(2, 2, 4)
    with InferenceClient(server.url, timeout_s=60) as client:
        np.testing.assert_array_equal(client.infer("good_variable", {"IN": x})["OUT"], x)
        with pytest.raises(ClientError) as caught:
            client.infer("bad_count", {"IN": np.zeros((1, 4), dtype=np.float32)})
        assert caught.value.status == grpc.StatusCode.NOT_FOUND  # no version loaded: unknown to Triton
        assert caught.value.message == "Request for unknown model: 'bad_count' has no available versions"
    assert_no_traceback(server.log())


def test_load_config_parameter_must_be_a_json_object_in_a_string(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    models.write_config(repo / "m", IDENTITY_CONFIG)
    (repo / "m" / "1").mkdir()
    server = server_factory(repo, "--model-control-mode", "explicit")
    cases = [
        ("bytes_param", b"\xff\xfe not UTF-8", "expected string_param"),
        ("bytes_param", b"{}", "expected string_param"),  # as Triton: the config is text
        ("string_param", "[]", "must be a JSON object"),
        ("string_param", "7", "must be a JSON object"),
        ("string_param", "{not json", "not valid JSON"),
    ]
    with grpc.insecure_channel(server.url) as channel:
        stub = InferenceStub(channel)
        for kind, value, phrase in cases:
            request = pb.RepositoryModelLoadRequest(model_name="m")
            setattr(request.parameters["config"], kind, value)
            with pytest.raises(grpc.RpcError) as caught:
                stub.RepositoryModelLoad(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (value, caught.value.details())
            assert phrase in (caught.value.details() or ""), (value, caught.value.details())
        request = pb.RepositoryModelLoadRequest(model_name="m")
        request.parameters["config"].string_param = json.dumps(
            {
                "backend": "identity",
                "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}],
                "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
            }
        )
        stub.RepositoryModelLoad(request)  # a JSON object still loads
        assert stub.ModelReady(pb.ModelReadyRequest(name="m")).ready
    assert_no_traceback(server.log())


# -- item 4: no ONNX Runtime telemetry -----------------------------------------------------------------


def test_onnxruntime_writes_no_telemetry(tmp_path: Path, server_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)
    repo = models.repository(tmp_path, "simple")
    (repo / "broken" / "1").mkdir(parents=True)  # an ORT error message, as telemetry would record
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not a model")
    server = server_factory(repo, "--strict-readiness", "false", "--exit-on-error", "false")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with InferenceClient(server.url, timeout_s=60) as client:
        np.testing.assert_array_equal(client.infer("simple", {"INPUT0": a, "INPUT1": a})["OUTPUT0"], 2 * a)
    assert server.stop() == 0
    assert list(home.rglob("*")) == [], sorted(home.rglob("*"))


# -- item 5: memory budgets under concurrent loads -----------------------------------------------------


def test_memory_budget_holds_under_concurrent_loads(tmp_path: Path, server_factory) -> None:
    """Two loads at once whose sum passes the budget: exactly one loads, the other is refused."""
    repo = tmp_path / "repo"
    names = ("first", "second")
    for name in names:
        models.add_weighty_onnx(repo, name, 6)
    server = server_factory(repo, "--model-control-mode", "explicit", "--memory-budget-mb", "cpu=10")
    start = threading.Barrier(len(names))
    errors: dict[str, ClientError | None] = {}

    def load(name: str) -> None:
        with InferenceClient(server.url, timeout_s=120) as client:
            start.wait(timeout=30)
            try:
                client.load_model(name)
                errors[name] = None
            except ClientError as exc:
                errors[name] = exc

    threads = [threading.Thread(target=load, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(errors) == sorted(names)
    refused = [exc for exc in errors.values() if exc is not None]
    assert len(refused) == 1, errors
    assert refused[0].status == grpc.StatusCode.INVALID_ARGUMENT and "memory budget" in refused[0].message
    with InferenceClient(server.url, timeout_s=60) as client:
        assert sum(client.is_model_ready(name) for name in names) == 1
        held = sum(int(m["byte_size"]) for s in client.statistics() for m in s.get("memory_usage", []))
    assert 0 < held <= 10 * 2**20


# -- item 6: a model folder given as the repository; an empty repository ------------------------------


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.parametrize("command", ["serve", "check"])
def test_a_model_folder_given_as_the_repository(tmp_path: Path, command: str) -> None:
    repo = models.repository(tmp_path, "simple")
    without_config = copy_simple(repo, "bare")
    (without_config / "config.pbtxt").unlink()
    for folder in (repo / "simple", without_config):
        if command == "serve":
            result = run_cli(
                "serve",
                "--model-repository",
                str(folder),
                "--grpc-address",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--allow-metrics",
                "false",
            )
        else:
            result = run_cli("config", "check", str(folder))
        assert result.returncode != 0, result
        assert "pass its parent folder" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr, result.stderr


def test_an_empty_repository_gets_a_warning(tmp_path: Path, server_factory) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("config", "check", str(empty))
    assert "holds no model folders" in result.stderr, result.stderr
    server = server_factory(empty)
    assert "holds no model folders" in server.log()
