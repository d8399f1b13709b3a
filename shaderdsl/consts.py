"""Values of integer constant expressions, for the errors WGSL raises at shader creation.

WGSL evaluates its const-expressions when a module is created, and a few
operations that are defined at run time are errors there: an integer division
or remainder by zero, i32's most negative value divided by -1, a shift by 32
or more, and a left shift that changes bits it shifts out (u32) or the sign
(i32). ``expr.binary`` refuses those while the expression is built, using
:func:`int_value` for both operands. Other operations wrap, as in WGSL.

Only what the DSL builds from literals is evaluated: literals, vector
constructors and splats, conversions between i32 and u32, unary ``-`` and
``~``, and the arithmetic, bit and shift operators. Anything else (a builtin
call, a float, a name) makes the value unknown, and the WGSL compiler judges it.
"""
from __future__ import annotations

from . import types as T

_I32_MIN = -(1 << 31)


def _wrap(v: int, s: T.Scalar) -> int:
    """``v`` modulo 2**32, as a u32 or an i32."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if s == T.i32 and v >= 1 << 31 else v


def _int_scalar(e):
    t = e.type
    if not isinstance(t, (T.Scalar, T.Vector)):
        return None
    s = T.scalar_of(t)
    return s if s in (T.i32, T.u32) else None


def int_value(e) -> tuple[int, ...] | None:
    """The components of integer expression ``e`` if it is a constant the DSL
    can evaluate, else None."""
    from . import expr as E

    if not isinstance(e, E.Expr) or e.deps:
        return None  # not an expression, or it reads a variable, let or buffer
    s = _int_scalar(e)
    if s is None:
        return None
    if isinstance(e, E.Lit):
        return (int(e.value),)
    if isinstance(e, E.Unary):
        v = int_value(e.a)
        if v is None:
            return None
        return tuple(_wrap(-x if e.op == "-" else ~x, s) for x in v)
    if isinstance(e, E.Call) and e.fn == str(e.type):  # constructor or conversion
        parts = [int_value(a) for a in e.args]
        if any(p is None for p in parts):
            return None
        comps = [x for p in parts for x in p]
        size = e.type.size if isinstance(e.type, T.Vector) else 1
        if len(comps) == 1:
            comps *= size
        return tuple(_wrap(x, s) for x in comps)
    if isinstance(e, E.Binary):
        a, b = int_value(e.a), int_value(e.b)
        if a is None or b is None or _int_scalar(e.a) != s:
            return None  # comparisons have a bool type and never get here
        n = max(len(a), len(b))
        a, b = a * (n // len(a)), b * (n // len(b))
        return tuple(_apply(e.op, x, y, s) for x, y in zip(a, b))
    return None


def _apply(op: str, x: int, y: int, s: T.Scalar) -> int:
    if op == "+":
        return _wrap(x + y, s)
    if op == "-":
        return _wrap(x - y, s)
    if op == "*":
        return _wrap(x * y, s)
    if op in ("/", "%"):  # y != 0: binary() refuses a constant zero divisor
        q = abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1)  # truncated, as WGSL
        return _wrap(q if op == "/" else x - q * y, s)
    if op == "&":
        return _wrap(x & y, s)
    if op == "|":
        return _wrap(x | y, s)
    if op == "^":
        return _wrap(x ^ y, s)
    if op == "<<":
        return _wrap(x << (y & 31), s)
    if op == ">>":
        return _wrap(x >> (y & 31), s)  # arithmetic for i32 (Python ints are signed)
    raise AssertionError(f"no constant rule for {op!r}")


def shift_loses_bits(value: int, amount: int, s: T.Scalar) -> bool:
    """True when ``value << amount`` (amount < 32) is a WGSL shader-creation
    error: a u32 shifts out a 1 bit; an i32's top ``amount + 1`` bits differ."""
    if s == T.u32:
        return value >> (32 - amount) != 0 if amount else False
    top = value >> (31 - amount)  # the top amount + 1 bits, sign-extended
    return top not in (0, -1)


def refuse_division(op: str, a, b, s: T.Scalar) -> str | None:
    """Why integer ``a / b`` or ``a % b`` is a shader-creation error, or None."""
    d = int_value(b)
    if d is not None and 0 in d:
        return f"integer `{op}` by a constant zero is a WGSL shader-creation error"
    n = int_value(a)
    if s == T.i32 and d is not None and n is not None:
        n, d = n * (len(d) // len(n)), d * (len(n) // len(d))
        if any(x == _I32_MIN and y == -1 for x, y in zip(n, d)):
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
        n = max(len(values), len(amounts))
        values, amounts = values * (n // len(values)), amounts * (n // len(amounts))
        if any(shift_loses_bits(v, k, s) for v, k in zip(values, amounts)):
            what = "shifts out a 1 bit" if s == T.u32 else "changes the sign"
            return (f"`{_show(values)} << {_show(amounts)}` of {s} constants {what}: a WGSL "
                    f"shader-creation error")
    return None


def _show(v: tuple[int, ...]) -> str:
    return str(v[0]) if len(v) == 1 else "(" + ", ".join(map(str, v)) + ")"
