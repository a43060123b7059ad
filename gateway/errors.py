"""The HTTP layer's own error (routes and auth): a status, a one-line `detail` and optional
structured fields. Services raise the domain errors of `schemas.errors` instead."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """Rendered as `{"detail": message, **extra}` with `status`."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None,
                 **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.extra = extra
