"""Command-line flags made from a service's pydantic config, and its one-line config errors.

Every service (`process`, `simulate`, `gateway`, `trainer`, `worker`, `engine`) keeps its
settings in one frozen pydantic model and gets its flags from it here:

- each field is the flag `--<field-name>` (underscores become dashes); its attribute
  docstring is the `--help` text; a model may spell a field's flag otherwise (or give it
  none) in its `cli_flags` class variable, first spelling first;
- a field holding another model (`kafka: KafkaSettings`) contributes that model's flags
  unprefixed, so `--bootstrap-servers` means the same in every service;
- lists and dicts have no flag (a config file or the environment sets them);
- values reach pydantic as strings and are parsed and checked there, once; a flag not
  given leaves the model's default (environment defaults included) in place;
- `none` (or an empty value) unsets a field whose default is not None
  (`--filter-path none`).

`config_error` turns the first pydantic error into a `ConfigError` whose one line names
the flag to fix, e.g. `--rollout-batch-size: Input should be greater than or equal to 1`.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ValidationError
from pydantic.fields import FieldInfo

from schemas.bounds import FieldValueError
from schemas.errors import ConfigError

Model = TypeVar("Model", bound=BaseModel)
UNSET = "none"


def _existing_file(value: Path) -> Path:
    if not value.is_file():
        raise ValueError(f"no such file: {value}")
    return value


ExistingFile = Annotated[Path, AfterValidator(_existing_file)]
"""A path that must name an existing file when the config is read."""


def flags_of(model: type[BaseModel], name: str) -> tuple[str, ...]:
    """The flag spellings of one field, the one errors name first; () for no flag."""
    spelled: Mapping[str, Sequence[str]] = getattr(model, "cli_flags", {})
    if name in spelled:
        return tuple(spelled[name])
    field = model.model_fields[name]
    if _nested_model(field.annotation) is not None or not _is_scalar(field.annotation):
        return ()
    return ("--" + name.replace("_", "-"),)


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     model: type[BaseModel], *, dest_prefix: str = "") -> None:
    """Add the flags of every field of `model` (and of the models it holds) to `parser`."""
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None and name not in getattr(model, "cli_flags", {}):
            group = parser if isinstance(parser, argparse._ArgumentGroup) else \
                parser.add_argument_group(f"{name} settings", _first_line(nested.__doc__))
            add_config_flags(group, nested, dest_prefix=f"{dest_prefix}{name}.")
            continue
        spellings = flags_of(model, name)
        if not spellings:
            continue
        kwargs: dict[str, Any] = {"dest": dest_prefix + name, "default": argparse.SUPPRESS,
                                  "help": _help(field), "metavar": _metavar(name, field)}
        choices = _choices(field.annotation)
        if _strip_none(field.annotation) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["metavar"]
        elif choices is not None:
            kwargs["choices"] = choices
            del kwargs["metavar"]
        if field.is_required():
            kwargs["required"] = True
        parser.add_argument(*spellings, **kwargs)


def flag_values(model: type[BaseModel], args: argparse.Namespace, *,
                dest_prefix: str = "") -> dict[str, Any]:
    """The values of the flags given for `model`, nested as the model nests them."""
    given = vars(args)
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            inner = flag_values(nested, args, dest_prefix=f"{dest_prefix}{name}.")
            if inner:  # an optional model (`kafka: KafkaSettings | None`) is set by any flag
                values[name] = inner
        elif dest_prefix + name in given:
            value = given[dest_prefix + name]
            if value in (UNSET, "") and _unsettable(field):
                value = None
            values[name] = value
    return values


def build_config(model: type[Model], values: Mapping[str, Any]) -> Model:
    """Validate `values`; the first error becomes a one-line `ConfigError`."""
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise config_error(model, err) from None


def config_from_args(model: type[Model], args: argparse.Namespace) -> Model:
    """The config the flags added by `add_config_flags` describe."""
    return build_config(model, flag_values(model, args))


def config_error(model: type[BaseModel], err: ValidationError) -> ConfigError:
    """`<flag>: <what is wrong>` for the first error; a check of a whole model (whose
    message says what it is about) is its message alone."""
    first = err.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    message = first["msg"].removeprefix("Value error, ")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldValueError):  # a model check that blames one field
        loc = [*loc, *cause.field.split(".")] if cause.field else loc
        message = str(cause)
    where = setting_name(model, loc)
    return ConfigError(f"{where}: {message}" if where else message)


def setting_name(model: type[BaseModel], loc: Sequence[str]) -> str | None:
    """How a user knows the setting at `loc`: its flag, else its dotted path; None for a
    whole model."""
    current: type[BaseModel] | None = model
    for depth, part in enumerate(loc):
        if current is None or part not in current.model_fields:
            return ".".join(loc)
        nested = _nested_model(current.model_fields[part].annotation)
        if nested is None:
            spellings = flags_of(current, part)
            if spellings and depth == len(loc) - 1:
                return spellings[0]
            return ".".join(loc)
        current = nested
    return None


def _help(field: FieldInfo) -> str:
    text = " ".join((field.description or "").split())
    default = field.default
    if (not field.is_required() and field.default_factory is None
            and not (default is None or default is False or default == "")):
        text = f"{text} [default: {default}]".strip()
        if _unsettable(field):
            text += f" ('{UNSET}' unsets)"
    return text.replace("%", "%%")  # argparse formats help with %


def _metavar(name: str, field: FieldInfo) -> str:
    kind = _strip_none(field.annotation)
    if kind is int:
        return "N"
    if kind is float:
        return "S" if name.endswith("_s") else "X"
    return name.rsplit("_", 1)[-1].upper()  # --custom-rm-path PATH


def _first_line(doc: str | None) -> str | None:
    return doc.strip().splitlines()[0] if doc else None


def _strip_none(annotation: Any) -> Any:
    """`X | None` -> X; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return _strip_metadata(rest[0])
    return _strip_metadata(annotation)


def _strip_metadata(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    inner = _strip_none(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _is_scalar(annotation: Any) -> bool:
    inner = _strip_none(annotation)
    return typing.get_origin(inner) in (None, Literal) and inner not in (list, dict, set)


def _choices(annotation: Any) -> list[Any] | None:
    inner = _strip_none(annotation)
    return list(typing.get_args(inner)) if typing.get_origin(inner) is Literal else None


def _unsettable(field: FieldInfo) -> bool:
    allows_none = _strip_none(field.annotation) is not _strip_metadata(field.annotation)
    return (allows_none and not field.is_required() and field.default is not None
            and field.default_factory is None)
