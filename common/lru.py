"""One bounded least-recently-used eviction rule for the session tables of edge and cloud."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

V = TypeVar("V")


def evict_lru(table: OrderedDict[str, V], over_bounds: Callable[[], bool], in_use: Callable[[V], bool]) -> list[str]:
    """Drop entries from the least recently used end (``table``'s front) while ``over_bounds()``,
    skipping those ``in_use``; stops when only used entries remain. Returns the dropped keys."""
    dropped = []
    while over_bounds():
        victim = next((k for k, v in table.items() if not in_use(v)), None)
        if victim is None:
            break
        del table[victim]
        dropped.append(victim)
    return dropped
