"""The process's file descriptors: raise the soft limit to the hard one, and say so once when they run out.

Every connection, gRPC's and HTTP's, is a descriptor. Linux starts most processes with a soft
limit of 1,024 under a far higher hard limit (systemd's is 524,288); at 1,024, 1,100 idle HTTP
connections made both listeners fail every new connection. The host and each front-end worker
raise the soft limit to the hard one at start, as nginx (``worker_rlimit_nofile``) and Go's
runtime do; the HTTP connection bound then keeps a share of them for everything else.

When they run out anyway, asyncio logs each failed ``accept`` with a traceback and retries every
second, per listener: ``AcceptFailureLog`` turns that into one line per interval, with a count.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

logger = logging.getLogger(__name__)

ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message when accept fails with EMFILE
ACCEPT_FAILURE_LOG_INTERVAL_S = 60.0


def raise_open_file_limit(level: int = logging.INFO) -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft  # Linux refuses an unlimited soft limit for descriptors; nothing to raise otherwise
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    logger.log(level, "raised the open-file limit (RLIMIT_NOFILE) from %d to its hard limit %d", soft, hard)
    return hard


def open_file_limit() -> int | None:
    """The soft limit on this process's descriptors; None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


class AcceptFailureLog:
    """A loop exception handler: failed accepts are logged at most once per ``interval_s``, with how
    many there were; everything else goes to asyncio's default handler."""

    def __init__(self, interval_s: float = ACCEPT_FAILURE_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_logged = -interval_s
        self._unlogged = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_logged < self.interval_s:
            return
        logger.error(
            "cannot accept new connections: %s (%d failed accepts since the last report; retried every "
            "second, reported at most every %.0f s)",
            context.get("exception"),
            self._unlogged,
            self.interval_s,
        )
        self._last_logged, self._unlogged = now, 0

    def install(self) -> None:
        """Handle the running loop's exceptions."""
        asyncio.get_running_loop().set_exception_handler(self)
