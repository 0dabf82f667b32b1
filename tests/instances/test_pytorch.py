"""The PyTorch backend: TorchScript and torch.export models load, serve, batch and refuse mismatches;
memory is accounted per model and budgets refuse what does not fit. Process instances:
tests/instances/test_process_instances.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from shoal.clients import ClientError, InferenceClient
from tests import models

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch (installed by .ci/run)")


class AddSub(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class Linear(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))


class Refills(torch.nn.Module):
    """OUTPUT__0 = INPUT__0, answered in a buffer of the module's own that every batch refills."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kept", torch.zeros(8, 4, dtype=torch.int32))

    def forward(self, INPUT__0: torch.Tensor) -> torch.Tensor:  # noqa: N803 - Triton's tensor name
        rows = INPUT__0.shape[0]
        self.kept[:rows].copy_(INPUT__0)
        return self.kept[:rows]


# Most tests here are about loading and serving, not placement: they pin the CPU, so that a GPU host
# (where KIND_AUTO puts a PyTorch model on the GPU) runs them as written. GPU paths: tests/instances/test_gpu.py.
ON_CPU = "instance_group [ { count: 1 kind: KIND_CPU } ]"


def _config(name: str, inputs: list[tuple[str, str, str]], outputs: list[tuple[str, str, str]], extra: str) -> str:
    def tensors(items: list[tuple[str, str, str]]) -> str:
        return ", ".join(f'{{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in items)

    return (
        f'name: "{name}"\nbackend: "pytorch"\nmax_batch_size: 8\ninput [ {tensors(inputs)} ]\n'
        f"output [ {tensors(outputs)} ]\n{extra}\n"
    )


def add_torchscript(
    repo: Path, name: str, inputs: list[tuple[str, str, str]], outputs: list[tuple[str, str, str]], extra: str = ON_CPU
) -> None:
    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(AddSub()).save(str(repo / name / "1" / "model.pt"))
    (repo / name / "config.pbtxt").write_text(_config(name, inputs, outputs, extra))


INDEXED_IN = [("INPUT__0", "TYPE_INT32", "[ 4 ]"), ("INPUT__1", "TYPE_INT32", "[ 4 ]")]
INDEXED_OUT = [("OUTPUT__0", "TYPE_INT32", "[ 4 ]"), ("OUTPUT__1", "TYPE_INT32", "[ 4 ]")]


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]):
    from tests.conftest import serving

    repo = tmp_path_factory.mktemp("repo")
    add_torchscript(
        repo,
        "addsub",
        INDEXED_IN,
        INDEXED_OUT,
        "dynamic_batching { max_queue_delay_microseconds: 20000 }\ninstance_group [ { count: 4 kind: KIND_CPU } ]",
    )
    add_torchscript(
        repo,
        "named",
        [("b", "TYPE_FP32", "[ 2 ]"), ("a", "TYPE_FP32", "[ 2 ]")],
        [("SUM", "TYPE_FP32", "[ 2 ]"), ("DIFF", "TYPE_FP32", "[ 2 ]")],
    )
    (repo / "exported" / "1").mkdir(parents=True)
    program = torch.export.export(
        Linear(8).eval(), (torch.zeros(2, 8),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},)
    )
    torch.export.save(program, str(repo / "exported" / "1" / "model.pt2"))
    (repo / "exported" / "config.pbtxt").write_text(
        _config(
            "exported",
            [("x", "TYPE_FP32", "[ 8 ]")],
            [("y", "TYPE_FP32", "[ 8 ]")],
            f'default_model_filename: "model.pt2"\n{ON_CPU}',
        )
    )
    add_torchscript(repo, "wrong_dims", INDEXED_IN, [("OUTPUT__0", "TYPE_INT32", "[ 5 ]"), INDEXED_OUT[1]])
    add_torchscript(repo, "wrong_type", INDEXED_IN, [("OUTPUT__0", "TYPE_FP32", "[ 4 ]"), INDEXED_OUT[1]])
    add_torchscript(repo, "three_inputs", [*INDEXED_IN, ("INPUT__2", "TYPE_INT32", "[ 4 ]")], INDEXED_OUT)
    add_torchscript(
        repo,
        "timeout_in_threads",
        INDEXED_IN,
        INDEXED_OUT,
        f'{ON_CPU}\nparameters {{ key: "execution_timeout_ms" value: {{ string_value: "100" }} }}',
    )
    with serving(
        repo, tmp_path_factory.mktemp("server"), *layout, "--strict-readiness", "false", "--exit-on-error", "false"
    ) as server:
        yield server


def test_torchscript_serves_with_indexed_names(torch_server) -> None:
    a = np.arange(8, dtype=np.int32).reshape(2, 4)
    with InferenceClient(torch_server.url, timeout_s=30) as client:
        out = client.infer("addsub", {"INPUT__0": a, "INPUT__1": a * 10})
    np.testing.assert_array_equal(out["OUTPUT__0"], a * 11)
    np.testing.assert_array_equal(out["OUTPUT__1"], -a * 9)


def test_forward_argument_names_pick_the_order(torch_server) -> None:
    a, b = np.array([[1.0, 2.0]], np.float32), np.array([[10.0, 20.0]], np.float32)
    with InferenceClient(torch_server.url, timeout_s=30) as client:
        out = client.infer("named", {"a": a, "b": b})  # config lists b first; forward(a, b)
    np.testing.assert_array_equal(out["SUM"], a + b)
    np.testing.assert_array_equal(out["DIFF"], a - b)


def test_exported_program_serves(torch_server) -> None:
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)
    with InferenceClient(torch_server.url, timeout_s=30) as client:
        y = client.infer("exported", {"x": x})["y"]
    assert y.shape == (3, 8) and (y >= 0).all()


def test_executors_sharing_one_module_batch_and_stay_correct(torch_server) -> None:
    def call(value: int) -> np.ndarray:
        with InferenceClient(torch_server.url, timeout_s=60) as client:
            a = np.full((1 + value % 2, 4), value, np.int32)
            return client.infer("addsub", {"INPUT__0": a, "INPUT__1": a})["OUTPUT__0"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(48)))
    for value, out in enumerate(results):
        assert out.shape == (1 + value % 2, 4) and (out == 2 * value).all()
    with InferenceClient(torch_server.url, timeout_s=30) as client:
        stats = client.statistics("addsub")[0]
    assert int(stats["execution_count"]) < int(stats["inference_stats"]["success"]["count"]), "requests batched"
    assert stats["memory_usage"][0]["type"] == "CPU"


@pytest.mark.parametrize(
    ("model", "phrase"),
    [
        ("wrong_dims", "output 'OUTPUT__0' has dims [1, 5] in the config (batch 1) but the model returns [1, 4]"),
        ("wrong_type", "output 'OUTPUT__0' is TYPE_FP32 in the config but the model returns TYPE_INT32"),
        ("three_inputs", "the model's forward takes 2 input(s) ['a', 'b'], the config lists 3"),
        ("timeout_in_threads", "parameter execution_timeout_ms needs process_instances: true"),
    ],
)
def test_config_model_mismatch_is_a_clear_load_error(torch_server, model: str, phrase: str) -> None:
    with InferenceClient(torch_server.url, timeout_s=30) as client:
        entry = next(e for e in client.repository_index() if e.name == model)
        assert entry.state == "UNAVAILABLE" and phrase in entry.reason, entry.reason
        with pytest.raises(ClientError) as caught:
            client.infer(model, {"INPUT__0": np.zeros((1, 4), np.int32), "INPUT__1": np.zeros((1, 4), np.int32)})
        assert caught.value.status == grpc.StatusCode.NOT_FOUND  # no version loaded, as Triton 2.51


def test_memory_budget_refuses_an_oversized_model(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    (repo / "big" / "1").mkdir(parents=True)
    torch.jit.script(Linear(1024)).save(str(repo / "big" / "1" / "model.pt"))  # 4 MB of weights
    (repo / "big" / "config.pbtxt").write_text(
        _config("big", [("x", "TYPE_FP32", "[ 1024 ]")], [("y", "TYPE_FP32", "[ 1024 ]")], ON_CPU)
    )
    models.copy_example(repo, "simple")
    server = server_factory(
        repo, "--memory-budget-mb", "cpu=2", "--strict-readiness", "false", "--exit-on-error", "false"
    )
    with InferenceClient(server.url, timeout_s=30) as client:
        index = {e.name: e for e in client.repository_index()}
        assert index["big"].state == "UNAVAILABLE"
        assert "memory budget: model 'big' needs about 4.0 MB on cpu" in index["big"].reason
        a = np.ones((1, 16), np.int32)
        np.testing.assert_array_equal(client.infer("simple", {"INPUT0": a, "INPUT1": a})["OUTPUT0"], 2 * a)


def test_model_memory_is_reported(tmp_path: Path, server_factory) -> None:
    """KIND_AUTO: one copy of the weights on each GPU where torch sees one, else one on the CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    repo = tmp_path / "repo"
    (repo / "linear" / "1").mkdir(parents=True)
    torch.jit.script(Linear(256)).save(str(repo / "linear" / "1" / "model.pt"))
    (repo / "linear" / "config.pbtxt").write_text(
        _config(
            "linear",
            [("x", "TYPE_FP32", "[ 256 ]")],
            [("y", "TYPE_FP32", "[ 256 ]")],
            "instance_group [ { count: 3 } ]",
        )
    )
    server = server_factory(repo)
    with InferenceClient(server.url, timeout_s=30) as client:
        usage = client.statistics("linear")[0]["memory_usage"]
    weights = str((256 * 256 + 256) * 4)  # one copy for 3 executors
    assert [(u["type"], u["byte_size"]) for u in usage] == ([("GPU", weights)] * gpus or [("CPU", weights)])


def test_generate_a_torchscript_config_from_input_shapes(tmp_path: Path) -> None:
    import subprocess
    import sys

    from shoal.repository.config import parse_config

    torch.jit.script(AddSub()).save(str(tmp_path / "addsub.pt"))
    command = [sys.executable, "-m", "shoal", "config", "generate", str(tmp_path / "addsub.pt")]
    missing = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "--input NAME:DTYPE:DIMS" in missing.stderr
    result = subprocess.run(
        [*command, "--input", "INPUT__0:INT32:4", "--input", "INPUT__1:INT32:4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "addsub" / "config.pbtxt").read_text()
    config = parse_config(text)
    assert config.backend == "pytorch" and config.max_batch_size == 4
    assert [(o.name, list(o.dims)) for o in config.output] == [("OUTPUT__0", [4]), ("OUTPUT__1", [4])]
    assert "found by running the model" in text
    wrong = subprocess.run(
        [*command, "--input", "INPUT__0:INT32:4", "--force"], capture_output=True, text=True, timeout=120
    )
    assert wrong.returncode == 1 and "does not run on zeros" in wrong.stderr


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")  # loaded here, not in a server
def test_an_output_in_the_modules_own_buffer_is_the_batchs_own(tmp_path: Path) -> None:
    """Found by the review of session 48: the instance's next batch rewrote an earlier batch's outputs
    (``.numpy()`` shares the module's buffer) while their responses were still to be encoded."""
    from shoal.backends import pytorch
    from shoal.backends.devices import CPU
    from shoal.configuring.pipeline import configure

    folder = tmp_path / "refills"
    (folder / "1").mkdir(parents=True)
    torch.jit.script(Refills()).save(str(folder / "1" / "model.pt"))
    (folder / "config.pbtxt").write_text(_config("refills", INDEXED_IN[:1], INDEXED_OUT[:1], ON_CPU))
    spec = configure(folder, strict=False).spec
    model = pytorch.load(spec, folder / "1" / "model.pt", CPU, 1)
    try:
        first = np.arange(8, dtype=np.int32).reshape(2, 4)
        answer = model.run({"INPUT__0": first}, ["OUTPUT__0"])
        model.run({"INPUT__0": np.full((2, 4), -1, np.int32)}, ["OUTPUT__0"])
    finally:
        model.close()
    assert answer["OUTPUT__0"].tolist() == first.tolist()
