"""What every Shoal process logs, and how: Triton's logging extension (``/v2/logging``, gRPC ``LogSettings``).

A server is several processes (the host, front-end workers, process instances such as Python
models), and a change made through any front end must apply in all of them at once. So the settings
live in one small shared page (``LogShare``: a memfd, nothing named) that the host writes and every
process maps; each process's log handler reads it for every record (``SettingsFilter``) and formats
the record as it says (``SettingsFormatter``). No message per process, nothing to keep in step: a
child started after a change (a restarted worker) reads the same page.

Each process lets every record reach its handlers (the root logger at DEBUG) and the handler
decides. Shoal's code logs little below INFO, and a record that is dropped costs a few
microseconds, so this is cheaper than telling each process to change its logger levels.

Levels as Triton's: ``log_info``, ``log_warning`` and ``log_error`` (Triton 2.51's names; its
protocol docs say ``log_warnings`` and ``log_errors``) switch INFO, WARNING and ERROR (CRITICAL
too) lines on and off; ``log_verbose_level`` N > 0 lets verbose lines through (Python's DEBUG:
Shoal has one verbose level, so 1 and above mean the same). ``log_format``: ``default`` (Shoal's
line: local time, level letter, logger) or ``ISO8601`` (UTC time first, as
``2026-12-04T19:01:15Z``). ``log_file`` is set at start only (``--log-file``): the host appends its
standard error, and so every process's, to it; Triton refuses to change it over the network too.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from multiprocessing import reduction
from typing import Any

from shoal.errors import ErrorCode, ShoalError, invalid, shown

FORMATS = ("default", "ISO8601")
SETTINGS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
# verbose level (uint32), then one byte each: info, warnings, errors, format (its index in FORMATS)
_LAYOUT = struct.Struct("<IBBBB")
_PAGE_BYTES = 64
_UINT32_MAX = 2**32 - 1
LOG_LINE = "%(asctime)s %(levelname).1s %(name)s: %(message)s"  # Shoal's line in the default format


class NoValue:
    """A gRPC setting sent with no kind of value set: refused as the wrong type, as Triton does
    (HTTP's ``null`` is different: it leaves the setting as it is)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoValue)

    def __hash__(self) -> int:
        return 0


NO_VALUE = NoValue()


@dataclass(frozen=True)
class LogSettings:
    """Triton's log settings, by its names (the JSON keys and gRPC map keys)."""

    log_verbose_level: int = 0
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: str = "default"
    log_file: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Triton's answer: every setting, in the order its HTTP endpoint prints them."""
        return {
            "log_file": self.log_file,
            "log_info": self.log_info,
            "log_warning": self.log_warning,
            "log_error": self.log_error,
            "log_verbose_level": self.log_verbose_level,
            "log_format": self.log_format,
        }

    def updated(self, changes: Mapping[str, Any]) -> LogSettings:
        """These settings with ``changes`` (name -> JSON-typed value) applied, all or none: a
        ShoalError names the first bad one (Triton applies those before it). Triton's words."""
        fields: dict[str, Any] = {}
        for name, value in changes.items():
            if value is None:  # JSON null, a gRPC value with no kind set: left as it is, as Triton
                continue
            if name in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise invalid(f"expect boolean for '{name}'")
                fields[name] = value
            elif name == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT32_MAX:
                    raise invalid(f"expect int32 for '{name}'")  # Triton's words, for a uint32
                fields[name] = value
            elif name == "log_format":
                if not isinstance(value, str):
                    raise invalid(f"expect string for '{name}'")
                if value not in FORMATS:
                    raise invalid(f"invalid argument for log_format, got: {value}")
                fields[name] = value
            elif name == "log_file":  # any value, the current one too, as Triton
                raise ShoalError(ErrorCode.UNSUPPORTED, "log file location can not be updated through network protocol")
            else:  # Triton ignores a name it does not know; a misspelt setting that changed nothing misleads
                raise invalid(f"unknown log setting '{shown(name)}'; the settings are {', '.join(SETTINGS)}")
        return replace(self, **fields)


class LogShare:
    """The shared page of log settings. The host creates it; a child gets it through its start
    arguments (it pickles as a descriptor multiprocessing duplicates into the child) and maps it."""

    def __init__(self, fd: int, log_file: str, writable: bool = True) -> None:
        self.fd = fd
        self.log_file = log_file
        self._map = mmap.mmap(fd, _PAGE_BYTES, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        self._lock = threading.Lock()  # one writer at a time in the host

    @classmethod
    def create(cls, settings: LogSettings) -> LogShare:
        fd = os.memfd_create("shoal-log-settings", os.MFD_CLOEXEC)
        os.ftruncate(fd, _PAGE_BYTES)
        share = cls(fd, settings.log_file)
        share.write(settings)
        return share

    def read(self) -> LogSettings:
        verbose, info, warning, error, form = _LAYOUT.unpack_from(self._map)
        return LogSettings(verbose, bool(info), bool(warning), bool(error), FORMATS[form], self.log_file)

    def write(self, settings: LogSettings) -> None:
        _LAYOUT.pack_into(
            self._map,
            0,
            settings.log_verbose_level,
            settings.log_info,
            settings.log_warning,
            settings.log_error,
            FORMATS.index(settings.log_format),
        )

    def update(self, changes: Mapping[str, Any]) -> LogSettings:
        """Apply ``changes`` (checked as ``LogSettings.updated``) for every process; the settings now."""
        with self._lock:
            settings = self.read().updated(changes)
            self.write(settings)
        return settings

    def passes(self, levelno: int) -> bool:
        """Whether a record of this level is logged now."""
        verbose, info, warning, error, _ = _LAYOUT.unpack_from(self._map)
        if levelno >= logging.ERROR:
            return bool(error)
        if levelno >= logging.WARNING:
            return bool(warning)
        if levelno >= logging.INFO:
            return bool(info)
        return bool(verbose > 0)

    def iso8601(self) -> bool:
        return bool(self._map[_LAYOUT.size - 1])

    def __reduce__(self) -> tuple[Callable[..., LogShare], tuple[Any, ...]]:
        return _rebuild, (reduction.DupFd(self.fd), self.log_file)  # only while a child is being started

    @classmethod
    def attach(cls, fd: int, log_file: str) -> LogShare:
        """In a child: map the page the host handed over as ``fd`` read-only, through a read-only
        descriptor of its own, and close ``fd``. Only the host writes the page (a child's settings
        changes go to it). Why read-only: ``mmap`` keeps a duplicate of the descriptor it maps, and a
        model's stray write to that one (a process instance runs the model's code) changed every
        process's settings, turning the server's logging off (review of session 47)."""
        readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        os.close(fd)
        try:
            share = cls(readonly, log_file, writable=False)
        finally:
            os.close(readonly)
        share.fd = -1
        return share


def _rebuild(duplicate: Any, log_file: str) -> LogShare:
    return LogShare.attach(duplicate.detach(), log_file)


class SettingsFilter(logging.Filter):
    def __init__(self, share: LogShare) -> None:
        super().__init__()
        self.share = share

    def filter(self, record: logging.LogRecord) -> bool:
        return self.share.passes(record.levelno)


class SettingsFormatter(logging.Formatter):
    """``line`` with local time in the default format, UTC ISO 8601 in the other."""

    def __init__(self, share: LogShare, line: str) -> None:
        super().__init__(line)
        self.share = share

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's
        if self.share.iso8601():
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
        return super().formatTime(record, datefmt)


_current: LogShare | None = None


def install(share: LogShare, line: str = LOG_LINE) -> None:
    """Log this process's records as ``share`` says, one line each to standard error."""
    global _current
    _current = share
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(SettingsFilter(share))
    handler.setFormatter(SettingsFormatter(share, line))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)


def start(settings: LogSettings, line: str = LOG_LINE) -> LogShare:
    """In the host: the settings' page for every process, this one logging by it. A ``log_file``
    takes this process's standard error (which the processes it starts inherit), appended."""
    if settings.log_file:
        fd = os.open(settings.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stderr.flush()
        os.dup2(fd, 2)
        os.close(fd)
    share = LogShare.create(settings)
    install(share, line)
    return share


def current() -> LogShare:
    """This process's page: the one it was started with, or (a server run in a test's process,
    with logging left as the test set it) a page of its own with the default settings."""
    global _current
    if _current is None:
        _current = LogShare.create(LogSettings())
    return _current
