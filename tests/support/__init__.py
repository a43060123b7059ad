"""Test helpers shared by unit tests, integration tests and bench/."""
