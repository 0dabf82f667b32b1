"""Write the example models' model.onnx files (the config.pbtxt files sit beside them).

    python model_repository/generate.py [REPOSITORY]

Needs the `onnx` package (installed with `pip install -e .[test]`). Deterministic: the
same files every run, so the committed models can be rebuilt and compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9  # readable by every onnxruntime Shoal accepts


def save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="shoal")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def simple_graph() -> onnx.GraphProto:
    """Triton's quick-start 'simple': OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    io = [
        helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])
        for name in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")
    ]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    return helper.make_graph(nodes, "simple", io[:2], io[2:])


def mlp_graph(width: int, layers: int, seed: int = 0) -> onnx.GraphProto:
    """An FP32 MLP: ``layers`` × (MatMul width×width + bias, ReLU between), dynamic batch."""
    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    current = "INPUT0"
    for index in range(layers):
        weight = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        bias = np.zeros(width, dtype=np.float32)
        initializers += [numpy_helper.from_array(weight, f"w{index}"), numpy_helper.from_array(bias, f"b{index}")]
        last = index == layers - 1
        nodes += [
            helper.make_node("MatMul", [current, f"w{index}"], [f"mm{index}"]),
            helper.make_node("Add", [f"mm{index}", f"b{index}"], ["OUTPUT0" if last else f"pre{index}"]),
        ]
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{index}"], [f"act{index}"]))
            current = f"act{index}"
    inputs = [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", width])]
    outputs = [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", width])]
    return helper.make_graph(nodes, "mlp", inputs, outputs, initializer=initializers)


def mlp_scale_graph(width: int) -> onnx.GraphProto:
    """The pre-processing step of the ``mlp_pipeline`` ensemble: raw UINT8 values (pixels, say) to the
    FP32 the MLP takes, ``RAW / 255 - 0.5``, dynamic batch."""
    constants = [
        numpy_helper.from_array(np.array(1 / 255, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "offset"),
    ]
    nodes = [
        helper.make_node("Cast", ["RAW"], ["raw_fp32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["raw_fp32", "scale"], ["scaled"]),
        helper.make_node("Sub", ["scaled", "offset"], ["SCALED"]),
    ]
    inputs = [helper.make_tensor_value_info("RAW", TensorProto.UINT8, ["batch", width])]
    outputs = [helper.make_tensor_value_info("SCALED", TensorProto.FLOAT, ["batch", width])]
    return helper.make_graph(nodes, "mlp_scale", inputs, outputs, initializer=constants)


def main(repository: Path) -> None:
    save(simple_graph(), repository / "simple" / "1" / "model.onnx")
    save(mlp_graph(width=256, layers=4), repository / "mlp" / "1" / "model.onnx")
    save(mlp_scale_graph(width=256), repository / "mlp_scale" / "1" / "model.onnx")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
