"""Where a lake is: its root (a local folder or an s3:// URI), checked before any table is
opened, and the object-store options delta-rs gets for it.

Configuration models hold a `LakePath`; this module imports neither deltalake nor pyarrow,
so a service parses its flags (and the processor starts its consumer-group joins) before
those load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from schemas.errors import ConfigError

# delta-rs turns a lake root into a URL: `^ [ ] |` make it panic, `\` and `%xx` make it
# read or write another path than the one given. Such roots are refused up front.
UNSAFE_PATH_CHARS = frozenset("^[]|\\%")


def lake_path_problem(root: str) -> str | None:
    """Why Delta cannot hold a lake at `root` (one line naming the path), or None."""
    bad = sorted({c for c in root if c in UNSAFE_PATH_CHARS or not c.isprintable()})
    if not bad:
        return None
    shown = " ".join(repr(c) for c in bad)
    return (
        f"lake path {root!r} contains {shown}, which Delta Lake cannot address; "
        "use a path without them"
    )


def _checked_lake_path(root: str) -> str:
    problem = lake_path_problem(root)
    if problem is None:
        try:
            lake_storage_options(root)
        except ConfigError as err:
            problem = str(err)
    if problem is not None:
        raise PydanticCustomError("lake_path", "{problem}", {"problem": problem})
    return root


LakePath = Annotated[str, Field(min_length=1), AfterValidator(_checked_lake_path)]
"""A config field holding a lake root (local folder or s3:// URI), checked as `Lake` does:
the path, and for S3 the storage options the environment gives it."""


# Object-store settings read from the environment, as the AWS tools name them.
OBJECT_STORE_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ALLOW_HTTP",
    "AWS_PROFILE",
    "AWS_CONDITIONAL_PUT",
    "AWS_S3_ALLOW_UNSAFE_RENAME",
)
UNSAFE_RENAME = "AWS_S3_ALLOW_UNSAFE_RENAME"


def lake_storage_options(
    root: str, explicit: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The delta-rs storage options of a lake: {} for a local one; for s3:// the AWS_*
    environment, then `explicit` on top, with conditional put on.

    Several writers share each table (both stages' dead letters, a second instance), so a
    commit must be put-if-absent: `AWS_CONDITIONAL_PUT=etag` (S3, MinIO, R2) makes a
    second writer of the same log version fail and retry instead of overwriting it. The
    unsafe-rename mode, which can lose such a commit, is refused.
    """
    if not root.startswith(("s3://", "s3a://")):
        return dict(explicit or {})
    env = os.environ if environ is None else environ
    options = {name: env[name] for name in OBJECT_STORE_ENV if env.get(name)}
    options.update(explicit or {})
    # delta-rs reads option names case-insensitively, with or without the AWS_ prefix.
    names = {name.upper().removeprefix("AWS_"): name for name in options}
    unsafe = names.get(UNSAFE_RENAME.removeprefix("AWS_"))
    if unsafe is not None and options[unsafe].strip().lower() in ("true", "1", "yes"):
        raise ConfigError(
            f"{UNSAFE_RENAME} is set: with several writers per table it can lose commits; "
            "unset it (the lake commits with AWS_CONDITIONAL_PUT=etag)"
        )
    if "CONDITIONAL_PUT" not in names:
        options["AWS_CONDITIONAL_PUT"] = "etag"
    return options
