"""Wait for a condition instead of sleeping (poll it until it holds, with a bounded deadline), and the
server-side counts tests poll."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from shoal.clients import ClientError, InferenceClient
from shoal.tools.local_server import LocalServer

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
    """One model's (version 1) value of a Prometheus metric, from /metrics (a counter's sample has no ``_total``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    prefix = f'{name}{{model="{model}",version="1"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"no {name} for model {model} in /metrics")


def success_count(client: InferenceClient, model: str) -> int:
    """Successful inference requests the server counted for ``model`` (its ready versions); 0 if unreachable."""
    try:
        rows = client.statistics(model)
    except ClientError:
        return 0
    return sum(int(row.get("inference_stats", {}).get("success", {}).get("count", 0)) for row in rows)
