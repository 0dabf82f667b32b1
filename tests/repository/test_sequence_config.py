"""``sequence_batching`` in config.pbtxt: parsed, normalized with Triton's defaults, refused in Triton's words."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.errors import ShoalError
from shoal.protocol.types import DataType
from shoal.repository.config import ModelSpec, normalize, parse_config, to_spec, validate
from shoal.repository.sequence_config import ControlKind, read_initial_states
from shoal.repository.sequence_spec import backend_spec

BASE = """
name: "m"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def spec_of(batching: str) -> ModelSpec:
    config = normalize(parse_config(BASE + f"sequence_batching {{ {batching} }}"), "m")
    validate(config, "m")
    return to_spec(config)


def test_defaults_are_tritons() -> None:
    direct = spec_of("").sequence_batching
    assert direct is not None and direct.strategy == "direct" and direct.max_sequence_idle_us == 1_000_000
    assert direct.slots_per_instance(4) == 4
    oldest = spec_of("oldest { max_candidate_sequences: 16 }").sequence_batching
    assert oldest is not None and oldest.preferred_batch_sizes == (4,) and oldest.slots_per_instance(4) == 16


def test_controls_and_state_become_backend_tensors() -> None:
    spec = spec_of("""
      control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] },
                      { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]
      state [ { input_name: "SI" output_name: "SO" data_type: TYPE_INT64 dims: [ 2, 3 ] } ]""")
    batching = spec.sequence_batching
    assert batching is not None
    start = batching.control(ControlKind.START)
    assert start is not None and (start.datatype, start.false_value, start.true_value) == (DataType.BOOL, False, True)
    assert batching.states[0].start_value().shape == (2, 3)
    seen = backend_spec(spec)
    assert [t.name for t in seen.inputs] == ["INPUT", "S", "C", "SI"]
    assert [t.name for t in seen.outputs] == ["OUTPUT", "SO"]
    assert [t.name for t in spec.inputs] == ["INPUT"]  # what clients send is unchanged


@pytest.mark.parametrize(
    ("batching", "message"),
    [
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]',
            "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for "
            "CONTROL_SEQUENCE_START for m",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] '
            "fp32_false_true: [ 0, 1 ] } ] } ]",
            "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and 'bool_false_true' "  # noqa: E501
            "for CONTROL_SEQUENCE_END for m",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 1 ] } ] } ]',
            "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_READY for m",
        ),
        (
            'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
            '{ name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ]',
            "sequence batching control tensor 'S' is specified for multiple control kinds for m",
        ),
        (
            'control_input [ { name: "A" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
            '{ name: "B" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]',
            "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for m",
        ),
        (
            'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',
            "unexpected control data type, expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32, or TYPE_STRING",
        ),
        (
            'control_input [ { name: "INPUT" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]',  # noqa: E501
            "control tensor 'INPUT' is also a config input",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 1 ] '
            'initial_state [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] zero_data: true }, '
            '{ name: "b" data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } ] } ]',
            "initial_state field for state input 'SI' must contain exactly one or zero element. Found '2' elements.",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 2 ] '
            'initial_state [ { name: "a" data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } ] } ]',
            "'initial_state' dim for input name 'SI' doesn't match 'state' dim description. 3 != 2",
        ),
        (
            'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 2 ] '
            'initial_state [ { name: "a" data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } ] } ]',
            "The data type used for 'initial_state' field of state 'SI' does not match the state data type.",
        ),
        ("iterative_sequence: true", "iterative_sequence is not supported"),
    ],
)
def test_bad_configs_are_refused(batching: str, message: str) -> None:
    with pytest.raises(ShoalError) as refused:
        spec_of(batching)
    assert message in refused.value.message


def test_initial_state_data_file_is_read_from_the_model_folder(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "initial_state").mkdir(parents=True)
    (model / "initial_state" / "seven.bin").write_bytes((7).to_bytes(4, "little") * 2)
    batching = spec_of(
        'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_INT32 dims: [ -1 ] '
        'initial_state [ { name: "s" data_type: TYPE_INT32 dims: [ 2 ] data_file: "seven.bin" } ] } ]'
    ).sequence_batching
    assert batching is not None
    assert read_initial_states(model, batching).states[0].start_value().tolist() == [7, 7]
    (model / "initial_state" / "seven.bin").write_bytes(b"\x07")
    with pytest.raises(ShoalError, match="initial_state setting expects 8 bytes"):
        read_initial_states(model, batching)


def test_a_sequence_model_completes_and_checks_against_its_file(tmp_path: Path) -> None:
    """Auto-complete leaves the batcher's tensors out of the config; ``config check`` finds them in the model."""
    from shoal.configuring.pipeline import check_against_model, configure
    from tests.sequence_models import add_accumulator

    add_accumulator(tmp_path, "acc")
    text = (tmp_path / "acc" / "config.pbtxt").read_text()
    start = text.index("sequence_batching")
    (tmp_path / "acc" / "config.pbtxt").write_text('backend: "onnxruntime"\n' + text[start:])
    configured = configure(tmp_path / "acc", strict=False)
    assert [t.name for t in configured.spec.inputs] == ["INPUT"]
    assert [t.name for t in configured.spec.outputs] == ["OUTPUT", "CORRID_OUT"]
    check_against_model(configured, tmp_path / "acc")
