"""ensemble_scheduling checks without a server: the config's own rules, the checks against composing
models' configs, and cycles between ensembles (tests/lifecycle/test_ensemble.py serves the same cases)."""

from __future__ import annotations

import pytest

from shoal.errors import ErrorCode, ShoalError
from shoal.repository.config import ModelSpec, normalize, parse_config, to_spec, validate
from shoal.repository.ensemble_composing import validate_against_composing
from shoal.repository.ensemble_config import dependency_cycle

ADD = (
    'name: "add" backend: "identity" max_batch_size: 8 '
    'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "MASK" data_type: TYPE_FP32 dims: [ 4 ] '
    'optional: true } ] output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]'
)
FLAT = (
    'name: "flat" backend: "identity" max_batch_size: 0 '
    'input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1, 4 ] } ] '
    'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]'
)
ENSEMBLE = (
    'name: "e" platform: "ensemble" max_batch_size: 8 '
    'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ] '
    'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ] '
)


def _spec(text: str) -> ModelSpec:
    parsed = parse_config(text)
    config = normalize(parsed, parsed.name)
    validate(config, config.name)
    return to_spec(config)


def _step(model: str = "add", extra: str = "") -> str:
    return (
        f'{{ model_name: "{model}" model_version: -1 input_map {{ key: "IN" value: "IN" }} '
        f'output_map {{ key: "OUT" value: "OUT" }} {extra} }}'
    )


def test_a_valid_ensemble_becomes_steps() -> None:
    spec = _spec(ENSEMBLE + f"ensemble_scheduling {{ step [ {_step()} ] }}")
    assert spec.ensemble is not None and spec.backend == "" and spec.instance_groups == ()
    assert [(s.model_name, s.model_version, s.input_map, s.output_map) for s in spec.ensemble.steps] == [
        ("add", -1, (("IN", "IN"),), (("OUT", "OUT"),))
    ]
    assert spec.config_json["model_transaction_policy"] == {}  # as Triton's ModelConfig shows an ensemble
    validate_against_composing(spec, [_spec(ADD)])  # the optional MASK may stay unmapped
    validate_against_composing(spec, [_spec(FLAT)])  # [-1,4] without batching is [4] with it


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ENSEMBLE, "ensemble scheduling must be set for ensemble e whose platform is ensemble"),
        (
            ADD + f" ensemble_scheduling {{ step [ {_step()} ] }}",
            "ensemble scheduling cannot be set for model 'add' whose platform is not ensemble",
        ),
        (
            ENSEMBLE + "optimization { } " + f"ensemble_scheduling {{ step [ {_step()} ] }}",
            "optimization should not be specified for ensemble 'e'",
        ),
        (
            ENSEMBLE + 'model_warmup { name: "w" } ' + f"ensemble_scheduling {{ step [ {_step()} ] }}",
            "model_warmup can not be specified for ensemble 'e'",
        ),
        (
            ENSEMBLE + 'ensemble_scheduling { step [ { input_map { key: "IN" value: "IN" } } ] }',
            "must specify 'model_name' in step 0 of ensemble 'e'",
        ),
        (
            ENSEMBLE + 'ensemble_scheduling { step [ { model_name: "add" input_map { key: "IN" value: "IN" } } ] }',
            "must specify 'output_map' in step 0 of ensemble 'e'",
        ),
    ],
)
def test_the_configs_own_rules(text: str, message: str) -> None:
    with pytest.raises(ShoalError) as caught:
        _spec(text)
    assert caught.value.code is ErrorCode.LOAD_FAILED
    assert caught.value.message == message


def test_cycles_between_ensembles() -> None:
    graph = {"a": ["b"], "b": ["c", "x"], "c": ["a"], "x": []}
    assert (
        dependency_cycle("a", graph["a"], lambda m: graph.get(m, []))
        == "circular dependency between ensembles: a -> ... -> c -> a"
    )
    assert dependency_cycle("b", ["x"], lambda m: graph.get(m, [])) == ""
    assert dependency_cycle("s", ["s"], lambda m: []) == "circular dependency between ensembles: s -> ... -> s -> s"
