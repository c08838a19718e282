"""A settings model as reference rows (``iter_settings``: flags, environment variable, TOML key, type,
default, description) and a markdown table (``settings_table``); ``docs/gen_configuration.py`` writes
``docs/configuration.md`` from them."""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import (
    BaseSettings,
)

from tandem.common.runtime.cli import one_line


@dataclass(frozen=True)
class SettingDoc:
    """One row of the reference."""

    flags: tuple[str, ...]
    env: str
    toml_key: str
    type: str
    default: str
    description: str


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _type_doc(name: str, tp: Any) -> str:
    tp = _strip_annotated(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _type_doc(name, args[0]) if len(args) == 1 else " or ".join(_type_doc(name, a) for a in args)
        return f"{inner} or `none`"
    if origin is Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ", ".join(f"`{m.name.lower()}`" for m in tp)
    if isinstance(tp, type) and issubclass(tp, ByteSize):
        return "size (bytes)"
    if tp is bool:
        return "bool"
    if isinstance(tp, type) and issubclass(tp, Path):
        return "path"
    base = getattr(tp, "__name__", str(tp))
    for suffix, unit in (("_s", "seconds"), ("_ms", "ms"), ("_tokens", "tokens"), ("_mbps", "Mbit/s")):
        if name.endswith(suffix):
            return f"{base} ({unit})"
    return base


def _default_doc(value: Any) -> str:
    if value is None:
        return "`none`"
    if isinstance(value, ByteSize):
        return f"`{_fmt_bytes(int(value))}`"
    if isinstance(value, enum.Enum):
        return f"`{value.name.lower()}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and value == "":
        return '`""`'
    if isinstance(value, list | tuple) and value:
        return ", ".join(_default_doc(v) for v in value)
    if isinstance(value, list | tuple):
        return "`[]`"
    return f"`{value}`"


def _default_of(info: FieldInfo) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.get_default(call_default_factory=True)
    return PydanticUndefined


def iter_settings(settings_cls: type[BaseSettings]) -> Iterator[SettingDoc]:
    """The reference rows of ``settings_cls``: one per leaf setting, nested models flattened."""
    cfg = settings_cls.model_config
    prefix = str(cfg.get("env_prefix", "")).upper()
    delim = cfg.get("env_nested_delimiter") or "__"
    shortcuts: Mapping[str, str | list[str]] = cfg.get("cli_shortcuts") or {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> Iterator[SettingDoc]:
        for name, info in model.model_fields.items():
            tp = _strip_annotated(info.annotation)
            full = (*path, name)
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                yield from walk(tp, full)
                continue
            flag = ".".join(_kebab(p) for p in full)
            extra = shortcuts.get(flag, [])
            names = [flag, *([extra] if isinstance(extra, str) else extra)]
            if tp is bool:
                flags = tuple(f for n in names for f in (f"--{n}", f"--no-{n}"))
            else:
                flags = tuple(f"--{n}" for n in names)
            default = _default_of(info)
            yield SettingDoc(
                flags=flags,
                env=prefix + delim.join(full).upper(),
                toml_key=".".join(full),
                type=_type_doc(name, info.annotation),
                default="(required)" if default is PydanticUndefined else _default_doc(default),
                description=one_line(info.description or ""),
            )

    yield from walk(settings_cls, ())


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table(settings_cls: type[BaseSettings]) -> str:
    """A markdown table of ``settings_cls``: a header and one row per ``iter_settings`` row."""
    rows = [
        "| flag | environment variable | TOML key | type | default | description |",
        "|---|---|---|---|---|---|",
    ]
    for d in iter_settings(settings_cls):
        flags = " ".join(f"`{f}`" for f in d.flags)
        cells = [flags, f"`{d.env}`", f"`{d.toml_key}`", d.type, d.default, d.description]
        rows.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return "\n".join(rows)
