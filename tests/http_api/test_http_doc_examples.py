"""The HTTP/REST examples of docs/http.md run as written, against a real server: they are parsed
out of the page, so they cannot drift from what the server does."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import models
from tests.models import REPO_ROOT

SECTION = "## HTTP/REST"


def _blocks(language: str) -> list[str]:
    """The ``language`` code blocks of docs/http.md's HTTP/REST section."""
    text = (REPO_ROOT / "docs" / "http.md").read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(rf"```{language}\n(.*?)```", text[start : end if end >= 0 else len(text)], flags=re.S)


def _on(port: int, code: str) -> str:
    assert "localhost:8000" in code
    return code.replace("localhost:8000", f"127.0.0.1:{port}")


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_curl_examples_run(tmp_path: Path, server_factory) -> None:
    (block,) = _blocks("bash")
    assert block.count("curl ") == 5
    server = server_factory(models.repository(tmp_path, "simple"))
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", _on(server.http_port, block)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    first, _, rest = result.stdout.partition("\n")
    assert first == "ready"
    metadata, inference, index, statistics = _documents(rest)  # curl prints them with no newline between
    assert metadata["name"] == "simple"
    outputs = {o["name"]: o["data"] for o in inference["outputs"]}
    assert outputs["OUTPUT0"] == list(range(1, 17)) and outputs["OUTPUT1"] == list(range(-1, 15))
    assert index == [{"name": "simple", "version": "1", "state": "READY"}]
    assert statistics["model_stats"][0]["inference_count"] == 1


def test_python_example_runs(tmp_path: Path, server_factory) -> None:
    (block,) = _blocks("python")
    server = server_factory(models.repository(tmp_path, "simple"))
    result = subprocess.run(
        [sys.executable, "-c", _on(server.http_port, block)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert [int(n) for n in re.findall(r"-?\d+", result.stdout)] == list(range(1, 17))


def _documents(text: str) -> list[object]:
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        document, at = decoder.raw_decode(text, at)
        found.append(document)
    return found
