"""Build test model repositories: ONNX models made with onnx.helper, identity models, broken ones."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import onnx
from onnx import TensorProto, helper

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "model_repository"

ALL_DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
)


def config_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def write_config(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(text))


def save_onnx(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def copy_example(repo: Path, name: str) -> None:
    shutil.copytree(EXAMPLES / name, repo / name)


def repository(tmp_path: Path, *examples: str) -> Path:
    """A fresh ``tmp_path/repo`` holding copies of these shipped example models."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in examples:
        copy_example(repo, name)
    return repo


def set_instance_kind(model_dir: Path, kind: str) -> None:
    """Rewrite an example config's KIND_CPU instance group to ``kind``."""
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", kind))


def add_identity(repo: Path, name: str, datatype: str, max_batch_size: int = 8, dims: str = "[ -1 ]") -> None:
    """An identity-backend model: OUT = IN, for one datatype."""
    write_config(
        repo / name,
        f"""
        backend: "identity"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: {config_type(datatype)} dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: {config_type(datatype)} dims: {dims} }} ]
        """,
    )
    (repo / name / "1").mkdir()


def add_delayed_identity(
    repo: Path, name: str, delay_ms: int, max_batch_size: int = 8, count: int = 1, extra: str = ""
) -> None:
    """OUT = IN over INT64 rows of 2, ``count`` CPU instances each sleeping ``delay_ms`` per execution."""
    write_config(
        repo / name,
        f"""
        backend: "identity"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: TYPE_INT64 dims: [ 2 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_INT64 dims: [ 2 ] }} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        parameters {{ key: "execute_delay_ms" value: {{ string_value: "{delay_ms}" }} }}
        {extra}
        """,
    )
    (repo / name / "1").mkdir()


def add_onnx_strings(repo: Path, name: str = "strings") -> None:
    """An ONNX Identity over a string tensor, without batching."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["IN"], ["OUT"])],
        "strings",
        [helper.make_tensor_value_info("IN", TensorProto.STRING, [None])],
        [helper.make_tensor_value_info("OUT", TensorProto.STRING, [None])],
    )
    save_onnx(graph, repo / name / "1" / "model.onnx")
    write_config(
        repo / name,
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        """,
    )


def add_broken_models(repo: Path) -> dict[str, str]:
    """Models that must fail to load; returns name → a phrase their reason must contain."""
    write_config(repo / "bad_syntax", 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\ninput [ { name: \n')
    (repo / "bad_syntax" / "1").mkdir()

    shutil.copytree(EXAMPLES / "simple", repo / "corrupt_file")
    (repo / "corrupt_file" / "config.pbtxt").write_text(
        (EXAMPLES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"corrupt_file"')
    )
    (repo / "corrupt_file" / "1" / "model.onnx").write_bytes(b"this is not an onnx model\x00\xff")

    shutil.copytree(EXAMPLES / "simple", repo / "wrong_dims")
    (repo / "wrong_dims" / "config.pbtxt").write_text(
        (EXAMPLES / "simple" / "config.pbtxt")
        .read_text()
        .replace('"simple"', '"wrong_dims"')
        .replace("dims: [ 16 ]", "dims: [ 15 ]", 1)
    )
    return {
        "bad_syntax": "config.pbtxt:",
        "corrupt_file": "cannot load",
        "wrong_dims": "input 'INPUT0'",
    }


def add_weighty_onnx(repo: Path, name: str, megabytes: float, instances: int = 1, extra: str = "") -> None:
    """y = x + w, with w a constant of ``megabytes`` MB: the model file's size is the weight."""
    count = int(megabytes * 2**20) // 4
    weight = helper.make_tensor("w", TensorProto.FLOAT, [count], bytes(4 * count), raw=True)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [count])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [count])],
        initializer=[weight],
    )
    save_onnx(graph, repo / name / "1" / "model.onnx")
    write_config(
        repo / name,
        f"""
        platform: "onnxruntime_onnx"
        max_batch_size: 0
        input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {count} ] }} ]
        output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {count} ] }} ]
        instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
        {extra}
        """,
    )
