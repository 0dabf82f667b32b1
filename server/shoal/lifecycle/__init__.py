"""Model lifecycle: states, loading versions, and the registry transports ask for models."""
