"""Ingest: producer SDK, embedded broker, stream processor and load generator."""
