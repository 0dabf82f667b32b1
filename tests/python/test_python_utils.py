"""``triton_python_backend_utils`` without a server: the surface model authors use, and the
auto-complete wrapper's rules (Triton's ``pb_utils`` and ``ModelConfig``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shoal.backends.python import pb_utils, runner
from shoal.backends.python.autocomplete import ModelConfig
from shoal.errors import ErrorCode, ShoalError
from tests import python_models as pm


def test_the_module_is_importable_under_triton_s_name() -> None:
    runner.install_utils()
    import triton_python_backend_utils  # type: ignore[import-not-found]

    assert triton_python_backend_utils is pb_utils
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1


def test_type_helpers() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.float32) == pb_utils.TRITONSERVER_TYPE_FP32 == 11
    assert pb_utils.numpy_to_triton_type(np.object_) == pb_utils.TRITONSERVER_TYPE_BYTES == 13
    assert pb_utils.triton_to_numpy_type(pb_utils.TRITONSERVER_TYPE_INT64) is np.int64
    encoded = pb_utils.serialize_byte_tensor(np.array([b"ab", "c"], dtype=np.object_))
    assert list(pb_utils.deserialize_bytes_tensor(encoded.tobytes())) == [b"ab", b"c"]


def test_tensor_request_response() -> None:
    tensor = pb_utils.Tensor("X", np.arange(6, dtype=np.int32).reshape(2, 3))
    assert (tensor.name(), tensor.shape(), tensor.is_cpu(), tensor.triton_dtype()) == ("X", [2, 3], True, 8)
    back = pb_utils.Tensor.from_dlpack("Y", tensor.to_dlpack())
    np.testing.assert_array_equal(back.as_numpy(), tensor.as_numpy())
    assert pb_utils.Tensor("S", np.array(["a"])).as_numpy().dtype == np.object_
    request = pb_utils.InferenceRequest(
        model_name="m",
        inputs=[tensor],
        requested_output_names=["Z"],
        request_id="7",
        correlation_id=3,
        parameters={"k": 1},
    )
    assert pb_utils.get_input_tensor_by_name(request, "X") is tensor
    assert pb_utils.get_input_tensor_by_name(request, "nope") is None
    assert (request.request_id(), request.correlation_id(), json.loads(request.parameters())) == ("7", 3, {"k": 1})
    response = pb_utils.InferenceResponse(error=pb_utils.TritonError("bad", pb_utils.TritonError.INVALID_ARG))
    assert response.has_error() and response.error().message() == "bad"  # type: ignore[union-attr]
    sender = request.get_response_sender()
    sender.send(pb_utils.InferenceResponse([tensor]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    with pytest.raises(pb_utils.TritonModelException):
        sender.send(pb_utils.InferenceResponse([tensor]))
    config = {"output": [{"name": "O", "data_type": "TYPE_FP16"}]}
    assert pb_utils.get_output_config_by_name(config, "O") == {"name": "O", "data_type": "TYPE_FP16"}


def test_auto_complete_wrapper() -> None:
    wrapper = ModelConfig(
        {"name": "m", "max_batch_size": 0, "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": ["2"]}]}
    )
    wrapper.set_max_batch_size(4)
    wrapper.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [2]})  # agrees with the config
    wrapper.add_output({"name": "B", "data_type": "TYPE_INT32", "dims": [3]})
    wrapper.set_dynamic_batching()
    wrapper.set_model_transaction_policy({"decoupled": False})
    assert wrapper.as_dict()["output"] == [{"name": "B", "data_type": "TYPE_INT32", "dims": [3]}]
    assert wrapper.max_batch_size() == 4 and wrapper.as_dict()["dynamic_batching"] == {}
    with pytest.raises(ValueError, match="configuration expects"):
        wrapper.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="max_batch_size"):
        wrapper.set_max_batch_size(8)
    with pytest.raises(ValueError, match="missing 'dims'"):
        wrapper.add_input({"name": "C", "data_type": "TYPE_FP32"})


def test_runner_answers_each_request(tmp_path: Path) -> None:
    """A batch of two through the runner alone: one response per request, errors in Triton's words."""
    folder = pm.add_add_sub(tmp_path)
    config = {
        "name": "add_sub",
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}, {"name": "OUTPUT1", "data_type": "TYPE_FP32"}],
    }
    model_file = folder / "1" / "model.py"
    model = runner.ModelRunner(config, model_file, runner.model_args(config, model_file, "add_sub_0", "CPU", 0, 1))
    ones = np.ones((1, 4), np.float32)
    items = [runner.RequestData({"INPUT0": ones * k, "INPUT1": ones}, ("OUTPUT0",)) for k in (1, 2)]
    outcomes = model.execute(items)
    assert [o.outputs["OUTPUT0"].tolist() for o in outcomes if o.outputs] == [[[2.0] * 4], [[3.0] * 4]]
    model.finalize()


# One reused FP32 buffer for every response: sent through each request's response sender (decoupled or
# not), or (STRIDED) returned as a strided view of it. Y = 2 X.
REUSED_BUFFER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.how = args["model_name"]
        self.buffer = np.zeros((2, 2), np.float32)

    def execute(self, requests):
        responses = []
        for request in requests:
            self.buffer[:, 0] = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0] * 2
            if self.how == "strided":  # a column: not contiguous
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", self.buffer[:, 0])]))
                continue
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", self.buffer[0, :1])]))
            if self.how == "decoupled":
                self.buffer[0, 0] = -1.0  # the response above is sent: this write is not in it
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return responses or None
"""


@pytest.mark.parametrize("how", ["sender", "decoupled", "strided"])
def test_a_reused_buffer_gives_each_response_what_it_held_when_sent(tmp_path: Path, how: str) -> None:
    """Triton copies a tensor that is not contiguous when it is built, and a response's tensors when a
    response sender sends it: a model reusing one buffer gets each request's own answer (every one
    carried the last request's values, on both instance kinds: the runner is theirs)."""
    model_file = tmp_path / how / "1" / "model.py"
    model_file.parent.mkdir(parents=True)
    model_file.write_text(REUSED_BUFFER)
    config = {"name": how, "output": [{"name": "Y", "data_type": "TYPE_FP32"}]}
    model = runner.ModelRunner(config, model_file, runner.model_args(config, model_file, f"{how}_0", "CPU", 0, 1))
    items = [runner.RequestData({"X": np.array([float(k)], np.float32)}, ("Y",)) for k in (1, 2, 3)]
    try:
        if how == "decoupled":
            sent: list[list[float]] = [[], [], []]

            def emit(index: int, outcome: runner.Outcome | None, final: bool) -> None:
                if outcome is not None:
                    sent[index].append(outcome.result()["Y"])  # type: ignore[index]

            model.execute_decoupled(items, emit)
            assert [[array.tolist() for array in arrays] for arrays in sent] == [[[2.0]], [[4.0]], [[6.0]]]
        else:
            outcomes = model.execute(items)
            expected = [[2.0] * 2, [4.0] * 2, [6.0] * 2] if how == "strided" else [[2.0], [4.0], [6.0]]
            assert [outcome.result()["Y"].tolist() for outcome in outcomes] == expected  # type: ignore[index]
    finally:
        model.finalize()


def test_auto_complete_runs_in_a_child_process(tmp_path: Path) -> None:
    folder = pm.write_model(tmp_path, "auto", pm.AUTO_CONFIG, pm.AUTO)
    done = subprocess.run(
        [sys.executable, "-m", "shoal.backends.python.autocomplete", str(folder / "1" / "model.py")],
        input=json.dumps({"name": "auto", "max_batch_size": 0}),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    completed = json.loads(done.stdout)
    assert completed["max_batch_size"] == 4 and [t["name"] for t in completed["input"]] == ["IN"]


def test_auto_complete_reads_its_answer_whatever_the_model_prints(tmp_path: Path) -> None:
    """Review of session 50 (F4): a model printing at import time (or in ``auto_complete_config``) put
    its text before the completed config on the child's stdout: the load raised a JSONDecodeError,
    which ``--exit-on-error false`` did not cover (the server exited). What a model prints goes to
    stderr, a log, as a Triton stub's stdout is."""
    from shoal.backends.python.autocomplete import auto_complete

    source = pm.AUTO.replace(
        "import triton_python_backend_utils as pb_utils\n",
        "import triton_python_backend_utils as pb_utils\nprint('hello from the model file')\n"
        "import sys\nsys.stdout.buffer.write(b'caf\\xe9\\n')\nsys.stdout.flush()\n",  # not even UTF-8
        1,
    )
    assert source != pm.AUTO
    source = source.replace(
        "    def auto_complete_config(auto_complete_model_config):\n",
        "    def auto_complete_config(auto_complete_model_config):\n        print('{not json')\n",
    )
    assert "print('{not json')" in source
    folder = pm.write_model(tmp_path, "auto", pm.AUTO_CONFIG, source)
    completed = auto_complete({"name": "auto", "max_batch_size": 0}, folder / "1" / "model.py", "auto/1/model.py")
    assert completed["max_batch_size"] == 4 and [t["name"] for t in completed["input"]] == ["IN"]


ONE_BAD = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x.flat[0] < 0:
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif x.flat[0] == 0:
                responses.append(pb_utils.InferenceResponse([]))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
"""


def test_an_error_response_fails_that_request_alone_and_a_missing_output_is_left_out(tmp_path: Path) -> None:
    folder = pm.write_model(tmp_path, "one_bad", 'backend: "python"', ONE_BAD)
    config = {"name": "one_bad", "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}]}
    model_file = folder / "1" / "model.py"
    model = runner.ModelRunner(config, model_file, runner.model_args(config, model_file, "one_bad_0", "CPU", 0, 1))
    items = [runner.RequestData({"INPUT0": np.full((1, 2), value, np.float32)}, ("OUTPUT0",)) for value in (1, -1, 0)]
    good, bad, empty = [outcome.result() for outcome in model.execute(items)]
    assert isinstance(good, dict) and good["OUTPUT0"].tolist() == [[1.0, 1.0]]
    assert isinstance(bad, ShoalError) and bad.code is ErrorCode.INVALID_ARGUMENT and bad.message == "negative input"
    assert empty == {}  # a response without outputs is answered so, as Triton's Python backend answers it


def test_bls_tensors_go_into_the_arena_when_they_fit() -> None:
    """What decides, in process mode, whether a BLS call's tensors cross in the arena or on the pipe."""
    from shoal.dataplane.arena import Arena
    from shoal.instances.worker_pipe import put, take

    arena = Arena.create("test-bls", 1 << 20)
    try:
        small = {"A": np.arange(10, dtype=np.float32), "B": np.array([b"x", b"yz"], dtype=np.object_)}
        slots, after = put(arena, 100, small)
        assert slots is not None and after % 64 == 0 and after > 100
        taken = take(arena, slots)
        np.testing.assert_array_equal(taken["A"], small["A"])
        assert list(taken["B"]) == [b"x", b"yz"]
        assert put(arena, after, {"C": np.zeros(1 << 18, np.float32)}) == (None, after)  # 1 MiB: no room left
    finally:
        arena.close()


def test_a_request_the_runner_hands_over_reads_as_one_built_by_the_constructor() -> None:
    """The runner builds the requests a model receives without the constructor's conversions (per
    request): every accessor gives what the constructor's request gives, parameters as the same JSON."""
    inputs = {"X": np.arange(4, dtype=np.float32), "S": np.array([b"a", b"bc"], dtype=np.object_)}
    parameters = {"k": 1, "s": "v", "b": True}
    item = runner.RequestData(inputs, ("Y", "Z"), "id-1", 5, parameters, 9, '{"traceparent": "00-a-b-01"}')
    received = runner.ModelRunner._requests([item])[0]
    built = pb_utils.InferenceRequest(
        inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
        requested_output_names=["Y", "Z"],
        request_id="id-1",
        correlation_id=5,
        parameters=parameters,
        trace=pb_utils.InferenceTrace(9, '{"traceparent": "00-a-b-01"}'),
    )
    for accessor in (
        "model_name",
        "model_version",
        "requested_output_names",
        "request_id",
        "correlation_id",
        "flags",
        "timeout",
        "parameters",
        "is_cancelled",
    ):
        assert getattr(received, accessor)() == getattr(built, accessor)(), accessor
    assert [(t.name(), t.as_numpy().dtype) for t in received.inputs()] == [
        (t.name(), t.as_numpy().dtype) for t in built.inputs()
    ]
    for mine, theirs in zip(received.inputs(), built.inputs(), strict=True):
        np.testing.assert_array_equal(mine.as_numpy(), theirs.as_numpy())
    assert (received.trace().trace_id, received.trace().get_context()) == (9, '{"traceparent": "00-a-b-01"}')
    assert json.loads(received.parameters()) == parameters
    assert vars(received).keys() == vars(built).keys()  # every attribute the constructor sets, set
    empty = runner.ModelRunner._requests([runner.RequestData(inputs, ("Y",))])[0]
    assert empty.parameters() == "{}" and empty.get_response_sender() is empty.get_response_sender()


def test_bytes_are_taken_wherever_a_string_is_as_tritons_pybind_layer_does() -> None:
    """Triton's BLS example names the model with ``model_name.as_numpy()[0]``, the bytes of a BYTES
    input: pybind11 turns bytes into the string, so Shoal's classes take them too (issue 23)."""
    request = pb_utils.InferenceRequest(
        model_name=b"add_sub",
        requested_output_names=[b"OUTPUT0", "OUTPUT1"],
        request_id=b"r-1",
        correlation_id=b"c-9",
        parameters=b'{"k": 1}',
        inputs=[pb_utils.Tensor(b"INPUT0", np.zeros(4, np.float32))],
    )
    assert request.model_name() == "add_sub"
    assert request.requested_output_names() == {"OUTPUT0", "OUTPUT1"}  # a set, as Triton's
    assert (request.request_id(), request.correlation_id(), request.parameters()) == ("r-1", "c-9", '{"k": 1}')
    assert request.inputs()[0].name() == "INPUT0"
    assert pb_utils.TritonError(b"broke").message() == "broke"
    assert pb_utils.InferenceResponse([], parameters=b'{"a": true}').parameters() == '{"a": true}'
