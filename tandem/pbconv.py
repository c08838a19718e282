"""Copy fields between a frozen dataclass and a protobuf message of the same field names,
so that no domain type lists its fields a second time for the wire. Pure Python (the
SDK uses it too). Enum members travel as their integer values; sequences as lists.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

T = TypeVar("T")


def to_pb(msg_cls: Any, obj: Any, exclude: tuple[str, ...] = (), **override: Any) -> Any:
    """``msg_cls`` built from ``obj``'s dataclass fields but ``exclude``; ``override`` replaces or
    adds fields."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name in override or f.name in exclude:
            continue
        v = getattr(obj, f.name)
        kw[f.name] = int(v) if isinstance(v, enum.IntEnum) else list(v) if isinstance(v, tuple) else v
    return msg_cls(**kw, **override)


def from_pb(cls: type[T], m: Any, **override: Any) -> T:
    """``cls`` built from the same-named fields of message ``m``; repeated fields become tuples,
    maps dicts; ``override`` supplies fields that need a conversion (enums, nested types)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in override or not hasattr(m, f.name):
            continue
        v = getattr(m, f.name)
        if hasattr(v, "items"):
            v = dict(v)
        elif not isinstance(v, str | bytes | int | float | bool) and hasattr(v, "__len__"):
            v = tuple(v)
        kw[f.name] = v
    return cls(**kw, **override)
