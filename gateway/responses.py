"""OpenAPI declarations of the gateway's error answers, shared by the routes.

Every error body is `{"detail": "<one line>", ...}` (a domain error of `schemas.errors`,
`ApiError`, the body limit, Kafka unavailable), except FastAPI's own request validation,
whose 422 `detail` is a list of `{loc, msg, type}`. Routes declare the statuses they can
answer with `errors(...)`, so /openapi.json lists each one with the body it really has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict


class ErrorBody(BaseModel):
    """An error answer: one readable line, plus fields some errors add (`field`,
    `errors`, `bad_lines`, ...)."""

    model_config = ConfigDict(extra="allow")

    detail: str


class RequestFieldError(BaseModel):
    loc: list[str | int]
    """Where: `["query", "count"]`, `["path", "run_id"]`, `["body", "config", ...]`."""
    msg: str
    type: str


class InvalidRequestBody(BaseModel):
    """A 422: either the declared schema failed (`detail` is a list) or a rule checked by
    the route did (`detail` is one line naming the field)."""

    detail: str | list[RequestFieldError]


DESCRIPTIONS = {
    401: "Missing or unknown bearer token (`WWW-Authenticate: Bearer`).",
    403: "The token lacks the scope (read or write) on this run, or a global token is needed.",
    413: "Request body over the gateway's configured limit; nothing was read further.",
    422: "Invalid request; the answer names the field.",
    503: ("Kafka unavailable, or its ACLs refuse the gateway's principal (the `detail` says "
          "which; `Retry-After` says when to retry); nothing was published."),
}
HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying.",
                          "schema": {"type": "integer"}}},
}
# Every authenticated route can answer these two.
AUTH = (401, 403)


def errors(*statuses: int, described: Mapping[int, str] | None = None
           ) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for `statuses` (default descriptions) and for `described`
    (status -> the route's own description)."""
    texts = {status: DESCRIPTIONS[status] for status in statuses}
    texts.update(described or {})
    docs: dict[int | str, dict[str, Any]] = {}
    for status, text in sorted(texts.items()):
        docs[status] = {"model": InvalidRequestBody if status == 422 else ErrorBody,
                        "description": text}
        if status in HEADERS:
            docs[status]["headers"] = HEADERS[status]
    return docs
