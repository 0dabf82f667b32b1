"""Wait for a condition instead of sleeping (poll it until it holds, with a bounded deadline), and the
server-side counts tests poll."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from shoal.clients import ClientError, InferenceClient
from shoal.tools.local_server import LocalServer
from tests.prometheus_text import parse, scrape

POLL_INTERVAL_S = 0.01


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "the condition") -> bool:
    """Return True as soon as ``condition()`` holds; fail the test if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)
    return True


def metric(server: LocalServer, name: str, model: str) -> float:
    """One model's (version 1) value of a Prometheus family, summed over its other labels (a failure's
    ``reason``), from /metrics; a counter's sample carries the family's name, with no ``_total``, as Triton's."""
    family = parse(scrape(server.metrics_port)).get(name)
    samples = (
        [s.value for s in family.samples if s.labels.get("model") == model and s.labels.get("version") == "1"]
        if family
        else []
    )
    if not samples:
        raise AssertionError(f"no {name} for model {model} in /metrics")
    return sum(samples)


def success_count(client: InferenceClient, model: str) -> int:
    """Successful inference requests the server counted for ``model`` (its ready versions); 0 if unreachable."""
    try:
        rows = client.statistics(model)
    except ClientError:
        return 0
    return sum(int(row.get("inference_stats", {}).get("success", {}).get("count", 0)) for row in rows)


def live_members(group: int | None = None, session: int | None = None) -> list[int]:
    """Live processes of a process group or a session, from /proc (zombies left out: they only wait
    to be reaped): what a test checks is gone once the server or tool that started them has ended."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and (int(fields[2]) == group or int(fields[3]) == session):
            members.append(int(stat.parent.name))
    return members
