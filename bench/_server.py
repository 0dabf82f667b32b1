"""Start a Shoal server for a benchmark (see shoal.tools.local_server)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.tools import local_server

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def shoal_server(repository: Path, *extra_args: str, timeout_s: float = 120.0) -> Iterator[tuple[str, int]]:
    """Yields (url, pid) of a ready server on a free loopback port; stops it afterwards."""
    with local_server.running(repository, *extra_args, timeout_s=timeout_s) as server:
        yield server.url, server.pid
