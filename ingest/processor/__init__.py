"""rolloutlake processor."""
