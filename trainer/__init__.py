"""rolloutlake trainer."""
