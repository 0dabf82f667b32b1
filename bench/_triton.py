"""Start a real Triton 2.51 (../shared/tools/triton_peer/run_triton.sh, Python backend) for a benchmark.

run_triton.sh installs tritonserver into /tmp/triton-venv the first time (a ~500 MB download), then serves gRPC on
PORT, HTTP on PORT-1 and metrics on PORT+1, all on 127.0.0.1. Triton cannot bind port 0 and tell us the port, so
free_triton_port() probes for three free ports (a small race with other programs, reported as a failed start).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench._server import REPO_ROOT

RUN_TRITON = REPO_ROOT.parent / "shared" / "tools" / "triton_peer" / "run_triton.sh"
ONNX_MODEL_PY = RUN_TRITON.parent / "onnx_model.py"


@dataclass(frozen=True)
class TritonServer:
    port: int
    pid: int  # tritonserver itself (run_triton.sh execs it); the Python-backend stubs are its children

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """``host:port`` of its HTTP endpoint (run_triton.sh serves HTTP on the port below gRPC's)."""
        return f"127.0.0.1:{self.port - 1}"


def free_triton_port(first: int = 18100, last: int = 18999) -> int:
    """A gRPC port with the ports below (HTTP) and above (metrics) it free too, on 127.0.0.1."""
    for port in range(first + 1, last, 3):
        try:
            for candidate in (port - 1, port, port + 1):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no three free ports between {first} and {last}")


def write_onnx_model(
    repo: Path, name: str, onnx_path: Path, io_config: str, config_extra: str, ort_threads: int = 2
) -> None:
    """A Python-backend model that runs ``onnx_path`` with onnxruntime (triton_peer/onnx_model.py).

    ``io_config`` holds max_batch_size and the input/output blocks; ``config_extra`` the rest (batching...)."""
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(ONNX_MODEL_PY, repo / name / "1" / "model.py")
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\n{io_config}\n{config_extra}\n'
        f'parameters {{ key: "onnx_path" value: {{ string_value: "{onnx_path.resolve()}" }} }}\n'
        f'parameters {{ key: "ort_threads" value: {{ string_value: "{ort_threads}" }} }}\n'
    )


def _wait_until_ready(process: subprocess.Popen[bytes], url: str, deadline: float) -> None:
    import tritonclient.grpc as triton

    while True:
        try:
            with triton.InferenceServerClient(url) as client:
                if client.is_server_ready():
                    return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("tritonserver did not become ready")
        time.sleep(0.5)


def _run_view(extra_args: tuple[str, ...], folder: Path) -> dict[str, str]:
    """An environment under which run_triton.sh starts the installed tritonserver with ``extra_args`` added:
    a TRITON_RUN folder whose backends and caches are the install's, and whose ``bin/tritonserver`` execs the
    real one with them (run_triton.sh passes no flags of its own choosing). Needs one plain start first."""
    installed = Path(os.environ.get("TRITON_RUN", "/tmp/triton-run")) / "tritonserver"
    binary = installed / "bin" / "tritonserver"
    if not binary.exists():
        raise RuntimeError(f"no tritonserver at {binary}: start run_triton.sh once (it installs it)")
    view = folder / "tritonserver"
    (view / "bin").mkdir(parents=True)
    for part in ("backends", "caches", "python_backend_stubs"):
        (view / part).symlink_to(installed / part)
    wrapper = view / "bin" / "tritonserver"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(str(binary))} "$@" {" ".join(map(shlex.quote, extra_args))}\n')
    wrapper.chmod(0o755)
    return {**os.environ, "TRITON_RUN": str(folder)}


@contextmanager
def triton_server(
    repo: Path,
    port: int | None = None,
    log_path: Path | None = None,
    timeout_s: float = 900.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[TritonServer]:
    """A ready tritonserver serving ``repo`` for the ``with`` block; SIGTERM to its process group afterwards.

    Its output goes to ``log_path`` (None: this process's stdout). The default timeout covers the first install.
    ``extra_args``: flags added to run_triton.sh's (e.g. ``--cache-config``); they need Triton installed."""
    port = port or free_triton_port()
    view = tempfile.TemporaryDirectory() if extra_args else None
    env = _run_view(extra_args, Path(view.name)) if view else None
    log = open(log_path, "wb") if log_path else None  # noqa: SIM115 - closed below, the child keeps its own copy
    try:
        process = subprocess.Popen(
            ["bash", str(RUN_TRITON), str(repo), str(port)],
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            env=env,
        )
    finally:
        if log:
            log.close()
    try:
        _wait_until_ready(process, f"127.0.0.1:{port}", time.monotonic() + timeout_s)
        yield TritonServer(port, process.pid)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if view is not None:
            view.cleanup()
