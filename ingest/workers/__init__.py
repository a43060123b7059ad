"""Rollout workers on real inference engines: the engine server, its HTTP adapters, the worker."""
