"""Backends load a model file once per device and execute batches on it."""
