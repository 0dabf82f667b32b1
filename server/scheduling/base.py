"""What a scheduler needs from the instances: a free executor, and a way to give it back.

The scheduler never calls a backend; it hands whole batches to an ``Executor`` it got from
the ``Runner``. Tests use fake runners.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np


class Executor(Protocol):
    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]: ...


E = TypeVar("E", bound=Executor)


class Runner(Protocol[E]):
    async def acquire(self) -> E:
        """Wait for a free executor."""
        ...

    def release(self, executor: E) -> None: ...
