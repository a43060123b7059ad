"""Dotted paths to user code (`module.fn` or `module:fn`): their shape and their loading.

One loader for every path a user configures: the run's group filter
(`dynamic_sampling_filter_path`), the trainer's pg-loss reducer and the worker's reward
function. Dotted paths split at the last dot, as Miles does; `module:attr.attr` names an
attribute inside the module. Every failure is one `FilterLoadError` line that names the
path and what went wrong, also when the user's module raises while it is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator

from schemas.errors import FilterLoadError

SHAPE = "'module.function' or 'module:function'"


def split_dotted_path(path: str) -> tuple[str, str] | None:
    """(module, attribute path), or None when `path` is not of either form."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        return None
    return module_name, attr_path


def _check_shape(path: str) -> str:
    if split_dotted_path(path) is None:
        raise ValueError(f"{path!r} is not of the form {SHAPE}")
    return path


DottedPath = Annotated[str, AfterValidator(_check_shape)]
"""A config field holding a dotted path; its shape is checked when the config is built."""


def load_callable(path: str, what: str) -> Callable[..., Any]:
    """The callable `path` names; `what` (`filter`, `reducer`, ...) starts the error line."""
    parts = split_dotted_path(path)
    if parts is None:
        raise FilterLoadError(f"{what} path {path!r} is not of the form {SHAPE}")
    module_name, attr_path = parts
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise FilterLoadError(
            f"{what} path {path!r}: cannot import module {module_name!r}: {err}"
        ) from err
    except Exception as err:  # the user's module itself failed while importing
        raise FilterLoadError(
            f"{what} path {path!r}: importing module {module_name!r} raised "
            f"{type(err).__name__}: {err}"
        ) from err
    for name in attr_path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise FilterLoadError(
                f"{what} path {path!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise FilterLoadError(
            f"{what} path {path!r}: {attr_path!r} is not callable (got {type(obj).__name__})"
        )
    return obj
