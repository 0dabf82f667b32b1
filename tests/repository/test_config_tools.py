"""shoal config generate / check / tune, and auto-complete at load."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from shoal.clients import InferenceClient
from shoal.configuring.pipeline import configure
from shoal.protocol import config_pb2
from shoal.repository.config import parse_config
from tests import models
from tests.models import EXAMPLES
from tests.polling import live_members, wait_until


def shoal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=timeout)


def multi_io_model(path: Path, batch: str | int = "batch") -> None:
    """Two inputs (FP16 [b,3], INT64 [b]) and two outputs (FP16 [b,3], BOOL [b]); ``batch`` is dim 0."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["pixels"], ["scaled"]),
            helper.make_node("Cast", ["ids"], ["flags"], to=TensorProto.BOOL),
        ],
        "multi",
        [
            helper.make_tensor_value_info("pixels", TensorProto.FLOAT16, [batch, 3]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [batch]),
        ],
        [
            helper.make_tensor_value_info("scaled", TensorProto.FLOAT16, [batch, 3]),
            helper.make_tensor_value_info("flags", TensorProto.BOOL, [batch]),
        ],
    )
    models.save_onnx(graph, path)


def test_generate_for_a_dynamic_batch_model(tmp_path: Path) -> None:
    multi_io_model(tmp_path / "multi.onnx")
    result = shoal("config", "generate", str(tmp_path / "multi.onnx"))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "multi"
    assert (folder / "1" / "model.onnx").is_file() and (tmp_path / "multi.onnx").is_file()
    text = (folder / "config.pbtxt").read_text()
    assert "# every input and output has a variable first dimension" in text
    config = parse_config(text)
    assert config.name == "multi" and config.backend == "onnxruntime" and config.max_batch_size == 4
    assert [(i.name, config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in config.input] == [
        ("pixels", "TYPE_FP16", [3]),
        ("ids", "TYPE_INT64", [1]),
    ]
    assert config.input[1].HasField("reshape") and list(config.input[1].reshape.shape) == []
    assert [(o.name, config_pb2.DataType.Name(o.data_type)) for o in config.output] == [
        ("scaled", "TYPE_FP16"),
        ("flags", "TYPE_BOOL"),
    ]
    assert config.HasField("dynamic_batching") and config.version_policy.latest.num_versions == 1
    assert shoal("config", "generate", str(folder)).returncode == 2  # exists: refuses without --force
    again = shoal("config", "generate", str(folder), "--output", "-")
    assert again.stdout == text, "generation is stable"
    # Written as Triton's docs and our examples write it: lists of blocks, dims as lists, the kind.
    assert 'input [\n  {\n    name: "pixels"' in text and "\ninput {" not in text
    assert "dims: [ 3 ]" in text and "dims: 3" not in text
    assert "preferred_batch_size: [ 4 ]" in text
    assert "kind: KIND_AUTO" in text and config.instance_group[0].kind == config_pb2.ModelInstanceGroup.KIND_AUTO


def test_generate_replaces_a_stale_copy_of_the_model_file(tmp_path: Path) -> None:
    model_file = tmp_path / "net.onnx"
    model_file.write_bytes(b"not an onnx model")
    failed = shoal("config", "generate", str(model_file))
    assert failed.returncode != 0 and "cannot load" in failed.stderr, failed.stderr
    multi_io_model(model_file)  # the user fixes the file and runs again: the broken copy must not be reused
    result = shoal("config", "generate", str(model_file), "--kind", "KIND_CPU")
    assert result.returncode == 0, result.stderr
    copy = tmp_path / "net" / "1" / "model.onnx"
    assert copy.read_bytes() == model_file.read_bytes()
    assert [i.name for i in parse_config((tmp_path / "net" / "config.pbtxt").read_text()).input] == ["pixels", "ids"]
    multi_io_model(model_file, batch=2)  # a changed model, regenerated with --force
    result = shoal("config", "generate", str(model_file), "--kind", "KIND_CPU", "--force")
    assert result.returncode == 0, result.stderr
    assert copy.read_bytes() == model_file.read_bytes()
    config = parse_config((tmp_path / "net" / "config.pbtxt").read_text())
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [2, 3]
    assert "kind: KIND_CPU" in (tmp_path / "net" / "config.pbtxt").read_text()
    assert not list((tmp_path / "net" / "1").glob(".*partial")), "no partial copy is left behind"


def test_generate_for_a_model_file_in_a_version_folder_writes_its_model_folders_config(tmp_path: Path) -> None:
    # Triton's layout, repo/<model>/<version>/model.onnx: the model folder is the one above the version.
    repo = tmp_path / "repo"
    multi_io_model(repo / "m" / "1" / "model.onnx")
    result = shoal("config", "generate", str(repo / "m" / "1" / "model.onnx"), "--kind", "KIND_CPU")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {repo / 'm' / 'config.pbtxt'}"
    assert parse_config((repo / "m" / "config.pbtxt").read_text()).name == "m"
    assert sorted(p.name for p in (repo / "m" / "1").iterdir()) == ["model.onnx"], "nothing nested, nothing copied"
    # The version folder itself, also from inside it: the same model folder.
    again = subprocess.run(
        [sys.executable, "-m", "shoal", "config", "generate", ".", "--kind", "KIND_CPU", "--output", "-"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo / "m" / "1",
    )
    assert again.returncode == 0 and parse_config(again.stdout) == parse_config(
        (repo / "m" / "config.pbtxt").read_text()
    ), again.stderr
    checked = shoal("config", "check", str(repo))
    assert checked.returncode == 0 and checked.stdout.startswith("ok    m"), checked.stdout + checked.stderr
    # A file the server would not look for in a version folder is refused, not copied into a new model.
    shutil.copy(repo / "m" / "1" / "model.onnx", repo / "m" / "1" / "other.onnx")
    refused = shoal("config", "generate", str(repo / "m" / "1" / "other.onnx"))
    assert refused.returncode == 1 and "where the server loads model.onnx: rename it" in refused.stderr
    assert sorted(p.name for p in (repo / "m" / "1").iterdir()) == ["model.onnx", "other.onnx"]


def test_generate_for_a_fixed_batch_model(tmp_path: Path) -> None:
    multi_io_model(tmp_path / "fixed" / "1" / "model.onnx", batch=2)
    result = shoal("config", "generate", str(tmp_path / "fixed"), "--instance-count", "3", "--kind", "KIND_CPU")
    assert result.returncode == 0, result.stderr
    config = parse_config((tmp_path / "fixed" / "config.pbtxt").read_text())
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert list(config.input[0].dims) == [2, 3] and list(config.input[1].dims) == [2]
    assert config.instance_group[0].count == 3


def test_generated_config_loads_and_serves(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    multi_io_model(repo / "multi.onnx")
    # KIND_CPU: with KIND_AUTO a GPU host whose onnxruntime has the CUDA provider would place it on the GPU.
    assert (
        shoal("config", "generate", str(repo / "multi.onnx"), "--max-batch-size", "8", "--kind", "KIND_CPU").returncode
        == 0
    )
    (repo / "multi.onnx").unlink()
    server = server_factory(repo, "--strict-model-config", "true")
    import numpy as np

    with InferenceClient(server.url, timeout_s=30) as client:
        served = client.model_config("multi")
        written = configure(repo / "multi", strict=True).config
        assert served["max_batch_size"] == written.max_batch_size == 8
        assert [i["name"] for i in served["input"]] == [i.name for i in written.input]
        # ids has dims [1] with an empty reshape (Triton's form for per-sample scalars): sent as [2, 1]
        outputs = client.infer("multi", {"pixels": np.ones((2, 3), np.float16), "ids": np.array([[0], [5]])})
    assert outputs["flags"].tolist() == [[False], [True]] and outputs["scaled"].dtype == np.float16


def test_auto_complete_at_load_and_strict_mode(tmp_path: Path, server_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    # "bare" has no config, so no instance kind: KIND_AUTO, the GPU on a host with onnxruntime-gpu.
    # Auto-complete is what this tests, on the CPU wherever it runs: hide the GPUs from the servers.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    repo = tmp_path / "repo"
    (repo / "bare").mkdir(parents=True)
    shutil.copytree(EXAMPLES / "simple" / "1", repo / "bare" / "1")  # no config.pbtxt at all
    (repo / "partial").mkdir()
    shutil.copytree(EXAMPLES / "simple" / "1", repo / "partial" / "1")
    (repo / "partial" / "config.pbtxt").write_text(
        "max_batch_size: 2\ninstance_group [ { count: 3 kind: KIND_CPU } ]\n"
    )
    server = server_factory(repo)
    with InferenceClient(server.url, timeout_s=30) as client:
        bare = client.model_config("bare")
        assert bare["backend"] == "onnxruntime" and bare["max_batch_size"] == 4
        assert [i["name"] for i in bare["input"]] == ["INPUT0", "INPUT1"] and "dynamic_batching" in bare
        partial = client.model_config("partial")
        assert partial["max_batch_size"] == 2 and partial["instance_group"][0]["count"] == 3
        assert [o["name"] for o in partial["output"]] == ["OUTPUT0", "OUTPUT1"]
    strict = server_factory(
        repo, "--strict-model-config", "true", "--strict-readiness", "false", "--exit-on-error", "false"
    )
    with InferenceClient(strict.url, timeout_s=30) as client:
        index = {e.name: e for e in client.repository_index()}
    assert index["bare"].state == "UNAVAILABLE" and "no config.pbtxt" in index["bare"].reason
    assert "strict-model-config" in index["partial"].reason


def test_check_reports_each_class_of_error(tmp_path: Path) -> None:
    repo = models.repository(tmp_path, "simple")
    models.add_broken_models(repo)  # bad_syntax, corrupt_file, wrong_dims
    for name, text in {
        "unknown_field": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\nmax_batch: 3\n',
        "preferred_too_big": (EXAMPLES / "simple" / "config.pbtxt")
        .read_text()
        .replace('"simple"', '"preferred_too_big"')
        + "dynamic_batching { preferred_batch_size: [ 16 ] }\n",
        "priority_out_of_range": (EXAMPLES / "simple" / "config.pbtxt")
        .read_text()
        .replace('"simple"', '"priority_out_of_range"')
        + "dynamic_batching { priority_levels: 2 default_priority_level: 3 }\n",
    }.items():
        shutil.copytree(EXAMPLES / "simple" / "1", repo / name / "1")
        (repo / name / "config.pbtxt").write_text(text)
    result = shoal("config", "check", str(repo))
    assert result.returncode == 1
    lines = {line.split()[1].rstrip(":"): line for line in result.stdout.splitlines()}
    assert lines["simple"].startswith("ok")
    expectations = {
        "bad_syntax": "config.pbtxt:4:",
        "corrupt_file": "cannot load",
        "wrong_dims": "input 'INPUT0' has dims [-1] + [15] in the config but shape [-1, 16] in the model",
        "unknown_field": "config.pbtxt:3:",
        "preferred_too_big": "preferred_batch_size 16 must be between 1 and max_batch_size 8",
        "priority_out_of_range": "default_priority_level must be between 1 and priority_levels 2",
    }
    for name, phrase in expectations.items():
        assert lines[name].startswith("FAIL") and phrase in lines[name], lines[name]
    assert 'Message type "inference.ModelConfig" has no field named "max_batch"' in lines["unknown_field"]
    assert "shoal.inference" not in result.stdout
    assert "1 ok, 6 failed" in result.stderr


def test_check_passes_the_shipped_repository() -> None:
    result = shoal("config", "check", str(EXAMPLES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 ok, 0 failed" in result.stderr


RICH_CONFIG_EXTRA = """
# Two priorities; the urgent ones may not wait.
dynamic_batching {
  priority_levels: 2
  default_priority_level: 2
  preserve_ordering: true  # replies in request order
  default_queue_policy { max_queue_size: 64 }
  priority_queue_policy { key: 1 value: { timeout_action: REJECT default_timeout_microseconds: 5000 } }
}
parameters { key: "note" value: { string_value: "kept" } }
"""


def _untuned(config: config_pb2.ModelConfig) -> config_pb2.ModelConfig:
    """``config`` without the fields the tuner may change."""
    out = config_pb2.ModelConfig()
    out.CopyFrom(config)
    out.ClearField("max_batch_size")
    for group in out.instance_group:
        group.ClearField("count")
    out.dynamic_batching.ClearField("max_queue_delay_microseconds")
    out.dynamic_batching.ClearField("preferred_batch_size")
    return out


def _comments(text: str) -> list[str]:
    return [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]


def test_tune_finds_a_config_at_least_as_good_as_the_start(tmp_path: Path) -> None:
    folder = tmp_path / "simple"
    shutil.copytree(EXAMPLES / "simple", folder)
    (folder / "config.pbtxt").write_text((EXAMPLES / "simple" / "config.pbtxt").read_text() + RICH_CONFIG_EXTRA)
    original_text = (folder / "config.pbtxt").read_text()
    # 0.4 min left one candidate and a half on a busy machine (a server start and two steps can take 20 s
    # there), and the assertions below want two candidates and four points.
    result = shoal(
        "config",
        "tune",
        str(folder),
        "--latency-budget-ms",
        "200",
        "--max-minutes",
        "1",
        "--concurrency",
        "1,4",
        "--window-s",
        "0.3",
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader((folder / "tuning" / "tune.csv").read_text().splitlines()))
    candidates = {(r["instances"], r["max_batch_size"], r["delay_us"], r["preferred_half"]) for r in rows}
    assert len(candidates) >= 2 and len(rows) >= 4, "the search measured several points"
    assert (folder / "tuning" / "tune.png").read_bytes()[:4] == b"\x89PNG"
    assert (folder / "config.pbtxt").read_text() == original_text
    tuned_text = (folder / "config.tuned.pbtxt").read_text()
    tuned = parse_config(tuned_text)
    start = [
        float(r["throughput"])
        for r in rows
        if (r["instances"], r["max_batch_size"], r["delay_us"], r["preferred_half"]) == ("1", "8", "0", "False")
    ]
    best = max(float(r["throughput"]) for r in rows if r["within_budget"] == "True")
    assert best >= max(start)
    assert tuned.name == "simple" and tuned.instance_group[0].count >= 1
    # Only the tuned fields changed: priorities, queue policies, preserve_ordering, parameters and
    # every comment are kept, and the header names no absolute path.
    assert _untuned(tuned) == _untuned(parse_config(original_text))
    assert tuned.dynamic_batching.priority_levels == 2 and tuned.dynamic_batching.preserve_ordering
    assert set(_comments(original_text)) <= set(_comments(tuned_text))
    assert str(tmp_path) not in tuned_text and "tuning/tune.csv" in tuned_text
    # The tuned config is valid: it passes the server's own pipeline.
    (folder / "config.pbtxt").write_text(tuned_text)
    assert configure(folder, strict=True).spec.max_batch_size == tuned.max_batch_size


@pytest.mark.parametrize(
    "candidate",
    [(3, 16, 500, True), (1, 1, 0, False), (2, 4, 0, False)],
    ids=["bigger", "no-batching", "smaller"],
)
def test_a_tuned_config_changes_only_the_tuned_fields(candidate: tuple[int, int, int, bool]) -> None:
    from shoal.tools.tune import Candidate, candidate_text

    original = textwrap.dedent("""\
        # A GPU model with everything the tuner must keep.
        name: "rich"
        backend: "onnxruntime"
        max_batch_size: 8  # the tuner changes this
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        instance_group [
          { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] },  # two per GPU
          { name: "spare" count: 1 kind: KIND_CPU }
        ]
        dynamic_batching {
          preferred_batch_size: 4
          preferred_batch_size: 8
          max_queue_delay_microseconds: 100
          priority_levels: 3
          default_priority_level: 2
          preserve_ordering: true
          default_queue_policy { max_queue_size: 16 allow_timeout_override: true }
          priority_queue_policy { key: 1 value { timeout_action: DELAY } }
        }
        parameters { key: "p" value: { string_value: "v" } }
        # the end
        """)
    chosen = Candidate(*candidate)
    text = candidate_text(original, chosen, can_batch=True)
    tuned, before = parse_config(text), parse_config(original)
    assert _untuned(tuned) == _untuned(before)
    assert [g.count for g in tuned.instance_group] == [chosen.instances] * 2
    assert list(tuned.instance_group[0].gpus) == [0, 1] and tuned.max_batch_size == chosen.max_batch_size
    batching = tuned.dynamic_batching
    if chosen.max_batch_size > 1:
        assert batching.max_queue_delay_microseconds == chosen.delay_us
        assert list(batching.preferred_batch_size) == (
            [chosen.max_batch_size // 2, chosen.max_batch_size] if chosen.preferred_half else [chosen.max_batch_size]
        )
    else:
        assert not batching.preferred_batch_size and batching.max_queue_delay_microseconds == 100
    assert batching.priority_levels == 3 and batching.preserve_ordering
    assert _comments(text) == _comments(original)
    # Untouched lines are byte for byte the same.
    kept = [
        line
        for line in original.splitlines()
        if not any(key in line for key in ("max_batch_size", "count", "preferred_batch_size", "max_queue_delay"))
    ]
    assert all(line in text.splitlines() for line in kept)


def test_a_tuned_config_adds_what_the_original_left_to_defaults() -> None:
    from shoal.tools.tune import Candidate, candidate_text

    original = 'backend: "identity"\n# no batching settings, no instance group\nmax_batch_size: 4\n'
    text = candidate_text(original, Candidate(2, 8, 100), can_batch=True)
    tuned = parse_config(text)
    assert tuned.instance_group[0].count == 2 and tuned.max_batch_size == 8
    assert list(tuned.dynamic_batching.preferred_batch_size) == [8]
    assert tuned.dynamic_batching.max_queue_delay_microseconds == 100
    assert text.startswith(original.replace("max_batch_size: 4", "max_batch_size: 8"))


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["config", "generate", "/nonexistent/model.onnx"], "neither a model folder nor a model file"),
        (["config", "check", "/nonexistent"], "is not a folder"),
    ],
)
def test_config_commands_fail_clearly(args: list[str], phrase: str) -> None:
    result = shoal(*args)
    assert result.returncode in (1, 2) and phrase in result.stderr


def test_triton_style_text_parses_back_to_the_same_config() -> None:
    from shoal.repository.config_text import format_config

    config = parse_config((EXAMPLES / "simple" / "config.pbtxt").read_text())
    config.input[0].reshape.SetInParent()  # an empty reshape (per-sample scalars) must survive
    config.parameters["execute_delay_ms"].string_value = 'say "10"'
    config.parameters["a"].string_value = "b"
    config.dynamic_batching.priority_levels = 2
    config.dynamic_batching.priority_queue_policy[1].max_queue_size = 4
    config.instance_group[0].ClearField("kind")
    config.instance_group[0].gpus.extend([0, 1])
    text = format_config(config)
    assert parse_config(text) == config
    assert "reshape { }" in text and "gpus: [ 0, 1 ]" in text and "kind: KIND_AUTO" in text
    assert text.index('key: "a"') < text.index('key: "execute_delay_ms"'), "map entries in key order"
    assert format_config(parse_config(text)) == text


def test_tune_names_the_input_whose_variable_dims_need_a_shape(tmp_path: Path) -> None:
    models.add_identity(tmp_path, "var", "FP32", dims="[ 3, -1 ]")
    result = shoal("config", "tune", str(tmp_path / "var"), "--latency-budget-ms", "100", "--max-minutes", "0.2")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        "shoal config tune: error: input 'IN' has variable dims [3, -1]: give one sample's dims with "
        "--shape IN:D1,D2,... (e.g. --shape IN:3,16)"
    )
    assert not (tmp_path / "var" / "tuning").exists(), "nothing was measured, nothing written"
    for shape, phrase in {
        "OTHER:3,4": "model 'var' has no such input; its inputs: IN",
        "IN:4,4": "does not fit input 'IN', whose dims are [3, -1]",
        "IN:3": "does not fit input 'IN'",
    }.items():
        wrong = shoal("config", "tune", str(tmp_path / "var"), "--latency-budget-ms", "100", "--shape", shape)
        assert wrong.returncode == 1 and phrase in wrong.stderr and len(wrong.stderr.splitlines()) == 1, wrong.stderr


def test_tune_measures_a_model_with_variable_dims_at_the_given_shape(tmp_path: Path) -> None:
    models.add_identity(tmp_path, "var", "FP32", dims="[ 3, -1 ]")
    result = shoal(
        "config",
        "tune",
        str(tmp_path / "var"),
        "--latency-budget-ms",
        "200",
        "--max-minutes",
        "0.1",
        "--concurrency",
        "1",
        "--window-s",
        "0.2",
        "--shape",
        "IN:3,5",
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "inputs IN:3,5" in result.stdout
    rows = list(csv.DictReader((tmp_path / "var" / "tuning" / "tune.csv").read_text().splitlines()))
    assert rows and all(float(r["throughput"]) > 0 and r["errors"] == "0" for r in rows)
    assert "--shape IN:3,5" in (tmp_path / "var" / "config.tuned.pbtxt").read_text()


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--latency-budget-ms", "nan"], "argument --latency-budget-ms: expected a positive number, got 'nan'"),
        (["--latency-budget-ms", "-5"], "argument --latency-budget-ms: expected a positive number, got '-5'"),
        (["--latency-budget-ms", "0"], "argument --latency-budget-ms: expected a positive number, got '0'"),
        (["--latency-budget-ms", "5", "--max-minutes", "0"], "argument --max-minutes: expected a positive number"),
        (["--latency-budget-ms", "5", "--max-minutes", "-1"], "argument --max-minutes: expected a positive number"),
        (["--latency-budget-ms", "5", "--max-minutes", "nan"], "argument --max-minutes: expected a positive number"),
        (["--latency-budget-ms", "5", "--max-minutes", "inf"], "argument --max-minutes: expected a positive number"),
        (["--latency-budget-ms", "5", "--window-s", "0"], "argument --window-s: expected a positive number"),
        (["--latency-budget-ms", "5", "--concurrency", "1,0"], "argument --concurrency: expected positive integers"),
        (["--latency-budget-ms", "5", "--shape", "IN"], "argument --shape: expected NAME:D1,D2,..."),
        (["--latency-budget-ms", "5", "--shape", "IN:-1"], "with non-negative dims, got 'IN:-1'"),
    ],
)
def test_tune_refuses_budgets_and_bounds_that_mean_nothing(tmp_path: Path, args: list[str], phrase: str) -> None:
    result = shoal("config", "tune", str(tmp_path / "absent"), *args)
    assert result.returncode == 2 and phrase in result.stderr, result.stderr
    assert not (tmp_path / "absent").exists()


def test_ctrl_c_stops_the_tuner_with_what_it_measured(tmp_path: Path) -> None:
    folder = tmp_path / "simple"
    shutil.copytree(EXAMPLES / "simple", folder)
    tune = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal",
            "config",
            "tune",
            str(folder),
            "--latency-budget-ms",
            "200",
            "--max-minutes",
            "5",
            "--concurrency",
            "1,2",
            "--window-s",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert tune.stdout is not None
        for line in tune.stdout:  # bounded by --max-minutes
            if "best in budget" in line:  # the first candidate is measured, the second is starting
                break
        os.killpg(tune.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        _, stderr = tune.communicate(timeout=120)
    finally:
        if tune.poll() is None:
            os.killpg(tune.pid, signal.SIGKILL)
        tune.wait()
    assert tune.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    assert (folder / "tuning" / "tune.csv").is_file() and not (folder / "config.tuned.pbtxt").exists()
    assert wait_until(lambda: not live_members(session=tune.pid), timeout_s=30), "a server outlived the tuner"
