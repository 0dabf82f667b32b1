"""Start a Shoal server for a benchmark (see shoal.tools.local_server)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.tools import local_server

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def shoal_server(
    repository: Path, *extra_args: str, timeout_s: float = 120.0, python_path: Path | None = None
) -> Iterator[tuple[str, int]]:
    """Yields (url, pid) of a ready server on a free loopback port; stops it afterwards. ``python_path``: a
    folder holding another ``shoal`` package to serve instead (``checked_out_server``)."""
    with local_server.running(repository, *extra_args, timeout_s=timeout_s, python_path=python_path) as server:
        yield server.url, server.pid


@contextmanager
def checked_out_server(revision: str) -> Iterator[Path]:
    """A folder holding the server's ``shoal`` as it was at ``revision`` (``git archive``), to pass as
    ``python_path``: the same benchmark run against an earlier revision of the server in one run, alternating.

    Since ``server/shoal/`` (a portion of the ``shoal`` namespace) the revision's server is served with this
    checkout's ``shoal.protocol`` and ``shoal.clients``. Before it, ``server/`` was the whole package, protocol
    included, and gets this checkout's generated protobuf modules (they are not in git)."""
    with tempfile.TemporaryDirectory() as folder:
        split = subprocess.run(
            ["git", "cat-file", "-e", f"{revision}:server/shoal"], cwd=REPO_ROOT, capture_output=True
        )
        tree = "server/shoal" if split.returncode == 0 else "server"
        archive = subprocess.run(
            ["git", "archive", revision, tree], cwd=REPO_ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        if split.returncode == 0:
            yield Path(folder) / "server"
            return
        package = Path(folder) / "shoal"
        (Path(folder) / "server").rename(package)
        for generated in (REPO_ROOT / "proto" / "shoal" / "protocol").glob("*_pb2.py"):
            shutil.copy(generated, package / "protocol" / generated.name)
        yield Path(folder)
