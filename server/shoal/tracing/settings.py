"""The trace settings of ``/v2/trace/setting`` and gRPC ``TraceSetting``, and the sampling they decide.

Triton 2.51's semantics, as captured from tritonserver 2.51: one global setting, started from
``--trace-config``; a model may override any of its fields (the rest follow the global one, also
when it changes later); clearing a field (JSON ``null``, an empty gRPC value) gives it back to the
global one, or, globally, to the start value. Values travel as Triton writes them: ``trace_level``
a list, every other value a string. ``trace_rate`` N traces one request in N (counted where the rate
lives: the model's own, or the global one for every model that follows it); ``trace_count`` is the
traces left to take (-1: no bound), counting down as they are taken; a request that carries a
client's valid ``traceparent`` is traced whenever the level is on, at any rate and count (so at rate
0, from the command line only, only those are).

Where Shoal differs on purpose: a request with any bad field changes nothing (Triton may apply a
global change and still answer 400); a setting name or level Shoal does not know is refused
(Triton ignores it); ``trace_mode`` cannot change while serving
(Triton ignores the field), as ``trace_file`` cannot (Triton's words).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from shoal.errors import ErrorCode, ShoalError, invalid, shown
from shoal.settings import INT32_MAX, LEVELS, UINT32_MAX, TraceConfig

FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency"}


@dataclass(frozen=True)
class Setting:
    level: frozenset[str]
    rate: int
    count: int
    log_frequency: int


class TraceSettings:
    """The settings and the counters behind them; used from the host's event loop only."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self._start = Setting(config.level, config.rate, config.count, config.log_frequency)
        self._global = self._start
        self._models: dict[str, dict[str, Any]] = {}  # model -> its own fields (Setting's names)
        self._seen: dict[str, int] = {}  # requests counted against a rate: "" the global one's, else the model's
        self.on = bool(self._start.level)  # any setting traces: the one check an untraced request pays

    # -- reading and changing ----------------------------------------------------------------------

    def effective(self, model: str = "") -> Setting:
        own = self._models.get(model)
        return replace(self._global, **own) if own else self._global

    def answer(self, model: str = "") -> dict[str, list[str] | str]:
        """Every setting as Triton answers it: the level a list, every other value a string."""
        setting = self.effective(model)
        values: dict[str, list[str] | str] = {
            "trace_level": [level for level in LEVELS if level in setting.level] or ["OFF"],
            "trace_rate": str(setting.rate),
            "trace_count": str(setting.count),
        }
        if self.config.mode == "triton":
            values.update(log_frequency=str(setting.log_frequency), trace_file=self.config.file, trace_mode="triton")
        else:
            values["trace_mode"] = "opentelemetry"
            if self.config.url:  # Triton shows the URL only when one was given
                values["url"] = self.config.url
            if self.config.resource:  # Triton repeats the key per resource; JSON keys are unique here
                values["resource"] = ",".join(f"{key}={value}" for key, value in self.config.resource)
            values.update({name: str(value) for name, value in self.config.bsp.items()})
        return values

    def update(self, model: str, changes: dict[str, list[str] | None]) -> None:
        """Apply ``changes`` (name -> its values, None to clear) to ``model``'s settings ("": the global
        ones), all or nothing; a ShoalError in Triton's words where it has them."""
        for name in ("trace_file", "trace_mode"):
            if name in changes:
                what = "trace file location" if name == "trace_file" else "trace mode"
                raise ShoalError(ErrorCode.UNSUPPORTED, f"{what} can not be updated through network protocol")
        parsed: dict[str, Any] = {}
        for name, values in changes.items():
            if name not in FIELDS:
                raise invalid(
                    f"unknown trace setting '{shown(name)}'; the settings are {', '.join(FIELDS)}, "
                    "trace_file and trace_mode"
                )
            parsed[FIELDS[name]] = None if values is None else _parse(name, values)
        # The command line's rate 0 (clients' traces only) holds wherever it is followed; only a change
        # that sets the rate to 0 itself is refused.
        zero_rate_ok = parsed.get("rate") is None and self._start.rate == 0
        if model:
            own = {**self._models.get(model, {}), **parsed}
            own = {name: value for name, value in own.items() if value is not None}
            _check(replace(self._global, **own), self.config, zero_rate_ok=zero_rate_ok)
            if own:
                self._models[model] = own
            else:
                self._models.pop(model, None)
            self._seen.pop(model, None)
        else:
            fields = {name: getattr(self._start, name) if value is None else value for name, value in parsed.items()}
            new_global = replace(self._global, **fields)
            for name, own in [("", {}), *self._models.items()]:
                _check(replace(new_global, **own), self.config, name, zero_rate_ok)
            self._global = new_global
            self._seen.pop("", None)
        self.on = bool(self._global.level) or any(self.effective(name).level for name in self._models)

    # -- sampling ----------------------------------------------------------------------------------

    def sample(self, model: str, has_parent: bool) -> frozenset[str] | None:
        """The level to trace this request of ``model`` at, or None not to trace it; counts it against
        the rate and takes one from the count. A request that carries a client's trace context
        (``has_parent``: a valid ``traceparent``) is traced whenever the model's level is on, whatever
        the rate and the count, and takes nothing from the count, as Triton's ``force_sample``. Only
        called when ``on``."""
        own = self._models.get(model, {})
        setting = replace(self._global, **own) if own else self._global
        if not setting.level:
            return None
        if has_parent:
            return setting.level
        if setting.count == 0 or setting.rate == 0:
            return None
        rate_owner = model if "rate" in own else ""
        seen = self._seen.get(rate_owner, 0)
        self._seen[rate_owner] = seen + 1
        if seen % setting.rate != 0:
            return None
        if setting.count > 0:
            if "count" in own:
                own["count"] -= 1
            else:
                self._global = replace(self._global, count=self._global.count - 1)
        return setting.level


def check_start(config: TraceConfig) -> None:
    """The command line's settings pass the checks a change would (rate 0 aside: only the command
    line may trace just the requests that carry a client's trace context, as Triton)."""
    _check(Setting(config.level, max(1, config.rate), config.count, config.log_frequency), config)
    if config.mode == "triton" and config.file:
        folder = os.path.dirname(os.path.abspath(config.file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise invalid(f"the trace file {config.file}: its folder {folder} is not a folder this server may write")


def _parse(name: str, values: list[str]) -> Any:
    if name == "trace_level":
        unknown = [v for v in values if v not in ("OFF", *LEVELS)]
        if unknown:
            raise invalid(f"unknown trace level '{shown(unknown[0])}'; the levels are OFF, TIMESTAMPS and TENSORS")
        if "OFF" in values and len(values) > 1:
            raise invalid("Expect only one trace level 'OFF' is specified")
        return frozenset(v for v in values if v != "OFF")
    if len(values) != 1:
        raise invalid(f"expect only 1 value for '{name}'")
    text = values[0]
    low, high = {"trace_rate": (0, UINT32_MAX), "trace_count": (-1, INT32_MAX), "log_frequency": (0, UINT32_MAX)}[name]
    try:
        number = int(text)
    except ValueError:
        raise invalid(f"Unable to parse '{name}', got: {shown(text)}") from None
    if name == "trace_count" and number < -1:
        raise invalid(f"Unable to parse 'trace_count'. Expecting value >= -1, got: {number}")
    if not low <= number <= high:
        raise invalid(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {number}")
    return number


def _check(setting: Setting, config: TraceConfig, model: str = "", zero_rate_ok: bool = False) -> None:
    """Triton's checks of a setting that traces (one that does not may hold anything); ``zero_rate_ok``:
    a rate of 0 is the command line's, which only the command line may give."""
    if not setting.level:
        return
    reason = ""
    if config.mode == "triton" and not config.file:
        reason = "trace file name is not given (start the server with --trace-config triton,file=PATH)"
    elif setting.rate == 0 and not zero_rate_ok:
        reason = "sample rate must be non-zero"
    elif setting.count == 0:
        reason = "trace count is 0: no trace is left to take (set trace_count)"
    if reason:
        where = f" (model '{model}')" if model else ""
        raise invalid(f"Attempting to set invalid trace setting{where} :{reason}")
