"""What a config key is: a dataclass field with its help text and range (`opt`), a type whose `Literal` gives its
choices (or, for a key naming a registered function, `Annotated[str, OneOf(registry)]`: the registry's names when
asked), and a section's `rules` across keys; the checks every key goes through (`value_problem`) and the walks over
a config's keys and sections."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Annotated, Literal

# (holds, the key it is about, what the key must be[, (another key it is as much about, what that one must be)]):
# a rule across two keys blames the one the user set
Rule = tuple[bool, str, str] | tuple[bool, str, str, tuple[str, str]]

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


@dataclasses.dataclass(frozen=True, eq=False)
class OneOf:
    """The choices of a key that names something registered (`Annotated[str, OneOf(registry)]`), read from the
    registry each time they are asked for: a name registered after the config was defined (a plugin's policy loss)
    is a valid value, listed in the help and offered as a hint. `source`: a mapping (its keys; its `notes`, where it
    has them, go into the help) or a function returning the names; `also`: what else the key takes, as the help and
    the errors write it, and `accepts` says whether a value is such a one."""
    source: typing.Any
    also: tuple[str, ...] = ()
    accepts: Callable[[str], bool] | None = None

    def names(self) -> tuple[str, ...]:
        return tuple(self.source() if callable(self.source) else self.source)

    def describe(self) -> str:
        """"a (note) | b | ...": the names with their notes, then `also`."""
        notes = getattr(self.source, "notes", {})
        return " | ".join([f"{n} ({notes[n]})" if notes.get(n) else n for n in self.names()] + list(self.also))


def one_of(t) -> OneOf | None:
    """The `OneOf` of an `Annotated[str, OneOf(...)]` type (also as `... | None`), else None."""
    if typing.get_origin(t) is Annotated:
        return next((m for m in t.__metadata__ if isinstance(m, OneOf)), None)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return next((o for a in typing.get_args(t) if (o := one_of(a))), None)
    return None


def choices(t) -> tuple | None:
    """The values a `Literal` type allows (also as `Literal[...] | None` or `list[Literal[...]]`), or those of a
    `OneOf` now, else None."""
    if typing.get_origin(t) is Literal:
        return typing.get_args(t)
    if (registered := one_of(t)) is not None:
        return registered.names() + registered.also
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
    allowed, accepts = choices(t), getattr(one_of(t), "accepts", None)
    if allowed and not all(v in allowed or (accepts and accepts(v)) for v in items if v is not None):
        return f"must {'name' if many else 'be'} {_one_of(allowed)}"
    bounds = meta.get("bounds")
    if bounds and not all(within(v, bounds) for v in items if v is not None):
        return f"must {'each be' if many else 'be'}{'' if bounds[0] in '<>' else ' in'} {bounds}"
    return None


def value_hint(value, t) -> str:
    """" (did you mean X?)" for a name close to one of the key's choices, else ""."""
    allowed = choices(t)
    if not allowed or not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(c) for c in allowed], n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


def help_text(t, meta: typing.Mapping) -> str:
    """A key's help: a `OneOf` key's choices as its registry describes them, then the key's own text."""
    registered = one_of(t)
    return f"{registered.describe()}: {meta['help']}" if registered is not None else meta["help"]


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
    out, hints = [], typing.get_type_hints(cls, include_extras=True)  # (the slow part: once per class)
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
