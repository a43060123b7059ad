"""rolloutlake gateway."""
