"""The registry of models: load, reload and unload without dropping a request; resolve requests.

Control modes, as Triton's: ``none`` loads every model at start and never changes; ``poll``
also rescans the repository every ``poll_secs`` (added, removed and changed models);
``explicit`` loads only the ``startup_models`` and then what RepositoryModelLoad asks.

A (re)load builds the new entry off the event loop (load, then warm up every copy) while
the old one keeps serving; the registry then swaps in one assignment on the event loop,
and the old entry drains (its queued and running requests finish) before its weights are
freed. A request resolves its version and enqueues without yielding to the loop in
between, so it lands either on the old entry before its drain starts, or on the new one.
A failed reload leaves the old entry serving and records the reason.

A reload rebuilds only the versions that changed, as Triton's ``ModelLifeCycle::AsyncLoad``
(core src/model_repository_manager/model_lifecycle.cc): a READY version whose version folder is
unchanged, under a config that differs at most in ``version_policy``, moves into the new entry
as it is and keeps serving (its statistics too); a version whose files changed, or every version
when anything else in the config changed, is built anew. (Triton also updates a changed
``instance_group`` in place; Shoal rebuilds for it.)

Entries and versions change state only through ``transition()`` (``lifecycle/state.py``: one
table of allowed moves); a loaded version is let go only through ``release``, whether it is
unloaded, replaced by a reload, stopped at shutdown or refused by a budget after its load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import time
from collections.abc import Callable, Collection, Coroutine, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from shoal.configuring.pipeline import ConfigOverride, configure, model_file
from shoal.errors import ErrorCode, ShoalError, internal_error, invalid, load_failed, poll_failed, shown, unknown_model
from shoal.lifecycle import ensemble, model_work, warmup
from shoal.lifecycle.budgets import LoadBudget, MemoryLedger
from shoal.lifecycle.fingerprint import fingerprint_or_none
from shoal.lifecycle.model import ModelVersion, placements
from shoal.lifecycle.response_cache import ResponseCache
from shoal.lifecycle.state import UNLOADED, IndexEntry, ModelEntry, ModelState, VersionEntry
from shoal.repository import scanner
from shoal.repository.config import ModelSpec, RateLimiterSpec, VersionPolicy
from shoal.request_types import InferRequest, InferResponse
from shoal.scheduling.rate_limiter import RateLimiter
from shoal.statistics import TRACED, LatencyWindows
from shoal.tracing.trace import live_trace

logger = logging.getLogger(__name__)

CONTROL_MODES = ("none", "poll", "explicit")
# A requested version, as std::stol reads it: ASCII digits ('²' is a digit to str.isdigit, not to stol).
_STOL = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")  # what std::stol reads of a version string

__all__ = ["CONTROL_MODES", "IndexEntry", "ModelEntry", "ModelManager", "release"]


async def release(versions: Iterable[VersionEntry], reason: str = UNLOADED) -> None:
    """The one teardown path (unload, reload, shutdown, a budget refusal after load): stop routing
    to every given version at once, then let each finish its queued and running requests and free
    its instances and weights (``ModelVersion.close``); each ends UNAVAILABLE with ``reason``."""
    detached = [(version, version.detach()) for version in versions if version.served is not None]
    for version, served in detached:  # nothing routes to any of them from here on
        if served is not None:
            try:
                await served.close()
            except Exception:  # noqa: BLE001 - one version's teardown failing leaves the others' to run (shutdown)
                logger.exception("model %s version %d: its teardown failed", served.spec.name, served.version)
        version.transition(ModelState.UNAVAILABLE, reason)


def _bls_target(manager: ModelManager, request: InferRequest) -> ModelVersion:
    """The version a BLS call runs on, refused in the words of Triton 2.51's Python backend (its
    ``RequestExecutor::Infer``, checked with ``run_triton.sh``), which models may show or match: a
    model or version that is not ready (unknown ones too), and a call for one response to a decoupled
    model. Their code is INTERNAL there, as a failed call's is here."""
    name = shown(request.model_name)
    failed = f"Model {name} - Error when running inference: "
    try:
        target = manager.resolve(request.model_name, request.model_version)
    except ShoalError:
        raise ShoalError(
            ErrorCode.INTERNAL, f"{failed}Failed for execute the inference request. Model '{name}' is not ready."
        ) from None
    if target.spec.decoupled and request.sink is None:
        raise ShoalError(
            ErrorCode.INTERNAL,
            f"{failed}Model {name} is using the decoupled. The current BLS request call doesn't support "
            "models using the decoupled transaction policy. Please use 'decoupled=True' argument to the "
            "'exec' or 'async_exec' calls for decoupled models.'",
        )
    return target


def _refuse_a_call_that_waits_for_itself(target: ModelVersion) -> None:
    """A BLS call from a version's only instance to that same version would wait for the instance that
    makes it, forever (Triton 2.51 hangs so, with a request timeout or without): it fails at once."""
    if target.instance_count == 1:
        raise ShoalError(
            ErrorCode.INVALID_ARGUMENT,
            f"model '{target.spec.name}' version {target.version}: a BLS call to itself from its only "
            "instance would wait forever for that instance, which runs the caller; give the model "
            "an instance_group count of 2 or more",
        )


class ModelManager:
    def __init__(
        self,
        repository: Path,
        strict_model_config: bool = False,
        control_mode: str = "none",
        on_change: Callable[[], None] | None = None,
        memory_budgets: dict[str, int] | None = None,
        rate_limiter: RateLimiter | None = None,
        response_cache: ResponseCache | None = None,
        summary_latencies: bool = False,
    ) -> None:
        if control_mode not in CONTROL_MODES:
            raise ValueError(f"control mode must be one of {CONTROL_MODES}")
        self.repository = repository
        self.strict_model_config = strict_model_config
        self.control_mode = control_mode
        self.on_change = on_change
        # Device ("cpu", "gpu:0") -> bytes all loaded models together may hold there.
        self.memory_budgets = memory_budgets or {}
        self._ledger = MemoryLedger(self.memory_budgets, self.memory_in_use)
        self.rate_limiter = rate_limiter  # --rate-limit execution_count: one for every model's instances
        self.response_cache = response_cache  # --cache-config local,size=BYTES: one for the models that enable it
        self.summary_latencies = summary_latencies  # --metrics-config summary_latencies=true
        self._models: dict[str, ModelEntry] = {}
        # How many times what the registry serves changed: an ensemble caches an answer only if nothing
        # changed while it was computed (its steps resolve their versions as they start).
        self.changes = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._client_order: dict[str, _InOrder] = {}  # per model: clients' loads and unloads, one at a time
        self._loading: dict[str, ModelEntry] = {}  # per model: the load under way (its versions, once chosen)
        self._dependents = ensemble.Dependents(self)  # ensembles follow the models they use
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # close() began: no load installs a model any more

    # -- loading -------------------------------------------------------------------------------------

    async def start(self, startup_models: tuple[str, ...] = ()) -> dict[str, str]:
        """Load what the control mode says to load at start; each model that failed, with why.

        Every model is tried and each failure logged, so the caller (``--exit-on-error``) can end
        the server naming them all, as Triton does.
        """
        if self.control_mode == "explicit" and "*" not in startup_models:
            names = list(startup_models)
        else:
            names = scanner.list_models(self.repository)
        failures: dict[str, str] = {}
        for name in names:
            if name in self._models:  # loaded already, as a model an ensemble uses
                continue
            try:
                await self.load(name)
            except ShoalError as exc:
                logger.error("model %s: %s", name, exc.message)
                failures[name] = exc.message
            except Exception as exc:  # noqa: BLE001 - Shoal's own fault in one model's load: the others still load
                failures[name] = internal_error(exc, f"loading model '{shown(name)}'")
        return failures

    async def load(self, name: str, config_override: dict[str, Any] | None = None, client: bool = False) -> None:
        """Load or reload ``name``; ``config_override`` is a ModelConfig as a JSON object (RepositoryModelLoad).
        Runs to its end if the caller stops waiting (``model_work.to_the_end``). ``client``: a client's
        call, run after the clients' loads and unloads of ``name`` asked for before it (``_in_order``)."""
        work = self._in_order(name, self._load(name, config_override)) if client else self._load(name, config_override)
        await model_work.to_the_end(work, f"the load of model '{shown(name)}'")

    async def _in_order(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        """``work`` once the clients' loads and unloads of ``name`` asked for before it are done, as
        Triton handles repository calls one at a time: a load, an unload, a load leave the model
        loaded, whatever their clients stopped waiting for. A model's lock cannot give that order: an
        ensemble's load takes its lock only after loading its composing models (whose loads may unload
        it, the server's own unload, which waits for no client's). Only clients' calls take this
        order, so none of the server's own waits on it."""
        order = self._client_order.get(name)
        if order is None:
            order = self._client_order[name] = _InOrder()
        order.users += 1
        try:
            async with order.lock:
                await work
        finally:
            work.close()  # never started (cancelled while waiting, at shutdown): no "never awaited" warning
            order.users -= 1
            if not order.users:  # nothing kept for a name no call is about (made-up names included)
                del self._client_order[name]

    async def _load(self, name: str, config_override: dict[str, Any] | None) -> None:
        if self._closed:
            raise shutting_down(name)
        self._loop = asyncio.get_running_loop()  # where BLS requests from models run (host_infer)
        try:
            folder: Path | None = scanner.model_dir(self.repository, name)
        except ShoalError:  # a name that cannot be a model folder's: to Triton, one it cannot poll either
            folder = None
        if folder is None or not folder.is_dir():
            raise poll_failed(name, "no such model folder in the repository")
        override = ConfigOverride.parse(name, config_override) if config_override is not None else None
        await self._dependents.load_composing(name, override.config if override else None)
        async with self._locks.setdefault(name, asyncio.Lock()):
            if self._closed:  # close() took this lock before this load did
                raise shutting_down(name)
            old = self._models.get(name)
            entry = ModelEntry(name)
            entry.config_override = config_override
            entry.transition(ModelState.LOADING)
            if old is None or not old.ready_versions():  # nothing serving: the index shows LOADING
                self._models[name] = entry
            self._loading[name] = entry
            try:
                reason, reserved, kept = await model_work.in_thread(self._build, entry, folder, override, old)
            except BaseException:
                if old is not None:
                    self._models[name] = old
                else:
                    self._models.pop(name, None)
                raise
            finally:
                del self._loading[name]
            if self._closed:  # close() went by while this load built: what it built goes, nothing installs
                await release(v for v in entry.versions.values() if v.served is not None and v not in kept)
                self._ledger.release(reserved)
                if old is not None:
                    self._models[name] = old
                else:
                    self._models.pop(name, None)
                raise shutting_down(name)
            # A load with a failed version fails whole, as Triton's (model_lifecycle.cc OnLoadComplete: "if
            # any of the versions fails to load, abort the load and unload all newly loaded versions"): the
            # versions built for it are let go (UNAVAILABLE, "unloaded") and, on a reload, the entry serving
            # goes on, every version of it. The refusal names the failed versions, before the others go.
            if any(version.state is not ModelState.READY for version in entry.versions.values()) or not entry.versions:
                entry.transition(ModelState.UNAVAILABLE, reason)
                refusal = _load_refusal(entry)
                await release(v for v in entry.versions.values() if v.served is not None and v not in kept)
                self._ledger.release(reserved)
                if old is not None and old.ready_versions():
                    _show_failed_versions(old, entry)
                    old.failed_fingerprint = entry.fingerprint
                    self._changed()
                    raise refusal
                self._models[name] = entry
                self._changed()
                if old is not None:
                    await self._retire(old)
                raise refusal
            entry.transition(ModelState.READY)
            with self._ledger.settling(reserved):  # the entry's bytes now count as in use, not reserved
                self._models[name] = entry  # the switch: one assignment on the event loop
            self._changed()
            if old is not None:
                await self._retire(old, keep=kept)
        await self._dependents.retire(name, only_unfit=True)
        await self._dependents.wake()

    async def unload(self, name: str, unload_dependents: bool = False, client: bool = False) -> None:
        """Stop routing to ``name``, let its queued and running requests finish, free the weights.

        ``unload_dependents`` (Triton's flag of that name): an ensemble's composing models are unloaded
        after it, each with its own, except those another loaded ensemble still uses. Runs to its end
        if the caller stops waiting (``model_work.to_the_end``); ``client``: as ``load``'s.
        """
        work = self._unload(name, unload_dependents)
        await model_work.to_the_end(
            self._in_order(name, work) if client else work, f"the unload of model '{shown(name)}'"
        )

    async def _unload(self, name: str, unload_dependents: bool) -> None:
        # A model that is not loaded (never was, or no such model) is unloaded already: OK, as Triton's
        # answer (model_repository_manager.cc ``LoadUnloadModels`` ignores ``AsyncUnload``'s "not served").
        if name not in self._models:  # before a lock is made for it: a made-up name keeps nothing
            return
        async with self._locks.setdefault(name, asyncio.Lock()):
            entry = self._models.get(name)
            if entry is None:
                return
            composing = (
                entry.spec.ensemble.composing_models
                if unload_dependents and entry.spec is not None and entry.spec.ensemble is not None
                else ()
            )
            entry.unloaded = True  # strict readiness stops waiting for it at once
            if entry.state is not ModelState.READY:  # failed or unloaded already: nothing to release
                entry.reason = UNLOADED
            self._changed()
            await self._retire(entry)
            self._changed()
        self._dependents.forget(name)
        await self._dependents.retire(name)
        for model in composing:
            if self._loaded(model) and not self._used_by_a_loaded_ensemble(model):
                await self._unload(model, unload_dependents=True)

    def _loaded(self, name: str) -> bool:
        entry = self._models.get(name)
        return entry is not None and entry.state is ModelState.READY

    def _used_by_a_loaded_ensemble(self, name: str) -> bool:
        return any(
            entry.state is ModelState.READY
            and entry.spec is not None
            and entry.spec.ensemble is not None
            and name in entry.spec.ensemble.composing_models
            for entry in self._models.values()
        )

    def memory_in_use(self) -> dict[str, int]:
        """Bytes the loaded versions hold, per device (also read from load threads: copies first)."""
        used: dict[str, int] = {}
        for model in list(self._models.values()):
            for version in list(model.versions.values()):
                served = version.served
                if served is not None:
                    for device, byte_size in served.memory_bytes.items():
                        used[str(device)] = used.get(str(device), 0) + byte_size
        return used

    def _build(
        self, entry: ModelEntry, folder: Path, override: ConfigOverride | None, old: ModelEntry | None
    ) -> tuple[str, dict[str, int], list[VersionEntry]]:
        """Runs in a worker thread: configure, load and warm every version the policy selects into
        ``entry`` (LOADING), taking over from ``old`` the READY versions that did not change. Returns
        why none is ready (if so), the memory it reserved in the ledger (the caller ends the
        reservation) and the versions taken over from ``old``."""
        entry.fingerprint = fingerprint_or_none(folder)  # a path outside: configure says which
        try:
            configured = configure(folder, self.strict_model_config, base=override.config if override else None)
            spec = configured.spec
            for warning in configured.warnings:
                logger.warning("%s", warning)
            available = scanner.list_versions(folder, warn=False)
        except ShoalError as exc:
            return exc.message, {}, []
        except Exception as exc:  # noqa: BLE001 - Shoal's own fault on this folder: this load fails, as any other
            return internal_error(exc, f"configuring model '{shown(entry.name)}'"), {}, []
        entry.spec = spec
        if self.rate_limiter is None and any(g.rate_limiter != RateLimiterSpec() for g in spec.instance_groups):
            logger.info(
                "model %s: its instance groups' rate_limiter takes effect with --rate-limit execution_count "
                "(off here, as Triton's default)",
                entry.name,
            )
        if self.response_cache is None and spec.response_cache:
            logger.info(
                "model %s: its response_cache takes effect with --cache-config local,size=BYTES (no cache "
                "here, as Triton's default)",
                entry.name,
            )
        chosen = spec.version_policy.select(available)
        entry.chosen = frozenset(chosen)  # a request naming one of them is told it is not ready yet
        if not chosen:
            return f"model '{entry.name}': no version folder matches the version policy (found {available})", {}, []
        if spec.ensemble is not None:  # no weights: its steps are checked against the composing models as loaded
            ensemble_versions, reason = ensemble.load_versions(spec, chosen, self)
            self._prepare(spec, ensemble_versions.values())
            entry.versions = ensemble_versions
            return reason, {}, []
        unchanged = _unchanged_versions(old, entry, chosen)
        if unchanged:
            logger.info("model %s: version(s) %s unchanged, kept serving", entry.name, sorted(unchanged))
        budget = LoadBudget(self._ledger, spec, {str(d) for d in _devices(spec)})
        budget.taken += sum(sum(v.served.memory_bytes.values()) for v in unchanged.values() if v.served)
        versions: dict[int, VersionEntry] = {}
        try:
            for version in chosen:
                if version in unchanged:
                    versions[version] = unchanged[version]
                    continue
                loaded = self._load_within_budget(spec, folder, version, budget, self.host_infer, self.rate_limiter)
                loaded.reason = scanner.without_repository_path(self.repository, loaded.reason)
                versions[version] = loaded
        except BaseException:
            self._ledger.release(budget.reserved)
            raise
        self._prepare(spec, versions.values())
        entry.versions = versions  # one assignment: index() never sees the dict change
        reason = "; ".join(v.reason for v in versions.values() if v.state is not ModelState.READY)
        return reason, budget.reserved, list(unchanged.values())

    def _prepare(self, spec: ModelSpec, versions: Iterable[VersionEntry]) -> None:
        """Before they take traffic. With a server cache: the versions of a model whose config enables the
        response cache answer from it, and every version's load number leaves it when the version goes
        (an ensemble's entries hold its steps' numbers; a version kept from the previous load has it already).
        With latency summaries: each version keeps its last minute of latencies (a kept one has them)."""
        for version in versions:
            if version.served is None:
                continue
            if self.response_cache is not None:
                version.served.use_cache(self.response_cache, answer_from_it=spec.response_cache)
            if self.summary_latencies and version.served.statistics.latencies is None:
                version.served.statistics.latencies = LatencyWindows()

    @staticmethod
    def _load_within_budget(
        spec: ModelSpec,
        folder: Path,
        version: int,
        budget: LoadBudget,
        host: Callable[..., Any],
        limiter: RateLimiter | None,
    ) -> VersionEntry:
        entry = VersionEntry(version)
        entry.transition(ModelState.LOADING)
        try:  # every path checked before anything is opened or stat'ed
            version_dir = scanner.checked_version_dir(folder, version)
            path = model_file(spec.default_model_filename, folder, version)
        except ShoalError as exc:
            entry.transition(ModelState.UNAVAILABLE, exc.message)
            return entry
        refusal = budget.refuse_before(path)
        if refusal:
            entry.transition(ModelState.UNAVAILABLE, refusal)
            return entry
        try:
            served = _load_and_warm(spec, version, version_dir, folder, host, limiter)
        except ShoalError as exc:
            budget.forget_estimate()
            entry.transition(ModelState.UNAVAILABLE, exc.message)
            return entry
        entry.attach(served)
        refusal = budget.refuse_after({str(d): b for d, b in served.memory_bytes.items()})
        if refusal:  # it never took a request (its scheduler never started): released on this thread's own loop
            asyncio.run(release([entry], refusal))
            return entry
        entry.transition(ModelState.READY)
        return entry

    async def _retire(self, entry: ModelEntry, keep: Collection[VersionEntry] = ()) -> None:
        """Let ``entry`` go: a READY one drains through ``release`` and ends UNAVAILABLE; the versions
        in ``keep`` (taken over by the entry that replaced it) go on serving."""
        if entry.state is not ModelState.READY:
            return
        entry.transition(ModelState.UNLOADING)
        await release(v for v in entry.versions.values() if v not in keep)
        entry.transition(ModelState.UNAVAILABLE, UNLOADED)
        logger.info("model %s: drained and unloaded", entry.name)

    def _changed(self) -> None:
        self.changes += 1
        if self.on_change is not None:
            self.on_change()

    # -- polling -------------------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Pick up added, removed and changed model folders (poll mode)."""
        present = set(scanner.list_models(self.repository, warn=False))
        for name in sorted(present):
            entry = self._models.get(name)
            found = fingerprint_or_none(self.repository / name)
            # Not again what a reload failed on (its good versions were built, warmed and let go each poll).
            changed = entry is None or (
                found != entry.fingerprint and (found is None or found != entry.failed_fingerprint)
            )
            if entry is not None and entry.failed_fingerprint is not None and found == entry.fingerprint:
                _forget_failed_reload(entry)  # the folder is back to what serves: the failure is history
                self._changed()
            if changed:
                logger.info("model %s: %s, loading", name, "new" if entry is None else "changed")
                try:
                    await self.load(name)
                except ShoalError as exc:
                    logger.error("model %s: %s", name, exc.message)
                except Exception as exc:  # noqa: BLE001 - Shoal's own fault in one model's load: the poll goes on
                    internal_error(exc, f"loading model '{shown(name)}'")
        for name in sorted(set(self._models) - present):
            async with self._locks.setdefault(name, asyncio.Lock()):
                entry = self._models.pop(name, None)  # unknown from now on, as it drains
                self._changed()
                if entry is not None and entry.versions:
                    logger.info("model %s: folder removed, unloading", name)
                    await self._retire(entry)
            await self._dependents.retire(name)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll_once()
            except ShoalError as exc:  # e.g. the repository now looks like a model folder
                logger.error("repository poll: %s", exc.message)
            except Exception:  # noqa: BLE001 - a bad scan must not stop polling
                logger.exception("repository poll failed")

    # -- queries -------------------------------------------------------------------------------------

    def host_infer(
        self, request: InferRequest, sink: Any = None, caller: ModelVersion | None = None, trace_id: int = 0
    ) -> concurrent.futures.Future[InferResponse]:
        """A model's request to another model of this server (BLS), from any thread: it runs on the
        serving loop through the target version's scheduler and statistics, as a client's would.
        With ``sink`` (``exec(decoupled=True)``) a decoupled model's responses go there as they come.
        ``caller``: the version whose instance makes the call (``ModelVersion.bind_host``); ``trace_id``:
        the calling request's trace (``InferenceRequest(trace=...)``), under which the call's is nested."""
        if self._loop is None or self._loop.is_closed():
            raise ShoalError(ErrorCode.UNAVAILABLE, "the server is not serving")
        if sink is not None:
            request = replace(request, sink=sink)

        async def infer() -> InferResponse:
            target = _bls_target(self, request)
            if target is caller:
                _refuse_a_call_that_waits_for_itself(target)
            parent = live_trace(trace_id) if trace_id else None
            if parent is None:
                return await target.infer(request)
            traced = parent.child(target.spec.name, str(target.version))
            TRACED.set(traced)  # this call's own task
            try:
                return await target.infer(request)
            except ShoalError as exc:
                traced.error = exc.message
                raise
            finally:
                traced.stamp("REQUEST_END")

        return asyncio.run_coroutine_threadsafe(infer(), self._loop)

    def entry(self, name: str) -> ModelEntry:
        model = self._models.get(name)
        if model is None:
            raise unknown_model(name)
        return model

    def resolve(self, name: str, version: str) -> ModelVersion:
        """The version to serve: ``""`` means the highest READY one, as Triton. The errors are Triton 2.51's
        (core model_lifecycle.cc ``GetModel``): a model with no ready version is as unknown as one never
        loaded (NOT_FOUND), a named version that is not ready is UNAVAILABLE; the index says why."""
        number = _version_number(version) if version else None
        model = self.entry(name)
        if number is None:
            newest = model.newest_ready()
            if newest is None:
                raise ShoalError(
                    ErrorCode.MODEL_NOT_FOUND, f"Request for unknown model: '{shown(name)}' has no available versions"
                )
            chosen = model.versions[newest]
        else:
            found = model.versions.get(number)
            if found is None:
                loading = self._loading.get(name)
                if loading is not None and number in loading.chosen:  # Triton lists it LOADING already
                    raise ShoalError(
                        ErrorCode.UNAVAILABLE,
                        f"Request for unknown model: '{shown(name)}' version {number} is not at ready state",
                    )
                raise unknown_model(name, str(number))
            chosen = found
        if chosen.served is None:
            raise ShoalError(
                ErrorCode.UNAVAILABLE,
                f"Request for unknown model: '{shown(name)}' version {chosen.version} is not at ready state",
            )
        return chosen.served

    def is_ready(self, name: str, version: str) -> bool:
        """False for a model or version that is unknown or not ready; a version string that is no
        version number is refused (INVALID_ARGUMENT), as Triton's ModelReady refuses it."""
        try:
            served = self.resolve(name, version)
        except ShoalError as exc:
            if exc.code is ErrorCode.INVALID_ARGUMENT:
                raise
            return False
        return served.can_serve()

    def names(self) -> list[str]:
        return sorted(self._models)

    def all_ready(self) -> bool:
        """Every model the server is meant to serve is READY (one unloaded on purpose is not meant to),
        and none lists a version a reload failed on (Triton 2.51's strict readiness, run here, is false
        while one does, though the version before it serves)."""
        return all(
            m.state is ModelState.READY
            and not any(v.state is ModelState.UNAVAILABLE and v.reason != UNLOADED for v in m.versions.values())
            for m in self._models.values()
            if not m.unloaded
        )

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        rows = []
        for model in sorted(self._models.values(), key=lambda m: m.name):
            if not model.versions:
                rows.append(IndexEntry(model.name, "", model.state, model.reason))
            for version in sorted(model.versions.values(), key=lambda v: v.version):
                reason = version.reason or (model.reason if version.state is ModelState.READY else "")
                rows.append(IndexEntry(model.name, str(version.version), version.state, reason))
        if not ready_only and self.control_mode == "explicit":
            loaded = set(self._models)
            rows += [
                IndexEntry(n, "", ModelState.UNKNOWN, "")
                for n in scanner.list_models(self.repository, warn=False)
                if n not in loaded
            ]
            rows.sort(key=lambda r: r.name)
        return [r for r in rows if not ready_only or r.state is ModelState.READY]

    def statistics(self, name: str, version: str) -> list[ModelVersion]:
        """Versions to report: every ready version of every model for name ``""`` (whatever a valid
        version says), as Triton; Triton 2.51's refusals, in its order: the version string first."""
        number = _version_number(version) if version else None
        if not name:
            return [e.served for m in self._models.values() for e in m.versions.values() if e.served]
        model = self._models.get(name)
        served = [e.served for e in model.versions.values() if e.served] if model is not None else []
        if not served:  # unknown, or no version loaded: Triton 2.51's answers (run here)
            raise invalid(f"requested model '{shown(name)}' is not available")
        if number is None:
            return served
        chosen = [s for s in served if s.version == number]
        if not chosen:
            raise invalid(f"requested model version is not available for model '{shown(name)}'")
        return chosen

    async def close(self) -> None:
        """Drain and unload everything (shutdown). A load under way ends first, without installing what it
        built (its client hears UNAVAILABLE), and none begins after: a model installed past this point
        would never be unloaded, nor its ``finalize`` run. The load of a model stuck in ``initialize``
        holds the stop until ``--exit-timeout-secs`` ends it."""
        self._closed = True
        for lock in list(self._locks.values()):
            async with lock:  # the load holding it, if any, has ended
                pass
        for entry in list(self._models.values()):
            await self._retire(entry)


class _InOrder:
    """One model's clients' loads and unloads, one at a time in the order asked (an asyncio lock
    wakes its waiters first come, first served), and how many calls hold or wait for it."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


def shutting_down(name: str) -> ShoalError:
    return ShoalError(ErrorCode.UNAVAILABLE, f"failed to load '{shown(name)}': the server is shutting down")


def _version_number(version: str) -> int:
    """A request's version string as Triton 2.51's front end reads it, with ``std::stol`` before it looks
    the model up: leading blanks, a sign and ASCII digits, the rest ignored (``1abc`` is 1); no number, or
    one past 64 bits, and a negative one are refused INVALID_ARGUMENT in its words. 0 is a version no
    model has (NOT_FOUND, ModelReady false), as to Triton."""
    parsed = _STOL.match(version)
    sign, digits = (parsed.group(1), parsed.group(2).lstrip("0") or "0") if parsed else ("", "")
    # Past 19 digits no number fits 64 bits (and Python refuses int() of over 4300 digits): out of range.
    number = int(sign + digits) if parsed and len(digits) <= 19 else None
    if number is None or not -(2**63) <= number < 2**63:
        raise invalid(
            f"failed to get model version from specified version string '{shown(version)}' (details: stol), "
            "version should be an integral value > 0"
        )
    if number < 0:
        raise invalid(f"invalid model version specified '{shown(version)}' , version should be an integral value > 0")
    return number


def _load_refusal(entry: ModelEntry) -> ShoalError:
    """Triton's answer to a load that left no version ready (core model_repository_manager.cc
    ``LoadUnloadModels``, model_lifecycle.cc ``OnLoadComplete``): INVALID_ARGUMENT, each failed
    version's state and reason, or the model's reason when no version was tried (Triton ends it with
    a newline, which Shoal leaves out)."""
    failed = "".join(
        f"version {number} is at {version.state.value} state: {version.reason};"
        for number, version in sorted(entry.versions.items())
        if version.state is not ModelState.READY
    )
    return ShoalError(
        ErrorCode.INVALID_ARGUMENT, f"load failed for model '{shown(entry.name)}': {failed or entry.reason}"
    )


def _show_failed_versions(serving: ModelEntry, failed: ModelEntry) -> None:
    """After a reload that failed, the versions it tried that ``serving`` has no READY one of are shown
    beside those it serves, UNAVAILABLE with why (the index; a request naming one is told it is not
    ready), as Triton 2.51 shows them. A reload that failed before any version (its config) leaves its
    reason on the serving entry's rows instead: Triton's index would show no sign of it."""
    tried = {
        number: version
        for number, version in failed.versions.items()
        if number not in serving.versions or serving.versions[number].state is not ModelState.READY
    }
    if tried:
        serving.versions = {**serving.versions, **tried}  # one assignment: index() never sees the dict change
    else:
        serving.reason = f"reload failed, previous version kept serving: {failed.reason}"


def _forget_failed_reload(serving: ModelEntry) -> None:
    """What ``_show_failed_versions`` added, taken away: the folder the reload failed on is gone."""
    serving.versions = {n: v for n, v in serving.versions.items() if v.state is ModelState.READY}
    serving.failed_fingerprint = None
    serving.reason = ""


def _unchanged_versions(old: ModelEntry | None, new: ModelEntry, chosen: list[int]) -> dict[int, VersionEntry]:
    """The READY versions of ``old`` that ``new`` keeps serving rather than rebuilds: chosen again,
    their version folder unchanged, and the config the same but for ``version_policy`` (Triton's
    ``ModelLifeCycle::AsyncLoad`` updates such a version in place: ``IsModelVersionModified`` and
    ``ConfigChangeRequiresReload``, which ignores ``version_policy`` and ``instance_group``)."""
    if old is None or old.spec is None or new.spec is None or old.fingerprint is None or new.fingerprint is None:
        return {}
    if _apart_from_policy(old.spec) != _apart_from_policy(new.spec) or old.fingerprint.others != new.fingerprint.others:
        return {}  # the others: files every version reads (initial_state/, warmup/)
    return {
        number: version
        for number, version in old.versions.items()
        if number in chosen
        and version.state is ModelState.READY
        and version.served is not None
        and old.fingerprint.version(number) is not None
        and old.fingerprint.version(number) == new.fingerprint.version(number)
    }


def _apart_from_policy(spec: ModelSpec) -> ModelSpec:
    config = {key: value for key, value in spec.config_json.items() if key != "version_policy"}
    return replace(spec, version_policy=VersionPolicy(), config_json=config)


def _devices(spec: ModelSpec) -> set[Any]:
    try:
        return {p.device for p in placements(spec)}
    except ShoalError:
        return set()


def _load_and_warm(
    spec: ModelSpec,
    version: int,
    folder: Path,
    model_folder: Path,
    host: Callable[..., Any],
    limiter: RateLimiter | None,
) -> ModelVersion:
    """Load one version and warm every copy: the config's ``model_warmup`` samples (one that fails fails
    the load, as Triton), else one zero-filled request (whose failure is only logged: zeros may be no
    valid input; real requests decide). ShoalError if it fails. ``host`` is bound first: a Python
    model's warm-up may call other models (BLS), as its requests may.

    It runs on a load thread, where no cancellation of the event loop's arrives: a BaseException
    that is no Exception was raised by the model's code and fails this load only.
    """
    try:
        samples = warmup.samples(spec, model_folder)  # before loading: a bad sample costs no load
    except ShoalError:
        raise
    except Exception as exc:  # a bug reading one model's samples fails that model's load, not the server
        logger.exception("model %s version %d: unexpected failure reading its warm-up samples", spec.name, version)
        raise load_failed(f"model '{spec.name}' version {version}: its warm-up samples: {exc}") from exc
    try:
        served = ModelVersion.load(spec, version, folder, limiter)
    except ShoalError as exc:
        logger.error("model %s version %d: %s", spec.name, version, exc.message)
        raise
    except Exception as exc:  # a backend bug must not take the other models down
        logger.exception("model %s version %d: unexpected load failure", spec.name, version)
        raise ShoalError(ErrorCode.UNAVAILABLE, f"unexpected load failure: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - SystemExit & co. from a model file, on this load thread
        logger.error("model %s version %d: loading raised %s", spec.name, version, type(exc).__name__, exc_info=exc)
        raise ShoalError(ErrorCode.UNAVAILABLE, f"unexpected load failure: {type(exc).__name__}: {exc}") from None
    served.bind_host(host)
    started = time.monotonic()
    try:
        served.warm_up(samples)
    except BaseException as exc:  # noqa: BLE001 - the model's own code
        if not samples:
            logger.warning("model %s version %d: warm-up with zero inputs failed: %s", spec.name, version, exc)
            return served
        asyncio.run(served.close())
        message = (
            exc.message
            if isinstance(exc, ShoalError)
            else str(exc)
            if isinstance(exc, warmup.SampleFailed)
            else f"{type(exc).__name__}: {exc}"
        )
        logger.error("model %s version %d: %s", spec.name, version, message)
        raise load_failed(f"model '{spec.name}' version {version}: {message}") from None
    if samples:
        elapsed_s = time.monotonic() - started
        served.statistics.warmup.add(int(elapsed_s * 1e9), count=sum(s.runs for s in samples))
        logger.info(
            "model %s version %d: warmed up with %d sample(s), %d run(s) per copy, in %.0f ms",
            spec.name,
            version,
            len(samples),
            served.statistics.warmup.count,
            elapsed_s * 1000,
        )
    return served
