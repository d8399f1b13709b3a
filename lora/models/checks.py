"""The model's own error and the readers of a config.json's values, each refusing a
value of the wrong JSON type by its key (a string "64" for hidden_size, 64.0, true)."""
from __future__ import annotations

import math

from ..training.adapter_io import json_kind

MAX_INDEX = 2**31 - 1  # a size any kernel can count to in an i32 / u32
MISSING = object()     # a reader's default meaning "the key is required"


class ModelError(ValueError):
    """A model's config or weights are not what lora runs: the message names the
    file (or the object) and the key or tensor, and what is supported."""


def _value(d: dict, key: str, default, where: str, nullable: bool):
    """``d[key]``, or ``default`` where absent (or null, where ``nullable``)."""
    value = d.get(key, default)
    if value is MISSING:
        raise ModelError(f"{where}: {key} is missing")
    if value is None and nullable:
        value = default
    return value


def _refuse(where: str, key: str, expected: str, value) -> ModelError:
    return ModelError(f"{where}: {key} must be {expected}, got {value!r}, {json_kind(value)}")


def integer(d: dict, key: str, default, where: str, *, low: int = 1, high: int = MAX_INDEX,
            nullable: bool = False) -> int:
    """An int in [low, high] (a JSON integer: not 64.0, not "64", not true)."""
    value = _value(d, key, default, where, nullable)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(where, key, f"an integer from {low} to {high}", value)
    return int(value)


def boolean(d: dict, key: str, default, where: str, *, nullable: bool = False) -> bool:
    """true or false (a string "false" would be truthy)."""
    value = _value(d, key, default, where, nullable)
    if not isinstance(value, bool):
        raise _refuse(where, key, "true or false", value)
    return value


def number(d: dict, key: str, default, where: str, *, low: float = -math.inf,
           positive: bool = False, nullable: bool = False) -> float:
    """A finite number >= ``low`` (> 0 where ``positive``)."""
    value = _value(d, key, default, where, nullable)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and \
        math.isfinite(value) and value >= low and (value > 0 or not positive)
    if not ok or not isinstance(value, (int, float)):
        bound = "> 0" if positive else (f">= {low}" if low > -math.inf else "")
        raise _refuse(where, key, f"a finite number {bound}".rstrip(), value)
    return float(value)


def text(d: dict, key: str, default, where: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the key's name and the choices in the message)."""
    value = _value(d, key, default, where, False)
    if value not in choices or not isinstance(value, str):
        raise ModelError(f"{where}: {key} {value!r} is not supported; lora runs "
                         f"{' or '.join(repr(c) for c in choices)}")
    return value
