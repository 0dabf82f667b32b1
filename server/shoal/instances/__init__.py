"""Model instances: the executors of a version, as threads over one loaded copy per device, a copy
each, or worker processes over one shared copy (``strategy`` chooses, from the backend's hooks)."""
