"""``auto_complete_config``: a Python model completes its own config, as Triton's Python backend does.

Triton imports ``model.py`` in a stub process at load and calls the class's static
``auto_complete_config(auto_complete_model_config)`` with a ``ModelConfig`` wrapper of the config
as read; what it returns is the config the model loads with. Shoal does the same in a short-lived
child process (``python -m shoal.backends.python.autocomplete MODEL_PY``, config JSON in on stdin,
out on stdout), so a model file's import-time code never runs in the server. A model file that
does not mention ``auto_complete_config`` is not imported here: Triton's default keeps the config
as it is, and import errors are then reported when the instances start; ``shoal config check``
imports every model file in the same child (``check_import``) to report them without serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from shoal.errors import load_failed

AUTO_COMPLETE_TIMEOUT_S = 60.0


class ModelConfig:
    """The object ``auto_complete_config`` receives (Triton's ``pb_utils.ModelConfig``)."""

    def __init__(self, model_config: dict[str, Any] | str) -> None:
        self._config: dict[str, Any] = json.loads(model_config) if isinstance(model_config, str) else model_config

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def max_batch_size(self) -> int:
        return int(self._config.get("max_batch_size", 0))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = self.max_batch_size()
        if current and current != max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._config.get('name', '')}' specified max_batch_size "
                f"{max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        if "sequence_batching" in self._config:
            raise ValueError(
                f"Configuration specified scheduling_choice as 'sequence_batching', but "
                f"auto-complete-config function for model '{self._config.get('name', '')}' tries "
                "to set scheduling_choice as 'dynamic_batching'"
            )
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property in auto-complete-config function for model "
                    f"'{self._config.get('name', '')}' contains property other than 'decoupled'"
                )
        self._config.setdefault("model_transaction_policy", {}).update(transaction_policy_dict)

    def add_input(self, input: dict[str, Any]) -> None:  # noqa: A002 - Triton's parameter name
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        """Add a tensor, or check one the config already has: what both give must agree."""
        model = self._config.get("name", "")
        for key in ("name", "data_type", "dims") if kind == "input" else ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(
                    f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model "
                    f"'{model}' is missing '{key}' property."
                )
        existing = next((t for t in self._config.setdefault(kind, []) if t.get("name") == tensor["name"]), None)
        if existing is None:
            self._config[kind].append({k: (list(v) if k == "dims" else v) for k, v in tensor.items()})
            return
        for key in ("data_type", "dims"):
            given, wanted = existing.get(key), tensor[key]
            if key == "dims":
                given, wanted = [int(d) for d in given or ()], [int(d) for d in wanted]
            if given and given != wanted:
                raise ValueError(
                    f"unable to load model '{model}', configuration expects {given} as {key} of "
                    f"{kind} '{tensor['name']}', model provides {wanted}"
                )
            existing[key] = wanted


def auto_complete(config: dict[str, Any], model_file: Path, label: str) -> dict[str, Any]:
    """The config ``model_file``'s ``auto_complete_config`` returns for ``config`` (a ModelConfig as JSON)."""
    try:
        source = model_file.read_text(errors="replace")
    except OSError as exc:
        raise load_failed(f"model file {label} cannot be read: {exc.strerror}") from None
    if "auto_complete_config" not in source:
        return config
    try:
        completed: dict[str, Any] = json.loads(_in_child(model_file, label, config))
    except json.JSONDecodeError:  # the child's answer is its own; a mangled one fails this load, nothing more
        raise load_failed(f"{label}: auto_complete_config's answer could not be read") from None
    return completed


def check_import(model_file: Path, label: str) -> None:
    """LOAD_FAILED with the error an instance's load reports if ``model_file`` does not import or
    defines no ``TritonPythonModel`` (``shoal config check`` refuses what ``serve`` refuses). It is
    imported in the same child as ``auto_complete``: never initialized, never executed."""
    _in_child(model_file, label, None)


def _in_child(model_file: Path, label: str, config: dict[str, Any] | None) -> str:
    """What the child prints: the completed ``config``, or nothing when ``config`` is None (import only)."""
    step, late = ("importing it", "did not finish") if config is None else ("auto_complete_config", "did not return")
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-m", __name__, str(model_file)],
            input=json.dumps(config),
            capture_output=True,
            text=True,
            errors="replace",  # what a model prints need not be UTF-8; the answer itself is JSON
            timeout=AUTO_COMPLETE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise load_failed(f"{label}: {step} {late} within {AUTO_COMPLETE_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise load_failed(lines[-1] if lines else f"{label}: {step} failed (exit code {done.returncode})")
    return done.stdout


def _main() -> None:
    """In the child: import the model file, run its auto_complete_config, print the config."""
    from shoal.backends.python import runner  # the model file's imports resolve as in an instance

    config = json.loads(sys.stdin.read())
    # The answer goes on a descriptor of its own: what the model prints (at import, in
    # auto_complete_config) goes to stderr, a log to Triton's stub, and never into the JSON.
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    try:
        model_class = runner.import_model_class(Path(sys.argv[1]))
        if config is None:  # only the import was asked for (check_import)
            return
        wrapper = ModelConfig(config)
        complete = getattr(model_class, "auto_complete_config", None)
        if complete is not None:
            wrapper = complete(wrapper)
            if not isinstance(wrapper, ModelConfig):
                raise ValueError("auto_complete_config must return the ModelConfig it was given")
    except Exception as exc:  # noqa: BLE001 - reported on the last line, as the load error
        sys.stderr.write(runner.describe_error(exc).splitlines()[0] + "\n")
        sys.exit(1)
    answer.write(json.dumps(wrapper.as_dict()))
    answer.flush()


if __name__ == "__main__":
    _main()
