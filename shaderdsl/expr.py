"""Expressions: the typed nodes of the kernel tree, their Python operators,
and how Python values become them.

Every expression carries its WGSL type, the Python line that built it, and
the names of the mutable things it reads (vars, buffers, workgroup arrays),
so the builder can refuse an expression whose meaning changed since it was
built (Hesper's live-reference bug). Operator nodes hold their entry of the
operation registry (``shaderdsl.operators``, ``shaderdsl.ops``), which gives
their WGSL spelling and their numpy meaning.

Python's operators on an expression call this module's typed construction
(``binary``, ``unary``, ``index``, ``member``): Python numbers become
range-checked literals of the other side's type (``shaderdsl.literals``),
and the operator rules (``shaderdsl.operators``) type the node or raise
ShaderTypeError naming the user's line. The type objects double as
conversion functions (``f32(x)``, ``vec4f(a, b, c, d)``) once this module is
imported, which ``import shaderdsl`` does.
"""
from __future__ import annotations

import itertools
import re
from enum import StrEnum

import numpy as np

from . import context
from . import types as T
from .context import type_error
from .errors import is_positive_int
from .literals import default_scalar, literal_value
from .location import shown, user_line
from .operators import CONSTRUCT, SHIFT, binary_rule, unary_rule

_seq = itertools.count()
_put = object.__setattr__            # Expr.__setattr__ is the DSL's member store
_EMPTY: frozenset = frozenset()
_ALONE: dict[int, frozenset] = {}    # block id -> frozenset({id}), shared by the nodes built there

SWIZZLE = re.compile(r"^([xyzw]{1,4}|[rgba]{1,4})$")


class RefKind(StrEnum):
    """What a name (:class:`Ref`) stands for."""
    BUFFER = "buffer"
    UNIFORM = "uniform"
    WORKGROUP = "workgroup"
    OVERRIDE = "override"
    BUILTIN = "builtin"
    VAR = "var"
    LET = "let"
    LOOP = "loop"


# Names whose reads the builder versions (a read made stale by a later write is refused)
TRACKED = (RefKind.VAR, RefKind.LET, RefKind.LOOP, RefKind.BUFFER, RefKind.WORKGROUP)


def next_seq() -> int:
    """A build-order number: larger means built later."""
    return next(_seq)


class Expr:
    """A WGSL expression with a known type. Build with operators and builtins."""

    __slots__ = ("type", "_at", "deps", "blocks")

    def __init__(self, type: T.WType | None, children: tuple = (), at: tuple | None = None):
        """``at``: the user's line (``location.user_line()``) when the caller
        already has it: a construction that makes several nodes looks it up once.
        ``type`` is None only for a call that gives no value (a store)."""
        _put(self, "type", type)
        _put(self, "_at", at or user_line())
        builder = context.active()
        deps = blocks = _EMPTY
        for c in children:  # what the children read, and the blocks they were built in
            d = c.read(builder) if isinstance(c, Ref) else c.deps
            if d:
                deps = deps | d if deps else d
            b = c.blocks
            if b and b is not blocks:
                blocks = blocks | b if blocks else b
        _put(self, "deps", deps)
        # Blocks (if/loop bodies) this expression was built in: using it after
        # one has closed means a Python `=` was meant as a WGSL assignment.
        here = builder.block_id if builder is not None else 0
        if here and here not in blocks:
            alone = _ALONE.get(here) or _ALONE.setdefault(here, frozenset((here,)))
            blocks = blocks | alone if blocks else alone
        _put(self, "blocks", blocks)

    @property
    def where(self) -> str:
        """'file:line' of the user's code that built this expression."""
        return shown(self._at)

    def int_constant(self):
        """The numpy value of this expression if it is an integer constant the
        DSL can evaluate (``shaderdsl.consts``), else None."""
        return None

    # Python truth would silently pick one branch at build time.
    def __bool__(self):
        raise type_error("a shader expression has no Python truth value; use `with "
                         "m.if_(cond):` or B.select(...) instead of Python if/and/or, "
                         "B.max/B.min instead of Python's max()/min(), and `(a < b) & (b < c)` "
                         "instead of a chained comparison `a < b < c`")

    # Python numbers and functions that would need a value now
    def __pow__(self, o):
        raise type_error("`**` has no WGSL operator: use B.pow(a, b) for floats, or "
                         "multiply (x * x)")

    __rpow__ = __pow__

    def __float__(self):
        raise type_error("a shader expression is not a Python number: use shaderdsl.builtins "
                         "(B.sqrt, B.exp, ...) instead of math.*, and f32(x) to convert")

    __int__ = __float__

    def __index__(self):
        raise type_error("a shader expression is not a Python int: `range(expr)` and list "
                         "indexes need Python values; use m.loop(...) for a runtime loop")

    __hash__ = object.__hash__

    # arithmetic, bits, comparisons: typed by the operator rules (binary, unary below)
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
        if not is_assignable(self):
            if isinstance(self, Ref) and self.kind == RefKind.LET:
                raise type_error(f"`{self.name}` is a let (immutable); declare it with "
                                 f"m.var(...) to update it")
            return binary(op, self, o)
        context.current().assign(self, o, op=op)
        # A named var stays bound to its name; for `buf[i] += v` Python calls
        # __setitem__ next, and the marker tells it the store is already emitted.
        return self if isinstance(self, Ref) else Assigned(self)

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
    def __getitem__(self, i):
        return index(self, i)

    def __setitem__(self, i, value):
        if isinstance(value, Assigned):  # `buf[i] += v` already emitted its statement
            return
        context.current().assign(index(self, i), value)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        t = object.__getattribute__(self, "type")
        if not isinstance(t, T.Vector):
            if SWIZZLE.match(name):
                raise type_error(f"{t} has no member {name!r}: only vectors have components")
            raise AttributeError(f"a shader expression of type {t} has no attribute {name!r}")
        return member(self, name)

    def __setattr__(self, name, value):
        if isinstance(value, Assigned):
            return
        if name in Expr.__slots__ or name in getattr(type(self), "__slots__", ()):
            _put(self, name, value)
            return
        t = object.__getattribute__(self, "type")
        if not isinstance(t, T.Vector):
            raise type_error(f"cannot set member {name!r} of a {t}: only vectors have components")
        if len(name) != 1:
            raise type_error(f"WGSL cannot assign to a swizzle ({name!r}); assign one "
                             f"component at a time or the whole vector")
        context.current().assign(member(self, name), value)

    def __iter__(self):
        raise type_error("a shader expression is not iterable; use m.loop(...) for a runtime loop")

    def _label(self) -> str:
        return ""

    def __repr__(self):
        label = self._label()
        return f"<{type(self).__name__}{' ' + label if label else ''}: {self.type} built at " \
               f"{self.where}>"


class Assigned:
    """Returned by `target op= value`: tells __setitem__/__setattr__ the store was emitted."""

    __slots__ = ("target",)

    def __init__(self, target):
        self.target = target


class Lit(Expr):
    __slots__ = ("value",)

    def __init__(self, value, type: T.Scalar, at: tuple | None = None):
        Expr.__init__(self, type, (), at)
        _put(self, "value", value)

    def int_constant(self):
        return T.DTYPES[self.type.name].type(self.value) if _is_int(self.type) else None

    def _label(self) -> str:
        return repr(self.value)


class Ref(Expr):
    """A name: buffer, uniform, workgroup array, override, builtin, var, let or loop counter.

    ``block`` is the id of the block that declared a local (None at module scope).
    Names are scope-checked by the builder instead of by blocks.
    """

    __slots__ = ("name", "kind", "block", "access", "shape")

    def __init__(self, name: str, type: T.WType, kind: RefKind, block=None, access: str = "read",
                 shape: tuple | None = None):
        _put(self, "type", type)
        _put(self, "_at", user_line())
        _put(self, "deps", _EMPTY)
        _put(self, "blocks", _EMPTY)
        _put(self, "name", name)
        _put(self, "kind", RefKind(kind))
        _put(self, "block", block)
        _put(self, "access", access)
        _put(self, "shape", shape)

    def read(self, builder) -> frozenset:
        """This name as read now: (name, version, seq) at the version ``builder``
        (the active one, or None) has of it, or nothing for a name that never changes."""
        if self.kind not in TRACKED:
            return _EMPTY
        version = builder.version(self.name) if builder is not None else 0
        return frozenset(((self.name, version, next(_seq)),))

    def _label(self) -> str:
        return self.name


def reads(e: Expr) -> frozenset:
    """What ``e`` reads, as (name, version, seq) triples.

    A name read directly is captured now, at the version the builder has for
    it; composite nodes keep the triples captured when their children were
    combined. The builder compares them with its versions when the expression
    is used, which is how a stale read is caught.
    """
    return e.read(context.active()) if isinstance(e, Ref) else e.deps


def _is_int(t) -> bool:
    return isinstance(t, (T.Scalar, T.Vector)) and T.scalar_of(t) in (T.i32, T.u32)


def _fold(e, parts: tuple):
    """The value of operator or constructor node ``e`` of an integer type from
    its parts' constant values, or None when one is not a constant."""
    if not _is_int(e.type):
        return None
    values = [p.int_constant() for p in parts]
    if any(v is None for v in values):
        return None
    with np.errstate(all="ignore"):
        return e.op.semantics(tuple(p.type for p in parts), e.type)(*values)


class Unary(Expr):
    """``op a``; ``op`` is an entry of the operation registry."""

    __slots__ = ("op", "a")

    def __init__(self, op, a: Expr, type: T.WType):
        Expr.__init__(self, type, (a,))
        _put(self, "op", op)
        _put(self, "a", a)

    def int_constant(self):
        return _fold(self, (self.a,))

    def _label(self) -> str:
        return self.op.wgsl


class Binary(Expr):
    """``a op b``; ``op`` is an entry of the operation registry."""

    __slots__ = ("op", "a", "b")

    def __init__(self, op, a: Expr, b: Expr, type: T.WType, at: tuple | None = None):
        Expr.__init__(self, type, (a, b), at)
        _put(self, "op", op)
        _put(self, "a", a)
        _put(self, "b", b)

    def int_constant(self):
        return _fold(self, (self.a, self.b))

    def _label(self) -> str:
        return self.op.wgsl


class Call(Expr):
    """A call of a builtin function, constructor or conversion (``op`` from the registry).
    ``type`` is None for a call that returns nothing (atomicStore)."""

    __slots__ = ("op", "args")

    def __init__(self, op, args: tuple, type: T.WType | None):
        args = tuple(args)
        Expr.__init__(self, type, args)
        _put(self, "op", op)
        _put(self, "args", args)

    @property
    def feature(self) -> str | None:
        return self.op.feature

    def int_constant(self):
        return _fold(self, self.args) if self.op is CONSTRUCT else None

    def _label(self) -> str:
        return self.op.spell(self.type)


class AddressOf(Expr):
    """``&target``: only an argument of atomic builtins and arrayLength."""

    __slots__ = ("target",)

    def __init__(self, target: Expr):
        Expr.__init__(self, target.type, (target,))
        _put(self, "target", target)


class Index(Expr):
    """``base[index]``; for a shaped array ``axes`` keeps each axis's (index,
    size) so the interpreter can check them, while ``index`` is the flat one."""

    __slots__ = ("base", "index", "axes")

    def __init__(self, base: Expr, index: Expr, type: T.WType, axes: tuple | None = None,
                 at: tuple | None = None):
        Expr.__init__(self, type, (base, index), at)
        _put(self, "base", base)
        _put(self, "index", index)
        _put(self, "axes", axes)


class Member(Expr):
    """A vector component or swizzle: ``v.x``, ``v.xy``."""

    __slots__ = ("base", "name")

    def __init__(self, base: Expr, name: str, type: T.WType):
        Expr.__init__(self, type, (base,))
        _put(self, "base", base)
        _put(self, "name", name)

    @property
    def components(self) -> list[int]:
        letters = "xyzw" if self.name[0] in "xyzw" else "rgba"
        return [letters.index(c) for c in self.name]

    def _label(self) -> str:
        return "." + self.name


def operands(e: Expr) -> tuple[Expr, ...]:
    """The subexpressions of ``e``, left to right."""
    if isinstance(e, Unary):
        return (e.a,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, AddressOf):
        return (e.target,)
    if isinstance(e, Index):
        return (e.base, e.index)
    if isinstance(e, Member):
        return (e.base,)
    return ()


def is_assignable(e: Expr) -> bool:
    if isinstance(e, Ref):
        return e.kind in (RefKind.VAR, RefKind.WORKGROUP) or \
            (e.kind == RefKind.BUFFER and e.access == "read_write")
    if isinstance(e, (Index, Member)):
        return is_assignable(e.base)
    return False


def root(e: Expr) -> Expr:
    """The named thing an index/member chain starts from."""
    while isinstance(e, (Index, Member)):
        e = e.base
    return e


# ---------------------------------------------------------------- construction

def literal(value, scalar: T.Scalar, where: str | None = None, at: tuple | None = None) -> Lit:
    """A Python number as a literal of ``scalar``, range-checked."""
    return Lit(literal_value(value, scalar, where), scalar, at)


# What a builtin or an operator accepts as an operand: an expression or a Python
# (or numpy) number, which takes the type of the expression beside it.
ExprLike = Expr | int | float | np.integer | np.floating | np.bool_


def as_expr(value, like: T.WType | None = None, at: tuple | None = None) -> Expr:
    """An Expr as is, or a Python literal typed from ``like`` (its scalar type);
    ``at`` as for Expr."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, Assigned):
        raise type_error("the result of an augmented assignment is not a value")
    scalar = T.scalar_of(like) if like is not None else None
    return literal(value, scalar or default_scalar(value), at=at)


def _identity(e, lit, value) -> bool:
    """True when Python number ``lit`` equals ``value`` and fits the type of ``e``."""
    if isinstance(lit, (Expr, bool)) or not isinstance(lit, (int, float)) or lit != value:
        return False
    if not isinstance(e, Expr) or not isinstance(e.type, (T.Scalar, T.Vector)):
        return False
    s = T.scalar_of(e.type)
    return s.is_float or (s.is_int and isinstance(lit, int))


def binary(op: str, a, b, at: tuple | None = None) -> Expr:
    """``a op b`` for a Python operator symbol; Python numbers take the other side's type."""
    # Python-side identities keep index arithmetic readable (`c`, not `0u + c`).
    if (op == "+" and _identity(b, a, 0)) or (op == "*" and _identity(b, a, 1)):
        return b
    if (op in ("+", "-") and _identity(a, b, 0)) or (op in ("*", "/") and _identity(a, b, 1)):
        return a
    at = at or user_line()
    if not isinstance(a, Expr):
        a = as_expr(a, b.type, at)
    if not isinstance(b, Expr):
        b = as_expr(b, T.u32 if op in SHIFT else a.type, at)
    entry, rt = binary_rule(op, a, b)
    return Binary(entry, a, b, rt, at)


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
        sized = is_positive_int(d)
        named = isinstance(d, Ref) and d.kind in (RefKind.OVERRIDE, RefKind.UNIFORM) \
            and d.type in (T.u32, T.i32)
        if not (sized or named):
            raise type_error(f"buffer {name!r}: each size of a shape must be a positive int or "
                             f"a u32/i32 override or uniform, got {d!r} in {tuple(length)!r}")
    shape = tuple(d if isinstance(d, Ref) else int(d) for d in length)
    sizes = [d for d in shape if isinstance(d, int)]
    return (int(np.prod(sizes)) if len(sizes) == len(shape) else None), shape


def _shaped_index(base: Ref, idx: tuple, at: tuple | None) -> Index:
    """``x[i, j, ...]`` of a shaped array: the flat index ``i * stride + j``
    with its strides in the WGSL; each axis kept for the interpreter's checks."""
    shape = base.shape
    if len(idx) != len(shape):
        raise type_error(f"`{base.name}` has shape {_shape_text(shape)}: index it with "
                         f"{len(shape)} indices, got {len(idx)}")
    flat, stride, axes, offset = None, 1, [], 0
    for k in reversed(range(len(shape))):
        i, d = idx[k], shape[k]
        e = as_expr(i, T.u32, at)
        if e.type not in (T.u32, T.i32):
            raise type_error(f"an index must be u32 or i32, got {e.type} on axis {k} of "
                             f"`{base.name}`")
        if isinstance(i, int) and isinstance(d, int) and not 0 <= i < d:
            raise type_error(f"index {i} is out of range for axis {k} of `{base.name}` "
                             f"(size {d})")
        e = e if e.type == T.u32 else construct(T.u32, e)
        if isinstance(i, int) and isinstance(stride, int):
            offset += i * stride  # constant parts fold into one number
        else:
            term = e if isinstance(stride, int) and stride == 1 else binary("*", e, stride, at)
            flat = term if flat is None else binary("+", term, flat, at)
        stride = stride * d if isinstance(stride, int) and isinstance(d, int) else \
            binary("*", _size(d, at), stride, at)
        axes.append((e, _size(d, at)))
    flat = as_expr(offset, T.u32, at) if flat is None else binary("+", flat, offset, at)
    return Index(base, flat, base.type.elem, tuple(reversed(axes)), at)


def _size(d, at: tuple | None) -> Expr:
    return as_expr(d, T.u32, at) if isinstance(d, int) else \
        d if d.type == T.u32 else construct(T.u32, d)


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(d) if isinstance(d, int) else d.name for d in shape) + ")"


def index(base: Expr, i) -> Index:
    """``base[i]`` of an array or vector; a constant index is range-checked.
    A shaped array takes one index per axis."""
    shape = getattr(base, "shape", None) if isinstance(base, Ref) else None
    at = user_line()
    if isinstance(i, tuple) or (shape and len(shape) > 1):
        if not (isinstance(base, Ref) and base.shape):
            raise type_error(f"`{getattr(base, 'name', base)}` has no shape: index it with one "
                             f"index (declare it with a shape such as (rows, cols) for x[r, c])")
        return _shaped_index(base, i if isinstance(i, tuple) else (i,), at)
    bt = base.type
    if isinstance(bt, T.Array):
        et = bt.elem
    elif isinstance(bt, T.Vector):
        et = bt.scalar
    else:
        raise type_error(f"cannot index a value of type {bt}")
    idx = as_expr(i, T.u32, at)
    if idx.type not in (T.u32, T.i32):
        raise type_error(f"an index must be u32 or i32, got {idx.type}")
    if isinstance(i, int) and isinstance(bt, T.Array) and bt.length is not None \
            and not 0 <= i < bt.length:
        raise type_error(f"index {i} is out of range for {bt}")
    return Index(base, idx, et, None, at)


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
