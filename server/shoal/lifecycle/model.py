"""One served model version: its config, its executors over the loaded weights, its scheduler.

This module only composes: where the executors go (``placements``), how they run over the
weights (``shoal.instances.strategy``, which asks the backend what it can do), and the scheduler
in front of them. It names no framework.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from shoal.backends.base import Backend, FeedModel, RequestModel, backend_for, resolve_kind
from shoal.backends.devices import CPU, Device, cuda_device_count
from shoal.errors import DecoupledRefused, ErrorCode, ShoalError, load_failed
from shoal.instances import strategy
from shoal.instances.pool import Instance, InstancePool, Placement, instance_name
from shoal.lifecycle import model_work, request_checks, warmup
from shoal.lifecycle.in_flight import InFlight
from shoal.lifecycle.response_cache import ResponseCache, VersionCache
from shoal.repository.config import InstanceKind, ModelSpec
from shoal.repository.sequence_config import read_initial_states
from shoal.repository.sequence_spec import backend_spec
from shoal.request_types import InferRequest, InferResponse, Tensor
from shoal.scheduling.base import ModelScheduler
from shoal.scheduling.dynamic import Scheduler
from shoal.scheduling.rate_limiter import Admission, Claim, RateLimiter, claim_for
from shoal.scheduling.sequence import SequenceScheduler
from shoal.statistics import FailureReason, ModelStatistics

logger = logging.getLogger(__name__)

# One number per loaded version, never given twice in a server's life (the response cache's keys start
# with it, so that a reload never answers from the old copy's entries).
_load_numbers = itertools.count(1)


def next_load_number() -> int:
    return next(_load_numbers)


def placements(spec: ModelSpec) -> list[Placement]:
    """Where each instance group's executors go; GPU groups get ``count`` per listed GPU."""
    gpus = cuda_device_count()
    result = []
    for group in spec.instance_groups:
        kind = resolve_kind(spec.backend, group, gpus)
        if kind is not InstanceKind.GPU:
            result.append(Placement(group.name, CPU, group.count, group.rate_limiter))
            continue
        if gpus == 0:
            raise load_failed(
                f"model '{spec.name}': instance group '{group.name}' asks for KIND_GPU but no CUDA device is available"
            )
        indices = group.gpus or tuple(range(gpus))
        for index in indices:
            if not 0 <= index < gpus:
                raise load_failed(
                    f"model '{spec.name}': instance group '{group.name}' lists GPU {index}, but {gpus} GPU(s) exist"
                )
            result.append(Placement(group.name, Device("gpu", index), group.count, group.rate_limiter))
    return result


def admit(spec: ModelSpec, where: list[Placement], limiter: RateLimiter | None) -> Admission | None:
    """Register the instances' claims (their groups' ``rate_limiter``) with the limiter, if it is on;
    ShoalError, in Triton's words, if one could never execute. CPU instances claim on device 0, as Triton's."""
    if limiter is None:
        return None
    claims: list[Claim] = []
    for placement in where:
        device = placement.device.index if placement.device.kind == "gpu" else 0
        asked = placement.rate_limiter
        for index in range(placement.count):
            name = instance_name(placement, index)
            claims.append(claim_for(f"{spec.name}:{name}", device, asked.resources, asked.priority))
    admission = Admission(limiter, claims)  # bound to the executors, in this order, once they are built
    limiter.register(admission, claims)
    return admission


class ModelVersion:
    """A READY version: ``infer`` checks the request, queues it with the scheduler, shapes the reply."""

    def __init__(
        self,
        spec: ModelSpec,
        version: int,
        pool: InstancePool,
        memory_bytes: dict[Device, int] | None = None,
        backend: Backend | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.spec = spec
        self.version = version
        self.pool = pool
        # Weight bytes the loaded copies hold, per device (each backend counts its own; see
        # LoadedModel.weight_bytes). Budgets and the memory metrics use these figures.
        self.memory_bytes = dict(memory_bytes or {})
        self._backend = backend  # for its per-request checks; None: none
        self.statistics = ModelStatistics()
        self.admission = admission  # its instances' claims on the rate limiter, when it is on
        self.load_number = next_load_number()
        self.cache: VersionCache | None = None  # use_cache: the server's response cache, when both enable it
        self._in_flight = InFlight()  # close() serves what entered infer, queued or not yet
        self._cache_holding_number: ResponseCache | None = None  # use_cache: forget this version's number at close
        self.scheduler: ModelScheduler
        if spec.sequence_batching is not None:
            self.scheduler = SequenceScheduler(
                pool, self.statistics, spec.max_batch_size, spec.sequence_batching, spec.name, admission
            )
        else:
            self.scheduler = Scheduler(pool, self.statistics, spec.max_batch_size, spec.dynamic_batching, admission)

    @classmethod
    def load(cls, spec: ModelSpec, version: int, version_dir: Path, limiter: RateLimiter | None = None) -> ModelVersion:
        """Choose how the executors run (refused before any weight loads), place them, load, start them."""
        model_path = version_dir / spec.default_model_filename if spec.default_model_filename else version_dir
        if spec.sequence_batching is not None:  # initial_state data files, from <model>/initial_state/
            spec = replace(spec, sequence_batching=read_initial_states(version_dir.parent, spec.sequence_batching))
        backend = backend_for(spec)
        plan = strategy.choose(spec, backend)
        where = placements(spec)
        admission = admit(spec, where, limiter)  # an instance that could never execute fails the load first
        try:
            # The backend sees the sequence batcher's control and state tensors too; requests are checked
            # against the config's own.
            built = strategy.build_instances(backend_spec(spec), model_path, where, backend, plan)
            if admission is not None:
                admission.bind(built.pool.instances)
        except BaseException:
            if admission is not None:
                admission.limiter.unregister(admission)
            raise
        logger.info(
            "model %s version %d: %d instance(s), %s, over %d loaded cop%s",
            spec.name,
            version,
            len(built.pool.instances),
            built.strategy.value,
            built.copies,
            "y" if built.copies == 1 else "ies",
        )
        return cls(spec, version, built.pool, built.memory_bytes, backend, admission)

    def use_cache(self, cache: ResponseCache, answer_from_it: bool) -> None:
        """Before taking traffic. ``answer_from_it``: answer requests equal to an earlier one from ``cache``.
        Either way the version's load number leaves ``cache`` with it (``close``): a caching ensemble's
        entries hold its steps' numbers, whether or not the steps cache their own answers."""
        self._cache_holding_number = cache
        if answer_from_it and self.cache is None:
            self.cache = VersionCache(cache, self.statistics)

    def _forget_cached_answers(self) -> None:
        if self._cache_holding_number is not None:
            self._cache_holding_number.forget(self.load_number)

    def composition(self) -> tuple[int, ...]:
        """The load numbers of what answers this version's requests: its own (an ensemble adds its steps')."""
        return (self.load_number,)

    def stateful_model(self) -> str | None:
        """The model answering this version's requests (itself, or an ensemble's step) whose answers no
        response cache may keep: a sequence model's depend on its sequence's state, a decoupled model's
        are several. None when there is none."""
        return self.spec.name if self.spec.sequence_batching is not None or self.spec.decoupled else None

    def bind_host(self, host: Callable[..., Any]) -> None:
        """Give the instances that call other models (Python models' BLS) the host's entry point, and
        this version, which they name as the caller (a call to the calling version itself may be refused)."""
        for model in self.pool.models():
            if model.runs_requests:
                cast(RequestModel, model).bind_host(host, self)

    @property
    def queued(self) -> int:
        """Requests waiting for an executor."""
        return self.scheduler.queued

    @property
    def instance_count(self) -> int:
        return len(self.pool.instances)

    def can_serve(self) -> bool:
        """At least one instance can take a request (a process instance whose worker is dead or hung cannot)."""
        return self.pool.can_serve()

    def warm_up(self, samples: Sequence[warmup.Sample] = ()) -> None:
        """Run the config's warm-up samples (``lifecycle/warmup.py``) on every loaded copy, off the event
        loop; without any, one zero-filled request (batch 1), whose failure the caller only logs, but
        for Python models (their ``execute`` is the user's code: it runs only on the config's samples)."""
        spec = backend_spec(self.spec)
        configured = bool(samples)
        zeros = request_checks.zeros_feed(spec)  # also the sequence batcher's own tensors, which a sample does not name
        if not samples:
            samples = [warmup.Sample("", zeros, spec.output_names, 1)]
        decoupled = self.spec.decoupled
        for instance in {id(i.model): i for i in self.pool.instances}.values():  # one instance per loaded copy
            model = instance.model
            admitted = self._admitted(instance)  # each warm-up run passes the rate limiter too, as Triton's
            if model.runs_requests:  # a Python model: it runs lists of requests, not feeds
                for sample in samples if configured else ():  # its execute is the user's: no zeros of ours
                    try:
                        warmup.run_on_requests(model, sample, decoupled, spec.max_batch_size > 0, admitted)
                    except BaseException as exc:  # noqa: BLE001 - the model's own code: named with its sample
                        raise warmup.SampleFailed(sample.name, exc) from exc
                continue
            for sample in samples:
                rows = next(iter(sample.feed.values())).shape[0] if spec.max_batch_size > 0 and sample.feed else 1
                extra = {
                    name: np.repeat(array, rows, axis=0) if spec.max_batch_size > 0 else array
                    for name, array in zeros.items()
                    if name not in sample.feed
                }
                for _ in range(sample.runs):
                    with admitted():
                        try:
                            cast(FeedModel, model).run({**sample.feed, **extra}, list(sample.outputs))
                        except BaseException as exc:  # noqa: BLE001 - the backend's or model's: named with its sample
                            if not configured:
                                raise
                            raise warmup.SampleFailed(sample.name, exc) from exc

    def _admitted(self, instance: Instance) -> Callable[[], AbstractContextManager[None]]:
        """A fresh hold of ``instance``'s claim per warm-up run (none without the limiter)."""
        admission = self.admission
        if admission is None:
            return nullcontext
        claim = admission.claim_of(instance)
        return lambda: admission.limiter.holding(claim)

    async def infer(self, request: InferRequest) -> InferResponse:
        refuse_unstreamed(self.spec, request)  # whoever sends it: a client, a BLS exec(), an ensemble's step
        # Counted from here: a request may wait (a large one's cache lookup runs on a thread) before it is
        # queued, and a reload retiring this version meanwhile must still serve it (close waits for it).
        # (In this one coroutine: a request is one await here, on every model's hot path.)
        with self._in_flight:
            arrival_ns = time.monotonic_ns()
            try:
                prepared = request_checks.prepare(self.spec, request)
                if self._backend is not None:
                    self._backend.validate_request(self.spec, prepared.feed)
            except ShoalError:  # rejected for bad input: still a failed request of this version
                self.statistics.record_failure(time.monotonic_ns() - arrival_ns, FailureReason.OTHER)
                raise
            cache = self.cache
            if cache is not None:  # never a decoupled or sequence model: their loads refuse the cache
                lookup = await cache.look_up(prepared, request.parameters, self.composition(), arrival_ns)
                if lookup.outputs is not None:
                    return self._answer(request, lookup.outputs)
            try:
                # A decoupled model's responses are checked as they go into the sink; its answer has no outputs.
                streamed = request.sink is not None and self.spec.decoupled
                check = None if streamed else request_checks.output_check(self.spec, prepared)
                results = await self.scheduler.submit(
                    prepared.feed,
                    prepared.outputs,
                    prepared.batch_size,
                    request.parameters,
                    context=request,
                    check=check,
                )
            except ShoalError:
                raise
            except Exception as exc:  # logged once per batch by the scheduler
                raise ShoalError(
                    ErrorCode.INTERNAL, f"model '{self.spec.name}' version {self.version} failed: {exc}"
                ) from exc
            if streamed:  # outputs: in the sink
                return self._answer(request, ())
            if request_checks.finish_is_costly(prepared, results):  # a wide classification: off the event loop
                outputs = await asyncio.to_thread(request_checks.respond, self.spec, prepared, results)
            else:
                outputs = request_checks.respond(self.spec, prepared, results)
            if cache is not None:
                await cache.insert(lookup, outputs)
            return self._answer(request, outputs)

    def _answer(self, request: InferRequest, outputs: tuple[Tensor, ...]) -> InferResponse:
        """This version's response to ``request`` (its id, this version's name and number) with ``outputs``."""
        return InferResponse(model_name=self.spec.name, model_version=str(self.version), id=request.id, outputs=outputs)

    async def close(self) -> None:
        """Finish entered, queued and running requests, then release the instances and the weights."""
        await self._in_flight.drained()
        await self.scheduler.stop()
        self._forget_cached_answers()
        await model_work.in_thread(self.pool.close)  # the model's finalize: a model thread, not asyncio's
        if self.admission is not None:
            self.admission.limiter.unregister(self.admission)


def refuse_unstreamed(spec: ModelSpec, request: InferRequest) -> None:
    """A request that wants one response (no sink to stream into) to a decoupled model is refused, before
    it is queued (in a batch, it failed every request batched with it) and, for a client's, before its
    shared memory is read (Triton refuses it first: its clients see these words whatever else is wrong)."""
    if spec.decoupled and request.sink is None:
        raise DecoupledRefused()
