"""An eager PyTorch model whose forward does heavy pure-Python pre-processing (holds the GIL).

Saved whole with ``torch.save`` by bench/python_preprocessing.py and by the tests; the server
unpickles it (parameter ``pickled_module: true``), so this module must be importable there.
"""

from __future__ import annotations

import torch


class PythonHeavy(torch.nn.Module):
    """Hashes each row with a pure-Python loop, then embeds the hash: GIL-bound per request."""

    def __init__(self, rounds: int = 2000) -> None:
        super().__init__()
        self.rounds = rounds
        self.embedding = torch.nn.Embedding(1024, 64)
        self.linear = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = []
        for row in x.tolist():
            value = 0
            for _ in range(self.rounds):
                for item in row:
                    value = (value * 31 + int(item)) % 1024
            ids.append(value)
        output: torch.Tensor = self.linear(self.embedding(torch.tensor(ids)))
        return output
