"""The repository scan and the command line's aliases (issue 25): a top-level symlink to a model folder
outside the repository, and Triton's flag aliases, read as a hostile user would."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from shoal.cli import build_parser
from shoal.clients import ClientError, InferenceClient
from shoal.errors import ShoalError
from shoal.lifecycle.fingerprint import fingerprint_of
from shoal.repository import scanner
from tests import models
from tests.conftest import RunningServer, start_server
from tests.polling import wait_until

ADD_CONFIG = """
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
MTIME_NS = 1_700_000_000_000_000_000  # what an image or archive that normalizes timestamps gives every file


def _add_model(folder: Path, addend: float, version: int = 1) -> None:
    """OUT = IN + addend, its model file as long as any other addend's, its mtime fixed."""
    models.write_config(folder, ADD_CONFIG)
    weight = numpy_helper.from_array(np.full(4, addend, dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Add", ["IN", "W"], ["OUT"])],
        "add",
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [4])],
        [weight],
    )
    models.save_onnx(graph, folder / str(version) / "model.onnx")
    for path in (folder / "config.pbtxt", folder / str(version) / "model.onnx"):
        os.utime(path, ns=(MTIME_NS, MTIME_NS))


def _retarget(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` in one step, as Kubernetes' atomic writer swaps its ``..data`` link."""
    fresh = link.with_name(f".{link.name}.new")
    fresh.symlink_to(target, target_is_directory=True)
    os.replace(fresh, link)


def _linked_layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    repo, store = tmp_path / "repo", tmp_path / "store"
    repo.mkdir()
    _add_model(store / "one", 1.0)
    _add_model(store / "two", 2.0)
    assert (store / "one" / "1" / "model.onnx").stat().st_size == (store / "two" / "1" / "model.onnx").stat().st_size
    (repo / "add").symlink_to(store / "one", target_is_directory=True)
    return repo, store / "one", store / "two"


def test_a_retargeted_top_level_link_is_a_change(tmp_path: Path) -> None:
    """A top-level link now pointing at another model folder is another model, even where that
    folder's config reads the same and its files have the same names, sizes and mtimes."""
    repo, _, two = _linked_layout(tmp_path)
    before = fingerprint_of(scanner.model_dir(repo, "add"))
    _retarget(repo / "add", two)
    assert fingerprint_of(scanner.model_dir(repo, "add")) != before


def test_poll_mode_serves_the_new_target_of_a_retargeted_link(tmp_path: Path) -> None:
    repo, _, two = _linked_layout(tmp_path)
    server = start_server(repo, tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    x = np.zeros(4, dtype=np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 1)
            _retarget(repo / "add", two)
            wait_until(
                lambda: client.infer("add", {"IN": x})["OUT"][0] == 2.0,
                timeout_s=15,
                what="the poller to serve the link's new target",
            )
    finally:
        server.stop()


def test_a_model_file_replaced_by_one_of_the_same_size_and_mtime_is_reloaded(tmp_path: Path) -> None:
    """Found by the review of session 48: ``cp -p``, ``rsync -a`` or a reproducible archive put new
    weights in place with the old size and mtime; the reload kept the old version serving them."""
    repo = tmp_path / "repo"
    _add_model(repo / "add", 1.0)
    _add_model(tmp_path / "next", 2.0)  # the same size and mtime
    server = start_server(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "add")
    x = np.zeros(4, dtype=np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 1)
            before = fingerprint_of(scanner.model_dir(repo, "add"))
            os.replace(tmp_path / "next" / "1" / "model.onnx", repo / "add" / "1" / "model.onnx")
            assert (repo / "add" / "1" / "model.onnx").stat().st_mtime_ns == MTIME_NS
            client.load_model("add")
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 2)
            assert fingerprint_of(scanner.model_dir(repo, "add")).version(1) != before.version(1)
    finally:
        server.stop()


def test_another_file_of_the_model_folder_reloads_every_version(tmp_path: Path) -> None:
    """Found by the review of session 48: a sequence model's ``initial_state/`` data changed, and the
    reload kept serving the old state (the fingerprint saw only config.pbtxt and the version folders)."""
    from tests.sequence_models import add_state_only

    repo = tmp_path / "repo"
    add_state_only(repo, "seq", 10.0)
    server = start_server(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "seq")
    one = np.ones(1, dtype=np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            first = client.infer("seq", {"INPUT": one}, parameters=_whole_sequence(1))
            assert first["OUTPUT"].tolist() == [11.0]
            before = fingerprint_of(scanner.model_dir(repo, "seq"))
            (repo / "seq" / "initial_state" / "start.bin").write_bytes(struct.pack("<f", 100.0))
            client.load_model("seq")
            again = client.infer("seq", {"INPUT": one}, parameters=_whole_sequence(2))
            assert again["OUTPUT"].tolist() == [101.0]
            after = fingerprint_of(scanner.model_dir(repo, "seq"))
            assert after.versions == before.versions  # the version folder alone did not change
    finally:
        server.stop()


def _whole_sequence(sequence_id: int) -> dict[str, bool | int | float | str]:
    return {"sequence_id": sequence_id, "sequence_start": True, "sequence_end": True}


@pytest.mark.parametrize(
    "argv",
    [
        ["--model-store=/a", "--model-repository=/b"],
        ["--model-repository=/a", "--model-store=/b"],
        ["--model-repository", "/a", "--model-repository", "/b"],
    ],
)
def test_a_second_repository_is_refused_not_dropped(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Triton serves every --model-repository/--model-store it is given; Shoal serves one, so a
    second must be refused, not silently replace the first."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", *argv])
    assert caught.value.code == 2
    assert "one model repository" in capsys.readouterr().err


def test_one_repository_flag_still_parses() -> None:
    for flag in ("--model-store", "--model-repository"):
        assert str(build_parser().parse_args(["serve", f"{flag}=/mnt/models"]).model_repository) == "/mnt/models"


@pytest.mark.parametrize(
    ("target", "phrase"),
    [
        ("repository", "the repository itself or a folder holding it"),
        ("above", "the repository itself or a folder holding it"),
        ("version", "a folder inside the repository below its top level"),
    ],
)
def test_a_skipped_top_level_link_is_skipped_in_words(
    tmp_path: Path, target: str, phrase: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Links out of the repository are model folders now: the skip warning must not say "it points
    outside the repository" for a link it skips for another reason, and must say which."""
    repo = tmp_path / "repo"
    (repo / "good" / "1").mkdir(parents=True)
    destination = {"repository": repo, "above": tmp_path, "version": repo / "good" / "1"}[target]
    (repo / "escape").symlink_to(destination, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        assert scanner.list_models(repo) == ["good"]
    assert "'escape'" in caplog.text and phrase in caplog.text, caplog.text
    assert "points outside the repository" not in caplog.text, caplog.text


def test_a_file_behind_a_symlinked_subfolder_is_checked_too(tmp_path: Path) -> None:
    """``1/sub -> ../data`` stays inside the model folder, but ``data/w.bin -> secret`` below it points
    outside: the version is refused, as a direct link would be (the walk once stopped at symlinked folders)."""
    repo, secret = tmp_path / "repo", tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    _add_model(repo / "m", 1.0)
    (repo / "m" / "data").mkdir()
    (repo / "m" / "data" / "w.bin").symlink_to(secret)
    (repo / "m" / "1" / "sub").symlink_to(Path("..") / "data", target_is_directory=True)
    with pytest.raises(ShoalError, match="is not a path inside the model repository"):
        scanner.checked_version_dir(repo / "m", 1)
    (repo / "m" / "data" / "w.bin").unlink()
    (repo / "m" / "data" / "w.bin").write_bytes(b"fine")
    (repo / "m" / "data" / "loop").symlink_to(Path("..") / "1", target_is_directory=True)  # a loop: it ends
    assert scanner.checked_version_dir(repo / "m", 1) == (repo / "m" / "1").resolve()


def test_a_config_giving_only_the_platform_is_completed_from_the_model_file(tmp_path: Path) -> None:
    """Found while writing a test in session 48: ``platform: "onnxruntime_onnx"`` with no inputs listed
    failed to load ("no platform or backend set"), where Triton completes it from the model file."""
    from shoal.configuring.pipeline import configure

    folder = tmp_path / "repo" / "add"
    _add_model(folder, 1.0)
    models.write_config(folder, 'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n')
    spec = configure(folder, strict=False).spec
    assert [tensor.name for tensor in spec.inputs] == ["IN"] and [tensor.name for tensor in spec.outputs] == ["OUT"]


def _serving_every_version(repo: Path, tmp_path: Path, addends: dict[int, float]) -> RunningServer:
    """Model ``add`` with a version per addend (OUT = IN + addend), every version served (explicit mode)."""
    for version, addend in addends.items():
        _add_model(repo / "add", addend, version=version)
    (repo / "add" / "config.pbtxt").write_text(ADD_CONFIG + "version_policy { all { } }\n")
    return start_server(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "add")


def test_a_reload_in_which_a_version_fails_fails_whole_and_every_version_serves_on(tmp_path: Path) -> None:
    """Found by the review of session 48: with version 2 broken, the reload answered OK, dropped version 2's
    serving copy, and requests naming no version moved to version 1. Triton fails such a load whole."""
    repo = tmp_path / "repo"
    server = _serving_every_version(repo, tmp_path, {1: 100.0, 2: 200.0})
    x = np.zeros(4, dtype=np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 200)
            (repo / "add" / "2" / "model.onnx").write_bytes(b"not a model")
            with pytest.raises(ClientError, match="load failed for model .add.: version 2 is at UNAVAILABLE state"):
                client.load_model("add")
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 200)
            np.testing.assert_array_equal(client.infer("add", {"IN": x}, version="1")["OUT"], x + 100)
    finally:
        server.stop()


def test_a_dangling_link_or_a_hard_link_or_a_chmod_in_a_model_folder_changes_nothing(tmp_path: Path) -> None:
    """Found by the review of the fingerprint's fix: an editor's lock file (a dangling link) beside
    config.pbtxt stopped the server at start; a hard link (``shoal config tune`` links the model's files)
    or a chmod moved the change time the fingerprint then read, and poll mode rebuilt every version."""
    repo = tmp_path / "repo"
    _add_model(repo / "add", 1.0)
    (repo / "add" / ".#config.pbtxt").symlink_to("user@host.4242:1765000000")  # dangling, as Emacs leaves it
    before = fingerprint_of(scanner.model_dir(repo, "add"))
    model_file = repo / "add" / "1" / "model.onnx"
    os.link(model_file, tmp_path / "linked.onnx")
    model_file.chmod(0o600)
    (repo / "add" / "config.tuned.pbtxt").write_text("tuned")  # `shoal config tune`'s output, never read
    assert fingerprint_of(scanner.model_dir(repo, "add")) == before
    (tmp_path / "linked.onnx").unlink()
    assert fingerprint_of(scanner.model_dir(repo, "add")) == before


def test_poll_mode_does_not_retry_a_reload_that_failed_until_the_folder_changes(tmp_path: Path) -> None:
    """Found by the same review: a reload failing whole kept the old fingerprint, so every poll built,
    warmed and let go the good versions again."""
    import asyncio

    from shoal.lifecycle.manager import ModelManager

    repo = tmp_path / "repo"
    _add_model(repo / "add", 100.0, version=1)
    _add_model(repo / "add", 200.0, version=2)
    (repo / "add" / "config.pbtxt").write_text(ADD_CONFIG + "version_policy { all { } }\n")
    manager = ModelManager(repo, control_mode="poll")
    builds: list[str] = []
    build = manager._build

    def counted(*args: object) -> object:
        builds.append("built")
        return build(*args)  # type: ignore[arg-type]

    manager._build = counted  # type: ignore[method-assign]

    async def main() -> None:
        await manager.poll_once()
        (repo / "add" / "2" / "model.onnx").write_bytes(b"not a model")
        await manager.poll_once()  # fails whole: version 2 served
        await manager.poll_once()
        await manager.poll_once()
        assert manager.resolve("add", "").version == 2  # the old entry serves on
        _add_model(repo / "add", 300.0, version=2)  # changed again: tried again
        await manager.poll_once()
        assert manager.resolve("add", "").version == 2
        await manager.close()

    asyncio.run(main())
    assert builds == ["built"] * 3


def test_a_load_with_a_broken_version_fails_whole_and_the_serving_versions_go_on(tmp_path: Path) -> None:
    """Triton fails a load in which any version fails (model_lifecycle.cc OnLoadComplete): a reload
    that adds a broken version, or changes another beside it, is refused whole, naming the broken
    version, and every version that served goes on serving as it was, until the broken one is mended."""
    repo = tmp_path / "repo"
    server = _serving_every_version(repo, tmp_path, {1: 100.0})
    x = np.zeros(4, dtype=np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            (repo / "add" / "2").mkdir()
            (repo / "add" / "2" / "model.onnx").write_bytes(b"not a model")
            with pytest.raises(ClientError, match="version 2 is at UNAVAILABLE state: ") as refused:
                client.load_model("add")
            assert refused.value.status == grpc.StatusCode.INVALID_ARGUMENT and "version 1" not in refused.value.message
            _add_model(tmp_path / "next", 150.0)
            os.replace(tmp_path / "next" / "1" / "model.onnx", repo / "add" / "1" / "model.onnx")
            with pytest.raises(ClientError, match="version 2 is at UNAVAILABLE state: "):
                client.load_model("add")
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 100)  # as it was
            assert not client.is_model_ready("add", "2")
            _add_model(repo / "add", 200.0, version=2)  # mended
            (repo / "add" / "config.pbtxt").write_text(ADD_CONFIG + "version_policy { all { } }\n")
            client.load_model("add")
            np.testing.assert_array_equal(client.infer("add", {"IN": x}, version="1")["OUT"], x + 150)
            np.testing.assert_array_equal(client.infer("add", {"IN": x})["OUT"], x + 200)
    finally:
        server.stop()


def test_a_first_load_with_a_broken_version_serves_none_of_its_versions(tmp_path: Path) -> None:
    """At a first load too, one broken version fails the model whole (Triton unloads the versions that
    loaded beside it): none serves, the index says why for each version, and the log says which failed."""
    repo = tmp_path / "repo"
    _add_model(repo / "add", 100.0, version=1)
    (repo / "add" / "2").mkdir()
    (repo / "add" / "2" / "model.onnx").write_bytes(b"not a model")
    (repo / "add" / "config.pbtxt").write_text(ADD_CONFIG + "version_policy { all { } }\n")
    _add_model(repo / "other", 7.0)
    server = start_server(repo, tmp_path, "--exit-on-error", "false", "--strict-readiness", "false")
    x = np.zeros(4, dtype=np.float32)
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            assert not client.is_model_ready("add") and not client.is_model_ready("add", "1")
            with pytest.raises(ClientError) as refused:
                client.infer("add", {"IN": x}, version="1")
            assert refused.value.status == grpc.StatusCode.UNAVAILABLE
            rows = {(row.name, row.version): row for row in client.repository_index()}
            assert rows["add", "1"].state == "UNAVAILABLE" and rows["add", "1"].reason == "unloaded"
            assert rows["add", "2"].state == "UNAVAILABLE" and "ONNX Runtime cannot load" in rows["add", "2"].reason
            np.testing.assert_array_equal(client.infer("other", {"IN": x})["OUT"], x + 7)  # the others serve
    finally:
        server.stop()
    assert "load failed for model 'add': version 2 is at UNAVAILABLE state: " in (tmp_path / "server.log").read_text()
