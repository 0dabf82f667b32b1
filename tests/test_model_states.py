"""The core's interface: what the transports call, and its local implementation."""

from __future__ import annotations

import inspect
from typing import Any

from shoal.core import Core, LocalCore


def test_local_core_has_exactly_the_protocol_s_members_and_signatures() -> None:
    def members(cls: type) -> dict[str, Any]:
        return {n: m for n, m in vars(cls).items() if not n.startswith("_")}

    protocol, local = members(Core), {n: getattr(LocalCore, n) for n in members(Core)}
    for name, declared in protocol.items():
        implemented = local[name]
        if isinstance(declared, property):
            assert isinstance(implemented, property), name
            assert inspect.signature(declared.fget) == inspect.signature(implemented.fget), name  # type: ignore
        else:
            assert inspect.signature(declared) == inspect.signature(implemented), name
            assert inspect.iscoroutinefunction(declared) == inspect.iscoroutinefunction(implemented), name
    called = set(members(LocalCore)) - {"manager", "strict_readiness"}
    assert called == set(protocol), "LocalCore's public members are the interface"
