"""Registries: one per extension point (policy losses, advantage estimators, loss aggregations, KL estimators, the
off-policy correction's weights and masks), each filled by a decorator on the function it names, where that
function is defined, as verl's `register_policy_loss`. The config reads a registry's names as the choices of the key
that picks from it (`config.keys.OneOf`), so a registered name is a valid value, in the help and in the hints."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Names -> entries of one `kind` (the word the errors use), in registration order."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self.notes: dict[str, str] = {}  # name -> a few words for the config's help

    def add(self, name: str, entry: T, note: str = "") -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name], self.notes[name] = entry, note

    def register(self, name: str, note: str = "") -> Callable[[T], T]:
        """Decorator: the function under `name`."""
        def add(fn: T) -> T:
            self.add(name, fn, note)
            return fn
        return add

    def unregister(self, name: str) -> None:
        del self._entries[name], self.notes[name]

    def lookup(self, name: str) -> T:
        """The entry of `name`; an unknown name is a one-line ValueError naming the registered ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r} (choose from {', '.join(self._entries)})") from None

    def describe(self) -> str:
        """"a (note) | b | ...": the names with their notes, for the config's help."""
        return " | ".join(f"{n} ({self.notes[n]})" if self.notes[n] else n for n in self._entries)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
