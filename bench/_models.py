"""Models the benchmarks build at run time (never committed): MLPs of a given size."""

from __future__ import annotations

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
