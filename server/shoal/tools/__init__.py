"""Tools that drive a server: the tuner, a local server for scripts and tests, nvidia-smi figures.

They sit above both the server and the client library (they import both; neither imports them)."""
