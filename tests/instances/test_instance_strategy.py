"""The instance strategy: which executors a version gets for which parameters and backend hooks,
what it refuses, what it loads and reports, and that only the backends know a framework."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import numpy as np
import pytest

from shoal.backends import base
from shoal.backends.base import Backend
from shoal.backends.devices import CPU, Device
from shoal.errors import ErrorCode, ShoalError
from shoal.instances import strategy
from shoal.instances.pool import Placement
from shoal.instances.process import DEFAULT_LIVENESS_INTERVAL_S, WorkerLimits
from shoal.instances.strategy import InstancePlan, Strategy
from shoal.lifecycle.model import ModelVersion
from shoal.repository.config import ModelSpec, normalize, parse_config, to_spec, validate
from tests.instances.test_instances import spec_of
from tests.models import REPO_ROOT

GPU0, GPU1 = Device("gpu", 0), Device("gpu", 1)


def spec_with(backend: str, **parameters: str) -> ModelSpec:
    lines = "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n' for key, value in parameters.items()
    )
    return spec_of(backend, lines)


class Copy:
    """A loaded copy that records what happens to it."""

    def __init__(self, device: Device, weight_bytes: int, log: list[str]) -> None:
        self.device, self.weight_bytes, self.log, self.shared = device, weight_bytes, log, False

    def run(self, inputs, outputs):  # pragma: no cover - not executed here
        return {}

    def close(self) -> None:
        self.log.append(f"close copy {self.device}")


def fake_backend(log: list[str], processes: bool, weight_bytes: int = 100) -> Backend:
    """A backend module with ``load``, and with the process hooks when ``processes``."""
    module = types.ModuleType("fake_backend")

    def load(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> Copy:
        log.append(f"load {device}")
        return Copy(device, weight_bytes, log)

    module.load = load  # type: ignore[attr-defined]
    module.gpu_available = lambda: False  # type: ignore[attr-defined]
    if processes:

        def share_weights(copy: Copy) -> str:
            log.append(f"share {copy.device}")
            return f"handle of {copy.device}"

        module.share_weights = share_weights  # type: ignore[attr-defined]
        module.attach = lambda *args: pytest.fail("attach runs in a worker process")  # type: ignore[attr-defined]
        module.WORKER_PRELOAD = ("fake_framework",)  # type: ignore[attr-defined]
    return Backend("fake", base.Declared("fake_backend", process_instances=processes), module)


# -- the choice ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, Strategy.THREADS),
        ({"share_weights": "TRUE"}, Strategy.THREADS),
        ({"share_weights": "false"}, Strategy.COPIES),
        ({"process_instances": "true"}, Strategy.PROCESSES),
        ({"process_instances": "true", "share_weights": "false"}, Strategy.PROCESSES),  # workers exist to share
        ({"process_instances": "false", "share_weights": "false"}, Strategy.COPIES),
    ],
)
def test_the_parameters_choose_the_strategy(parameters: dict[str, str], expected: Strategy) -> None:
    plan = strategy.choose(spec_with("fake", **parameters), fake_backend([], processes=True))
    assert plan.strategy is expected
    assert (plan.limits is not None) == (expected is Strategy.PROCESSES)


def test_worker_limits_come_from_the_parameters() -> None:
    backend = fake_backend([], processes=True)
    plan = strategy.choose(spec_with("fake", process_instances="true"), backend)
    assert plan.limits == WorkerLimits(0.0, DEFAULT_LIVENESS_INTERVAL_S)
    plan = strategy.choose(
        spec_with("fake", process_instances="true", execution_timeout_ms="250", liveness_check_interval_ms="0"), backend
    )
    assert plan.limits == WorkerLimits(0.25, 0.0)


@pytest.mark.parametrize(
    ("parameters", "processes", "message"),
    [
        ({"process_instances": "true"}, False, "model 'm': process_instances needs the pytorch backend"),
        ({"execution_timeout_ms": "100"}, True, "parameter execution_timeout_ms needs process_instances: true"),
        (
            {"liveness_check_interval_ms": "0", "process_instances": "false"},
            True,
            "parameter liveness_check_interval_ms needs process_instances: true",
        ),
        ({"share_weights": "no"}, True, "parameter share_weights must be true or false"),
        ({"process_instances": "1"}, True, "parameter process_instances must be true or false"),
        (
            {"process_instances": "true", "execution_timeout_ms": "1.5"},
            True,
            "parameter execution_timeout_ms must be a whole number of milliseconds",
        ),
        # Review of session 50 (F6): "²" passed str.isdigit, then failed the load as an unexpected error;
        # an interval past what a timer can wait killed the liveness watchdog (OverflowError).
        (
            {"process_instances": "true", "execution_timeout_ms": "²"},
            True,
            "parameter execution_timeout_ms must be a whole number of milliseconds",
        ),
        (
            {"process_instances": "true", "liveness_check_interval_ms": "99999999999999999999"},
            True,
            "parameter liveness_check_interval_ms must be a whole number of milliseconds, at most 2147483647",
        ),
    ],
)
def test_what_cannot_be_provided_is_refused_before_any_load(
    parameters: dict[str, str], processes: bool, message: str
) -> None:
    log: list[str] = []
    with pytest.raises(ShoalError, match=message) as refused:
        strategy.choose(spec_with("fake", **parameters), fake_backend(log, processes))
    assert refused.value.code is ErrorCode.LOAD_FAILED and log == []


def test_a_version_of_a_backend_without_process_hooks_is_refused_process_instances(tmp_path: Path) -> None:
    with pytest.raises(ShoalError, match="process_instances needs the pytorch backend"):
        ModelVersion.load(spec_with("identity", process_instances="true"), 1, tmp_path)


# -- what each strategy loads --------------------------------------------------------------------------


def test_threads_load_one_copy_per_device_and_report_its_bytes() -> None:
    log: list[str] = []
    built = strategy.build_instances(
        spec_with("fake"),
        Path("unused"),
        [Placement("a", CPU, 2), Placement("b", GPU0, 3)],
        fake_backend(log, processes=False),
        InstancePlan(Strategy.THREADS),
    )
    assert log == ["load cpu", "load gpu:0"] and built.copies == 2
    assert built.memory_bytes == {CPU: 100, GPU0: 100} and len(built.pool.instances) == 5
    built.pool.close()


def test_copies_load_one_per_executor_and_report_their_sum() -> None:
    log: list[str] = []
    built = strategy.build_instances(
        spec_with("fake"),
        Path("unused"),
        [Placement("a", CPU, 3)],
        fake_backend(log, processes=False),
        InstancePlan(Strategy.COPIES),
    )
    assert log == ["load cpu"] * 3 and built.copies == 3 and built.memory_bytes == {CPU: 300}
    built.pool.close()
    assert log.count("close copy cpu") == 3


class FakeWorker:
    """Stands in for ProcessModel: records what a worker would be started with."""

    weight_bytes = 0
    started: list[FakeWorker] = []
    fail_at = -1

    def __init__(
        self,
        spec: ModelSpec,
        model_path: Path,
        device: Device,
        handle: object,
        threads: int,
        limits: WorkerLimits,
        preload: tuple[str, ...],
    ) -> None:
        if len(FakeWorker.started) == FakeWorker.fail_at:
            raise ShoalError(ErrorCode.LOAD_FAILED, "a worker process did not start")
        self.device, self.handle, self.limits, self.preload = device, handle, limits, preload
        self.closed = False
        FakeWorker.started.append(self)

    def run(self, inputs, outputs):  # pragma: no cover - not executed here
        return {}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_workers(monkeypatch: pytest.MonkeyPatch) -> type[FakeWorker]:
    monkeypatch.setattr(strategy, "ProcessModel", FakeWorker)
    monkeypatch.setattr(FakeWorker, "started", [])
    return FakeWorker


def test_processes_share_one_copy_per_device_with_a_worker_per_executor(fake_workers: type[FakeWorker]) -> None:
    log: list[str] = []
    limits = WorkerLimits(0.5, 1.0)
    built = strategy.build_instances(
        spec_with("fake"),
        Path("unused"),
        [Placement("a", GPU0, 2), Placement("a", GPU1, 2)],
        fake_backend(log, processes=True, weight_bytes=64),
        InstancePlan(Strategy.PROCESSES, limits),
    )
    assert log == ["load gpu:0", "share gpu:0", "load gpu:1", "share gpu:1"]
    assert [(w.device, w.handle) for w in fake_workers.started] == [
        (GPU0, "handle of gpu:0"),
        (GPU0, "handle of gpu:0"),
        (GPU1, "handle of gpu:1"),
        (GPU1, "handle of gpu:1"),
    ]
    assert all(w.limits == limits and w.preload == ("fake_framework",) for w in fake_workers.started)
    assert built.memory_bytes == {GPU0: 64, GPU1: 64} and built.copies == 2  # the workers hold no weights
    built.pool.close()  # the workers stop first, then the copies they attached to are released
    assert all(w.closed for w in fake_workers.started)
    assert log[-2:] == ["close copy gpu:0", "close copy gpu:1"]


def test_a_worker_that_cannot_start_releases_the_shared_copy_and_the_workers(fake_workers: type[FakeWorker]) -> None:
    log: list[str] = []
    fake_workers.fail_at = 1
    try:
        with pytest.raises(ShoalError, match="did not start"):
            strategy.build_instances(
                spec_with("fake"),
                Path("unused"),
                [Placement("a", CPU, 3)],
                fake_backend(log, processes=True),
                InstancePlan(Strategy.PROCESSES, WorkerLimits()),
            )
    finally:
        fake_workers.fail_at = -1
    assert [w.closed for w in fake_workers.started] == [True]
    assert log == ["load cpu", "share cpu", "close copy cpu"]


def test_a_version_over_the_identity_backend_builds_copies_as_asked(tmp_path: Path) -> None:
    served = ModelVersion.load(
        spec_of(
            "identity",
            "instance_group [ { count: 3 kind: KIND_CPU } ]\n"
            'parameters { key: "share_weights" value: { string_value: "false" } }',
        ),
        1,
        tmp_path,
    )
    assert len(served.pool.models()) == 3 and served.memory_bytes == {CPU: 0} and served.can_serve()
    served.pool.close()


# -- the hooks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(base.BACKENDS))
def test_what_a_backend_declares_is_what_its_module_does(name: str) -> None:
    """``BACKENDS`` says what each backend can do without importing it (a refusal names the backends
    that could, configuring asks without loading torch); each flag holds to the module's hooks."""
    declared = base.BACKENDS[name]
    try:
        module = importlib.import_module(declared.module)
    except ImportError:  # pragma: no cover - a framework not installed here
        pytest.skip(f"{declared.module} does not import here")
    assert declared.process_instances == (hasattr(module, "share_weights") and hasattr(module, "attach"))
    assert declared.process_instances == bool(getattr(module, "WORKER_PRELOAD", ())), "a worker preloads its framework"
    assert declared.self_described == hasattr(module, "complete_config") == hasattr(module, "check_model_file")
    if declared.own_instances:  # each instance loads the model itself and runs lists of requests
        from shoal.configuring.pipeline import configure
        from tests.models import EXAMPLES

        spec = configure(EXAMPLES / "preprocess", strict=False).spec
        loaded = module.load(spec, EXAMPLES / "preprocess" / "1" / "model.py", CPU, 1)
        try:
            assert loaded.runs_requests and loaded.weight_bytes == 0
        finally:
            loaded.close()


def test_a_refusal_names_the_backends_declared_able() -> None:
    with pytest.raises(ShoalError, match="process_instances needs the pytorch backend"):
        strategy.choose(spec_with("identity", process_instances="true"), base.backend_for(spec_with("identity")))


def strings_spec(backend: str) -> ModelSpec:
    text = (
        f'backend: "{backend}"\nmax_batch_size: 4\n'
        'input [ { name: "IN" data_type: TYPE_STRING dims: [ 2 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_STRING dims: [ 2 ] } ]\n'
    )
    config = normalize(parse_config(text), "s")
    validate(config, "s")
    return to_spec(config)


def test_onnxruntime_refuses_a_request_whose_strings_are_not_utf8_and_identity_takes_any_bytes() -> None:
    good = {"IN": np.array([[b"caf\xc3\xa9", b"ok"]], dtype=object)}
    bad = {"IN": np.array([[b"ok", b"\xff\xfe"]], dtype=object)}
    onnx = strings_spec("onnxruntime")
    base.backend_for(onnx).validate_request(onnx, good)
    with pytest.raises(ShoalError, match="input 'IN' for model 's': BYTES element 1 is not valid UTF-8") as refused:
        base.backend_for(onnx).validate_request(onnx, bad)
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT
    identity = strings_spec("identity")
    base.backend_for(identity).validate_request(identity, bad)  # no checks: a no-op


FRAMEWORKS = {"torch", "onnxruntime"}
BACKEND_MODULES = {"shoal.backends.pytorch", "shoal.backends.onnxruntime", "shoal.backends.identity"}


@pytest.mark.parametrize("package", ["instances", "lifecycle"])
def test_instances_and_lifecycle_name_no_framework_and_no_backend_module(package: str) -> None:
    """What a backend can do is asked through its hooks (backends/base.py), never by importing it."""
    found = []
    for path in sorted((REPO_ROOT / "server" / "shoal" / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else (
                    [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
            )
            found += [
                f"{path.name}: {name}" for name in names if name.split(".")[0] in FRAMEWORKS or name in BACKEND_MODULES
            ]
    assert not found


def test_the_hooks_are_read_from_the_backend_module_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = base.backend_for(spec_with("identity"))
    module = importlib.import_module("shoal.backends.identity")
    assert not backend.declared.process_instances and backend.worker_preload == ()
    monkeypatch.setattr(module, "gpu_available", lambda: True, raising=True)
    assert backend.gpu_available()
