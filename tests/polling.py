"""Waiting on a polled condition with a bounded deadline, and the server-side counts tests poll."""

from __future__ import annotations

import time
from collections.abc import Callable

from clients import ClientError, InferenceClient


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0, interval_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def success_count(client: InferenceClient, model: str) -> int:
    """Successful inference requests the server counted for ``model`` (its ready versions); 0 if unreachable."""
    try:
        rows = client.statistics(model)
    except ClientError:
        return 0
    return sum(int(row.get("inference_stats", {}).get("success", {}).get("count", 0)) for row in rows)
