"""Python numbers in shader expressions: the value a literal of a type holds.

A Python number takes the type of the expression it meets (``x + 1`` with
``x: u32`` gives ``1u``); alone it becomes what WGSL makes of an abstract
literal (bool, i32 or f32). A value that does not fit its type raises here,
naming the user's line. The literal nodes themselves are made in
``shaderdsl.expr`` (``literal``, ``as_expr``).
"""
from __future__ import annotations

import math

import numpy as np

from . import types as T
from .context import type_error

I32_MIN, I32_MAX, U32_MAX = -(2 ** 31), 2 ** 31 - 1, 2 ** 32 - 1


def literal_value(value, scalar: T.Scalar, where: str | None = None):
    """A Python number as the value of a literal of ``scalar``, range-checked."""
    if value is None:
        raise _not_a_value(value, where)
    if isinstance(value, (bool, np.bool_)):
        if scalar != T.bool_:
            raise type_error(f"bool literal {value!r} used where {scalar} is expected", where)
        return bool(value)
    if scalar == T.bool_:
        raise type_error(f"number {value!r} used where bool is expected", where)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if scalar == T.u32 and not 0 <= value <= U32_MAX:
            raise type_error(f"{value} does not fit in u32", where)
        if scalar == T.i32 and not I32_MIN <= value <= I32_MAX:
            raise type_error(f"{value} does not fit in i32", where)
        return float(value) if scalar.is_float else value
    if isinstance(value, (float, np.floating)):
        if not scalar.is_float:
            raise type_error(f"float literal {value!r} used where {scalar} is expected; "
                             f"convert explicitly, e.g. {scalar}(...)", where)
        value = float(value)
        if math.isfinite(value):
            limit = 65504.0 if scalar == T.f16 else float(np.finfo(np.float32).max)
            with np.errstate(over="ignore"):
                rounded = float(np.float16(value) if scalar == T.f16 else np.float32(value))
            if not math.isfinite(rounded) or abs(rounded) > limit:
                raise type_error(f"{value!r} is out of range for {scalar}", where)
        return value
    raise _not_a_value(value, where)


def default_scalar(value) -> T.Scalar:
    """WGSL's concretisation of an abstract literal: bool, i32 or f32."""
    if isinstance(value, (bool, np.bool_)):
        return T.bool_
    if isinstance(value, (int, np.integer)):
        return T.i32
    if isinstance(value, (float, np.floating)):
        return T.f32
    raise _not_a_value(value)


def _not_a_value(value, where: str | None = None):
    """The error for a Python object that is no number; None mostly comes from
    a helper function that builds its result but does not return it."""
    if value is None:
        return type_error("None used as a shader value: a helper function that builds an "
                          "expression must `return` it (a function without `return` "
                          "gives None)", where)
    return type_error(f"cannot use {type(value).__name__} {value!r} in a shader expression",
                      where)
