"""A model that keeps its inputs, or writes into them, never changes another request's answer.

Found by the review of session 47. A process instance's model read its inputs as views of the
worker's REQUESTS arena, which the next batch rewrites: a model that kept an input (a stateful model
storing the previous request's input in ``self``) later returned another request's data, or zeros
where the host gave the arena's pages back. A thread instance's model was handed the server's own
arrays: in an ensemble, a step writing into its input changed its sibling step's input and the
ensemble's output. Every answer here is compared with one computed locally.
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from shoal.dataplane import inline
from tests import models
from tests.conftest import RunningServer, serving
from tests.ensemble_models import add_ensemble, add_onnx_add1, step
from tests.python_models import reuses_buffer, write_model

THREAD = 'parameters { key: "process_instances" value: { string_value: "false" } }'
KINDS = {"process": "", "thread": THREAD}

# A model that keeps inputs in ``self.kept`` (None at first): ``{keep}`` sets OUT (``answer``) and keeps.
KEEPING = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kept = None

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            {keep}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", answer)]))
        return responses
"""
# OUT = the input of the request before (its own the first time): the model keeps each input.
STASH = KEEPING.format(keep="answer = x if self.kept is None else self.kept\n            self.kept = x")
# OUT = the first request's input, every time: the model keeps that one only.
KEEPS_FIRST = KEEPING.format(keep="self.kept = x if self.kept is None else self.kept\n            answer = self.kept")

STASH_CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT64 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT64 dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
"""


# OUT = a table of the model's own (its BLS callers write into what they get: it must not change).
TABLE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.table = np.array([[0, 100, 200, 300]], np.float32)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.table)]) for _ in requests]
"""

# OUT = IN * 10, written into the input itself; or (COPY) a copy of IN taken after a pause, so that a
# sibling step writing in place first would show.
IN_PLACE = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            {body}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y)]))
        return responses
"""
TIMES_TEN = "x *= 10\n            y = x"
LATE_COPY = "time.sleep(0.05)\n            y = x.copy()"

FP32_4 = "data_type: TYPE_FP32 dims: [ 4 ]"
STEP_CONFIG = f"""
backend: "python"
max_batch_size: 8
input [ {{{{ name: "IN" {FP32_4} }}}} ]
output [ {{{{ name: "OUT" {FP32_4} }}}} ]
instance_group [ {{{{ count: 1 kind: KIND_CPU }}}} ]
{{extra}}
"""

# A BLS caller: passes its input to {callee}, then answers what ``{answer}`` says: its input as it is
# afterwards (the callee writes into its input), or the callee's answer with the input added into it
# in place (the callee answered a table of its own).
CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN")
            called = pb_utils.InferenceRequest(
                model_name="{callee}", requested_output_names=["OUT"], inputs=[x]
            ).exec()
            if called.has_error():
                raise pb_utils.TritonModelException(called.error().message())
            {answer}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y)]))
        return responses
"""
INPUT_AFTERWARDS = "y = x.as_numpy()"
ANSWER_PLUS_INPUT = "y = called.output_tensors()[0].as_numpy()\n            y += x.as_numpy()"


def _add_torch_stash(repo: Path, name: str) -> None:
    """TorchScript that keeps its input: OUT = the input of the batch before, in a worker process."""
    import torch

    class Stash(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.previous = torch.zeros(1, 4, dtype=torch.int64)
            self.seen = False

        def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803 - Triton's tensor name
            before = self.previous if self.seen else INPUT__0
            self.previous = INPUT__0
            self.seen = True
            return before

    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(Stash()).save(str(repo / name / "1" / "model.pt"))
    models.write_config(
        repo / name,
        """
        platform: "pytorch_libtorch"
        max_batch_size: 0
        input [ { name: "INPUT__0" data_type: TYPE_INT64 dims: [ 1, -1 ] } ]
        output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 1, -1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        parameters { key: "process_instances" value: { string_value: "true" } }
        """,
    )


def _add_torch_keep_42(repo: Path, name: str) -> None:
    """TorchScript that keeps an input whose first value is 42 (a load's zero-filled probe is not) and
    answers what it kept since, else its input, in a worker process; rows of any width (the test's are
    too wide to ride in the pipe's messages, ``inline``: they are views of the worker's arena)."""
    import torch

    class Keep42(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kept = torch.zeros(1, 4, dtype=torch.int64)
            self.keeping = False

        def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803 - Triton's tensor name
            if bool(INPUT__0[0, 0] == 42):
                self.kept = INPUT__0
                self.keeping = True
            return self.kept + 0 if self.keeping else INPUT__0 + 0

    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(Keep42()).save(str(repo / name / "1" / "model.pt"))
    (repo / name / "config.pbtxt").write_text((repo / "torch_stash" / "config.pbtxt").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    for kind, extra in KINDS.items():
        write_model(repo, f"stash_{kind}", STASH_CONFIG.format(extra=extra), STASH)
        write_model(repo, f"times_ten_{kind}", STEP_CONFIG.format(extra=extra), IN_PLACE.format(body=TIMES_TEN))
        write_model(repo, f"late_copy_{kind}", STEP_CONFIG.format(extra=extra), IN_PLACE.format(body=LATE_COPY))
        write_model(
            repo,
            f"caller_{kind}",
            STEP_CONFIG.format(extra=THREAD),
            CALLER.format(callee=f"times_ten_{kind}", answer=INPUT_AFTERWARDS),
        )
        write_model(repo, f"keeps_first_{kind}", STASH_CONFIG.format(extra=extra), KEEPS_FIRST)
        write_model(repo, f"table_{kind}", STEP_CONFIG.format(extra=extra), TABLE)
        write_model(
            repo,
            f"table_caller_{kind}",
            STEP_CONFIG.format(extra=THREAD),
            CALLER.format(callee=f"table_{kind}", answer=ANSWER_PLUS_INPUT),
        )
        write_model(repo, f"reuses_buffer_{kind}", STEP_CONFIG.format(extra=extra), reuses_buffer())
        add_ensemble(  # the reused buffer's answer waits for the slow step while the next request refills it
            repo,
            f"reuse_then_wait_{kind}",
            [
                step(f"reuses_buffer_{kind}", {"IN": "IN"}, {"OUT": "B"}),
                step(f"late_copy_{kind}", {"IN": "B"}, {"OUT": "OUT"}),
            ],
            io=f'input [ {{ name: "IN" {FP32_4} }} ]\noutput [ {{ name: "OUT" {FP32_4} }} ]',
        )
        add_ensemble(
            repo,
            f"fan_out_{kind}",
            [
                step("add1", {"IN": "IN"}, {"OUT": "C"}),
                step(f"times_ten_{kind}", {"IN": "C"}, {"OUT": "P"}),
                step(f"late_copy_{kind}", {"IN": "C"}, {"OUT": "Q"}),
            ],
            io=f'input [ {{ name: "IN" {FP32_4} }} ]\noutput [ '
            + ", ".join(f'{{ name: "{name}" {FP32_4} }}' for name in ("P", "Q", "C"))
            + " ]",
        )
    add_onnx_add1(repo)
    _add_torch_stash(repo, "torch_stash")
    _add_torch_keep_42(repo, "torch_keep_42")
    with serving(repo, tmp_path_factory.mktemp("server")) as running:
        yield running


def _stash_call(client: grpcclient.InferenceServerClient, model: str, value: np.ndarray) -> np.ndarray:
    data = grpcclient.InferInput("IN", list(value.shape), "INT64")
    data.set_data_from_numpy(value)
    return client.infer(model, [data]).as_numpy("OUT")


def _interfere(url: str, model: str, done: threading.Event, wrong: list[str]) -> None:
    """Another client's requests to the same model meanwhile (bounded): its answers are checked too."""
    with grpcclient.InferenceServerClient(url) as client:
        previous = None
        for count in range(300):
            if done.is_set():
                return
            value = np.full(16, -1 - count, dtype=np.int64)  # another length: no answer of the other client's
            got = _stash_call(client, model, value)
            if got.shape == value.shape and previous is not None and not np.array_equal(got, previous):
                wrong.append(f"{got} after {previous}")
            previous = value


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_input_the_model_keeps_stays_as_it_came(server: RunningServer, kind: str) -> None:
    """Each answer is the input of the request before it (the model's kept array), while other requests
    rewrite the instance's arena meanwhile; then once more with inputs past the arena's resident part
    (whose pages the host gave back after each batch)."""
    model = f"stash_{kind}"
    with grpcclient.InferenceServerClient(server.url) as client:
        values = [np.arange(8, dtype=np.int64) + 1000 * k for k in range(3)]
        answers = [_stash_call(client, model, value) for value in values]
        assert [a.tolist() for a in answers] == [values[0].tolist(), values[0].tolist(), values[1].tolist()]

        big = [np.arange(3_000_000, dtype=np.int64) * (k + 1) for k in range(2)]  # 24 MB: past 16 MiB
        answers = [_stash_call(client, model, value) for value in big]
        assert np.array_equal(answers[0], values[-1]) and np.array_equal(answers[1], big[0])
        small = np.arange(8, dtype=np.int64) - 5
        assert np.array_equal(_stash_call(client, model, small), big[1])  # the big kept input, not zeros

        done, wrong = threading.Event(), []
        other = threading.Thread(target=_interfere, args=(server.url, model, done, wrong))
        other.start()
        try:
            for k in range(60):  # the answers of this client's own requests, interleaved with the other's
                value = np.arange(4, dtype=np.int64) + 10 * k
                got = _stash_call(client, model, value)
                assert got.shape in ((4,), (8,), (16,)) and got.dtype == np.int64, got
        finally:
            done.set()
            other.join(60)
        assert not wrong, wrong[:3]


@pytest.mark.parametrize("width", [4, inline.INLINE_BYTES // 8 + 1], ids=["in-the-message", "in-the-arena"])
def test_a_torchscript_model_that_keeps_its_input_in_a_worker(server: RunningServer, width: int) -> None:
    """A feed model's process instance: the same promise (PyTorch's tensor shares the bytes it was given:
    a view of the arena, or the worker's own copy of what the message carried)."""
    with grpcclient.InferenceServerClient(server.url) as client:
        values = [np.arange(width, dtype=np.int64).reshape(1, width) + 100 * k for k in range(4)]
        answers = []
        for value in values:
            data = grpcclient.InferInput("INPUT__0", [1, width], "INT64")
            data.set_data_from_numpy(value)
            answers.append(client.infer("torch_stash", [data]).as_numpy("OUTPUT__0"))
    # The first answer is whatever the module kept before (a load may run it once): not checked.
    assert [a.tolist() for a in answers[1:]] == [v.tolist() for v in values[:3]]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_step_writing_into_its_input_leaves_its_sibling_and_the_ensemble_output_alone(
    server: RunningServer, kind: str
) -> None:
    """C = IN + 1 feeds two steps and is an output itself: P = C * 10 (written into C in place), Q = C."""
    with grpcclient.InferenceServerClient(server.url) as client:
        for k in range(3):
            value = np.arange(4, dtype=np.float32).reshape(1, 4) + k
            data = grpcclient.InferInput("IN", [1, 4], "FP32")
            data.set_data_from_numpy(value)
            result = client.infer(f"fan_out_{kind}", [data])
            assert np.array_equal(result.as_numpy("C"), value + 1), result.as_numpy("C")
            assert np.array_equal(result.as_numpy("Q"), value + 1), result.as_numpy("Q")
            assert np.array_equal(result.as_numpy("P"), (value + 1) * 10), result.as_numpy("P")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bls_callee_writing_into_its_input_leaves_the_callers_alone(server: RunningServer, kind: str) -> None:
    """A thread instance's BLS call hands its input to a model that multiplies it by ten in place."""
    with grpcclient.InferenceServerClient(server.url) as client:
        value = np.arange(4, dtype=np.float32).reshape(1, 4) + 3
        data = grpcclient.InferInput("IN", [1, 4], "FP32")
        data.set_data_from_numpy(value)
        assert np.array_equal(client.infer(f"caller_{kind}", [data]).as_numpy("OUT"), value)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_model_that_kept_one_input_costs_one_new_arena_not_one_a_batch(server: RunningServer, kind: str) -> None:
    """Once a process instance's model kept an input, its worker copies: later batches are not taken
    for kept ones too (each would cost a new arena, a collection and a warning: 25x slower). The inputs
    are too large to ride in the batch's message (``inline``): they are views of the arena."""
    model = f"keeps_first_{kind}"
    with grpcclient.InferenceServerClient(server.url) as client:
        first = np.arange(inline.INLINE_BYTES // 8 + 1, dtype=np.int64) + 77
        answers = [_stash_call(client, model, first if k == 0 else first * 0 + k) for k in range(20)]
    assert all(np.array_equal(answer, first) for answer in answers), answers
    warnings = server.log().count(f"model {model}: an input outlived its batch")
    assert warnings == (1 if kind == "process" else 0), server.log()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bls_caller_writing_into_its_answer_leaves_the_callees_array_alone(server: RunningServer, kind: str) -> None:
    """A thread instance's caller got the callee's own array (its table) and changed it for every client."""
    with grpcclient.InferenceServerClient(server.url) as client:
        for k in range(3):
            value = np.full((1, 4), k + 1, dtype=np.float32)
            data = grpcclient.InferInput("IN", [1, 4], "FP32")
            data.set_data_from_numpy(value)
            got = client.infer(f"table_caller_{kind}", [data]).as_numpy("OUT")
            assert np.array_equal(got, np.array([[0, 100, 200, 300]], np.float32) + value), got


def test_a_kept_arena_is_never_written_when_no_new_one_can_be_made(server: RunningServer) -> None:
    """The host cannot make the new arena (no descriptor left): a batch fails, and none is ever packed
    into the arena the model reads (the feed path packed the next one there, the model then answering
    another request's bytes)."""
    limits = Path(f"/proc/{server.pid}/limits").read_text().splitlines()
    soft, hard = (
        int(v) if v.isdigit() else resource.RLIM_INFINITY
        for v in next(line for line in limits if line.startswith("Max open files")).split()[3:5]
    )

    def call(client: grpcclient.InferenceServerClient, value: np.ndarray) -> np.ndarray | str:
        data = grpcclient.InferInput("INPUT__0", list(value.shape), "INT64")
        data.set_data_from_numpy(value)
        try:
            return client.infer("torch_keep_42", [data]).as_numpy("OUTPUT__0")
        except InferenceServerException as exc:
            return str(exc)

    width = inline.INLINE_BYTES // 8 + 1  # past what a message carries: the inputs lie in the arena
    values = [np.arange(width, dtype=np.int64).reshape(1, width) + 10 * k for k in range(3)]
    values[0][0, 0] = 42  # the one the module keeps
    with grpcclient.InferenceServerClient(server.url) as client:
        assert client.is_server_live()  # connected before the limit: accepting a connection needs a descriptor
        # No new descriptor from here (fewer allowed than are open): no new arena can be made.
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (16, hard))
        try:
            kept = call(client, values[0])  # answered; the module keeps this input
            refused = call(client, values[1])  # needs a new arena first: none can be made
        finally:
            resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (soft, hard))
        after = call(client, values[2])
    assert isinstance(kept, np.ndarray) and np.array_equal(kept, values[0]), kept
    assert isinstance(refused, str) and "Too many open files" in refused, refused
    assert isinstance(after, np.ndarray) and np.array_equal(after, values[0]), after


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_answer_in_the_models_own_reused_buffer_is_the_requests_own(server: RunningServer, kind: str) -> None:
    """Clients at once through an ensemble whose first step answers in one buffer it refills for every
    request; its answer waits for the slow second step meanwhile (359 of 360 wrong, thread instance)."""
    wrong: list[str] = []

    def client_calls(client_index: int) -> None:
        with grpcclient.InferenceServerClient(server.url) as client:
            for k in range(5):
                value = np.full((1, 4), 1000 * client_index + k, dtype=np.float32)
                data = grpcclient.InferInput("IN", [1, 4], "FP32")
                data.set_data_from_numpy(value)
                got = client.infer(f"reuse_then_wait_{kind}", [data]).as_numpy("OUT")
                if not np.array_equal(got, value):
                    wrong.append(f"client {client_index} sent {value[0, 0]}, got {got.tolist()}")

    threads = [threading.Thread(target=client_calls, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert not wrong, wrong[:5]
