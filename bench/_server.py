"""Start a Shoal server for a benchmark (see shoal.tools.local_server)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
    """A folder holding ``shoal`` as it was at ``revision`` (``git archive``), to pass as ``python_path``:
    the same benchmark run against an earlier revision of the server in one run, alternating.

    The folder's ``shoal`` is one regular package holding the whole revision (server, protocol and
    clients), so that nothing of this checkout's namespace fills a module the revision lacks; it gets
    this checkout's generated protobuf modules (they are not in git). Before ``server/shoal/``,
    ``server/`` was that package, protocol included."""
    with tempfile.TemporaryDirectory() as folder:
        found = subprocess.run(
            ["git", "cat-file", "-e", f"{revision}:server/shoal"], cwd=REPO_ROOT, capture_output=True
        )
        split = found.returncode == 0
        trees = ["server/shoal", "proto/shoal", "clients/shoal"] if split else ["server"]
        archive = subprocess.run(
            ["git", "archive", revision, *trees], cwd=REPO_ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        package = Path(folder) / "shoal"
        if split:
            for tree in trees:  # one package: shoal/ with protocol/ and clients/ inside
                shutil.copytree(Path(folder) / tree, package, dirs_exist_ok=True)
            (package / "__init__.py").touch()
        else:
            (Path(folder) / "server").rename(package)
        for generated in (REPO_ROOT / "proto" / "shoal" / "protocol").glob("*_pb2.py"):
            shutil.copy(generated, package / "protocol" / generated.name)
        yield Path(folder)


def child_figures(script: Path, arguments: list[str], python_path: Path | None = None) -> dict[str, float]:
    """Run a benchmark's child process (``python script *arguments``) and return the figures it prints
    as its last line (JSON); ``python_path``: a folder holding another revision's ``shoal``
    (``checked_out_server``) for the child to import instead of this checkout's."""
    environment = dict(os.environ)
    if python_path is not None:
        environment["PYTHONPATH"] = str(python_path)
    command = [sys.executable, str(script), *arguments]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement failed:\n{done.stderr[-4000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def revisions(stack: ExitStack, before: str) -> list[tuple[str, Path | None]]:
    """The Shoals a ``--before REV`` benchmark measures: ("this checkout", None), and with ``before``
    (before, the folder ``checked_out_server`` made of it, kept until ``stack`` closes)."""
    sides: list[tuple[str, Path | None]] = [("this checkout", None)]
    if before:
        sides.append((before, stack.enter_context(checked_out_server(before))))
    return sides


def rounds_of(sides: list[tuple[str, Path | None]], rounds: int) -> Iterator[tuple[int, str, Path | None]]:
    """(round, name, python_path) for each of ``sides`` in each round, every other round in the reverse
    order, so neither always goes first."""
    for round_number in range(rounds):
        for name, python_path in sides if round_number % 2 == 0 else sides[::-1]:
            yield round_number, name, python_path
