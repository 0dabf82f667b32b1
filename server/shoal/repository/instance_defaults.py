"""Triton's default instance count (core model_config_utils.cc ``SetDefaultInstanceCount``), in one place.

``normalize`` applies it to a group without a ``count``; ``shoal config generate --help`` and the
comment in the file it writes quote the rule, so the three cannot disagree. A module of its own,
without protobuf, so that building the command line stays fast.
"""

from __future__ import annotations

DEFAULT_CPU_INSTANCE_COUNT = {"onnxruntime": 2}  # backend -> count of a KIND_CPU group; others get 1
DEFAULT_INSTANCE_COUNT_RULE = "2 for an onnxruntime model on the CPU, else 1, as Triton"
