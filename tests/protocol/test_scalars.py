"""Scalar and per-sample scalar tensors, with configs as Triton users write them, and auto-complete.

What Triton does, from its ONNX Runtime backend (onnxruntime_backend ``src/onnxruntime.cc``):
- ``AutoCompleteIO``: a tensor with no dims left gets ``dims: [1]``, plus ``reshape: { shape: [] }``
  only when the model batches ("Empty reshape with `max_batch_size` indicates a scalar tensor in the
  model configuration which is not a valid model configuration");
- ``AutoCompleteConfig``: with both inputs and outputs in the config nothing is completed, not even
  ``max_batch_size``; ``AutoCompleteMaxBatch`` sets it to 4 when every tensor's first dim is variable;
- ``ValidateInputs``/``ValidateOutputs``: a scalar in the model ("Only compare the dimensions if the
  tensor is not scalar") takes config dims made of 1s, else "scalar tensor ... should only provide
  1"; other tensors go through ``CompareDimsSupported`` against the reshape if there is one, else dims;
- ``SetInputTensors`` feeds a scalar model input as a scalar; ``scalar_outputs_`` keeps the config
  dims of a scalar output, so responses carry those dims.
ModelMetadata shows the config ``dims`` (never the reshape), with -1 first when the model batches
(core ``src/tritonserver.cc`` ``TRITONSERVER_ServerModelMetadata``: "If the model supports batching
then must include '-1' for the batch dimension", then ``io.dims()``); server docs
``model_configuration.md``: "Input shape specified by dims indicates the shape of input expected by
the inference API"; the reshape is what the framework gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningServer, serving

SCALAR_IO = """
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] %(reshape)s } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] %(reshape)s } ]
"""
RESHAPE = "reshape: { shape: [ ] }"


def _double(
    repo: Path, name: str, shape: list[int | str | None], elem: int = TensorProto.FLOAT, config: str | None = None
) -> None:
    """An ONNX model ``Y = X + X`` (or Identity for strings) with both tensors of ``shape``."""
    node = (
        helper.make_node("Identity", ["X"], ["Y"])
        if elem == TensorProto.STRING
        else helper.make_node("Add", ["X", "X"], ["Y"])
    )
    graph = helper.make_graph(
        [node],
        name,
        [helper.make_tensor_value_info("X", elem, shape)],
        [helper.make_tensor_value_info("Y", elem, shape)],
    )
    models.save_onnx(graph, repo / name / "1" / "model.onnx")
    if config is not None:
        models.write_config(repo / name, config)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    _double(repo, "scalar_auto", [])  # no config.pbtxt at all
    _double(repo, "scalar_dims_1", [], config=SCALAR_IO % {"reshape": ""})
    _double(repo, "scalar_reshaped", [], config=SCALAR_IO % {"reshape": RESHAPE})
    _double(repo, "scalar_dims_2", [], config=SCALAR_IO.replace("[ 1 ]", "[ 2 ]") % {"reshape": ""})
    _double(repo, "scalar_string", [], elem=TensorProto.STRING)
    _double(repo, "scalar_batching", [], config="max_batch_size: 8")
    _double(repo, "per_sample_auto", ["batch"])
    _double(repo, "per_sample_config", ["batch"], config="max_batch_size: 8\n" + SCALAR_IO % {"reshape": RESHAPE})
    _double(repo, "per_sample_no_reshape", ["batch"], config="max_batch_size: 8\n" + SCALAR_IO % {"reshape": ""})
    _double(repo, "column_no_reshape", ["batch", 1], config="max_batch_size: 8\n" + SCALAR_IO % {"reshape": ""})
    _double(repo, "per_sample_io_only", ["batch"], config=SCALAR_IO % {"reshape": RESHAPE})
    _double(
        repo,
        "per_sample_inputs_only",
        ["batch"],
        config='input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]',
    )
    with serving(repo, tmp_path_factory.mktemp("server"), *layout, "--exit-on-error", "false") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.url) as client:
        yield client


def _metadata_shapes(client: triton.InferenceServerClient, model: str) -> tuple[list[int], list[int]]:
    metadata = client.get_model_metadata(model)
    return [int(d) for d in metadata.inputs[0].shape], [int(d) for d in metadata.outputs[0].shape]


def _tensor_config(client: triton.InferenceServerClient, model: str) -> tuple[int, dict, dict]:
    config = client.get_model_config(model, as_json=True)["config"]
    return int(config.get("max_batch_size", 0)), config["input"][0], config["output"][0]


def _infer(client: triton.InferenceServerClient, model: str, x: np.ndarray) -> tuple[np.ndarray, list[int]]:
    datatype = "BYTES" if x.dtype == object else "FP32"
    tensor = triton.InferInput("X", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    return result.as_numpy("Y"), [int(d) for d in result.get_output("Y").shape]


def _state(client: triton.InferenceServerClient, model: str) -> tuple[str, str]:
    entry = next(m for m in client.get_model_repository_index().models if m.name == model)
    return entry.state, entry.reason


def test_scalar_model_without_config_completes_as_triton(client: triton.InferenceServerClient) -> None:
    """AutoCompleteIO without batching: dims [1], no reshape; metadata [1]; the scalar comes back as [1]."""
    max_batch_size, tensor_in, tensor_out = _tensor_config(client, "scalar_auto")
    assert max_batch_size == 0
    for tensor in (tensor_in, tensor_out):
        assert tensor["dims"] == ["1"] and "reshape" not in tensor and tensor["data_type"] == "TYPE_FP32"
    assert _metadata_shapes(client, "scalar_auto") == ([1], [1])
    x = np.array([1.25], dtype=np.float32)
    values, shape = _infer(client, "scalar_auto", x)
    assert shape == [1]
    np.testing.assert_array_equal(values, x + x)


@pytest.mark.parametrize("model", ["scalar_dims_1", "scalar_reshaped"])
def test_scalar_model_with_a_hand_written_config(client: triton.InferenceServerClient, model: str) -> None:
    """A config with only input and output (no name, platform, max_batch_size): dims [1] with or
    without ``reshape: { shape: [] }`` both serve a scalar model (ValidateInputs skips the dims
    comparison for a scalar model tensor); auto-complete adds nothing since both are listed."""
    assert client.is_model_ready(model)
    max_batch_size, tensor_in, _ = _tensor_config(client, model)
    assert max_batch_size == 0 and tensor_in["dims"] == ["1"]
    assert _metadata_shapes(client, model) == ([1], [1])
    x = np.array([-3.5], dtype=np.float32)
    values, shape = _infer(client, model, x)
    assert shape == [1]
    np.testing.assert_array_equal(values, x + x)


def test_scalar_model_refuses_dims_other_than_ones(client: triton.InferenceServerClient) -> None:
    """ValidateInputs: "scalar tensor 'X', should only provide 1 in the model configuration"."""
    state, reason = _state(client, "scalar_dims_2")
    assert state == "UNAVAILABLE"
    assert "'X' is a scalar in the model" in reason and "[2]" in reason


def test_scalar_model_cannot_batch(client: triton.InferenceServerClient) -> None:
    """AutoCompleteMaxBatch: a scalar has no batch dimension, so a non-zero max_batch_size fails."""
    state, reason = _state(client, "scalar_batching")
    assert state == "UNAVAILABLE"
    assert (
        "autofill failed for model 'scalar_batching': model does not support batching while non-zero "
        "max_batch_size is specified"
    ) in reason


def test_string_scalar(client: triton.InferenceServerClient) -> None:
    """A BYTES scalar completes and serves like any other scalar."""
    _, tensor_in, _ = _tensor_config(client, "scalar_string")
    assert tensor_in["dims"] == ["1"] and tensor_in["data_type"] == "TYPE_STRING"
    x = np.array([b"seven"], dtype=object)
    values, shape = _infer(client, "scalar_string", x)
    assert shape == [1] and list(values) == [b"seven"]


def _check_per_sample(client: triton.InferenceServerClient, model: str, max_batch_size: int) -> None:
    configured, tensor_in, tensor_out = _tensor_config(client, model)
    assert configured == max_batch_size
    for tensor in (tensor_in, tensor_out):
        assert tensor["dims"] == ["1"] and tensor["reshape"] == {}
    assert _metadata_shapes(client, model) == ([-1, 1], [-1, 1])
    x = np.array([[1.5], [2.5], [-4.0]], dtype=np.float32)
    values, shape = _infer(client, model, x)
    assert shape == [3, 1]
    np.testing.assert_array_equal(values, x + x)


def test_per_sample_scalars_without_config(client: triton.InferenceServerClient) -> None:
    """Model shape [batch]: AutoCompleteMaxBatch sets 4 (and dynamic batching); AutoCompleteIO gives
    dims [1] with an empty reshape; metadata shows [-1, 1]; requests [N, 1] reach the model as [N]."""
    _check_per_sample(client, "per_sample_auto", 4)
    assert "dynamic_batching" in client.get_model_config("per_sample_auto", as_json=True)["config"]


def test_per_sample_scalars_with_a_hand_written_config(client: triton.InferenceServerClient) -> None:
    """The config users write for a [batch] model: max_batch_size, dims [1], reshape { shape: [] }."""
    _check_per_sample(client, "per_sample_config", 8)


def test_per_sample_inputs_only_config_completes_the_rest(client: triton.InferenceServerClient) -> None:
    """With outputs missing, AutoCompleteConfig runs: max_batch_size 4 and the output as Triton writes it."""
    _check_per_sample(client, "per_sample_inputs_only", 4)


def test_column_model_with_dims_1_and_no_reshape(client: triton.InferenceServerClient) -> None:
    """A model of shape [batch, 1] takes dims [1] as written (CompareDimsSupported: [-1, 1])."""
    max_batch_size, tensor_in, _ = _tensor_config(client, "column_no_reshape")
    assert max_batch_size == 8 and tensor_in["dims"] == ["1"] and "reshape" not in tensor_in
    assert _metadata_shapes(client, "column_no_reshape") == ([-1, 1], [-1, 1])
    x = np.array([[0.5], [7.0]], dtype=np.float32)
    values, shape = _infer(client, "column_no_reshape", x)
    assert shape == [2, 1]
    np.testing.assert_array_equal(values, x + x)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        # CompareDimsSupported: the model expects 1 dimension, the config [-1] + [1] makes 2
        ("per_sample_no_reshape", "[-1] + [1]"),
        # both inputs and outputs listed: nothing is completed, so max_batch_size stays 0 and the
        # empty reshape (a scalar) does not match the model's [batch]
        ("per_sample_io_only", "shape [-1] in the model"),
    ],
)
def test_per_sample_configs_triton_refuses(client: triton.InferenceServerClient, model: str, why: str) -> None:
    state, reason = _state(client, model)
    assert state == "UNAVAILABLE" and why in reason
    with pytest.raises(InferenceServerException):
        _infer(client, model, np.array([[1.0]], dtype=np.float32))


def test_refused_models_leave_the_others_serving(client: triton.InferenceServerClient, server: RunningServer) -> None:
    for model in ("scalar_auto", "scalar_dims_1", "per_sample_auto", "column_no_reshape"):
        assert client.is_model_ready(model), server.log()
