"""Triton's Python backend: ``backend: "python"`` and a ``model.py`` defining ``TritonPythonModel``.

The model author's API is Triton's, unchanged (``pb_utils``, the module models import as
``triton_python_backend_utils``); ``runner`` runs a model, ``autocomplete`` its
``auto_complete_config``, ``bls`` its calls to other models. Each instance runs in its own worker
process by default (``shoal.instances.python_process``, like Triton's stub processes), or, with
the parameter ``process_instances: false``, on an instance thread in the server
(``ThreadInstance``), for models that release the GIL or must share the server's memory.

Unlike the other backends there are no weights to load once and share: every instance imports
the model file and calls ``initialize`` itself, so the instance strategy builds these instances
itself (``own_instances`` in ``backends.base.BACKENDS``) and the scheduler hands them lists of requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any

import numpy as np
from google.protobuf import json_format

from shoal import custom_metrics
from shoal.backends.devices import Device
from shoal.backends.python import autocomplete, bls, pb_utils, runner
from shoal.errors import DecoupledRefused, ShoalError, load_failed
from shoal.protocol import config_pb2, wire_names
from shoal.repository import scanner
from shoal.repository.config import ModelSpec
from shoal.request_types import InferRequest, ResponseSink

DEFAULT_PROCESS_INSTANCES = True  # an instance is a process unless the config says otherwise


def gpu_available() -> bool:
    """KIND_AUTO resolves to the CPU: a Python model's tensors are numpy arrays in host memory."""
    return False


def complete_config(config: config_pb2.ModelConfig, folder: Path) -> config_pb2.ModelConfig:
    """The config a Python model's ``auto_complete_config`` (in the newest version's model file) returns,
    as Triton's Python backend completes it (``backends.base.complete_own_config``)."""
    versions = scanner.list_versions(folder, warn=False)
    if not versions:
        return config
    label = PurePath(folder.name, str(versions[-1]), config.default_model_filename or "model.py")
    scanner.checked_version_dir(folder, versions[-1])
    document = json_format.MessageToDict(config, preserving_proto_field_name=True)
    completed = autocomplete.auto_complete(
        runner.triton_config(document), scanner.checked_path(folder.parent, label), str(label)
    )
    result = config_pb2.ModelConfig()
    try:
        json_format.ParseDict(completed, result, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise load_failed(
            f"model '{config.name}': auto_complete_config returned an invalid config: {wire_names(str(exc))}"
        ) from None
    return result


def check_model_file(model_file: Path, label: str) -> None:
    """A model.py declares no tensors: it is imported (never run), as an instance's load imports it."""
    if not model_file.is_file():
        raise load_failed(f"model file {label} not found")
    autocomplete.check_import(model_file, label)


def load(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> ThreadInstance:
    """One in-process instance (the strategy names instances itself and calls ``ThreadInstance``)."""
    return ThreadInstance(spec, model_path, device, f"{spec.name}_0", version_of(model_path))


def version_of(model_file: Path) -> int:
    return int(model_file.parent.name)


def sink_of(pending: Any) -> ResponseSink:
    """The response sink of a queued request (``scheduling.base.QueuedRequest``) to a decoupled model:
    its core request (``context``) carries it."""
    request: InferRequest | None = pending.context
    sink = request.sink if request is not None else None
    if sink is None:
        raise DecoupledRefused()
    return sink


class ThreadInstance:
    """A Python model instance on an instance thread of the server (``process_instances: false``).

    It imports the model's files in an import context of its own (``shoal.backends.python.imports``),
    so models and versions sharing the server's ``sys.modules`` each run their own ``helper.py``.
    """

    weight_bytes = 0
    runs_requests = True  # execute(requests), as Triton's

    def __init__(self, spec: ModelSpec, model_file: Path, device: Device, instance_name: str, version: int) -> None:
        # Installed (process-wide) only by ``run_requests``, once ``bind_host`` gave it its host: installed
        # here, with none yet, it failed the BLS calls other thread models made while this one initialized.
        self._link = bls.ThreadLink(None)
        self._caller: Any = None
        args = runner.model_args(
            spec.config_json, model_file, instance_name, device.kind.upper(), device.index, version
        )
        self._decoupled = spec.decoupled
        # The model's custom metrics: the server's registry, its series given back at the unload.
        self._metrics = custom_metrics.InstanceMetrics(custom_metrics.REGISTRY, instance_name)
        if pb_utils._metrics is None:  # a family made on a thread a model started: no instance's, unnamed
            pb_utils.set_metrics_link(custom_metrics.InstanceMetrics(custom_metrics.REGISTRY, "", own_holds=False))
        try:
            with bls.initializing():  # a BLS call from initialize raises, as Triton's
                self._runner = runner.ModelRunner(
                    spec.config_json, model_file, args, isolated=True, metrics=self._metrics
                )
        except BaseException as exc:  # noqa: BLE001 - SystemExit too (argparse): this load fails, not the server
            self._metrics.close()
            raise load_failed(runner.describe_error(exc).rstrip()) from None

    def bind_host(self, host: bls.HostInfer, caller: Any) -> None:
        """``caller``: this instance's version, named by the BLS calls its execute makes on its thread."""
        self._link.host = host
        self._caller = caller

    def run_requests(self, batch: Sequence[Any]) -> list[dict[str, np.ndarray] | ShoalError]:
        pb_utils.set_host_link(self._link)  # every thread instance of a server holds the same host
        with bls.running_as(self._caller):
            return self._run(batch)

    def _run(self, batch: Sequence[Any]) -> list[dict[str, np.ndarray] | ShoalError]:
        # The model gets inputs of its own, as a process instance's does (views of its batch's arena) and
        # as Triton's stub does (copies in its shared memory): an array here may be another's too (an
        # ensemble step's input is its sibling steps' and the ensemble's output; a BLS call's, its
        # caller's), and a model may write into its inputs.
        items = [
            runner.request_data(
                {name: array.copy() for name, array in pending.feed.items()},
                pending.outputs,
                pending.context,
                getattr(pending, "traced", None),
            )
            for pending in batch
        ]
        if self._decoupled:
            sinks = [sink_of(pending) for pending in batch]

            def emit(index: int, outcome: runner.Outcome | None, final: bool) -> None:
                sinks[index].put(None if outcome is None else outcome.result(), final)  # copied as sent

            self._runner.execute_decoupled(items, emit, lambda index: sinks[index].cancelled)
            return [{} for _ in batch]  # the responses went through the sinks
        return [_owned(outcome.result()) for outcome in self._runner.execute(items)]

    def close(self) -> None:
        try:
            self._runner.finalize()
        finally:
            self._metrics.close()


def _owned(result: dict[str, np.ndarray] | ShoalError) -> dict[str, np.ndarray] | ShoalError:
    """A returned response's outputs copied once ``execute`` returns, as Triton's stub copies them into
    its shared memory then (and a process instance into its arena): an array the model returns may be
    its own (one buffer it fills for every request), which its next batch rewrites while this response
    is still being encoded, waits for an ensemble's next step, or goes into the response cache. (A
    response sent through a sender is copied as it is sent: ``pb_utils._as_sent``.)"""
    if isinstance(result, ShoalError):
        return result
    return {name: np.array(array, copy=True) for name, array in result.items()}
