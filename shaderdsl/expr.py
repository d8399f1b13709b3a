"""The typed expression tree.

Every node carries its WGSL type, the Python 'file:line' that built it, and
the names of the mutable things it reads (vars, buffers, workgroup arrays),
so the builder can refuse an expression whose meaning changed since it was
built (Hesper's live-reference bug). Python operators build nodes; a type
mismatch raises ShaderTypeError at construction.
"""
from __future__ import annotations

import itertools
import math
import os
import re
import sys

import numpy as np

from . import consts
from . import types as T
from .errors import ShaderTypeError, ShaderScopeError

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_seq = itertools.count()


def caller_location() -> str:
    """'file:line' of the first frame outside this package: the user's code."""
    f = sys._getframe(1)
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)).startswith(_PKG_DIR):
        f = f.f_back
    if f is None:
        return "<unknown>"
    return f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno}"


def type_error(msg: str, where: str | None = None) -> ShaderTypeError:
    return ShaderTypeError(f"{where or caller_location()}: {msg}")


class Expr:
    """A WGSL expression with a known type. Build with operators and builtins."""

    __slots__ = ("type", "where", "deps", "seq", "blocks")

    def __init__(self, type: T.WType, children: tuple = ()):
        self.type = type
        self.where = caller_location()
        self.deps = frozenset().union(*(reads(c) for c in children)) if children else frozenset()
        self.seq = next(_seq)
        # Blocks (if/loop bodies) this expression was built in: using it after
        # one has closed means a Python `=` was meant as a WGSL assignment.
        from .monad import _active
        here = _active[-1].block_id if _active else 0
        self.blocks = frozenset((here,)).union(*(c.blocks for c in children)) if here else \
            frozenset().union(*(c.blocks for c in children))

    # Python truth would silently pick one branch at build time.
    def __bool__(self):
        raise type_error("a shader expression has no Python truth value; "
                         "use `with m.if_(cond):` or select(...) instead of Python if/and/or")

    __hash__ = object.__hash__

    # arithmetic
    def __add__(self, o): return binary("+", self, o)
    def __radd__(self, o): return binary("+", o, self)
    def __sub__(self, o): return binary("-", self, o)
    def __rsub__(self, o): return binary("-", o, self)
    def __mul__(self, o): return binary("*", self, o)
    def __rmul__(self, o): return binary("*", o, self)
    def __truediv__(self, o): return binary("/", self, o)
    def __rtruediv__(self, o): return binary("/", o, self)
    def __floordiv__(self, o): return binary("//", self, o)
    def __rfloordiv__(self, o): return binary("//", o, self)
    def __mod__(self, o): return binary("%", self, o)
    def __rmod__(self, o): return binary("%", o, self)
    def __and__(self, o): return binary("&", self, o)
    def __rand__(self, o): return binary("&", o, self)
    def __or__(self, o): return binary("|", self, o)
    def __ror__(self, o): return binary("|", o, self)
    def __xor__(self, o): return binary("^", self, o)
    def __rxor__(self, o): return binary("^", o, self)
    def __lshift__(self, o): return binary("<<", self, o)
    def __rlshift__(self, o): return binary("<<", o, self)
    def __rshift__(self, o): return binary(">>", self, o)
    def __rrshift__(self, o): return binary(">>", o, self)
    def __lt__(self, o): return binary("<", self, o)
    def __le__(self, o): return binary("<=", self, o)
    def __gt__(self, o): return binary(">", self, o)
    def __ge__(self, o): return binary(">=", self, o)
    def __eq__(self, o): return binary("==", self, o)  # type: ignore[override]
    def __ne__(self, o): return binary("!=", self, o)  # type: ignore[override]
    def __neg__(self): return unary("-", self)
    def __pos__(self): return self
    def __invert__(self): return unary("~", self)

    # compound assignment: a statement on an assignable target
    def _compound(self, op, o):
        from .monad import current_builder
        if not is_assignable(self):
            if isinstance(self, Ref) and self.kind == "let":
                raise type_error(f"`{self.name}` is a let (immutable); declare it with m.var(...) to update it")
            return binary(op, self, o)
        current_builder().assign(self, o, op=op)
        # A named var stays bound to its name; for `buf[i] += v` Python calls
        # __setitem__ next, and the marker tells it the store is already emitted.
        return self if isinstance(self, Ref) else _Assigned(self)

    def __iadd__(self, o): return self._compound("+", o)
    def __ifloordiv__(self, o): return self._compound("//", o)
    def __isub__(self, o): return self._compound("-", o)
    def __imul__(self, o): return self._compound("*", o)
    def __itruediv__(self, o): return self._compound("/", o)
    def __imod__(self, o): return self._compound("%", o)
    def __iand__(self, o): return self._compound("&", o)
    def __ior__(self, o): return self._compound("|", o)
    def __ixor__(self, o): return self._compound("^", o)
    def __ilshift__(self, o): return self._compound("<<", o)
    def __irshift__(self, o): return self._compound(">>", o)

    # indexing and stores
    def __getitem__(self, index):
        return Index(self, index)

    def __setitem__(self, index, value):
        from .monad import current_builder
        if isinstance(value, _Assigned):  # `buf[i] += v` already emitted its statement
            return
        current_builder().assign(Index(self, index), value)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        t = object.__getattribute__(self, "type")
        if not isinstance(t, T.Vector):
            if _SWIZZLE.match(name):
                raise type_error(f"{t} has no member {name!r}: only vectors have components")
            raise AttributeError(f"a shader expression of type {t} has no attribute {name!r}")
        return Member(self, name)

    def __setattr__(self, name, value):
        if name in Expr.__slots__ or name in getattr(type(self), "__slots__", ()):
            object.__setattr__(self, name, value)
            return
        if isinstance(value, _Assigned):
            return
        t = object.__getattribute__(self, "type")
        if not isinstance(t, T.Vector):
            raise type_error(f"cannot set member {name!r} of a {t}: only vectors have components")
        if len(name) != 1:
            raise type_error(f"WGSL cannot assign to a swizzle ({name!r}); assign one "
                             f"component at a time or the whole vector")
        from .monad import current_builder
        current_builder().assign(Member(self, name), value)

    def __iter__(self):
        raise type_error("a shader expression is not iterable; use m.loop(...) for a runtime loop")

    def __repr__(self):
        from .emit import expr_text
        return f"<Expr {expr_text(self)}: {self.type}>"


_TRACKED = ("var", "let", "loop", "buffer", "workgroup")


def reads(e: "Expr") -> frozenset:
    """What ``e`` reads, as (name, version, seq) triples.

    A name read directly is captured now, at the version the builder has for
    it; composite nodes keep the triples captured when their children were
    combined. The builder compares them with its versions when the expression
    is used, which is how a stale read is caught.
    """
    if isinstance(e, Ref):
        if e.kind not in _TRACKED:
            return frozenset()
        from .monad import _active
        version = _active[-1].version(e.name) if _active else 0
        return frozenset(((e.name, version, next(_seq)),))
    return e.deps


class _Assigned:
    """Returned by `target op= value`: tells __setitem__/__setattr__ the store was emitted."""

    __slots__ = ("target",)

    def __init__(self, target):
        self.target = target


class Lit(Expr):
    __slots__ = ("value",)

    def __init__(self, value, type: T.Scalar):
        super().__init__(type)
        self.value = value


class Ref(Expr):
    """A name: buffer, uniform, workgroup array, override, builtin, var, let or loop counter.

    ``block`` is the id of the block that declared a local (None at module scope).
    """

    __slots__ = ("name", "kind", "block", "access")

    def __init__(self, name: str, type: T.WType, kind: str, block=None, access: str = "read"):
        super().__init__(type)
        self.blocks = frozenset()  # names are scope-checked by the builder instead
        self.name = name
        self.kind = kind
        self.block = block
        self.access = access


class Unary(Expr):
    __slots__ = ("op", "a")

    def __init__(self, op: str, a: Expr, type: T.WType):
        super().__init__(type, (a,))
        self.op, self.a = op, a


class Binary(Expr):
    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr, type: T.WType):
        super().__init__(type, (a, b))
        self.op, self.a, self.b = op, a, b


class Call(Expr):
    """A call of a WGSL builtin function or a type constructor/conversion."""

    __slots__ = ("fn", "args", "feature")

    def __init__(self, fn: str, args: tuple, type: T.WType, feature: str | None = None):
        super().__init__(type, tuple(args))
        self.fn, self.args, self.feature = fn, tuple(args), feature


class AddressOf(Expr):
    """``&target``: only used as the first argument of atomic builtins."""

    __slots__ = ("target",)

    def __init__(self, target: Expr):
        super().__init__(target.type, (target,))
        self.target = target


class Index(Expr):
    __slots__ = ("base", "index")

    def __init__(self, base: Expr, index):
        bt = base.type
        if isinstance(bt, T.Array):
            et = bt.elem
        elif isinstance(bt, T.Vector):
            et = bt.scalar
        else:
            raise type_error(f"cannot index a value of type {bt}")
        idx = as_expr(index, T.u32)
        if idx.type not in (T.u32, T.i32):
            raise type_error(f"an index must be u32 or i32, got {idx.type}")
        if isinstance(index, int) and isinstance(bt, T.Array) and bt.length is not None \
                and not 0 <= index < bt.length:
            raise type_error(f"index {index} is out of range for {bt}")
        super().__init__(et, (base, idx))
        self.base, self.index = base, idx


_SWIZZLE = re.compile(r"^([xyzw]{1,4}|[rgba]{1,4})$")


class Member(Expr):
    __slots__ = ("base", "name")

    def __init__(self, base: Expr, name: str):
        vt = base.type
        if not _SWIZZLE.match(name):
            raise AttributeError(f"{vt} has no member {name!r} (use x, y, z, w or a swizzle like xy)")
        comps = "xyzw" if name[0] in "xyzw" else "rgba"
        if any(comps.index(c) >= vt.size for c in name):
            raise type_error(f"{vt} has no component in {name!r}")
        t = vt.scalar if len(name) == 1 else T.Vector(len(name), vt.scalar)
        super().__init__(t, (base,))
        self.base, self.name = base, name


# ---------------------------------------------------------------- literals

_I32_MIN, _I32_MAX, _U32_MAX = -(2 ** 31), 2 ** 31 - 1, 2 ** 32 - 1


def literal(value, scalar: T.Scalar, where: str | None = None) -> Lit:
    """A Python number as a literal of ``scalar``, range-checked."""
    if isinstance(value, (bool, np.bool_)):
        if scalar != T.bool_:
            raise type_error(f"bool literal {value!r} used where {scalar} is expected", where)
        return Lit(bool(value), T.bool_)
    if scalar == T.bool_:
        raise type_error(f"number {value!r} used where bool is expected", where)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if scalar == T.u32 and not 0 <= value <= _U32_MAX:
            raise type_error(f"{value} does not fit in u32", where)
        if scalar == T.i32 and not _I32_MIN <= value <= _I32_MAX:
            raise type_error(f"{value} does not fit in i32", where)
        if scalar.is_float:
            value = float(value)
        return Lit(value, scalar)
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
        return Lit(value, scalar)
    raise type_error(f"cannot use {type(value).__name__} {value!r} in a shader expression", where)


def default_scalar(value) -> T.Scalar:
    """WGSL's concretisation of an abstract literal: bool, i32 or f32."""
    if isinstance(value, (bool, np.bool_)):
        return T.bool_
    if isinstance(value, (int, np.integer)):
        return T.i32
    if isinstance(value, (float, np.floating)):
        return T.f32
    raise type_error(f"cannot use {type(value).__name__} {value!r} in a shader expression")


def as_expr(value, like: T.WType | None = None) -> Expr:
    """An Expr as is, or a Python literal typed from ``like`` (its scalar type)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, _Assigned):
        raise type_error("the result of an augmented assignment is not a value")
    scalar = T.scalar_of(like) if like is not None else None
    return literal(value, scalar or default_scalar(value))


def is_assignable(e: Expr) -> bool:
    if isinstance(e, Ref):
        return e.kind in ("var", "workgroup") or (e.kind == "buffer" and e.access == "read_write")
    if isinstance(e, (Index, Member)):
        return is_assignable(e.base)
    return False


def root(e: Expr) -> Expr:
    while isinstance(e, (Index, Member)):
        e = e.base
    return e


# ---------------------------------------------------------------- operators

_ARITH = {"+", "-", "*", "/", "//", "%"}
_COMPARE = {"<", "<=", ">", ">=", "==", "!="}
_BITS = {"&", "|", "^"}
_SHIFT = {"<<", ">>"}


def _value_type(e: Expr, op: str) -> T.WType:
    t = e.type
    if isinstance(t, T.Atomic):
        raise type_error(f"cannot use an atomic<{t.scalar}> directly in `{op}`; use atomic_load(...)")
    if not isinstance(t, (T.Scalar, T.Vector)):
        raise type_error(f"operator `{op}` does not apply to {t}")
    return t


def _identity(e, lit, value) -> bool:
    """True when Python number ``lit`` equals ``value`` and fits the type of ``e``."""
    if isinstance(lit, (Expr, bool)) or not isinstance(lit, (int, float)) or lit != value:
        return False
    if not isinstance(e, Expr) or not isinstance(e.type, (T.Scalar, T.Vector)):
        return False
    s = T.scalar_of(e.type)
    return s.is_float or (s.is_int and isinstance(lit, int))


def binary(op: str, a, b) -> Expr:
    # Python-side identities keep index arithmetic readable (`c`, not `0u + c`).
    if (op == "+" and _identity(b, a, 0)) or (op == "*" and _identity(b, a, 1)):
        return b
    if (op in ("+", "-") and _identity(a, b, 0)) or (op in ("*", "/") and _identity(a, b, 1)):
        return a
    if not isinstance(a, Expr):
        a = as_expr(a, b.type)
    if not isinstance(b, Expr):
        b = as_expr(b, T.u32 if op in _SHIFT else a.type)
    ta, tb = _value_type(a, op), _value_type(b, op)
    sa, sb = T.scalar_of(ta), T.scalar_of(tb)

    if op in _SHIFT:
        if not sa.is_int:
            raise type_error(f"`{op}` needs an integer left operand, got {ta}")
        want = T.u32 if isinstance(ta, T.Scalar) else T.Vector(ta.size, T.u32)
        if tb != want:
            raise type_error(f"`{op}` needs a shift amount of type {want}, got {tb}")
        why = consts.refuse_shift(op, a, b, sa)
        if why:
            raise type_error(why)
        return Binary(op, a, b, ta)

    if sa != sb:
        raise type_error(f"`{op}` between {ta} and {tb}: convert one side explicitly, "
                         f"e.g. {sa}(...) or {sb}(...)")

    if op in _COMPARE:
        if ta != tb:
            raise type_error(f"`{op}` needs operands of the same type, got {ta} and {tb}")
        if sa == T.bool_ and op not in ("==", "!="):
            raise type_error(f"`{op}` does not apply to bool")
        rt = T.bool_ if isinstance(ta, T.Scalar) else T.Vector(ta.size, T.bool_)
        return Binary(op, a, b, rt)

    if op in _BITS:
        if ta != tb:
            raise type_error(f"`{op}` needs operands of the same type, got {ta} and {tb}")
        if sa == T.bool_:
            if isinstance(ta, T.Scalar) and op != "^":
                op = "&&" if op == "&" else "||"
            elif op == "^":
                op = "!="
            return Binary(op, a, b, ta)
        if not sa.is_int:
            raise type_error(f"`{op}` needs integer or bool operands, got {ta}")
        return Binary(op, a, b, ta)

    if op in _ARITH:
        if not sa.is_numeric:
            raise type_error(f"`{op}` does not apply to {ta}")
        if op == "//":
            if not sa.is_int:
                raise type_error(f"`//` needs integer operands, got {ta}; use `/` for floats")
            op = "/"
        why = consts.refuse_division(op, a, b, sa) if op in ("/", "%") and sa.is_int else None
        if why:
            raise type_error(why)
        if ta == tb:
            rt = ta
        elif isinstance(ta, T.Vector) and tb == sa:
            rt = ta
        elif isinstance(tb, T.Vector) and ta == sb:
            rt = tb
        else:
            raise type_error(f"`{op}` between {ta} and {tb}: vector sizes differ")
        return Binary(op, a, b, rt)

    raise type_error(f"unknown operator {op!r}")


def unary(op: str, a: Expr) -> Expr:
    t = _value_type(a, op)
    s = T.scalar_of(t)
    if op == "-":
        if s not in (T.f32, T.f16, T.i32):
            raise type_error(f"unary minus needs a signed type (f32, f16, i32), got {t}")
        return Unary("-", a, t)
    if op == "~":
        if s == T.bool_:
            return Unary("!", a, t)
        if not s.is_int:
            raise type_error(f"`~` needs an integer or bool operand, got {t}")
        return Unary("~", a, t)
    raise type_error(f"unknown unary operator {op!r}")


# ---------------------------------------------------------------- constructors

def construct(t: T.WType, *args) -> Expr:
    """``f32(x)``, ``vec4f(a, b, c, d)``, ``vec4f(x)``: conversions and constructors."""
    if isinstance(t, T.Scalar):
        if len(args) != 1:
            raise type_error(f"{t}(...) takes one argument, got {len(args)}")
        x = args[0]
        if not isinstance(x, Expr):
            return literal(x, t)
        if not isinstance(x.type, T.Scalar) or isinstance(x.type, T.Atomic):
            raise type_error(f"cannot convert {x.type} to {t}")
        return Call(str(t), (x,), t)
    if isinstance(t, T.Vector):
        s = t.scalar
        if len(args) == 1 and isinstance(args[0], Expr) and isinstance(args[0].type, T.Vector):
            x = args[0]
            if x.type.size != t.size:
                raise type_error(f"cannot convert {x.type} to {t}")
            return Call(str(t), (x,), t)
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
        return Call(str(t), exprs, t)
    raise type_error(f"cannot construct a value of type {t}")


def _call_type(self, *args):
    return construct(self, *args)


# Let the type objects double as conversion functions: f32(i), vec4f(a, b, c, d).
T.Scalar.__call__ = _call_type
T.Vector.__call__ = _call_type
