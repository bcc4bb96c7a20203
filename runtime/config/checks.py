"""What a config section checks about its own fields: choices from Literal types, named bounds, its rules."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from runtime.errors import UserError


class ConfigError(UserError):
    """A configuration problem, phrased for the user: names the dotted key and what is allowed."""


def choices(tp: Any) -> tuple[str, ...] | None:
    """The values an `Annotated[str, Literal[...]]` field type allows (Optional or not); None for any other type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Annotated:
        return next((typing.get_args(m) for m in tp.__metadata__ if typing.get_origin(m) is Literal), None)
    return None


BOUND_TESTS: dict[str, Callable[[Any], bool]] = {
    "positive": lambda v: v > 0,
    "positive or null": lambda v: v is None or v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in (0, 1)": lambda v: 0 < v < 1,
    "between 0 and 1": lambda v: 0 <= v <= 1,
    "between 0 and 65535": lambda v: 0 <= v <= 65535,
}
"""The bounds a numeric key may need, by the words its message uses."""


class Problems(list):
    """The messages of the rules a config breaks, each naming its dotted key."""

    def need(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)

    def bounded(self, section: Any, at: str, bound: str, names: str) -> None:
        """`at.NAME must be BOUND (got VALUE)` for each of the space-separated names out of BOUND_TESTS[bound]."""
        for name in names.split():
            value = getattr(section, name)
            self.need(BOUND_TESTS[bound](value), f"{at}.{name} must be {bound} (got {value})")

    def chosen(self, section: Any, at: str) -> None:
        """`at.NAME=VALUE is not one of ...` for each field typed with a Literal whose value is not in it."""
        hints = typing.get_type_hints(type(section), include_extras=True)
        for f in dataclasses.fields(section):
            allowed, value = choices(hints[f.name]), getattr(section, f.name)
            if allowed is not None:
                null = ("null",) if type(None) in typing.get_args(hints[f.name]) else ()
                self.need(value in allowed or (value is None and bool(null)),
                          f"{at + '.' if at else ''}{f.name}={value!r} is not one of {', '.join(allowed + null)}")


class ConfigSection:
    """A config section that checks its own fields: its choices (Literal types), the BOUNDS it declares, its rules."""

    BOUNDS: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(bound, space-separated field names): each name's value must pass BOUND_TESTS[bound]."""

    def problems(self, at: str) -> Problems:
        """What is wrong with this section alone; `at` is its dotted key (model, tasks.NAME ...)."""
        p = Problems()
        p.chosen(self, at)
        for bound, names in self.BOUNDS:
            p.bounded(self, at, bound, names)
        self.rules(p, at)
        return p

    def rules(self, p: Problems, at: str) -> None:
        """The checks that relate this section's fields to each other."""
