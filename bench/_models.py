"""Models the benchmarks build at run time (never committed): MLPs of a given size."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from bench._server import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "model_repository"))
from generate import mlp_graph, save  # noqa: E402


def write_mlp(repo: Path, name: str, width: int, layers: int, config_extra: str, max_batch_size: int = 32) -> Path:
    """An FP32 MLP model folder: ``layers`` × width×width weights, INPUT0 → OUTPUT0."""
    folder = repo / name
    model = folder / "1" / "model.onnx"
    if not model.exists():
        save(mlp_graph(width=width, layers=layers), model)
    (folder / "config.pbtxt").write_text(
        f"""
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
{config_extra}
"""
    )
    return folder


# Issue 12's configuration, which every side-by-side benchmark gives its models: one instance (the
# copied config's), a 200 µs dynamic batch, 2 ONNX Runtime intra-op threads.
ORT_THREADS = 2
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 200 }"
ORT_THREADS_PARAMETER = f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{ORT_THREADS}" }} }}\n'


def write_tiny(repo: Path, name: str = "tiny") -> Path:
    """``simple`` (add/sub, INT32 [1,16]) with max_batch_size 32 and issue 12's configuration."""
    return write_simple(repo, name, f"\n{BATCHING}\n{ORT_THREADS_PARAMETER}")


def write_simple(repo: Path, name: str, config_extra: str, max_batch_size: int = 32) -> Path:
    """A copy of model_repository/simple (add/sub, INT32 [16]) named ``name``, with ``config_extra`` appended."""
    source = REPO_ROOT / "model_repository" / "simple"
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    shutil.copy(source / "1" / "model.onnx", folder / "1" / "model.onnx")
    config = (source / "config.pbtxt").read_text()
    config = config.replace("max_batch_size: 8", f"max_batch_size: {max_batch_size}")
    (folder / "config.pbtxt").write_text(config.replace('name: "simple"', f'name: "{name}"') + config_extra)
    return folder
