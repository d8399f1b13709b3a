"""Values of integer constant expressions, for the errors WGSL raises at shader creation.

WGSL evaluates its const-expressions when a module is created, and a few
operations that are defined at run time are errors there: an integer division
or remainder by zero, i32's most negative value divided by -1, a shift by 32
or more, and a left shift that changes bits it shifts out (u32) or the sign
(i32). The operator rules (``shaderdsl.operators``) refuse those while the
expression is built, using :func:`int_value` for both operands. Other
operations wrap, as in WGSL.

Each expression gives its own value (``Expr.int_constant()`` in
``shaderdsl.expr``), computed with its registry semantics, the same numpy
functions the interpreter runs. Only trees built from integer literals are
evaluated: literals, vector constructors and splats, conversions between i32
and u32, unary ``-`` and ``~``, and the arithmetic, bit and shift operators.
Anything else (a builtin call, a float, a name) makes the value unknown, and
the WGSL compiler judges it.
"""
from __future__ import annotations

import numpy as np

from . import types as T

_I32_MIN = -(1 << 31)


def int_value(e) -> tuple[int, ...] | None:
    """The components of integer expression ``e`` if it is a constant the DSL
    can evaluate, else None."""
    if e.deps:
        return None  # it reads a variable, let or buffer
    v = e.int_constant()
    return None if v is None else tuple(int(x) for x in np.atleast_1d(v))


def shift_loses_bits(value: int, amount: int, s: T.Scalar) -> bool:
    """True when ``value << amount`` (amount < 32) is a WGSL shader-creation
    error: a u32 shifts out a 1 bit; an i32's top ``amount + 1`` bits differ."""
    if s == T.u32:
        return value >> (32 - amount) != 0 if amount else False
    top = value >> (31 - amount)  # the top amount + 1 bits, sign-extended
    return top not in (0, -1)


def _pair(a: tuple, b: tuple) -> tuple[tuple, tuple]:
    """Two component tuples of one length (a scalar is splat)."""
    n = max(len(a), len(b))
    return a * (n // len(a)), b * (n // len(b))


def refuse_division(op: str, a, b, s: T.Scalar) -> str | None:
    """Why integer ``a / b`` or ``a % b`` is a shader-creation error, or None."""
    d = int_value(b)
    if d is not None and 0 in d:
        return f"integer `{op}` by a constant zero is a WGSL shader-creation error"
    n = int_value(a)
    if s == T.i32 and d is not None and n is not None:
        if any(x == _I32_MIN and y == -1 for x, y in zip(*_pair(n, d))):
            return (f"`-2147483648 {op} -1` of i32 constants does not fit i32: a WGSL "
                    f"shader-creation error")
    return None


def refuse_shift(op: str, a, b, s: T.Scalar) -> str | None:
    """Why ``a << b`` or ``a >> b`` is a shader-creation error, or None."""
    amounts = int_value(b)
    if amounts is None:
        return None
    if max(amounts) >= 32:
        return (f"`{op} {_show(amounts)}`: a constant shift of 32 or more is a WGSL "
                f"shader-creation error")
    values = int_value(a)
    if op == "<<" and values is not None:
        values, amounts = _pair(values, amounts)
        if any(shift_loses_bits(v, k, s) for v, k in zip(values, amounts)):
            what = "shifts out a 1 bit" if s == T.u32 else "changes the sign"
            return (f"`{_show(values)} << {_show(amounts)}` of {s} constants {what}: a WGSL "
                    f"shader-creation error")
    return None


def _show(v: tuple[int, ...]) -> str:
    return str(v[0]) if len(v) == 1 else "(" + ", ".join(map(str, v)) + ")"
