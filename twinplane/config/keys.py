"""What a config key is: a dataclass field with its help text and range (`opt`), a type whose `Literal` gives its
choices, and a section's `rules` across keys; the checks every key goes through (`value_problem`) and the walks
over a config's keys and sections."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Literal

Rule = tuple[bool, str, str]  # (holds, the key it is about, what the key must be)

_BOUNDS = re.compile(r"(?P<op>>=|>) (?P<x>\S+)"  # >= 0, > 0
                     r"|(?P<l>[\[(])(?P<lo>\S+), (?P<hi>\S+)(?P<r>[\])])"  # [0, 1), (0, 1]
                     r"|(?P<a>\S+)\.\.(?P<b>\S+)")  # 1..6


def _number(text: str) -> float:
    base, _, power = text.partition("**")
    return float(base) ** float(power) if power else float(text)


@functools.cache
def interval(bounds: str) -> tuple[float, bool, float, bool]:
    """(low, low included, high, high included) of a range as `opt` takes it: ">= 0", "> 0", "[0, 1)", "(0, 1]"
    or "1..6" (both ends included), optionally followed by a note in parentheses."""
    m = _BOUNDS.fullmatch(bounds.split(" (")[0])
    if m is None:
        raise ValueError(f"not a range: {bounds!r}")
    if m["op"]:
        return _number(m["x"]), m["op"] == ">=", math.inf, False
    if m["l"]:
        return _number(m["lo"]), m["l"] == "[", _number(m["hi"]), m["r"] == "]"
    return _number(m["a"]), True, _number(m["b"]), True


def within(value: float, bounds: str) -> bool:
    lo, lo_in, hi, hi_in = interval(bounds)
    return (lo < value or (lo_in and value == lo)) and (value < hi or (hi_in and value == hi))


def opt(default=None, help: str = "", *, bounds: str | None = None, check: Callable[[typing.Any], str | None] | None
        = None, factory: Callable[[], typing.Any] | None = None):
    """A config key: its default (`factory` for a list or mapping), its help text, its range for a number (as the
    error message writes it, see `interval`; each element of a list) and `check`, a function returning what is
    wrong with a value (None when nothing is)."""
    if bounds is not None:
        interval(bounds)  # a malformed range fails at import, not at the first bad value
    meta = {"help": help, "bounds": bounds, "check": check}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def choices(t) -> tuple | None:
    """The values a `Literal` type allows (also as `Literal[...] | None` or `list[Literal[...]]`), else None."""
    if typing.get_origin(t) is Literal:
        return typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType, list):
        return next((c for a in typing.get_args(t) if (c := choices(a))), None)
    return None


def _one_of(values: tuple) -> str:
    """"a or b", "a, b or c", "one of a, b, c, d"."""
    names = [str(v) for v in values]
    if len(names) > 3:
        return "one of " + ", ".join(names)
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def value_problem(value, t, meta: typing.Mapping) -> str | None:
    """What is wrong with one key's value given its type (a `Literal`'s choices) and metadata (range, check),
    or None. Lists are checked element by element."""
    items, many = (value, True) if isinstance(value, list) else ([value], False)
    if not many and isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"  # no setting means anything at inf or NaN (limits that can be off use 0)
    allowed = choices(t)
    if allowed and not all(v in allowed for v in items if v is not None):
        return f"must {'name' if many else 'be'} {_one_of(allowed)}"
    bounds = meta.get("bounds")
    if bounds and not all(within(v, bounds) for v in items if v is not None):
        return f"must {'each be' if many else 'be'}{'' if bounds[0] in '<>' else ' in'} {bounds}"
    return None


class Section:
    """A group of keys; `rules` are the checks across its keys (and others') that a key's own type and range
    cannot express, each naming the key it is about. `cfg` is the whole config (a Section too)."""

    def rules(self, cfg: Section) -> list[Rule]:
        return []


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _sections(cfg) -> list:
    """`cfg` and its sections, nested ones (train.lora) after their parent, in field order."""
    out = [cfg]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += _sections(value)
    return out


@functools.cache
def _fields(cls, prefix: str = "") -> tuple[tuple[str, str, typing.Any, typing.Mapping], ...]:
    """(key, attribute path, type, metadata) of every setting under `cls`."""
    out, hints = [], typing.get_type_hints(cls)  # (resolving the hints is the slow part: once per class)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += [(k, f"{f.name}.{a}", tt, m) for k, a, tt, m in _fields(t, f"{prefix}{f.name}.")]
        else:
            out.append((prefix + f.name, f.name, t, f.metadata))
    return tuple(out)


def _settings(cfg) -> typing.Iterator[tuple[str, typing.Any, typing.Any, typing.Mapping]]:
    """(key, value, type, metadata) of every setting of `cfg`."""
    for key, attrs, t, meta in _fields(type(cfg)):
        value = cfg
        for a in attrs.split("."):
            value = getattr(value, a)
        yield key, value, t, meta


def _all_keys(cls) -> tuple[str, ...]:
    return tuple(key for key, *_ in _fields(cls))
