"""Config parsing, normalization, validation, version policies and folder scanning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shoal.configuring.pipeline import configure
from shoal.errors import ErrorCode, ShoalError, shown
from shoal.protocol.types import DataType
from shoal.repository import scanner
from shoal.repository.config import InstanceKind, VersionPolicy, normalize, parse_config, validate
from tests.models import EXAMPLES, write_config

TRITON_STYLE = """
name: "resnet"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { specific { versions: [ 1, 3 ] } }
input [
  {
    name: "data"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape: { shape: [ 1, 3, 224, 224 ] }
  }
]
output [ { name: "prob" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" } ]
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
optimization { execution_accelerators { gpu_execution_accelerator : [ { name : "tensorrt" } ] } }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
model_warmup [
  {
    name: "w"
    batch_size: 1
    inputs { key: "data" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
  }
]
"""


def test_triton_config_parses_and_converts() -> None:
    config = normalize(parse_config(TRITON_STYLE), "resnet")
    validate(config, "resnet")
    assert config.backend == "onnxruntime"
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.model_warmup[0].inputs["data"].zero_data


def test_spec_from_example_folder() -> None:
    spec = configure(EXAMPLES / "simple", strict=True).spec
    assert spec.name == "simple" and spec.backend == "onnxruntime" and spec.max_batch_size == 8
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [
        ("INPUT0", DataType.INT32, (16,)),
        ("INPUT1", DataType.INT32, (16,)),
    ]
    assert spec.default_model_filename == "model.onnx"
    assert spec.instance_groups[0].kind is InstanceKind.CPU
    assert spec.version_policy == VersionPolicy("latest", 1)
    assert spec.config_json["max_batch_size"] == 8


def test_normalize_fills_triton_defaults() -> None:
    config = normalize(parse_config('backend: "onnxruntime"\nmax_batch_size: 4\ndynamic_batching {}'), "m")
    assert config.name == "m" and config.platform == "onnxruntime_onnx"
    assert config.version_policy.latest.num_versions == 1
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    assert config.instance_group[0].name == "m" and config.instance_group[0].count == 1


def test_parse_error_names_file_line_and_column(tmp_path: Path) -> None:
    """Named relative to the repository (the model folder's parent), never by its absolute path."""
    write_config(tmp_path / "m", 'name: "m"\nmax_batch_size: "eight"\n')
    with pytest.raises(ShoalError) as caught:
        configure(tmp_path / "m", strict=True)
    assert caught.value.code is ErrorCode.LOAD_FAILED
    assert caught.value.message.startswith("m/config.pbtxt:2:")
    assert str(tmp_path) not in caught.value.message


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ShoalError, match="max_batch"):
        parse_config("max_batch: 4")


def _with_reshape(dims: str, reshape: str) -> str:
    return (
        f'backend: "identity" input [{{ name: "a" data_type: TYPE_FP32 dims: {dims} '
        f'reshape {{ shape: {reshape} }} }}] output [{{ name: "b" data_type: TYPE_FP32 dims: [1] }}]'
    )


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ('name: "other" backend: "onnxruntime"', "does not match the folder name"),
        ("max_batch_size: 2", "neither 'platform' nor 'backend'"),
        ('backend: "onnxruntime" max_batch_size: -1', "max_batch_size must be >= 0"),
        ('backend: "onnxruntime" input [{ name: "a" data_type: TYPE_FP32 dims: [1] }]', "at least one input"),
        (
            'backend: "onnxruntime" input [{ name: "a" data_type: TYPE_FP32 }] '
            'output [{ name: "b" data_type: TYPE_FP32 dims: [1] }]',
            "input 'a' must have at least one dim",
        ),
        (
            'backend: "onnxruntime" input [{ name: "a" dims: [1] }] '
            'output [{ name: "b" data_type: TYPE_FP32 dims: [1] }]',
            "input 'a' has no data_type",
        ),
        (
            'backend: "onnxruntime" input [{ name: "a" data_type: TYPE_FP32 dims: [0] }] '
            'output [{ name: "b" data_type: TYPE_FP32 dims: [1] }]',
            "invalid dims",
        ),
        ('platform: "pytorch_libtorch" backend: "onnxruntime"', "does not match backend"),
        (_with_reshape("[4]", "[3]"), "different size for dims [4] and reshape [3]"),
        (_with_reshape("[2, -1]", "[-1, 2]"), "different size for dims"),
        (_with_reshape("[-1]", "[-1, -1]"), "different size for dims"),
        (_with_reshape("[2]", "[]"), "dims must hold one element"),
        (_with_reshape("[-1, -1]", "[-1, -1]"), "more than one variable dimension"),
        (_with_reshape("[4]", "[0, 4]"), "invalid reshape"),
        (
            'backend: "onnxruntime" max_batch_size: 4 input [{ name: "a" data_type: TYPE_FP32 dims: [1] }] '
            'output [{ name: "b" data_type: TYPE_FP32 dims: [1] }] '
            "dynamic_batching { priority_levels: 4000000000 default_priority_level: 1 }",
            "priority_levels must be at most 1024",
        ),  # a queue per level: 4e9 took the server past 14 GB
    ],
)
def test_validation_names_the_problem(text: str, phrase: str) -> None:
    with pytest.raises(ShoalError) as caught:
        validate(normalize(parse_config(text), "m"), "m")
    assert phrase in caught.value.message


@pytest.mark.parametrize(
    ("policy", "available", "selected"),
    [
        (VersionPolicy(), [1, 2, 10], [10]),
        (VersionPolicy("latest", 2), [1, 2, 10], [2, 10]),
        (VersionPolicy("all"), [3, 1], [1, 3]),
        (VersionPolicy("specific", versions=(1, 7)), [1, 2], [1]),
    ],
)
def test_version_policy(policy: VersionPolicy, available: list[int], selected: list[int]) -> None:
    assert policy.select(available) == selected


def test_version_folders_skip_non_integer_and_zero_padded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("1", "2", "010", "0", "v3", "latest"):
        (tmp_path / name).mkdir()
    (tmp_path / "7").write_text("a file, not a folder")
    with caplog.at_level(logging.WARNING):
        assert scanner.list_versions(tmp_path) == [1, 2]
    assert "'010'" in caplog.text and "'v3'" in caplog.text


@pytest.mark.parametrize("name", ["..", "../etc", "a/b", "/abs", ".hidden", "", "a\x00b", "a/../b"])
def test_unsafe_model_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ShoalError) as caught:
        scanner.model_dir(tmp_path, name)
    assert caught.value.code is ErrorCode.MODEL_NOT_FOUND  # unknown_model: UNAVAILABLE over gRPC


def test_a_top_level_symlink_out_of_the_repository_is_a_model_folder(tmp_path: Path) -> None:
    """kserve-storage's local download puts a symlink in place of each top-level entry (issue 25):
    the model is the link's name, its files are checked against the target's real path."""
    repo, store = tmp_path / "repo", tmp_path / "store"
    (repo / "good").mkdir(parents=True)
    (store / "abc123" / "1").mkdir(parents=True)
    (store / "other" / "1").mkdir(parents=True)
    (store / "abc123" / "1" / "ok").symlink_to(store / "abc123" / "1")
    (store / "abc123" / "1" / "to_other").symlink_to(store / "other" / "1")
    (store / "abc123" / "2").symlink_to(store / "other" / "1", target_is_directory=True)
    (repo / "linked").symlink_to(store / "abc123", target_is_directory=True)
    assert scanner.list_models(repo) == ["good", "linked"]
    folder = scanner.model_dir(repo, "linked")
    assert folder == repo.resolve() / "linked" and folder.name == "linked"
    assert scanner.checked_path(repo, "linked/1/ok") == (store / "abc123" / "1").resolve()
    for relative in ("linked/1/to_other", "linked/../store/other/1", "linked/2"):
        with pytest.raises(ShoalError, match="is not a path inside the model repository"):
            scanner.checked_path(repo, relative)
    with pytest.raises(ShoalError, match="'linked/2' is not a path inside the model repository"):
        scanner.list_versions(folder)


def test_a_linked_model_folder_is_named_by_its_link_in_messages(tmp_path: Path) -> None:
    """A reason that names a file of a model folder linked from outside names it as the repository
    does (``linked/1/model.onnx``), never by the target's absolute path."""
    repo, store = tmp_path / "repo", tmp_path / "store"
    (store / "abc123" / "1").mkdir(parents=True)
    repo.mkdir()
    (repo / "linked").symlink_to(store / "abc123", target_is_directory=True)
    real = (store / "abc123").resolve()
    text = f"Load model from {real}/1/model.onnx failed: protobuf parsing failed ({real})"
    assert (
        scanner.without_repository_path(repo, text)
        == "Load model from linked/1/model.onnx failed: protobuf parsing failed (linked)"
    )


@pytest.mark.parametrize("target", ["repository", "above", "file", "dangling"])
def test_a_top_level_symlink_to_the_repository_or_no_folder_is_skipped(tmp_path: Path, target: str) -> None:
    """A top-level symlink to the repository or a folder holding it would put everything inside
    one model folder; one to a file or nothing is no model folder."""
    repo = tmp_path / "repo"
    (repo / "good").mkdir(parents=True)
    (tmp_path / "afile").write_text("x")
    destination = {
        "repository": repo,
        "above": tmp_path.parent,
        "file": tmp_path / "afile",
        "dangling": tmp_path / "nothing",
    }[target]
    (repo / "escape").symlink_to(destination)
    assert scanner.list_models(repo) == ["good"]
    with pytest.raises(ShoalError):
        scanner.model_dir(repo, "escape")
    if target == "above":  # through "escape", the whole file system would be inside
        with pytest.raises(ShoalError):
            scanner.checked_path(repo, f"escape/{tmp_path.name}/afile")


def test_the_repository_may_itself_be_a_symlink(tmp_path: Path) -> None:
    """An oci:// modelcar makes /mnt/models itself a symlink (issue 25)."""
    (tmp_path / "real" / "m" / "1").mkdir(parents=True)
    (tmp_path / "mnt").symlink_to(tmp_path / "real", target_is_directory=True)
    assert scanner.list_models(tmp_path / "mnt") == ["m"]
    assert scanner.list_versions(scanner.model_dir(tmp_path / "mnt", "m")) == [1]


@pytest.mark.parametrize(
    ("dims", "reshape"),
    [("[1]", "[]"), ("[4]", "[2, 2]"), ("[-1, 4]", "[-1, 2, 2]"), ("[3, -1, 4]", "[3, -1, 2, 2]"), ("[-1]", "[-1, 1]")],
)
def test_reshape_with_the_same_elements_is_valid(dims: str, reshape: str) -> None:
    validate(normalize(parse_config(_with_reshape(dims, reshape)), "m"), "m")


def test_checked_path_refuses_every_way_out_alike(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    (repo / "m" / "1").mkdir(parents=True)
    (outside / "there").mkdir(parents=True)
    (repo / "m" / "inside").symlink_to(repo / "m" / "1", target_is_directory=True)
    assert scanner.checked_path(repo, "m/inside") == (repo / "m" / "1").resolve()
    for suffix in ("there", "missing"):
        (repo / "m" / f"link_{suffix}").symlink_to(outside / suffix)
    refusals = []
    for relative in (
        "/etc/passwd",
        "m/../../outside/there",
        "m/../../outside/missing",
        "m/link_there",
        "m/link_missing",
        "m/link_there/deeper",
        "m/" + "x" * 300,
    ):
        with pytest.raises(ShoalError) as caught:
            scanner.checked_path(repo, relative)
        assert caught.value.code is ErrorCode.LOAD_FAILED
        refusals.append(caught.value.message.replace(shown(relative), "<path>"))
    assert set(refusals) == {"'<path>' is not a path inside the model repository"}


def test_version_folder_symlinked_out_refuses_the_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (repo / "m" / "2").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ShoalError, match="'m/2' is not a path inside the model repository"):
        scanner.list_versions(repo / "m")


def test_a_model_folder_is_no_repository(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ShoalError, match="pass its parent folder"):
        scanner.list_models(EXAMPLES / "simple")
    bare = tmp_path / "bare"
    (bare / "3").mkdir(parents=True)
    (bare / "3" / "model.onnx").write_bytes(b"")
    with pytest.raises(ShoalError, match="pass its parent folder"):
        scanner.list_models(bare)
    assert scanner.list_models(EXAMPLES) == [
        "image_pipeline",
        "mlp",
        "mlp_pipeline",
        "mlp_scale",
        "preprocess",
        "repeat",
        "simple",
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    with caplog.at_level(logging.WARNING):
        assert scanner.list_models(empty) == []
    assert "holds no model folders" in caplog.text
