"""How a flag of ``diffserve serve`` is declared: a dataclass field whose metadata carries its
help text and bounds (:func:`option`), and how a flag's text becomes its value
(:func:`parse_value`). :mod:`diffserve.config.flags` and :mod:`diffserve.config.speed` declare the
flags with it."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from diffserve.config.rules import ConfigError


def option(default: Any, help: str, *, ge: float | None = None, le: float | None = None,
           choices: tuple[str, ...] | None = None, env: str | None = None,
           metavar: str | None = None, repeat: bool = False) -> Any:
    """A config field with its help text and bounds kept beside the default. A tuple default
    makes a flag that takes several values; a bool default, a switch; ``repeat``: a text flag
    that may be given several times (its values are kept comma-separated)."""
    return field(default=default, metadata={"help": help, "ge": ge, "le": le,
                                            "choices": choices, "env": env, "metavar": metavar,
                                            "repeat": repeat})


def parse_value(f: dataclasses.Field, text: str) -> Any:
    """Convert a string to the field's type (the type of its default): a switch from
    true/false, several values from a whitespace- or comma-separated list."""
    kind = type(f.default)
    flag = f"--{f.name.replace('_', '-')}"
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ConfigError(f"{flag}={text!r} is not true or false")
        return lowered in ("1", "true", "yes", "on")
    if kind is tuple:
        return tuple(part for part in text.replace(",", " ").split() if part)
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{flag}={text!r} is not a valid {kind.__name__}") from None
