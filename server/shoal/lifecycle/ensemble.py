"""A served ensemble (``platform: "ensemble"``): its steps run on the composing models as their inputs arrive.

An ensemble has no weights, instances or scheduler of its own. Each request walks the steps that
lead to its requested outputs: a step starts as soon as every tensor it reads exists, so steps that
do not depend on each other run at the same time, and each step is an ordinary request to its
composing model (``ModelVersion.infer``), resolved when the step starts (as Triton's ensemble
scheduler looks its models up per request). The composing model's checks, scheduler, dynamic
batcher and statistics see it like any other request. Tensors pass between steps as the numpy
arrays the steps returned: nothing is copied or serialized.

Statistics, as Triton reports an ensemble's (core ensemble_scheduler.cc ``FinishEnsemble``): one
execution per request, ``inference_count`` its batch rows, success/fail per request (its whole
time), ``batch_stats`` by batch size; ``queue`` the time before its first step starts (checking the
request); ``compute_input``/``compute_infer``/``compute_output`` the sums of its steps' own phases as
their models' schedulers measured them (``statistics.ALSO_COUNT_PHASES``, Triton's secondary stats
aggregator), so time a step spent queued at its model is in the ensemble's success time only.
A failed request counts once (Triton 2.51 counts a failed ensemble request twice).

Loading (``load_versions``, on the manager's load thread) checks the steps against the composing
models as loaded now, with Triton's messages; the manager loads composing models first.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from shoal.backends.devices import Device
from shoal.errors import ErrorCode, ShoalError
from shoal.lifecycle import request_checks
from shoal.lifecycle.in_flight import InFlight
from shoal.lifecycle.model import ModelVersion, next_load_number
from shoal.lifecycle.response_cache import ResponseCache, VersionCache
from shoal.lifecycle.state import ModelEntry, ModelState, VersionEntry
from shoal.protocol import config_pb2
from shoal.protocol.types import DataType
from shoal.repository import ensemble_composing, ensemble_config, scanner
from shoal.repository.config import ModelSpec, read_config
from shoal.repository.ensemble_config import EnsembleStep
from shoal.request_types import InferRequest, InferResponse, Tensor
from shoal.statistics import ALSO_COUNT_PHASES, TRACED, FailureReason, ModelStatistics, PhaseTotals
from shoal.tracing.trace import RequestTrace

logger = logging.getLogger(__name__)

# Requested-output sets whose pruned step lists are kept per ensemble (a client picks among few).
MAX_CACHED_PLANS = 64


class Registry(Protocol):
    """What an ensemble needs of the model manager."""

    repository: Path
    changes: int  # grows with every change of what is served

    def entry(self, name: str) -> ModelEntry: ...

    def resolve(self, name: str, version: str) -> ModelVersion: ...


class Manager(Registry, Protocol):
    """What ``Dependents`` needs of the model manager besides the registry."""

    def names(self) -> list[str]: ...

    async def load(self, name: str, config_override: dict[str, Any] | None = None) -> None: ...

    async def unload(self, name: str) -> None: ...


class EnsembleVersion(ModelVersion):
    """A READY ensemble version. A ``ModelVersion`` to the registry, statistics and metrics; it
    holds no pool or scheduler (their figures, ``queued`` and ``instance_count``, are 0)."""

    def __init__(self, spec: ModelSpec, version: int, registry: Registry) -> None:  # ModelVersion's is not called
        assert spec.ensemble is not None
        self.spec = spec
        self.version = version
        self.memory_bytes: dict[Device, int] = {}
        self.statistics = ModelStatistics()
        self.load_number = next_load_number()
        self.cache: VersionCache | None = None  # use_cache: at the top level only, as Triton's
        self._cache_holding_number: ResponseCache | None = None
        self._registry = registry
        self._steps = spec.ensemble.steps
        self._plans: dict[tuple[str, ...], tuple[EnsembleStep, ...]] = {}
        self._in_flight = InFlight()  # close() lets the running requests finish (their steps hold models)
        self._uncached_for: set[str] = set()  # the stateful steps it said it serves uncached for
        self._closing = False

    @property
    def queued(self) -> int:
        return 0

    @property
    def instance_count(self) -> int:
        return 0

    def can_serve(self) -> bool:
        return not self._closing

    def _step_versions(self) -> list[ModelVersion]:
        """The versions its steps resolve to now (ShoalError: one is gone)."""
        return [
            self._registry.resolve(step.model_name, str(step.model_version) if step.model_version >= 0 else "")
            for step in self._steps
        ]

    def composition(self) -> tuple[int, ...]:
        """Its load number and those of the versions its steps resolve to now (ShoalError: one is gone)."""
        return self._composition_of(self._step_versions())

    def _composition_of(self, steps: list[ModelVersion]) -> tuple[int, ...]:
        return (self.load_number, *(number for served in steps for number in served.composition()))

    def stateful_model(self) -> str | None:
        return _stateful_among(self._step_versions())

    def _cache_key(self) -> tuple[int, ...] | None:
        """What its cached answers are filed under now; None when the cache must not be used: a step's model
        is gone (the steps fail the request in their words), or a step's answers depend on more than the
        request (Triton loads such an ensemble and answers a sequence from another one's cached answer;
        Shoal serves it without the cache, and says so once per such step)."""
        try:
            steps = self._step_versions()  # resolved once for both
            stateful = _stateful_among(steps)
            composition = self._composition_of(steps)
        except ShoalError:
            return None
        if stateful is None:
            return composition
        if stateful not in self._uncached_for:
            self._uncached_for.add(stateful)
            logger.warning(
                "ensemble %s: its response cache is not used while its step model %s has a sequence batcher "
                "or is decoupled (its answers depend on more than the request)",
                self.spec.name,
                stateful,
            )
        return None

    async def infer(self, request: InferRequest) -> InferResponse:
        if self._closing:
            raise ShoalError(ErrorCode.UNAVAILABLE, "the model is unloading")
        with self._in_flight:
            return await self._infer(request)

    async def _infer(self, request: InferRequest) -> InferResponse:
        arrival_ns = time.monotonic_ns()
        try:
            prepared = request_checks.prepare(self.spec, request)
        except ShoalError:
            self.statistics.record_failure(time.monotonic_ns() - arrival_ns, FailureReason.OTHER)
            raise
        lookup = None
        changes = self._registry.changes
        if self.cache is not None:
            composition = self._cache_key()
            if composition is not None:
                lookup = await self.cache.look_up(prepared, request.parameters, composition, arrival_ns)
                if lookup.outputs is not None:
                    return self._answer(request, lookup.outputs)
        pool = {name: Tensor(name, self._datatype(name), array.shape, array) for name, array in prepared.feed.items()}
        outer = ALSO_COUNT_PHASES.get()  # an ensemble that has this one as a step
        steps_phases = PhaseTotals()
        token = ALSO_COUNT_PHASES.set(steps_phases)
        started_ns = time.monotonic_ns()
        try:
            await self._run(self._plan(prepared.outputs), pool, request)
            # An output a Python step left out of its response is left out of the answer, as Triton's ensemble does.
            written = {name: pool[name].data for name in prepared.outputs if name in pool}
            outputs = request_checks.finish(self.spec, prepared, written)
        except ShoalError as exc:
            reason = FailureReason.OTHER if exc.code is ErrorCode.INVALID_ARGUMENT else FailureReason.BACKEND
            self.statistics.record_failure(time.monotonic_ns() - arrival_ns, reason)
            raise ShoalError(exc.code, f"in ensemble '{self.spec.name}', {exc.message}") from None
        except asyncio.CancelledError:  # the client went away: its running steps were cancelled
            self.statistics.record_failure(time.monotonic_ns() - arrival_ns, FailureReason.CANCELED)
            raise
        except Exception as exc:
            logger.exception("ensemble %s: a step failed unexpectedly", self.spec.name)
            self.statistics.record_failure(time.monotonic_ns() - arrival_ns, FailureReason.BACKEND)
            raise ShoalError(ErrorCode.INTERNAL, f"in ensemble '{self.spec.name}', {exc}") from exc
        finally:
            ALSO_COUNT_PHASES.reset(token)
        phases = steps_phases.phases()
        self.statistics.record_execution(max(1, prepared.batch_size), phases)
        self.statistics.record_success(time.monotonic_ns() - arrival_ns, started_ns - arrival_ns, phases)
        if outer is not None:
            outer.add(phases)
        # Filed under the versions the steps resolve to now, so only if none changed meanwhile: a step may
        # have run on a version that came and went (its answer under the key of the one before it).
        if self.cache is not None and lookup is not None and self._registry.changes == changes:
            await self.cache.insert(lookup, outputs)
        return self._answer(request, outputs)

    def _datatype(self, name: str) -> DataType:
        tensor = self.spec.input(name)
        assert tensor is not None  # prepare() let only the config's inputs through
        return tensor.datatype

    def _plan(self, outputs: tuple[str, ...]) -> tuple[EnsembleStep, ...]:
        """The steps that lead to ``outputs``, in config order (Triton, too, runs no other step)."""
        plan = self._plans.get(outputs)
        if plan is not None:
            return plan
        needed = set(outputs)
        chosen: set[int] = set()
        grew = True
        while grew:
            grew = False
            for index, step in enumerate(self._steps):
                if index not in chosen and needed.intersection(step.writes):
                    chosen.add(index)
                    needed.update(step.reads)
                    grew = True
        plan = tuple(step for index, step in enumerate(self._steps) if index in chosen)
        if len(self._plans) < MAX_CACHED_PLANS:
            self._plans[outputs] = plan
        return plan

    async def _run(self, steps: Sequence[EnsembleStep], pool: dict[str, Tensor], request: InferRequest) -> None:
        """Start every step whose tensors exist; as each finishes, add what it wrote and start the
        steps that were waiting for it. The first failure cancels the steps still running. An optional
        ensemble input the request left out is not waited for: its steps run without it (as Triton's),
        and the composing model's own checks decide whether it may be missing."""
        absent = {tensor.name for tensor in self.spec.inputs} - pool.keys()
        waiting = {
            index: {t for t in step.reads if t not in pool and t not in absent} for index, step in enumerate(steps)
        }
        ready = _arrived({}, pool, waiting)
        running: dict[asyncio.Task[dict[str, Tensor]], int] = {}
        try:
            while ready or running:
                if len(ready) == 1 and not running:  # one step at a time (a chain): no task needed
                    step = steps[ready[0]]
                    ready = _arrived(await self._step(step, pool, request), pool, waiting, step)
                    continue
                for index in ready:
                    running[asyncio.create_task(self._step(steps[index], pool, request))] = index
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                ready = []
                failure: BaseException | None = None
                for task in done:
                    step = steps[running.pop(task)]
                    if task.cancelled():  # by its model (stopping), not by this request
                        failure = failure or ShoalError(
                            ErrorCode.UNAVAILABLE, f"the step of model '{step.model_name}' was cancelled"
                        )
                    elif task.exception() is not None:
                        failure = failure or task.exception()
                    else:
                        ready += _arrived(task.result(), pool, waiting, step)
                if failure is not None:
                    raise failure
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        if waiting:  # a step never got a tensor: a composing model answered without an output it was asked for
            missing = sorted(set().union(*waiting.values()) - pool.keys())
            raise ShoalError(ErrorCode.INTERNAL, f"ensemble tensor '{missing[0]}' was not written by its step")

    async def _step(self, step: EnsembleStep, pool: dict[str, Tensor], request: InferRequest) -> dict[str, Tensor]:
        """One step as a request to its composing model; returns what it wrote, by ensemble tensor name."""
        inputs = tuple(
            Tensor(model_input, pool[name].datatype, pool[name].shape, pool[name].data)
            for model_input, name in step.input_map
            if name in pool
        )  # not: an optional input left out
        version = str(step.model_version) if step.model_version >= 0 else ""
        served = self._registry.resolve(step.model_name, version)
        parent = TRACED.get()  # this request's trace, when it is sampled: the step's is its child
        traced = parent.child(step.model_name, str(served.version)) if isinstance(parent, RequestTrace) else None
        token = TRACED.set(traced)  # the step's own trace, or none (this step's task: its siblings keep theirs)
        try:
            response = await served.infer(
                InferRequest(
                    model_name=step.model_name,
                    model_version=version,
                    id=request.id,
                    inputs=inputs,
                    requested_outputs=tuple(output for output, _ in step.output_map),
                    parameters=request.parameters,
                )
            )
        except ShoalError as exc:
            if traced is not None:
                traced.error = exc.message
            raise
        finally:
            if traced is not None:
                traced.stamp("REQUEST_END")
            TRACED.reset(token)
        renamed = dict(step.output_map)
        return {renamed[t.name]: Tensor(renamed[t.name], t.datatype, t.shape, t.data) for t in response.outputs}

    async def close(self) -> None:
        """Refuse new requests; let the running ones finish (their steps hold the composing models)."""
        self._closing = True
        await self._in_flight.drained()
        self._forget_cached_answers()


def _arrived(
    produced: dict[str, Tensor], pool: dict[str, Tensor], waiting: dict[int, set[str]], step: EnsembleStep | None = None
) -> list[int]:
    """Add ``produced`` (what ``step`` wrote) to ``pool``; the steps that now have every tensor they read
    leave ``waiting``. A tensor ``step`` was to write and did not (a Python model's response may leave an
    output out) is waited for no more: its readers run without it, and their models' own checks answer,
    as Triton's ensemble does."""
    pool.update(produced)
    done_with = set(produced) if step is None else set(produced) | {tensor for _, tensor in step.output_map}
    ready = []
    for index, missing in list(waiting.items()):
        missing.difference_update(done_with)
        if not missing:
            ready.append(index)
            del waiting[index]
    return ready


# -- loading --------------------------------------------------------------------------------------


def composing_models(repository: Path, name: str, config: config_pb2.ModelConfig | None = None) -> tuple[str, ...]:
    """The models ensemble ``name`` uses, from ``config`` or its config.pbtxt; () for any other model
    (or one whose config cannot be read: its own load says why)."""
    if config is None:
        try:
            config = read_config(scanner.model_dir(repository, name))
        except ShoalError:
            return ()
    if not ensemble_config.is_ensemble(config):
        return ()
    return tuple(dict.fromkeys(step.model_name for step in config.ensemble_scheduling.step if step.model_name))


def load_versions(spec: ModelSpec, chosen: list[int], registry: Registry) -> tuple[dict[int, VersionEntry], str]:
    """The ensemble's versions, READY, or UNAVAILABLE with the reason its steps do not fit the
    composing models as loaded now (on the manager's load thread)."""
    reason = unfit(spec, registry)
    versions = {}
    for number in chosen:
        entry = VersionEntry(number)
        entry.transition(ModelState.LOADING)
        if reason:
            entry.transition(ModelState.UNAVAILABLE, reason)
        else:
            entry.attach(EnsembleVersion(spec, number, registry))
            entry.transition(ModelState.READY)
        versions[number] = entry
    return versions, reason


def unfit(spec: ModelSpec, registry: Registry) -> str:
    """Why the ensemble cannot load, in Triton's words and order: a cycle, models missing from the
    repository, models (or versions) not loaded, then steps that do not fit their models; or ""."""
    assert spec.ensemble is not None
    models = spec.ensemble.composing_models
    cycle = ensemble_config.dependency_cycle(
        spec.name, models, lambda model: composing_models(registry.repository, model)
    )
    if cycle:
        return cycle
    missing = [model for model in models if not in_repository(registry.repository, model)]
    if missing:
        return f"ensemble {spec.name} contains models that are not available or ambiguous: {', '.join(missing)}"
    step_specs = []
    for step in spec.ensemble.steps:
        try:
            served = registry.resolve(step.model_name, str(step.model_version) if step.model_version >= 0 else "")
        except ShoalError:
            return _not_loaded(spec.name, step, registry)
        step_specs.append(served.spec)
    try:
        ensemble_composing.validate_against_composing(spec, step_specs)
    except ShoalError as exc:
        return exc.message
    return ""


def in_repository(repository: Path, name: str) -> bool:
    try:
        return scanner.model_dir(repository, name).is_dir()
    except ShoalError:  # a name that could not be a model folder
        return False


def _not_loaded(ensemble: str, step: EnsembleStep, registry: Registry) -> str:
    model = step.model_name
    try:
        entry: ModelEntry | None = registry.entry(model)
    except ShoalError:
        entry = None
    if entry is not None and entry.ready_versions() and step.model_version >= 0:
        return f"ensemble '{ensemble}' depends on '{model}' whose required version {step.model_version} is not loaded."
    why = entry.reason if entry is not None else ""
    tail = f" Model '{model}' loading failed with error: {why}" if why else ""
    return f"ensemble '{ensemble}' depends on '{model}' which has no loaded version.{tail}"


# -- the manager's side: ensembles follow the models they use ---------------------------------------

# The ensembles whose composing models this task is loading now (an ensemble loads them first).
_LOADING_FOR: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("loading_for", default=())


class Dependents:
    """As much of Triton's dependency graph (core model_repository_manager.cc) as ensembles need: an
    ensemble loads after the models it uses; unloading one of them, or reloading it with a config the
    steps no longer fit, unloads the ensemble; it loads again once its steps fit."""

    def __init__(self, manager: Manager) -> None:
        self._manager = manager
        self._dormant: set[str] = set()  # ensembles unloaded with a model they use

    async def load_composing(self, name: str, config: config_pb2.ModelConfig | None) -> None:
        """Before ``name`` loads: load the models it uses (if it is an ensemble) that have no ready
        version, in every control mode, as Triton does. A model already on the way (a cycle) is left
        to the ensemble's own check, which names the cycle."""
        chain = _LOADING_FOR.get()
        models = composing_models(self._manager.repository, name, config)
        token = _LOADING_FOR.set((*chain, name))
        try:
            for model in models:
                if model == name or model in chain or self._ready(model):
                    continue
                if not in_repository(self._manager.repository, model):
                    continue  # the ensemble's check names it
                try:
                    await self._manager.load(model)
                except ShoalError as exc:
                    logger.error("model %s (used by ensemble %s): %s", model, name, exc.message)
        finally:
            _LOADING_FOR.reset(token)

    async def retire(self, name: str, only_unfit: bool = False) -> None:
        """``name`` was unloaded (or, ``only_unfit``, reloaded): unload the READY ensembles that use it
        (that no longer fit it) and keep them to ``wake``."""
        for ensemble_name in self._manager.names():
            try:
                entry = self._manager.entry(ensemble_name)
            except ShoalError:  # gone meanwhile (poll mode)
                continue
            spec = entry.spec
            if (
                spec is None
                or spec.ensemble is None
                or name not in spec.ensemble.composing_models
                or entry.state is not ModelState.READY
            ):
                continue
            reason = unfit(spec, self._manager) if only_unfit else f"model {name}, which it uses, was unloaded"
            if reason:
                logger.warning("ensemble %s: unloaded: %s", ensemble_name, reason)
                await self._manager.unload(ensemble_name)
                self._dormant.add(ensemble_name)

    async def wake(self) -> None:
        """Load the ensembles whose steps fit their models now: those ``retire`` unloaded, and those whose
        load failed for their steps (a composing model missing or not loaded then), as Triton's dependency
        graph loads a model once the models it waits for are there. Each is loaded as its client loaded
        it (its config override kept), and only while it still waits: a client may unload it while an
        earlier one loads."""
        for name in sorted(self._dormant | self._failed_for_steps()):
            if name not in self._dormant and name not in self._failed_for_steps():
                continue  # unloaded by a client (``forget``) or loaded while an earlier one loaded
            try:
                entry: ModelEntry | None = self._manager.entry(name)
            except ShoalError:  # its folder was removed meanwhile
                entry = None
            if entry is None or entry.spec is None or entry.spec.ensemble is None:
                self._dormant.discard(name)
            elif entry.state is not ModelState.UNAVAILABLE:  # loaded (or loading) meanwhile: a nested wake
                self._dormant.discard(name)
            elif not unfit(entry.spec, self._manager):
                self._dormant.discard(name)
                try:
                    await self._manager.load(name, entry.config_override)
                except ShoalError as exc:
                    logger.error("ensemble %s: %s", name, exc.message)

    def _failed_for_steps(self) -> set[str]:
        """Ensembles not unloaded on purpose whose versions ``load_versions`` left UNAVAILABLE: the only
        reason it does is that the steps did not fit the composing models as loaded then."""
        failed = set()
        for name in self._manager.names():
            try:
                entry = self._manager.entry(name)
            except ShoalError:
                continue
            if (
                entry.spec is not None
                and entry.spec.ensemble is not None
                and not entry.unloaded
                and entry.state is ModelState.UNAVAILABLE
                and entry.versions
                and not entry.ready_versions()
            ):
                failed.add(name)
        return failed

    def forget(self, name: str) -> None:
        """``name`` was unloaded on purpose: it stays unloaded."""
        self._dormant.discard(name)

    def _ready(self, name: str) -> bool:
        try:
            return bool(self._manager.entry(name).ready_versions())
        except ShoalError:
            return False


def _stateful_among(steps: list[ModelVersion]) -> str | None:
    """The first of ``steps`` (through nested ensembles) whose answers no response cache may keep."""
    return next((found for served in steps if (found := served.stateful_model())), None)
