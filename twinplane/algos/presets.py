"""`algo.name` presets: each algorithm module registers the `algo.*` defaults that make it that algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    """`algo.name`: its one-line summary, the paper, and the `algo.*` values it sets (overridable key by key)."""
    name: str
    summary: str
    paper: str
    values: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {}


def register(*presets: Preset) -> None:
    for p in presets:
        PRESETS[p.name] = p
