"""Sequence-batched models built for tests and bench/sequence_batching.py: accumulators whose running sum
is implicit state the server keeps per sequence."""

from __future__ import annotations

import struct
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from tests.models import save_onnx, write_config

CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]"""
# The CORRID control's type in the config and the ONNX graph's element type for it.
CORRID_TYPES = {"TYPE_UINT64": TensorProto.UINT64, "TYPE_STRING": TensorProto.STRING}
PROCESSES = """
parameters { key: "process_instances" value: { string_value: "true" } }"""
STATE = """
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]"""


def add_accumulator(
    repo: Path,
    name: str,
    strategy: str = "direct { }",
    max_batch_size: int = 8,
    instances: int = 1,
    idle_us: int = 0,
    corrid_type: str = "TYPE_UINT64",
) -> None:
    """ONNX, with control inputs and implicit state: OUTPUT = (START ? 0 : STATE_IN) + INPUT; the state
    moves on only where READY (a null row keeps its state); CORRID_OUT echoes the correlation id
    (``corrid_type``: TYPE_UINT64, or TYPE_STRING for string ids)."""

    def batch(name: str, elem: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, ["batch", 1])

    nodes = [
        helper.make_node("Cast", ["START"], ["start_f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "start_f"], ["keep"]),
        helper.make_node("Mul", ["STATE_IN", "keep"], ["previous"]),
        helper.make_node("Add", ["previous", "INPUT"], ["OUTPUT"]),
        helper.make_node("Sub", ["OUTPUT", "STATE_IN"], ["moved"]),
        helper.make_node("Mul", ["moved", "READY"], ["moved_if_ready"]),
        helper.make_node("Add", ["STATE_IN", "moved_if_ready"], ["STATE_OUT"]),
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [
            batch("INPUT", TensorProto.FLOAT),
            batch("START", TensorProto.INT32),
            batch("READY", TensorProto.FLOAT),
            batch("CORRID", CORRID_TYPES[corrid_type]),
            batch("STATE_IN", TensorProto.FLOAT),
        ],
        [
            batch("OUTPUT", TensorProto.FLOAT),
            batch("CORRID_OUT", CORRID_TYPES[corrid_type]),
            batch("STATE_OUT", TensorProto.FLOAT),
        ],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    save_onnx(graph, repo / name / "1" / "model.onnx")
    idle = f"\n  max_sequence_idle_microseconds: {idle_us}" if idle_us else ""
    write_config(
        repo / name,
        f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }},
         {{ name: "CORRID_OUT" data_type: {corrid_type} dims: [ 1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
sequence_batching {{
  {strategy}{idle}{CONTROLS.replace("TYPE_UINT64", corrid_type)}{STATE}
}}
""",
    )


def add_state_only(repo: Path, name: str, start: float) -> None:
    """ONNX without batching or control inputs: OUTPUT = STATE_IN + INPUT, the state starting at ``start``
    (an ``initial_state`` data file in the model folder's initial_state/)."""
    tensor = helper.make_tensor_value_info
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["STATE_IN", "INPUT"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        ],
        name,
        [tensor("INPUT", TensorProto.FLOAT, [1]), tensor("STATE_IN", TensorProto.FLOAT, [1])],
        [tensor("OUTPUT", TensorProto.FLOAT, [1]), tensor("STATE_OUT", TensorProto.FLOAT, [1])],
    )
    save_onnx(graph, repo / name / "1" / "model.onnx")
    (repo / name / "initial_state").mkdir(parents=True)
    (repo / name / "initial_state" / "start.bin").write_bytes(struct.pack("<f", start))
    write_config(
        repo / name,
        f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
sequence_batching {{
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state: {{ name: "start" data_type: TYPE_FP32 dims: [ 1 ] data_file: "start.bin" }} }} ]
}}
""",
    )


def _save_torch_sequence_model(
    repo: Path, name: str, module: object, instances: int, processes: bool, batching: str
) -> None:
    """A TorchScript model with INPUT -> OUTPUT (FP32 rows of 1, batches of 4) and the implicit state
    STATE_IN -> STATE_OUT, under ``sequence_batching { batching STATE }``."""
    import torch

    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(module).save(str(repo / name / "1" / "model.pt"))
    write_config(
        repo / name,
        f"""
name: "{name}"
backend: "pytorch"
max_batch_size: 4
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]{PROCESSES if processes else ""}
sequence_batching {{
  {batching}{STATE}
}}
""",
    )


def add_torch_accumulator(repo: Path, name: str, processes: bool = False) -> None:
    """TorchScript: forward(INPUT, START, STATE_IN) -> (OUTPUT, STATE_OUT), the running sum, reset at START;
    ``processes``: its instances are worker processes (process_instances)."""
    import torch

    class Accumulator(torch.nn.Module):
        def forward(
            self,
            INPUT: torch.Tensor,
            START: torch.Tensor,  # noqa: N803 - Triton's tensor names
            STATE_IN: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            total = STATE_IN * (1 - START.float()) + INPUT
            return total, total

    _save_torch_sequence_model(
        repo,
        name,
        Accumulator(),
        2,
        processes,
        "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }\n  control_input [ { name: "
        '"START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]',
    )


def add_torch_passthrough_state(repo: Path, name: str, strategy: str = "direct { }", processes: bool = False) -> None:
    """TorchScript whose state output is one of its inputs, returned as it came (no new tensor):
    OUTPUT = INPUT - STATE_IN, STATE_OUT = INPUT. So the state the server keeps between steps is the
    request's own input tensor: it must outlive the request's memory (issue 22)."""
    import torch

    class PassThrough(torch.nn.Module):
        def forward(
            self,
            INPUT: torch.Tensor,  # noqa: N803 - Triton's tensor names
            STATE_IN: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return INPUT - STATE_IN, INPUT

    _save_torch_sequence_model(repo, name, PassThrough(), 1, processes, strategy)
