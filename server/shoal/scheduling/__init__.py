"""Scheduling: queues and the dynamic batcher in front of a model's instances."""
