"""Model instances: N executors sharing one loaded copy of a model per device."""
