"""``shoal config generate`` and ``shoal config check``: the server's own config pipeline, offline.

Both run ``shoal.configuring.pipeline`` (the code the server loads models with) and the
model-file check the backend makes at load, so what they accept the server serves.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from shoal.backends.base import load_model, probe_model
from shoal.backends.devices import CPU
from shoal.configuring.pipeline import Configured, check_against_model, configure
from shoal.errors import ShoalError, load_failed
from shoal.protocol import config_pb2
from shoal.protocol.types import DataType
from shoal.repository import scanner
from shoal.repository.config import CONFIG_FILENAME, DEFAULT_MODEL_FILENAMES
from shoal.repository.config_text import format_fields
from shoal.repository.instance_defaults import DEFAULT_INSTANCE_COUNT_RULE
from shoal.repository.model_io import complete

MODEL_SUFFIXES = {".onnx": "model.onnx", ".pt": "model.pt"}


@dataclass(frozen=True)
class GenerateOptions:
    max_batch_size: int | None = None
    instance_count: int | None = None
    kind: str | None = None  # KIND_CPU, KIND_GPU, KIND_AUTO
    name: str | None = None
    inputs: tuple[str, ...] = ()  # NAME:DTYPE:DIMS, for models without a signature (TorchScript)


def parse_input(text: str) -> tuple[str, DataType, tuple[int, ...]]:
    """``NAME:DTYPE:DIMS``, e.g. ``INPUT__0:FP32:3,224,224`` (DIMS of one sample, no batch dimension)."""
    parts = text.split(":")
    if len(parts) != 3:
        raise load_failed(f"--input {text!r}: expected NAME:DTYPE:DIMS, e.g. INPUT__0:FP32:3,224,224")
    name, dtype, dims = parts
    try:
        datatype = DataType(dtype.removeprefix("TYPE_").replace("STRING", "BYTES"))
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise load_failed(f"--input {text!r}: unknown datatype or non-integer dims") from None
    if any(d < 1 for d in shape):
        raise load_failed(f"--input {text!r}: dims must be positive (the model is run on them)")
    return name, datatype, shape


def prepare_folder(path: Path, name: str | None) -> Path:
    """The model folder for ``path``, as Triton's layout ``<repository>/<model>/<version>/model.onnx`` has it.

    A model folder is itself. A version folder (``repo/m/1``) or a model file in one
    (``repo/m/1/model.onnx``) is already in that layout: its model folder is the one above
    (``repo/m``), and nothing is copied. A bare model file gets ``<name>/1/model.<ext>`` beside
    it (copied); the copy is made again whenever its bytes differ from ``path`` (so ``--force``
    is not needed to pick up a changed file, and a stale or partial copy from an earlier failed
    run is never reused).
    """
    if path.is_dir():
        named = _named(path)
        if scanner.looks_like_version_folder(named) and not scanner.looks_like_model_folder(named):
            return _named(named.parent)
        return path
    if not path.is_file():
        raise load_failed(f"{path} is neither a model folder nor a model file")
    filename = MODEL_SUFFIXES.get(path.suffix)
    if filename is None:
        raise load_failed(f"{path}: expected a .onnx or .pt file, or a model folder")
    version_dir = _named(path.parent)
    if scanner.is_version_name(version_dir.name):
        if path.name != filename:  # the server would not find it there
            raise load_failed(
                f"{path} is in version folder {version_dir.name} of model folder "
                f"{_named(version_dir.parent)}, where the server loads {filename}: rename it"
            )
        return _named(version_dir.parent)
    folder = path.parent / (name or path.stem)
    target = folder / "1" / filename
    if not (target.is_file() and filecmp.cmp(path, target, shallow=False)):
        # A copy left by an earlier run (of another file, or cut short) is replaced, atomically.
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{filename}.partial")
        shutil.copy2(path, partial)
        os.replace(partial, target)
    return folder


def _named(path: Path) -> Path:
    """``path``, made absolute where it has no name of its own (``.``, ``..``)."""
    return path if path.name not in {"", ".."} else Path(os.path.abspath(path))


def generate(folder: Path, options: GenerateOptions) -> str:
    """The completed config for ``folder`` as commented text format."""
    base = config_pb2.ModelConfig(name=options.name or folder.name)
    if options.max_batch_size is not None:
        base.max_batch_size = options.max_batch_size
    if options.instance_count is not None or options.kind is not None:
        group = base.instance_group.add(count=options.instance_count or 0)  # 0: normalize's default for the kind
        group.kind = config_pb2.ModelInstanceGroup.Kind.Value(options.kind or "KIND_AUTO")
    versions = scanner.list_versions(folder)
    torch_file = next(
        (
            folder / str(versions[-1]) / f
            for f in ("model.pt", "model.pt2")
            if versions and (folder / str(versions[-1]) / f).exists()
        ),
        None,
    )
    if torch_file is None:
        configured = configure(folder, strict=False, base=base)
        check_against_model(configured, folder)
        return render(configured, source=folder)
    # TorchScript has no signature: run the model on the given input shapes to learn the rest.
    if not options.inputs:
        raise load_failed(
            f"{torch_file}: PyTorch models carry no input signature; give each input as --input NAME:DTYPE:DIMS"
        )
    base.backend = "pytorch"
    if torch_file.name != DEFAULT_MODEL_FILENAMES["pytorch"]:
        base.default_model_filename = torch_file.name
    io = probe_model("pytorch", torch_file, [parse_input(text) for text in options.inputs])
    completed, reasons = complete(base, io)
    reasons["input"] = "as given with --input; the outputs were found by running the model on zeros of them"
    configured = configure(folder, strict=True if (folder / CONFIG_FILENAME).exists() else False, base=completed)
    configured.reasons = {**reasons, **configured.reasons}
    load_model(configured.spec, torch_file, CPU, 1).close()  # the load's own trial run agrees
    return render(configured, source=folder)


def render(configured: Configured, source: Path) -> str:
    """Stable text format, with a comment above each value Shoal chose for the user."""
    config = configured.config
    reasons = dict(configured.reasons)
    if not any(g.HasField("rate_limiter") for g in config.instance_group):
        counts = ", ".join(str(g.count) for g in config.instance_group)
        reasons.setdefault(
            "instance_group",
            f"{counts} executor(s) sharing one copy of the weights per device (a group without a count gets "
            f"{DEFAULT_INSTANCE_COUNT_RULE}); `shoal config tune` measures more",
        )
    reasons.setdefault("version_policy", "serve the newest version folder (Triton's default)")
    if any(g.kind == config_pb2.ModelInstanceGroup.KIND_AUTO for g in config.instance_group):
        reasons["instance_group"] = (
            reasons.get("instance_group", "") + "; KIND_AUTO runs on a GPU where one is "
            "visible and the backend can use it, else on the CPU: set KIND_CPU or "
            "KIND_GPU to pin it"
        ).lstrip("; ")
    lines = [f"# Generated by `shoal config generate` from {source}.", "# Edit freely: `shoal config check` validates."]
    for field_name, text in format_fields(config):
        if field_name in reasons:
            lines += ["#", *("# " + part for part in textwrap.wrap(reasons.pop(field_name), 96))]
        lines.append(text)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CheckResult:
    model: str
    error: str | None
    completed: bool
    warnings: tuple[str, ...] = ()


def check_repository(repository: Path, strict: bool) -> list[CheckResult]:
    results = []
    for name in scanner.list_models(repository):
        folder = repository / name
        try:
            configured = configure(folder, strict)
            if not scanner.list_versions(folder):
                raise load_failed(f"model '{name}': no integer version folder")
            if configured.spec.backend != "identity":
                check_against_model(configured, folder)
            results.append(CheckResult(name, None, configured.completed, configured.warnings))
        except ShoalError as exc:
            results.append(CheckResult(name, exc.message, False))
    return results


def run_check(repository: Path, strict: bool) -> int:
    results = check_repository(repository, strict)
    for result in results:
        if result.error:
            print(f"FAIL  {result.model}: {result.error}")
        else:
            note = " (inputs/outputs completed from the model file)" if result.completed else ""
            print(f"ok    {result.model}{note}")
            for warning in result.warnings:
                print(f"      warning: {warning}")
    failed = sum(1 for r in results if r.error)
    print(f"{len(results) - failed} ok, {failed} failed", file=sys.stderr)
    return 1 if failed else 0
