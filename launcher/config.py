"""Settings declared once: a dataclass field carries its default, and its flag when it has one.

Every setting of the control plane is a field of the dataclass that uses it
(:class:`launcher.membership.MembershipConfig`, :class:`launcher.policy.ElasticConfig`,
:class:`launcher.coordinator.CoordinatorConfig`, :class:`launcher.agent.AgentConfig`,
:class:`launcher.slurm.Flags`, ...). A field p2p-run takes from the command line is declared with
:func:`setting`, which records the flag's names and help beside the default; :func:`add_flags`
turns such fields into argparse flags (``dest`` is the field's name) and :func:`from_args`
builds the dataclass back from the parsed flags. The coordinator process receives its whole
:class:`~launcher.coordinator.CoordinatorConfig` as one JSON document (:func:`dump`,
:func:`load`), never as a second command line.

This module imports nothing from ``launcher``: every config module may import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_FLAGS = "flags"
_HELP = "help"
_TYPE = "type"
_FLAG_DEFAULT = "flag_default"
_UNSET: Any = object()


def setting(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | tuple[str, ...],
    help: str,
    type: Callable[[str], Any] | None = None,
    flag_default: Any = _UNSET,
) -> Any:
    """A dataclass field that p2p-run also takes as a flag.

    Args:
        default: The setting's default (none: the field is required).
        flag: The flag's names, the first one canonical (e.g. ``("--max-restarts",
            "--max_restarts")``).
        help: Its help; ``{default}`` is replaced by the flag's default, or the setting's when
            the flag's is ``None`` (``3.0`` reads ``3``).
        type: How the flag's text is read (default: from the field's annotation).
        flag_default: The flag's value when it is not given, where it differs from the
            setting's default (e.g. ``None``: "not given" must be told apart).
    """
    names = (flag,) if isinstance(flag, str) else flag
    metadata = {_FLAGS: names, _HELP: help, _TYPE: type, _FLAG_DEFAULT: flag_default}
    return dataclasses.field(default=default, metadata=metadata)


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if _FLAGS not in f.metadata:
                raise TypeError(f"{cls.__name__}.{name} is not declared with setting()")
            return f
    raise TypeError(f"{cls.__name__} has no field {name}")


def _scalar(f: dataclasses.Field[Any]) -> Callable[[str], Any]:
    """The type of a flag's value: declared, else the first of ``int | float | str`` in the
    field's annotation (``int | None``: ``int``)."""
    declared = f.metadata[_TYPE]
    if declared is not None:
        return typing.cast(Callable[[str], Any], declared)
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    for part in annotation.split("|"):
        kind = {"int": int, "float": float, "str": str}.get(part.strip())
        if kind is not None:
            return kind
    raise TypeError(f"setting {f.name}: declare type= (annotation {annotation!r})")


def flag_default(cls: type, name: str) -> Any:
    """The value of ``cls.name``'s flag when it is not given."""
    f = _field(cls, name)
    if f.metadata[_FLAG_DEFAULT] is not _UNSET:
        return f.metadata[_FLAG_DEFAULT]
    return None if f.default is dataclasses.MISSING else f.default


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, *names: str) -> None:
    """Add the flags of ``cls``'s fields ``names`` to ``parser`` (or an argument group), in
    that order; each stores into the field's name."""
    for name in names:
        f = _field(cls, name)
        default = flag_default(cls, name)
        shown = f.default if default is None else default
        help_text = f.metadata[_HELP].replace("{default}", _shown(shown))
        if f.type in ("bool", bool):
            parser.add_argument(*f.metadata[_FLAGS], dest=name, action="store_true", help=help_text)
        else:
            parser.add_argument(
                *f.metadata[_FLAGS],
                dest=name,
                metavar=f.metadata[_FLAGS][0].lstrip("-").replace("-", "_").upper(),
                type=_scalar(f),
                default=default,
                help=help_text,
            )


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` built from the parsed flags of its fields, ``given`` for the rest (and over the
    flags); fields with neither keep their defaults."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(typing.cast(Any, cls))
        if _FLAGS in f.metadata and hasattr(args, f.name)
    }
    values.update(given)
    try:
        return cls(**values)
    except ValueError as e:  # the dataclass speaks of its fields; the user gave flags
        raise ValueError(_as_flags(cls, str(e))) from None


def _as_flags(cls: type, message: str) -> str:
    """``message`` with each ``Cls.field=value`` of a field that is a flag as ``--flag value``."""
    flags = {
        f.name: f.metadata[_FLAGS][0]
        for f in dataclasses.fields(typing.cast(Any, cls))
        if _FLAGS in f.metadata
    }

    def flag(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        return match.group(0) if name not in flags else f"{flags[name]} {value}"

    return re.sub(rf"\b{cls.__name__}\.(\w+)=(\S+)", flag, message)


# -- one document -----------------------------------------------------------------------------


def dump(config: Any) -> str:
    """A config dataclass (nested ones included) as JSON."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def _value(hint: Any, value: Any, where: str) -> Any:
    """``value`` read from JSON as the annotation ``hint`` says (dataclasses, tuples)."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value(options[0], value, where) if len(options) == 1 else value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        return _build(hint, value, where)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    return value


def _build(cls: type[T], doc: dict[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(typing.cast(Any, cls))}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}")
    return cls(**{k: _value(hints[k], v, f"{where}.{k}") for k, v in doc.items()})


def load(cls: type[T], text: str) -> T:
    """The config :func:`dump` wrote (its checks run again).

    Raises:
        ValueError: not JSON, an unknown setting, or a value its dataclass refuses.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a {cls.__name__} document: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not a {cls.__name__} document: {type(doc).__name__}")
    try:
        return _build(cls, doc, cls.__name__)
    except TypeError as e:  # a required setting missing
        raise ValueError(f"{cls.__name__}: {e}") from None


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by this user only (mode 0600)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
