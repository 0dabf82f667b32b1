"""Triton's own perf_analyzer (a C++ gRPC client) completes a short sweep against Shoal,
and reports the server-side breakdown it reads from ModelStatistics.

perf_analyzer is installed by bench/install_perf_analyzer.sh (.ci/run does it). Set
SHOAL_PERF_ANALYZER to use another binary.
"""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest

from tests import models
from tests.models import REPO_ROOT

BINARY = Path(os.environ.get("SHOAL_PERF_ANALYZER", REPO_ROOT / ".bench-venv" / "bin" / "perf_analyzer"))


@pytest.mark.skipif(
    not BINARY.exists(), reason=f"perf_analyzer not installed at {BINARY}: run bench/install_perf_analyzer.sh"
)
@pytest.mark.other_engine
def test_perf_analyzer_concurrency_sweep(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo)
    out = tmp_path / "pa.csv"
    result = subprocess.run(
        [
            str(BINARY),
            "-m",
            "simple",
            "-u",
            server.url,
            "-i",
            "grpc",
            "--input-data",
            "zero",
            "-b",
            "2",
            "--concurrency-range",
            "1:2",
            "-p",
            "500",
            "--max-trials",
            "4",
            "--stability-percentage",
            "1000",
            "-f",
            str(out),
        ],  # protocol check, not a speed test,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 2]
    for row in rows:
        # Server-side columns come from ModelStatistics deltas: statistics are advertised and read.
        assert float(row["Server Compute Infer"]) > 0 and float(row["Server Queue"]) >= 0
        assert float(row["Inferences/Second"]) > 0
        assert 0 < float(row["p50 latency"]) <= float(row["p99 latency"])


@pytest.mark.skipif(
    not BINARY.exists(), reason=f"perf_analyzer not installed at {BINARY}: run bench/install_perf_analyzer.sh"
)
def test_perf_analyzer_over_http(tmp_path: Path, server_factory) -> None:
    """``-i http`` (issue 15): binary tensor data in and out, statistics read from /v2/models/.../stats."""
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo)
    out = tmp_path / "pa.csv"
    result = subprocess.run(
        [
            str(BINARY),
            "-m",
            "simple",
            "-u",
            server.http_url,
            "-i",
            "http",
            "--input-data",
            "random",
            "-b",
            "2",
            "--concurrency-range",
            "1:2",
            "-p",
            "500",
            "--max-trials",
            "4",
            "--stability-percentage",
            "1000",
            "-f",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 2]
    for row in rows:
        assert float(row["Server Compute Infer"]) > 0 and float(row["Inferences/Second"]) > 0
