"""Building typed expressions: operators, indexing, members and constructors.

The rules come from the operation registry (``shaderdsl.ops``); this module
turns Python values into nodes (``shaderdsl.nodes``) and gives the nodes
their Python operators. Importing it makes ``f32(x)`` and ``vec4f(...)``
work: the type objects double as conversion functions.
"""
from __future__ import annotations

import numpy as np

from . import nodes
from . import types as T
from .literals import as_expr, default_scalar, literal  # noqa: F401  (re-exported)
from .nodes import (AddressOf, Binary, Call, Expr, Index, Lit, Member, Ref, SWIZZLE,  # noqa: F401
                    Unary, is_assignable, root, type_error)
from .ops import CONSTRUCT, SHIFT, binary_rule, unary_rule


def _identity(e, lit, value) -> bool:
    """True when Python number ``lit`` equals ``value`` and fits the type of ``e``."""
    if isinstance(lit, (Expr, bool)) or not isinstance(lit, (int, float)) or lit != value:
        return False
    if not isinstance(e, Expr) or not isinstance(e.type, (T.Scalar, T.Vector)):
        return False
    s = T.scalar_of(e.type)
    return s.is_float or (s.is_int and isinstance(lit, int))


def binary(op: str, a, b) -> Expr:
    """``a op b`` for a Python operator symbol; Python numbers take the other side's type."""
    # Python-side identities keep index arithmetic readable (`c`, not `0u + c`).
    if (op == "+" and _identity(b, a, 0)) or (op == "*" and _identity(b, a, 1)):
        return b
    if (op in ("+", "-") and _identity(a, b, 0)) or (op in ("*", "/") and _identity(a, b, 1)):
        return a
    if not isinstance(a, Expr):
        a = as_expr(a, b.type)
    if not isinstance(b, Expr):
        b = as_expr(b, T.u32 if op in SHIFT else a.type)
    entry, rt = binary_rule(op, a, b)
    return Binary(entry, a, b, rt)


def unary(op: str, a: Expr) -> Expr:
    entry, t = unary_rule(op, a)
    return Unary(entry, a, t)


def shaped_length(length, name: str):
    """(element count or None, shape or None) of a buffer declared with a
    length or a shape; a shape's sizes are ints or u32/i32 overrides or uniforms."""
    if not isinstance(length, (tuple, list)):
        return length, None
    if not length:
        raise type_error(f"buffer {name!r}: a shape needs at least one size")
    for d in length:
        sized = isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 1
        named = isinstance(d, Ref) and d.kind in ("override", "uniform") and d.type in (T.u32, T.i32)
        if not (sized or named):
            raise type_error(f"buffer {name!r}: each size of a shape must be a positive int or "
                             f"a u32/i32 override or uniform, got {d!r} in {tuple(length)!r}")
    shape = tuple(d if isinstance(d, Ref) else int(d) for d in length)
    fixed = all(isinstance(d, int) for d in shape)
    return (int(np.prod(shape)) if fixed else None), shape


def _shaped_index(base: Ref, idx: tuple) -> Index:
    """``x[i, j, ...]`` of a shaped array: the flat index ``i * stride + j``
    with its strides in the WGSL; each axis kept for the interpreter's checks."""
    shape = base.shape
    if len(idx) != len(shape):
        raise type_error(f"`{base.name}` has shape {_shape_text(shape)}: index it with "
                         f"{len(shape)} indices, got {len(idx)}")
    flat, stride, axes, offset = None, 1, [], 0
    for k in reversed(range(len(shape))):
        i, d = idx[k], shape[k]
        e = as_expr(i, T.u32)
        if e.type not in (T.u32, T.i32):
            raise type_error(f"an index must be u32 or i32, got {e.type} on axis {k} of `{base.name}`")
        if isinstance(i, int) and isinstance(d, int) and not 0 <= i < d:
            raise type_error(f"index {i} is out of range for axis {k} of `{base.name}` "
                             f"(size {d})")
        e = e if e.type == T.u32 else construct(T.u32, e)
        if isinstance(i, int) and isinstance(stride, int):
            offset += i * stride  # constant parts fold into one number
        else:
            term = e if isinstance(stride, int) and stride == 1 else binary("*", e, stride)
            flat = term if flat is None else binary("+", term, flat)
        stride = stride * d if isinstance(stride, int) and isinstance(d, int) else \
            binary("*", _size(d), stride)
        axes.append((e, _size(d)))
    flat = as_expr(offset, T.u32) if flat is None else binary("+", flat, offset)
    return Index(base, flat, base.type.elem, axes=tuple(reversed(axes)))


def _size(d) -> Expr:
    return as_expr(d, T.u32) if isinstance(d, int) else \
        d if d.type == T.u32 else construct(T.u32, d)


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(d) if isinstance(d, int) else d.name for d in shape) + ")"


def index(base: Expr, i) -> Index:
    """``base[i]`` of an array or vector; a constant index is range-checked.
    A shaped array takes one index per axis."""
    shape = getattr(base, "shape", None) if isinstance(base, Ref) else None
    if isinstance(i, tuple) or (shape and len(shape) > 1):
        if not shape:
            raise type_error(f"`{getattr(base, 'name', base)}` has no shape: index it with one "
                             f"index (declare it with a shape such as (rows, cols) for x[r, c])")
        return _shaped_index(base, i if isinstance(i, tuple) else (i,))
    bt = base.type
    if isinstance(bt, T.Array):
        et = bt.elem
    elif isinstance(bt, T.Vector):
        et = bt.scalar
    else:
        raise type_error(f"cannot index a value of type {bt}")
    idx = as_expr(i, T.u32)
    if idx.type not in (T.u32, T.i32):
        raise type_error(f"an index must be u32 or i32, got {idx.type}")
    if isinstance(i, int) and isinstance(bt, T.Array) and bt.length is not None \
            and not 0 <= i < bt.length:
        raise type_error(f"index {i} is out of range for {bt}")
    return Index(base, idx, et)


def member(base: Expr, name: str) -> Member:
    """``base.x`` or a swizzle ``base.xy`` of a vector."""
    vt = base.type
    if not SWIZZLE.match(name):
        raise AttributeError(f"{vt} has no member {name!r} (use x, y, z, w or a swizzle like xy)")
    letters = "xyzw" if name[0] in "xyzw" else "rgba"
    if any(letters.index(c) >= vt.size for c in name):
        raise type_error(f"{vt} has no component in {name!r}")
    t = vt.scalar if len(name) == 1 else T.Vector(len(name), vt.scalar)
    return Member(base, name, t)


def _construct_vector(t: T.Vector, args) -> Expr:
    s = t.scalar
    if len(args) == 1 and isinstance(args[0], Expr) and isinstance(args[0].type, T.Vector):
        x = args[0]
        if x.type.size != t.size:
            raise type_error(f"cannot convert {x.type} to {t}")
        return Call(CONSTRUCT, (x,), t)
    exprs = tuple(as_expr(a, s) for a in args)
    count = 0
    for e in exprs:
        et = e.type
        if isinstance(et, T.Vector):
            if et.scalar != s:
                raise type_error(f"{t}(...) argument of type {et}: component types differ")
            count += et.size
        elif et == s:
            count += 1
        else:
            raise type_error(f"{t}(...) argument of type {et}, expected {s} or a vector of {s}")
    if count not in (1, t.size):
        raise type_error(f"{t}(...) needs 1 or {t.size} components, got {count}")
    return Call(CONSTRUCT, exprs, t)


def construct(t: T.WType, *args) -> Expr:
    """``f32(x)``, ``vec4f(a, b, c, d)``, ``vec4f(x)``: conversions and constructors."""
    if isinstance(t, T.Scalar):
        if len(args) != 1:
            raise type_error(f"{t}(...) takes one argument, got {len(args)}")
        x = args[0]
        if not isinstance(x, Expr):
            return literal(x, t)
        if not isinstance(x.type, T.Scalar):
            raise type_error(f"cannot convert {x.type} to {t}")
        return Call(CONSTRUCT, (x,), t)
    if isinstance(t, T.Vector):
        return _construct_vector(t, args)
    raise type_error(f"cannot construct a value of type {t}")


def _call_type(self, *args):
    return construct(self, *args)


# Let the type objects double as conversion functions: f32(i), vec4f(a, b, c, d).
T.Scalar.__call__ = _call_type
T.Vector.__call__ = _call_type
nodes.hooks.binary, nodes.hooks.unary = binary, unary
nodes.hooks.index, nodes.hooks.member = index, member
