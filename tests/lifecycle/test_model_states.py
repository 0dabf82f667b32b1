"""The lifecycle state machine (lifecycle/state.py), its one teardown path, and the core's interface.

Unit tests: the manager runs in this process on ``asyncio.run``, without a server.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.core import Core
from shoal.core.local import LocalCore
from shoal.core.remote import RemoteCore
from shoal.errors import ErrorCode, ShoalError
from shoal.grpc import convert
from shoal.lifecycle.manager import ModelManager
from shoal.lifecycle.model import ModelVersion
from shoal.lifecycle.state import (
    TRANSITIONS,
    UNLOADED,
    IllegalTransition,
    Lifecycle,
    ModelEntry,
    ModelState,
    VersionEntry,
)
from shoal.protocol import service_pb2
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, Tensor
from tests import models
from tests.python_models import ADD_SUB, ADD_SUB_CONFIG, write_model

S = ModelState
# How each state is reached from UNKNOWN through allowed moves only.
PATHS = {
    S.UNKNOWN: [],
    S.LOADING: [S.LOADING],
    S.READY: [S.LOADING, S.READY],
    S.UNAVAILABLE: [S.LOADING, S.UNAVAILABLE],
    S.UNLOADING: [S.LOADING, S.READY, S.UNLOADING],
}


def _version_in(state: ModelState) -> VersionEntry:
    entry = VersionEntry(1)
    for step in PATHS[state]:
        if step is S.READY:
            entry.attach(object())  # type: ignore[arg-type]  # a stand-in: never served or closed
        entry.transition(step)
    return entry


def _model_in(state: ModelState) -> ModelEntry:
    entry = ModelEntry("m")
    for step in PATHS[state]:
        entry.transition(step)
    return entry


@pytest.mark.parametrize("make", [_version_in, _model_in], ids=["version", "model"])
@pytest.mark.parametrize(("source", "target"), list(itertools.product(ModelState, repeat=2)))
def test_every_move_in_the_table_is_allowed_and_every_other_refused(
    make: Callable[[ModelState], Lifecycle], source: ModelState, target: ModelState
) -> None:
    entry = make(source)
    assert entry.state is source
    if (source, target) in TRANSITIONS:
        if isinstance(entry, VersionEntry) and target is S.READY:
            entry.attach(object())  # type: ignore[arg-type]
        entry.transition(target, "why")
        assert entry.state is target and entry.reason == "why"
    else:
        with pytest.raises(IllegalTransition, match=f"{source.name} -> {target.name}"):
            entry.transition(target)
        assert entry.state is source


def test_the_table_is_triton_s_lifecycle() -> None:
    assert ModelEntry("m").state is S.UNKNOWN and VersionEntry(1).state is S.UNKNOWN
    assert {s for s, _ in TRANSITIONS} | {t for _, t in TRANSITIONS} == set(ModelState)
    assert not [t for s, t in TRANSITIONS if s is S.UNAVAILABLE], "a reload builds new entries"


def test_a_version_is_ready_only_with_a_loaded_model_and_stops_routing_when_detached() -> None:
    entry = _version_in(S.LOADING)
    with pytest.raises(IllegalTransition, match="READY without a loaded model"):
        entry.transition(S.READY)
    with pytest.raises(IllegalTransition, match="attach while UNKNOWN"):
        VersionEntry(2).attach(object())  # type: ignore[arg-type]
    ready = _version_in(S.READY)
    assert ready.detach() is not None and ready.served is None and ready.state is S.UNLOADING
    assert ready.detach() is None and ready.state is S.UNLOADING


@pytest.mark.parametrize("implementation", [LocalCore, RemoteCore])
def test_each_core_implements_the_protocol_s_members_with_its_signatures(implementation: type) -> None:
    def members(cls: type) -> dict[str, Any]:
        return {n: m for n, m in vars(cls).items() if not n.startswith("_")}

    for name, declared in members(Core).items():
        implemented = getattr(implementation, name)
        assert inspect.signature(declared) == inspect.signature(implemented), name
        if inspect.signature(declared).return_annotation in (None, "None") and name in ONE_WAY:
            continue  # a notice that crosses as a one-way message: nothing to wait for
        # Every call may cross a process boundary: a coroutine, or an async iterator (streamed responses).
        assert inspect.iscoroutinefunction(implemented) or inspect.isasyncgenfunction(implemented), name


# Core members that only tell the core something (no answer, called from a transport's done callback):
# plain methods returning None, sent on as one-way messages by RemoteCore.
ONE_WAY = {"sent"}


def test_the_remote_core_has_only_the_interface_and_its_channel() -> None:
    public = {n for n in vars(RemoteCore) if not n.startswith("_")}
    assert public - {n for n in vars(Core) if not n.startswith("_")} == {"connect", "started"}


# -- the manager: states, the one teardown path --------------------------------------------------------


@pytest.fixture
def closes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ModelVersion.close call, by model name (the real close still runs)."""
    calls: list[str] = []
    original = ModelVersion.close

    async def counted(self: ModelVersion) -> None:
        calls.append(self.spec.name)
        await original(self)

    monkeypatch.setattr(ModelVersion, "close", counted)
    yield calls


def _identity(repo: Path, name: str) -> None:
    models.add_identity(repo, name, "FP32")


def _onnx_two_copies(repo: Path, name: str) -> int:
    """y = x + w with a 1 MB weight, two unshared copies: counted 2 MB after the load, 1 MB before."""
    models.add_weighty_onnx(
        repo, name, 1, instances=2, extra='parameters { key: "share_weights" value: { string_value: "false" } }'
    )
    return (repo / name / "1" / "model.onnx").stat().st_size


def _rows(manager: ModelManager, name: str) -> list[tuple[str, ModelState, str]]:
    return [(r.version, r.state, r.reason) for r in manager.index() if r.name == name]


def test_states_through_load_unload_and_shutdown(tmp_path: Path, closes: list[str]) -> None:
    repo = tmp_path / "repo"
    for name in ("a", "b"):
        _identity(repo, name)
    models.write_config(
        repo / "broken",
        """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        """,
    )  # the backend refuses it: a version that fails to load
    (repo / "broken" / "1").mkdir()

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        await manager.start(("a",))
        assert _rows(manager, "a") == [("1", S.READY, "")]
        assert _rows(manager, "b") == [("", S.UNKNOWN, "")]  # in the repository, never loaded
        assert manager.all_ready()
        with pytest.raises(ShoalError, match="load failed for model 'broken'"):
            await manager.load("broken")
        assert _rows(manager, "broken")[0][1] is S.UNAVAILABLE and not manager.all_ready()
        await manager.unload("broken")  # unloaded on purpose: readiness stops waiting for it
        assert manager.all_ready() and closes == []
        core = LocalCore(manager)
        ones = np.ones((1, 3), np.float32)
        request = InferRequest("a", "", "7", (Tensor("IN", DataType.FP32, (1, 3), ones),))
        [output] = (await core.infer(request)).outputs
        np.testing.assert_array_equal(output.data, ones)
        await manager.unload("a")
        assert _rows(manager, "a") == [("1", S.UNAVAILABLE, UNLOADED)] and manager.all_ready()
        assert manager.entry("a").state is S.UNAVAILABLE and closes == ["a"]
        with pytest.raises(ShoalError, match="version 1 is not at ready state"):
            manager.resolve("a", "1")
        await manager.load("a")
        override = {**manager.resolve("a", "").spec.config_json, "max_batch_size": 4}
        await manager.load("a", override)  # a reload: the previous load is released
        assert closes == ["a", "a"] and manager.resolve("a", "").spec.max_batch_size == 4
        await manager.close()
        assert closes == ["a", "a", "a"] and manager.entry("a").state is S.UNAVAILABLE

    asyncio.run(scenario())


def test_a_budget_refusal_after_load_releases_through_model_version_close(tmp_path: Path, closes: list[str]) -> None:
    repo = tmp_path / "repo"
    size = _onnx_two_copies(repo, "twice")
    _identity(repo, "small")

    async def scenario() -> None:
        manager = ModelManager(repo, memory_budgets={"cpu": size * 3 // 2})  # one copy fits, two do not
        await manager.start()
        [(version, state, reason)] = _rows(manager, "twice")
        assert state is S.UNAVAILABLE and "memory budget: model 'twice' needs 2.0 MB on cpu" in reason
        assert closes == ["twice"] and not any(manager.memory_in_use().values())
        assert manager.resolve("small", "").spec.name == "small"  # the other model is untouched
        await manager.close()
        assert closes == ["twice", "small"]

    asyncio.run(scenario())


def test_a_failed_reload_releases_nothing_and_keeps_the_old_version_serving(tmp_path: Path, closes: list[str]) -> None:
    repo = tmp_path / "repo"
    _identity(repo, "a")

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        await manager.load("a")
        with pytest.raises(ShoalError) as caught:
            await manager.load("a", {"backend": "identity", "input": [{"name": "IN", "data_type": "TYPE_FP32"}]})
        assert caught.value.code is ErrorCode.INVALID_ARGUMENT  # Triton's "load failed for model 'a': ..."
        assert manager.entry("a").state is S.READY and "reload failed" in manager.entry("a").reason
        assert closes == [] and manager.resolve("a", "1").spec.name == "a"
        await manager.close()

    asyncio.run(scenario())


# -- the load override: JSON decoded at the edge, a ModelConfig in the config pipeline -------------------


def _load_request(config: str) -> service_pb2.RepositoryModelLoadRequest:
    request = service_pb2.RepositoryModelLoadRequest(model_name="m")
    request.parameters["config"].string_param = config
    return request


def test_the_transport_decodes_the_override_to_a_plain_dict() -> None:
    assert convert.load_parameters(_load_request('{"max_batch_size": 4}')) == {"max_batch_size": 4}
    assert convert.load_parameters(service_pb2.RepositoryModelLoadRequest(model_name="m")) is None
    for text, phrase in [("not json", "is not valid JSON"), ("[]", "must be a JSON object"), ("7", "got a JSON int")]:
        with pytest.raises(ShoalError, match=phrase) as caught:
            convert.load_parameters(_load_request(text))
        assert caught.value.code is ErrorCode.INVALID_ARGUMENT and "failed to load 'm'" in caught.value.message


def test_the_manager_turns_the_dict_into_a_model_config(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _identity(repo, "a")

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        for override, phrase in [
            ({"name": "other"}, "names model 'other'"),
            ({"max_batch_size": "many"}, "not a valid ModelConfig"),
        ]:
            with pytest.raises(ShoalError, match=phrase) as caught:
                await manager.load("a", override)
            assert caught.value.code is ErrorCode.INVALID_ARGUMENT
        assert manager.names() == []  # refused before anything was built

    asyncio.run(scenario())


def test_the_manager_touches_no_protobuf() -> None:
    """protobuf stays in the transports and the config pipeline."""
    source = models.REPO_ROOT / "server" / "shoal" / "lifecycle" / "manager.py"
    imported = {
        alias.name
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module or "" for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.ImportFrom)
    }
    assert not {m for m in imported if m.startswith(("shoal.protocol", "google.protobuf"))}, imported


def test_unloading_a_model_whose_config_failed_gives_readiness_back(tmp_path: Path) -> None:
    """A client's load of a model whose config.pbtxt does not parse leaves no version (and no spec)
    behind; the server is not ready while it waits for it. Its unload answers OK and readiness comes
    back (the unload answered OK and left the server not ready for good)."""
    repo = tmp_path / "repo"
    _identity(repo, "a")
    models.write_config(repo / "bad", "max_batch_size: [ broken")
    (repo / "bad" / "1").mkdir()

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        await manager.start(("a",))
        with pytest.raises(ShoalError):
            await manager.load("bad")
        assert not manager.all_ready()
        await manager.unload("bad")
        assert manager.all_ready() and _rows(manager, "bad") == [("", S.UNAVAILABLE, UNLOADED)]
        await manager.close()

    asyncio.run(scenario())


def test_a_version_still_loading_is_not_ready_rather_than_unknown(tmp_path: Path, monkeypatch) -> None:
    """While a reload builds version 2, a request naming it is told UNAVAILABLE "is not at ready state",
    as Triton 2.51 answers (it lists the version LOADING); a version no load chooses stays NOT_FOUND."""
    repo = tmp_path / "repo"
    _identity(repo, "m")
    entered, release = threading.Event(), threading.Event()
    real = ModelManager._load_within_budget

    def held(spec: Any, folder: Path, version: int, *args: Any) -> Any:
        if version == 2:
            entered.set()
            release.wait(60)
        return real(spec, folder, version, *args)

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        await manager.start(("m",))
        (repo / "m" / "2").mkdir()
        monkeypatch.setattr(ModelManager, "_load_within_budget", staticmethod(held))
        loading = asyncio.ensure_future(manager.load("m"))
        try:
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 60)
            with pytest.raises(ShoalError) as caught:
                manager.resolve("m", "2")
            assert caught.value.code is ErrorCode.UNAVAILABLE
            assert caught.value.message == "Request for unknown model: 'm' version 2 is not at ready state"
            with pytest.raises(ShoalError) as caught:
                manager.resolve("m", "3")
            assert caught.value.code is ErrorCode.MODEL_NOT_FOUND
        finally:
            release.set()
            await loading
        assert manager.resolve("m", "2").version == 2
        await manager.close()

    asyncio.run(scenario())


FAILING_INITIALIZE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("version two cannot start")

    def execute(self, requests):
        return []
"""


def test_a_version_a_failed_reload_tried_is_shown_unavailable_beside_the_served_one(tmp_path: Path) -> None:
    """Review of session 49: after a reload whose new version failed, Triton 2.51 lists that version
    UNAVAILABLE with its error beside the one still served (reason ""), and a request naming it is
    UNAVAILABLE "not at ready state". Shoal listed only the served version, with the failure as its
    reason, and answered the named version NOT_FOUND. A later good reload lists what it serves."""
    repo = tmp_path / "repo"
    folder = write_model(
        repo, "m", ADD_SUB_CONFIG.format(delay_us=0, count=1, extra="version_policy: { all { } }"), ADD_SUB
    )

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        await manager.load("m")
        (folder / "2").mkdir()
        (folder / "2" / "model.py").write_text(FAILING_INITIALIZE)
        with pytest.raises(ShoalError) as refused:
            await manager.load("m")
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT and "version 2" in refused.value.message
        rows = [(row.version, row.state, row.reason) for row in manager.index()]
        assert rows[0] == ("1", S.READY, "")
        assert rows[1][:2] == ("2", S.UNAVAILABLE) and "version two cannot start" in rows[1][2]
        with pytest.raises(ShoalError) as named:
            manager.resolve("m", "2")
        assert named.value.code is ErrorCode.UNAVAILABLE
        assert named.value.message == "Request for unknown model: 'm' version 2 is not at ready state"
        assert manager.resolve("m", "").version == 1
        assert not manager.all_ready()  # strict readiness: Triton's ServerReady is false while v2 is listed
        assert [served.version for served in manager.statistics("m", "")] == [1]

        (folder / "2" / "model.py").unlink()
        (folder / "2").rmdir()
        await manager.load("m")
        assert [(row.version, row.state) for row in manager.index()] == [("1", S.READY)]
        assert manager.all_ready()
        await manager.close()

    asyncio.run(scenario())


def test_a_version_whose_teardown_fails_leaves_the_others_to_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of session 50 (F2): one model's close raising (a process instance whose restart the
    system had refused) stopped the server's shutdown there: the models after it were never unloaded,
    their ``finalize`` never ran. Each version's teardown now runs whatever the others' do."""
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        _identity(repo, name)
    closed: list[str] = []
    original = ModelVersion.close

    async def failing_for_b(self: ModelVersion) -> None:
        if self.spec.name == "b":
            raise AssertionError("can only join a started process")
        await original(self)
        closed.append(self.spec.name)

    monkeypatch.setattr(ModelVersion, "close", failing_for_b)

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        for name in ("a", "b", "c"):
            await manager.load(name)
        await manager.close()
        assert [(row.name, row.state) for row in manager.index()] == [(n, S.UNAVAILABLE) for n in ("a", "b", "c")]

    asyncio.run(scenario())
    assert closed == ["a", "c"]


def test_a_load_failing_with_an_unexpected_error_fails_that_model_only_at_start(tmp_path: Path) -> None:
    """Review of session 50 (F4): an error of Shoal's own in one model's load (a JSONDecodeError there)
    ended the server's start, ``--exit-on-error false`` notwithstanding: ``start`` let anything but a
    ShoalError through. That model now fails (its failure logged with an incident id), the others load."""
    repo = tmp_path / "repo"
    for name in ("a", "b", "c"):
        _identity(repo, name)
    manager = ModelManager(repo, control_mode="none")
    build = manager._build

    def failing_for_b(entry: ModelEntry, *args: Any) -> Any:
        if entry.name == "b":
            raise ValueError("Expecting value: line 1 column 1 (char 0)")
        return build(entry, *args)

    manager._build = failing_for_b  # type: ignore[method-assign]

    async def scenario() -> None:
        failures = await manager.start()
        assert list(failures) == ["b"] and "internal error (incident" in failures["b"]
        assert manager.is_ready("a", "") and manager.is_ready("c", "") and not manager.is_ready("b", "")
        await manager.close()

    asyncio.run(scenario())


def test_a_poll_past_a_model_whose_configuration_fails_unexpectedly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of session 50: in poll mode an unexpected error reading one model's configuration (its
    ``auto_complete_config`` child printing non-UTF-8) ended the poll there: the models after it never
    loaded, and it was read again every poll. It is now that model's failed load (the reason carries
    an incident id; the log has the traceback), the poll goes on, and the next poll leaves it until
    its folder changes."""
    from shoal.lifecycle import manager as manager_module

    repo = tmp_path / "repo"
    for name in ("a", "b"):
        _identity(repo, name)
    read: list[str] = []
    original = manager_module.configure

    def configure(folder: Path, *args: Any, **kwargs: Any) -> Any:
        read.append(folder.name)
        if folder.name == "a":
            raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")
        return original(folder, *args, **kwargs)

    monkeypatch.setattr(manager_module, "configure", configure)

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="poll")
        await manager.poll_once()
        assert manager.is_ready("b", "") and not manager.is_ready("a", "")
        (row,) = [row for row in manager.index() if row.name == "a"]
        assert row.state is S.UNAVAILABLE and "internal error (incident" in row.reason
        await manager.poll_once()
        assert read == ["a", "b"]  # nothing changed: nothing read again
        await manager.close()

    asyncio.run(scenario())


def test_poll_mode_forgets_a_failed_reload_once_the_folder_is_back(tmp_path: Path) -> None:
    """Review of session 50 (50d): in poll mode, a broken version added and then removed left its
    failed row, and with it strict readiness false, for good (the folder was what served again, so no
    poll reloaded). The poll that finds the folder back drops the row; explicit mode's reload did."""
    repo = tmp_path / "repo"
    folder = write_model(
        repo, "m", ADD_SUB_CONFIG.format(delay_us=0, count=1, extra="version_policy: { all { } }"), ADD_SUB
    )

    async def scenario() -> None:
        manager = ModelManager(repo, control_mode="poll")
        await manager.poll_once()
        assert manager.all_ready()
        (folder / "2").mkdir()
        (folder / "2" / "model.py").write_text(FAILING_INITIALIZE)
        await manager.poll_once()
        assert not manager.all_ready() and [row.version for row in manager.index()] == ["1", "2"]
        (folder / "2" / "model.py").unlink()
        (folder / "2").rmdir()
        await manager.poll_once()
        assert [(row.version, row.state, row.reason) for row in manager.index()] == [("1", S.READY, "")]
        assert manager.all_ready() and manager.resolve("m", "").version == 1
        await manager.close()

    asyncio.run(scenario())
