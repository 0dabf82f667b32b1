"""Ensembles over ONNX, PyTorch and identity models, built in the test (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper

from tests import models

FP32_4 = "data_type: TYPE_FP32 dims: [ 4 ]"
IN_OUT = f'input [ {{ name: "IN" {FP32_4} }} ]\noutput [ {{ name: "OUT" {FP32_4} }} ]'
ON_CPU = "instance_group [ { count: 1 kind: KIND_CPU } ]"
STEP_DELAY_MS = 400  # each of the diamond's two slow steps


def add_onnx_add1(repo: Path, name: str = "add1") -> None:
    """OUT = IN + 1 over FP32 rows of 4 (ONNX Runtime), batching up to 8."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["IN", "one"], ["OUT"])],
        name,
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [None, 4])],
        [one],
    )
    models.save_onnx(graph, repo / name / "1" / "model.onnx")
    models.write_config(repo / name, f'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n{IN_OUT}\n{ON_CPU}\n')


def add_onnx_sum(repo: Path, name: str = "sum") -> None:
    """OUT = A + B over FP32 rows of 4 (ONNX Runtime): the join of the diamond."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["OUT"])],
        name,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 4]) for n in ("A", "B")],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [None, 4])],
    )
    models.save_onnx(graph, repo / name / "1" / "model.onnx")
    models.write_config(
        repo / name,
        f"""
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ {{ name: "A" {FP32_4} }}, {{ name: "B" {FP32_4} }} ]
        output [ {{ name: "OUT" {FP32_4} }} ]
        {ON_CPU}
        """,
    )


def add_onnx_pick(repo: Path, name: str = "pick") -> None:
    """OUT = [IN[5]] without batching; IN's length is variable, so a shorter IN fails in ONNX Runtime
    itself (an index out of bounds): a step that fails while executing."""
    index = helper.make_tensor("index", TensorProto.INT64, [1], [5])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["IN", "index"], ["OUT"])],
        name,
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [1])],
        [index],
    )
    models.save_onnx(graph, repo / name / "1" / "model.onnx")
    models.write_config(
        repo / name,
        f"""
        platform: "onnxruntime_onnx"
        max_batch_size: 0
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        {ON_CPU}
        """,
    )


def add_torch_double(repo: Path, name: str = "double") -> None:
    """OUTPUT__0 = 2 * INPUT__0 (TorchScript on the PyTorch backend)."""
    import torch

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(Double()).save(str(repo / name / "1" / "model.pt"))
    models.write_config(
        repo / name,
        f"""
        backend: "pytorch"
        max_batch_size: 8
        input [ {{ name: "INPUT__0" {FP32_4} }} ]
        output [ {{ name: "OUTPUT__0" {FP32_4} }} ]
        {ON_CPU}
        """,
    )


def add_identity(repo: Path, name: str, delay_ms: int = 0, extra: str = "") -> None:
    """OUT = IN over FP32 rows of 4 (the identity backend), one instance sleeping ``delay_ms`` per execution."""
    models.write_config(
        repo / name,
        f'''
        backend: "identity"
        max_batch_size: 8
        {IN_OUT}
        {ON_CPU}
        parameters {{ key: "execute_delay_ms" value: {{ string_value: "{delay_ms}" }} }}
        {extra}
        ''',
    )
    (repo / name / "1").mkdir()


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    """One ``ensemble_scheduling`` step: ``inputs`` maps the model's inputs to ensemble tensors, ``outputs``
    its outputs to ensemble tensors."""
    input_map = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    output_map = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {input_map} {output_map} }}'


def add_ensemble(
    repo: Path, name: str, steps: list[str], io: str = IN_OUT, max_batch_size: int = 8, extra: str = ""
) -> None:
    models.write_config(
        repo / name,
        f'''
        name: "{name}"
        platform: "ensemble"
        max_batch_size: {max_batch_size}
        {io}
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
        {extra}
        ''',
    )
    (repo / name / "1").mkdir()


def add_serving_ensembles(repo: Path) -> None:
    """The composing models and the ensembles that serve (see test_ensemble.py for what each shows)."""
    add_onnx_add1(repo)
    add_onnx_sum(repo)
    add_onnx_pick(repo)
    add_torch_double(repo)
    add_identity(repo, "pass")
    add_identity(repo, "slow_a", STEP_DELAY_MS)
    add_identity(repo, "slow_b", STEP_DELAY_MS)
    add_identity(repo, "batched", extra="dynamic_batching { max_queue_delay_microseconds: 200000 }")
    # (IN + 1) * 2, through ONNX, then PyTorch, then identity
    add_ensemble(
        repo,
        "chain",
        [
            step("add1", {"IN": "IN"}, {"OUT": "plus_one"}),
            step("double", {"INPUT__0": "plus_one"}, {"OUTPUT__0": "doubled"}),
            step("pass", {"IN": "doubled"}, {"OUT": "OUT"}),
        ],
    )
    # A = IN and B = IN at once (two slow steps), then OUT = A + B
    add_ensemble(
        repo,
        "diamond",
        [
            step("slow_a", {"IN": "IN"}, {"OUT": "A"}),
            step("slow_b", {"IN": "IN"}, {"OUT": "B"}),
            step("sum", {"A": "A", "B": "B"}, {"OUT": "OUT"}),
        ],
        io=f'input [ {{ name: "IN" {FP32_4} }} ]\n'
        f'output [ {{ name: "OUT" {FP32_4} }}, {{ name: "A" {FP32_4} }}, {{ name: "B" {FP32_4} }} ]',
    )
    add_ensemble(repo, "through_batcher", [step("batched", {"IN": "IN"}, {"OUT": "OUT"})])
    # BYTES through two identity steps (the identity backend round-trips any element exactly)
    for name in ("echo_a", "echo_b"):
        models.add_identity(repo, name, "BYTES")
    add_ensemble(
        repo,
        "strings",
        [step("echo_a", {"IN": "IN"}, {"OUT": "middle"}), step("echo_b", {"IN": "middle"}, {"OUT": "OUT"})],
        io='input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]',
    )
    # Variable ensemble dims: a request whose shape the step refuses, or on which ONNX Runtime fails
    add_ensemble(
        repo,
        "wide_chain",
        [step("add1", {"IN": "IN"}, {"OUT": "OUT"})],
        io='input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]',
    )
    add_ensemble(
        repo,
        "fails_in_onnx",
        [step("pick", {"IN": "IN"}, {"OUT": "OUT"})],
        max_batch_size=0,
        io='input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]',
    )


def add_invalid_ensembles(repo: Path) -> dict[str, str]:
    """Ensembles that must fail to load (beside ``add_serving_ensembles``); returns each one's reason,
    word for word as Triton 2.51 gives it (checked against the real Triton)."""
    models.write_config(repo / "broken", 'backend: "identity"\nmax_batch_size: 8\n')  # lists no inputs
    (repo / "broken" / "1").mkdir()
    to_add1 = step("add1", {"IN": "IN"}, {"OUT": "OUT"})
    out_other = (
        f'input [ {{ name: "IN" {FP32_4} }} ]\noutput [ {{ name: "OUT" {FP32_4} }}, {{ name: "OTHER" {FP32_4} }} ]'
    )
    cases = {
        "v_unknown": (
            [step("nope", {"IN": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "ensemble v_unknown contains models that are not available or ambiguous: nope",
        ),
        "v_cycle1": (
            [step("v_cycle2", {"IN": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "circular dependency between ensembles: v_cycle1 -> ... -> v_cycle2 -> v_cycle1",
        ),
        "v_cycle2": (
            [step("v_cycle1", {"IN": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "circular dependency between ensembles: v_cycle2 -> ... -> v_cycle1 -> v_cycle2",
        ),
        "v_unmapped": (
            [step("sum", {"A": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "in ensemble v_unmapped, input B in model sum is not mapped to any ensemble tensors",
        ),
        "v_no_input": (
            [step("add1", {"NOTIN": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "in ensemble v_no_input, ensemble tensor IN is mapping to non-existing input NOTIN in model add1",
        ),
        "v_no_output": (
            [step("add1", {"IN": "IN"}, {"NOPE": "OUT"})],
            IN_OUT,
            8,
            "",
            "in ensemble v_no_output, ensemble tensor OUT is mapped from non-existing output NOPE in model add1",
        ),
        "v_twice": (
            [to_add1, step("pass", {"IN": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "ensemble tensor 'OUT' can appear in an output map only once for ensemble 'v_twice' step 1",
        ),
        "v_dtype": (
            [to_add1],
            IN_OUT.replace("TYPE_FP32", "TYPE_INT32", 1),
            8,
            "",
            "in ensemble v_dtype, ensemble tensor IN: inconsistent data type: TYPE_INT32 is inferred from "
            "model v_dtype while TYPE_FP32 is inferred from model add1",
        ),
        "v_shape": (
            [to_add1],
            IN_OUT.replace("[ 4 ]", "[ 3 ]", 1),
            8,
            "",
            "in ensemble v_shape, ensemble tensor IN: inconsistent shape: [-1,3] is inferred from model "
            "v_shape while [-1,4] is inferred from model add1",
        ),
        "v_out_dtype": (
            [to_add1],
            IN_OUT.replace('"OUT" data_type: TYPE_FP32', '"OUT" data_type: TYPE_INT64'),
            8,
            "",
            "in ensemble v_out_dtype, ensemble tensor OUT: inconsistent data type: TYPE_INT64 is "
            "inferred from model v_out_dtype while TYPE_FP32 is inferred from model add1",
        ),
        "v_batch": (
            [to_add1],
            IN_OUT,
            16,
            "",
            "ensemble v_batch allows maximum batch size 16, but it contains model "
            "add1 which only allows maximum batch size to be 8",
        ),
        "v_loop": (
            [
                step("add1", {"IN": "b"}, {"OUT": "a"}),
                step("pass", {"IN": "a"}, {"OUT": "b"}),
                step("sum", {"A": "IN", "B": "IN"}, {"OUT": "OUT"}),
            ],
            IN_OUT,
            8,
            "",
            "ensemble tensor 'a' is unused in ensemble 'v_loop'",
        ),
        "v_not_written": (
            [to_add1],
            out_other,
            8,
            "",
            "ensemble output 'OTHER' for ensemble v_not_written' is not used",
        ),
        "v_unused_input": (
            [to_add1],
            IN_OUT.replace("input [ {", 'input [ { name: "EXTRA" data_type: TYPE_FP32 dims: [ 4 ] }, {'),
            8,
            "",
            "ensemble input 'EXTRA' for ensemble v_unused_input' is not used",
        ),
        "v_version": (
            [step("add1", {"IN": "IN"}, {"OUT": "OUT"}, version=3)],
            IN_OUT,
            8,
            "",
            "ensemble 'v_version' depends on 'add1' whose required version 3 is not loaded.",
        ),
        "v_broken_dep": (
            [step("broken", {"IN": "IN"}, {"OUT": "OUT"})],
            IN_OUT,
            8,
            "",
            "ensemble 'v_broken_dep' depends on 'broken' which has no loaded version. Model 'broken' "
            "loading failed with error: ",
        ),
        "v_instances": (
            [to_add1],
            IN_OUT,
            8,
            ON_CPU,
            "instance group should not be specified for ensemble 'v_instances'",
        ),
        "v_no_map": (
            ['{ model_name: "add1" output_map { key: "OUT" value: "OUT" } }'],
            IN_OUT,
            8,
            "",
            "must specify 'input_map' in step 0 of ensemble 'v_no_map'",
        ),
    }
    for name, (steps, io, max_batch_size, extra, _) in cases.items():
        add_ensemble(repo, name, steps, io, max_batch_size, extra)
    models.write_config(
        repo / "v_no_steps",
        f'name: "v_no_steps"\nplatform: "ensemble"\nmax_batch_size: 8\n{IN_OUT}\nensemble_scheduling {{ }}\n',
    )
    (repo / "v_no_steps" / "1").mkdir()
    reasons = {name: case[-1] for name, case in cases.items()}
    reasons["v_no_steps"] = "must specify 'step' for ensemble 'v_no_steps'"
    return reasons
