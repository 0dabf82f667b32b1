"""shoal-load against a real server: sweeps, CSV/JSON/PNG output, error accounting, bad arguments."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clients.loadtest.cli import parse_steps
from clients.loadtest.report import PERF_ANALYZER_COLUMNS
from tests import models
from tests.conftest import RunningServer

FAST = ["--warmup-s", "0.3", "--window-s", "0.5", "--max-windows", "4", "--max-seconds", "60", "--no-progress"]


@pytest.fixture(scope="module")
def load_server(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server

    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")
    models.write_config(
        repo / "bounded",
        """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        dynamic_batching { default_queue_policy { max_queue_size: 1 } }
        parameters { key: "execute_delay_ms" value: { string_value: "20" } }
        """,
    )
    (repo / "bounded" / "1").mkdir()
    server = start_server(repo, tmp_path_factory.mktemp("server"))
    yield server
    assert server.stop() == 0, server.log()


def shoal_load(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.loadtest", *args], capture_output=True, text=True,
                          timeout=120)


def test_sweep_writes_csv_json_and_png(load_server: RunningServer, tmp_path: Path) -> None:
    out_csv, out_json, out_png = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "r.png"
    result = shoal_load("-m", "simple", "-u", load_server.url, "--concurrency", "1:2:x2", "--input-data", "zeros",
                        "--csv", str(out_csv), "--json", str(out_json), "--plot", str(out_png), *FAST)
    assert result.returncode == 0, result.stderr
    assert "concurrency 1" in result.stdout and "concurrency 2" in result.stdout
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert list(rows[0])[: 1 + len(PERF_ANALYZER_COLUMNS)] == ["Concurrency", *PERF_ANALYZER_COLUMNS]
    assert [r["Concurrency"] for r in rows] == ["1", "2"]
    for row in rows:
        assert float(row["Inferences/Second"]) > 0
        assert 0 < float(row["p50 latency"]) <= float(row["p99 latency"]) <= float(row["Max latency"])
        assert row["Errors"] == ""
        assert float(row["Server Compute Infer"]) > 0  # breakdown from ModelStatistics deltas
    steps = json.loads(out_json.read_text())["steps"]
    assert steps[1]["concurrency"] == 2 and steps[1]["requests"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    assert imread(out_png).shape[0] > 100


def test_rejections_are_counted_by_status(load_server: RunningServer, tmp_path: Path) -> None:
    out_csv = tmp_path / "r.csv"
    result = shoal_load("-m", "bounded", "-u", load_server.url, "--concurrency", "6", "--csv", str(out_csv), *FAST)
    assert result.returncode == 0, result.stderr
    row = next(csv.DictReader(out_csv.read_text().splitlines()))
    errors = dict(item.split("=") for item in row["Errors"].split(";"))
    assert set(errors) == {"UNAVAILABLE"} and int(errors["UNAVAILABLE"]) > 0
    assert float(row["Inferences/Second"]) > 0  # the accepted requests still complete


def test_open_loop_with_two_processes(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load("-m", "simple", "-u", load_server.url, "--request-rate", "200", "--distribution", "poisson",
                        "--processes", "2", "--json", str(out_json), *FAST)
    assert result.returncode == 0, result.stderr
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["request_rate"] == 200 and not step["errors"]
    assert 120 < step["throughput"] < 280  # a Poisson schedule at 200/s over ~1.5 s


def test_fixed_request_count(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load("-m", "simple", "-u", load_server.url, "--concurrency", "2", "--request-count", "300",
                        "--json", str(out_json), *FAST)
    assert result.returncode == 0, result.stderr
    assert json.loads(out_json.read_text())["steps"][0]["requests"] >= 300


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--concurrency", "0"], "every value must be positive"),
        (["--concurrency", "1:8:x1"], "START:END:xFACTOR"),
        (["--concurrency", "many"], "expected N"),
        (["--concurrency", "1", "--request-rate", "5"], "not allowed with argument"),
        (["--batch-size", "9"], "exceeds model 'simple' max_batch_size 8"),
        (["--shape", "NOPE:3"], "unknown input(s) ['NOPE']"),
        (["--window-s", "0"], "--window-s and --max-seconds must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(load_server: RunningServer, args: list[str], phrase: str) -> None:
    result = shoal_load("-m", "simple", "-u", load_server.url, *args)
    assert result.returncode == 2
    assert phrase in result.stderr


def test_unknown_model_exits_1(load_server: RunningServer) -> None:
    result = shoal_load("-m", "nope", "-u", load_server.url)
    assert result.returncode == 1
    assert "Request for unknown model: 'nope'" in result.stderr


def test_step_specs() -> None:
    assert parse_steps("1:32:x2", True) == [1, 2, 4, 8, 16, 32]
    assert parse_steps("1:7:3", True) == [1, 4, 7]
    assert parse_steps("1,3", True) == [1, 3]
    assert parse_steps("50:100:25", False) == [50.0, 75.0, 100.0]


def test_more_processes_than_concurrency(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load("-m", "simple", "-u", load_server.url, "--concurrency", "1", "--processes", "2",
                        "--json", str(out_json), *FAST)
    assert result.returncode == 0, result.stderr
    assert json.loads(out_json.read_text())["steps"][0]["throughput"] > 0
