"""Shoal: a Python model server for Triton-style model repositories (KServe v2 gRPC)."""

__version__ = "0.1.0"
