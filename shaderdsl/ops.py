"""The operation registry: every operator and builtin function, defined once.

An entry (:class:`Op`) says everything the library knows about an operation:

- its typing rule (``rule``: the arguments as the user gave them -> the
  checked argument expressions and the result type, or a ShaderTypeError
  naming the user's line);
- its WGSL spelling (``wgsl``) and, for infix operators, its precedence
  ``group`` (the emitter parenthesizes from it);
- its meaning on numpy values (``semantics(arg_types, result_type)`` gives
  a function of the argument values), which the interpreter runs and which
  constant evaluation (``shaderdsl.consts``) uses;
- the adapter feature it needs and whether it is a side effect (atomics,
  emitted as a statement) or a subgroup collective (values across lanes).

``shaderdsl.expr`` builds operator nodes from these entries, ``shaderdsl.builtins``
exposes the functions, ``shaderdsl.emit`` prints them, ``shaderdsl.interp``
runs them, ``shaderdsl.names`` reserves their names, and docs/dsl.md's table
of builtins is tested against :data:`BUILTINS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import consts
from . import types as T
from . import values as V
from .literals import as_expr, default_scalar
from .nodes import AddressOf, Expr, Ref, is_assignable, type_error


@dataclass(frozen=True, eq=False)
class Op:
    """One operation. ``form`` is "infix", "prefix", "call", "atomic" or "subgroup"."""

    name: str                       # the DSL's name (registry key)
    wgsl: str                       # WGSL spelling; "{type}" is replaced by the result type
    form: str
    semantics: Callable             # (arg types, result type) -> f(*values)
    rule: Callable | None = None    # calls: (*user args) -> (arg exprs, result type)
    feature: str | None = None
    group: str = ""                 # infix precedence: mul, add, shift, rel, bit, logic
    doc: str = ""

    @property
    def effect(self) -> bool:
        """Atomics change memory: the builder emits them as statements."""
        return self.form == "atomic"

    @property
    def collective(self) -> bool:
        """Subgroup operations combine the values of several invocations."""
        return self.form == "subgroup"

    def spell(self, result_type) -> str:
        return self.wgsl.format(type=result_type) if "{" in self.wgsl else self.wgsl

    def __repr__(self) -> str:
        return f"<Op {self.name} {self.wgsl!r}>"


# ================================================================ operators

def _int_arith(f):
    """Integer semantics: in int64, wrapped to the 32-bit result type."""
    def make(types, rt):
        dt = V.dtype_of(rt)
        return lambda a, b: V.wrap(f(np.asarray(a).astype(V.I64), np.asarray(b).astype(V.I64)), dt)
    return make


def _idiv(x, y):
    """WGSL integer division on int64 values: truncates; x / 0 = x (and, after
    wrapping, i32 MIN / -1 = MIN)."""
    zero = y == 0
    ys = np.where(zero, 1, y)
    q = np.abs(x) // np.abs(ys)
    q = np.where((x < 0) != (ys < 0), -q, q)
    return np.where(zero, x, q)


def _irem(x, y):
    """WGSL integer remainder: sign of x; x % 0 = 0 (and i32 MIN % -1 = 0)."""
    zero = y == 0
    ys = np.where(zero, 1, y)
    q = np.abs(x) // np.abs(ys)
    q = np.where((x < 0) != (ys < 0), -q, q)
    return np.where(zero, 0, x - q * ys)


def _by_kind(int_fn, float_fn, bool_fn=None):
    """Semantics choosing by the scalar type of the first operand."""
    def make(types, rt):
        s = T.scalar_of(types[0])
        if s == T.bool_:
            return bool_fn
        if s.is_int:
            return _int_arith(int_fn)(types, rt)
        return float_fn
    return make


def _plain(f):
    """Semantics that need no types (comparisons, logic)."""
    return lambda types, rt: f


_INFIX = [
    # name, wgsl, group, semantics
    ("add", "+", "add", _by_kind(lambda x, y: x + y, lambda x, y: x + y)),
    ("sub", "-", "add", _by_kind(lambda x, y: x - y, lambda x, y: x - y)),
    ("mul", "*", "mul", _by_kind(lambda x, y: x * y, lambda x, y: x * y)),
    ("div", "/", "mul", _by_kind(_idiv, lambda x, y: x / y)),
    ("rem", "%", "mul", _by_kind(_irem, np.fmod)),
    ("bit_and", "&", "bit", _by_kind(lambda x, y: x & y, None, lambda x, y: x & y)),
    ("bit_or", "|", "bit", _by_kind(lambda x, y: x | y, None, lambda x, y: x | y)),
    ("bit_xor", "^", "bit", _by_kind(lambda x, y: x ^ y, None)),
    # WGSL: a run-time shift amount is taken modulo the bit width (32).
    ("shl", "<<", "shift", _int_arith(lambda x, y: x << (y & 31))),
    ("shr", ">>", "shift", _int_arith(lambda x, y: x >> (y & 31))),
    ("lt", "<", "rel", _plain(lambda x, y: x < y)),
    ("le", "<=", "rel", _plain(lambda x, y: x <= y)),
    ("gt", ">", "rel", _plain(lambda x, y: x > y)),
    ("ge", ">=", "rel", _plain(lambda x, y: x >= y)),
    ("eq", "==", "rel", _plain(lambda x, y: x == y)),
    ("ne", "!=", "rel", _plain(lambda x, y: x != y)),
    # && and || short-circuit: the interpreter evaluates b only when needed.
    ("and", "&&", "logic", _plain(lambda x, y: np.bool_(x and y))),
    ("or", "||", "logic", _plain(lambda x, y: np.bool_(x or y))),
]
INFIX = {wgsl: Op(name, wgsl, "infix", sem, group=group) for name, wgsl, group, sem in _INFIX}


def _negate(types, rt):
    if T.scalar_of(rt).is_int:
        dt = V.dtype_of(rt)
        return lambda a: V.wrap(-np.asarray(a).astype(V.I64), dt)
    return lambda a: -a


def _complement(types, rt):
    dt = V.dtype_of(rt)
    return lambda a: V.wrap(~np.asarray(a).astype(V.I64), dt)


PREFIX = {
    "-": Op("neg", "-", "prefix", _negate),
    "~": Op("complement", "~", "prefix", _complement),
    "!": Op("not", "!", "prefix", _plain(lambda a: V.scalar(np.asarray(np.logical_not(a))))),
}

ARITH = {"+", "-", "*", "/", "//", "%"}
COMPARE = {"<", "<=", ">", ">=", "==", "!="}
BITS = {"&", "|", "^"}
SHIFT = {"<<", ">>"}


def value_type(e: Expr, op: str) -> T.WType:
    """The type of an operand, refusing atomics and arrays."""
    t = e.type
    if isinstance(t, T.Atomic):
        raise type_error(f"cannot use an atomic<{t.scalar}> directly in `{op}`; use atomic_load(...)")
    if not isinstance(t, (T.Scalar, T.Vector)):
        raise type_error(f"operator `{op}` does not apply to {t}")
    return t


def _shift_rule(op, a, b, ta, tb):
    sa = T.scalar_of(ta)
    if not sa.is_int:
        raise type_error(f"`{op}` needs an integer left operand, got {ta}")
    want = T.u32 if isinstance(ta, T.Scalar) else T.Vector(ta.size, T.u32)
    if tb != want:
        raise type_error(f"`{op}` needs a shift amount of type {want}, got {tb}")
    why = consts.refuse_shift(op, a, b, sa)
    if why:
        raise type_error(why)
    return INFIX[op], ta


def _compare_rule(op, ta, tb):
    if ta != tb:
        raise type_error(f"`{op}` needs operands of the same type, got {ta} and {tb}")
    if T.scalar_of(ta) == T.bool_ and op not in ("==", "!="):
        raise type_error(f"`{op}` does not apply to bool")
    return INFIX[op], (T.bool_ if isinstance(ta, T.Scalar) else T.Vector(ta.size, T.bool_))


def _bits_rule(op, ta, tb):
    if ta != tb:
        raise type_error(f"`{op}` needs operands of the same type, got {ta} and {tb}")
    s = T.scalar_of(ta)
    if s == T.bool_:
        if op == "^":
            return INFIX["!="], ta
        if isinstance(ta, T.Scalar):
            return INFIX["&&" if op == "&" else "||"], ta
        return INFIX[op], ta
    if not s.is_int:
        raise type_error(f"`{op}` needs integer or bool operands, got {ta}")
    return INFIX[op], ta


def _arith_rule(op, a, b, ta, tb):
    s = T.scalar_of(ta)
    if not s.is_numeric:
        raise type_error(f"`{op}` does not apply to {ta}")
    if op == "//":
        if not s.is_int:
            raise type_error(f"`//` needs integer operands, got {ta}; use `/` for floats")
        op = "/"
    why = consts.refuse_division(op, a, b, s) if op in ("/", "%") and s.is_int else None
    if why:
        raise type_error(why)
    if ta == tb or (isinstance(ta, T.Vector) and tb == s):
        return INFIX[op], ta
    if isinstance(tb, T.Vector) and ta == T.scalar_of(tb):
        return INFIX[op], tb
    raise type_error(f"`{op}` between {ta} and {tb}: vector sizes differ")


def binary_rule(op: str, a: Expr, b: Expr) -> tuple[Op, T.WType]:
    """The entry and result type of ``a op b`` (Python's operator symbol)."""
    ta, tb = value_type(a, op), value_type(b, op)
    if op in SHIFT:
        return _shift_rule(op, a, b, ta, tb)
    sa, sb = T.scalar_of(ta), T.scalar_of(tb)
    if sa != sb:
        raise type_error(f"`{op}` between {ta} and {tb}: convert one side explicitly, "
                         f"e.g. {sa}(...) or {sb}(...)")
    if op in COMPARE:
        return _compare_rule(op, ta, tb)
    if op in BITS:
        return _bits_rule(op, ta, tb)
    if op in ARITH:
        return _arith_rule(op, a, b, ta, tb)
    raise type_error(f"unknown operator {op!r}")


def unary_rule(op: str, a: Expr) -> tuple[Op, T.WType]:
    """The entry and result type of ``-a`` or ``~a``."""
    t = value_type(a, op)
    s = T.scalar_of(t)
    if op == "-":
        if s not in (T.f32, T.f16, T.i32):
            raise type_error(f"unary minus needs a signed type (f32, f16, i32), got {t}")
        return PREFIX["-"], t
    if op == "~":
        if s == T.bool_:
            return PREFIX["!"], t
        if not s.is_int:
            raise type_error(f"`~` needs an integer or bool operand, got {t}")
        return PREFIX["~"], t
    raise type_error(f"unknown unary operator {op!r}")


# ================================================================ builtin functions

BUILTINS: dict[str, Op] = {}


def _register(op: Op) -> Op:
    assert op.name not in BUILTINS, op.name
    BUILTINS[op.name] = op
    return op


# ---- argument rules

_KINDS = {
    "float": lambda s: s is not None and s.is_float,
    "numeric": lambda s: s is not None and s.is_numeric,
    "signed": lambda s: s in (T.f32, T.f16, T.i32),
    "int": lambda s: s is not None and s.is_int,
    "any": lambda s: s is not None,
}


def unify(fn: str, args) -> tuple[Expr, ...]:
    """The arguments as expressions; Python numbers take the first expression's type."""
    like = next((a.type for a in args if isinstance(a, Expr)), None)
    if like is None:
        like = default_scalar(args[0])
    exprs = tuple(as_expr(a, like) for a in args)
    for e in exprs:
        if isinstance(e.type, T.Atomic):
            raise type_error(f"{fn}() got an atomic; read it with atomic_load(...) first")
    return exprs


def same_type(fn: str, exprs) -> T.WType:
    t = exprs[0].type
    for e in exprs[1:]:
        if e.type != t:
            raise type_error(f"{fn}() needs arguments of one type, got "
                             f"{', '.join(str(x.type) for x in exprs)}")
    return t


def check_kind(fn: str, t: T.WType, kind: str) -> None:
    if not _KINDS[kind](T.scalar_of(t)) or not isinstance(t, (T.Scalar, T.Vector)):
        raise type_error(f"{fn}() does not accept {t} (needs {kind} scalar or vector)")


def _arity(fn: str, args, n: int) -> None:
    if len(args) != n:
        raise type_error(f"{fn}() takes {n} argument(s), got {len(args)}")


def _elementwise_rule(wgsl: str, kind: str, arity: int):
    def rule(*args):
        _arity(wgsl, args, arity)
        exprs = unify(wgsl, args)
        t = same_type(wgsl, exprs)
        check_kind(wgsl, t, kind)
        return exprs, t
    return rule


# ---- numpy semantics of builtins

def _fdot(a, b):
    """Sum of products in the vector's float type, left to right."""
    s = a[0] * b[0]
    for k in range(1, len(a)):
        s = s + a[k] * b[k]
    return s


def _length(v):
    return np.sqrt(_fdot(v, v)) if isinstance(v, np.ndarray) else np.abs(v)


def _float(f):
    """Semantics of a float builtin, given the component dtype: f(dt) -> function."""
    return lambda types, rt: f(V.dtype_of(types[0]).type)


def _smoothstep(dt):
    def f(lo, hi, x):
        t = np.clip((x - lo) / (hi - lo), dt(0), dt(1))
        return V.scalar(np.asarray(t * t * (dt(3) - dt(2) * t)))
    return f


_FLOAT_FUNCTIONS = [
    # dsl name, wgsl, arity, semantics given the dtype's type
    ("sqrt", "sqrt", 1, lambda dt: np.sqrt),
    ("inverse_sqrt", "inverseSqrt", 1, lambda dt: lambda x: dt(1) / np.sqrt(x)),
    ("exp", "exp", 1, lambda dt: np.exp),
    ("exp2", "exp2", 1, lambda dt: np.exp2),
    ("log", "log", 1, lambda dt: np.log),
    ("log2", "log2", 1, lambda dt: np.log2),
    ("sin", "sin", 1, lambda dt: np.sin),
    ("cos", "cos", 1, lambda dt: np.cos),
    ("tan", "tan", 1, lambda dt: np.tan),
    ("tanh", "tanh", 1, lambda dt: np.tanh),
    ("floor", "floor", 1, lambda dt: np.floor),
    ("ceil", "ceil", 1, lambda dt: np.ceil),
    ("round", "round", 1, lambda dt: np.rint),
    ("trunc", "trunc", 1, lambda dt: np.trunc),
    ("fract", "fract", 1, lambda dt: lambda x: x - np.floor(x)),
    ("saturate", "saturate", 1, lambda dt: lambda x: np.clip(x, dt(0), dt(1))),
    ("pow", "pow", 2, lambda dt: np.power),
    ("step", "step", 2, lambda dt: lambda edge, x: V.scalar(
        np.where(x >= edge, dt(1), dt(0)).astype(dt))),
    ("fma", "fma", 3, lambda dt: lambda a, b, c: V.scalar(
        (np.asarray(a, V.F64) * b + np.asarray(c, V.F64)).astype(dt))),
    ("smoothstep", "smoothstep", 3, _smoothstep),
]
for _name, _wgsl, _n, _sem in _FLOAT_FUNCTIONS:
    _register(Op(_name, _wgsl, "call", _float(_sem), _elementwise_rule(_wgsl, "float", _n),
                 doc=f"{_n} argument(s) of one float scalar or vector type"))


def _numeric(int_fn, float_fn):
    """Integer and float semantics of abs/sign/min/max/clamp."""
    def make(types, rt):
        if T.scalar_of(types[0]).is_int:
            return int_fn(V.dtype_of(rt))
        return float_fn
    return make


_register(Op("abs", "abs", "call",
             _numeric(lambda dt: lambda a: V.wrap(np.abs(np.asarray(a).astype(V.I64)), dt), np.abs),
             _elementwise_rule("abs", "numeric", 1)))
_register(Op("sign", "sign", "call", _numeric(lambda dt: np.sign, np.sign),
             _elementwise_rule("sign", "signed", 1)))
_register(Op("min", "min", "call", _numeric(lambda dt: np.minimum, np.fmin),
             _elementwise_rule("min", "numeric", 2)))
_register(Op("max", "max", "call", _numeric(lambda dt: np.maximum, np.fmax),
             _elementwise_rule("max", "numeric", 2)))
_register(Op("clamp", "clamp", "call",
             _numeric(lambda dt: lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
                      lambda x, lo, hi: np.fmin(np.fmax(x, lo), hi)),
             _elementwise_rule("clamp", "numeric", 3)))


def _first_leading_bit(is_signed: bool):
    def f(v):
        if is_signed:
            x = V.signed(v)
            if x in (0, -1):
                return -1
            return (~x).bit_length() - 1 if x < 0 else x.bit_length() - 1
        x = V.bits(v)
        return -1 if x == 0 else x.bit_length() - 1
    return f


def _bit_function(fn):
    """Semantics from a Python-int function of (value, signed?)."""
    return lambda types, rt: V.per_component(fn(T.scalar_of(types[0]) == T.i32), V.dtype_of(rt))


for _name, _wgsl, _fn in (
        ("count_ones", "countOneBits", lambda s: lambda v: bin(V.bits(v)).count("1")),
        ("reverse_bits", "reverseBits", lambda s: lambda v: int(f"{V.bits(v):032b}"[::-1], 2)),
        ("first_leading_bit", "firstLeadingBit", _first_leading_bit),
        ("first_trailing_bit", "firstTrailingBit",
         lambda s: lambda v: -1 if V.bits(v) == 0 else (V.bits(v) & -V.bits(v)).bit_length() - 1)):
    _register(Op(_name, _wgsl, "call", _bit_function(_fn), _elementwise_rule(_wgsl, "int", 1)))


# ---- vectors, selection, bits of other types

def _normalize_rule(v):
    (v,) = unify("normalize", (v,))
    if not (isinstance(v.type, T.Vector) and v.type.scalar.is_float):
        raise type_error(f"normalize() needs a float vector, got {v.type}")
    return (v,), v.type


def _mix_rule(a, b, t):
    a, b = unify("mix", (a, b))
    ty = same_type("mix", (a, b))
    check_kind("mix", ty, "float")
    t = as_expr(t, ty)
    if t.type not in (ty, T.scalar_of(ty)):
        raise type_error(f"mix() blend factor must be {ty} or {T.scalar_of(ty)}, got {t.type}")
    return (a, b, t), ty


def _dot_rule(a, b):
    a, b = unify("dot", (a, b))
    t = same_type("dot", (a, b))
    if not isinstance(t, T.Vector) or not t.scalar.is_numeric:
        raise type_error(f"dot() needs two numeric vectors of one type, got {a.type} and {b.type}")
    return (a, b), t.scalar


def _dot(types, rt):
    if T.scalar_of(rt).is_float:
        return _fdot
    dt = V.dtype_of(rt)
    return lambda a, b: V.wrap(np.sum(a.astype(V.I64) * b.astype(V.I64)), dt)


def _length_rule(v):
    (v,) = unify("length", (v,))
    check_kind("length", v.type, "float")
    return (v,), T.scalar_of(v.type)


def _distance_rule(a, b):
    a, b = unify("distance", (a, b))
    t = same_type("distance", (a, b))
    check_kind("distance", t, "float")
    return (a, b), T.scalar_of(t)


def _cross_rule(a, b):
    a, b = unify("cross", (a, b))
    t = same_type("cross", (a, b))
    if not (isinstance(t, T.Vector) and t.size == 3 and t.scalar.is_float):
        raise type_error(f"cross() needs two vec3 of a float type, got {t}")
    return (a, b), t


def _select_rule(if_false, if_true, cond):
    f, t = unify("select", (if_false, if_true))
    ty = same_type("select", (f, t))
    c = as_expr(cond, T.bool_)
    want = T.bool_ if isinstance(ty, T.Scalar) else T.Vector(ty.size, T.bool_)
    if c.type != want and c.type != T.bool_:
        raise type_error(f"select() condition must be {want}, got {c.type}")
    return (f, t, c), ty


def _select(types, rt):
    if isinstance(rt, T.Vector):
        dt = V.dtype_of(rt)
        return lambda f, t, c: np.where(c, t, f).astype(dt)
    return lambda f, t, c: t if c else f


def _bool_test_rule(name: str):
    def rule(v):
        v = as_expr(v, T.bool_)
        if T.scalar_of(v.type) != T.bool_:
            raise type_error(f"{name}() needs bool or vecN<bool>, got {v.type}")
        return (v,), T.bool_
    return rule


def _array_length_rule(buffer):
    if not (isinstance(buffer, Ref) and buffer.kind == "buffer"
            and isinstance(buffer.type, T.Array) and buffer.type.length is None):
        raise type_error("array_length() needs a runtime-sized storage buffer")
    return (AddressOf(buffer),), T.u32


def _bitcast(types, rt):
    dt = V.dtype_of(rt)
    if isinstance(rt, T.Vector):
        return lambda a: np.ascontiguousarray(a).view(dt).copy()
    return lambda a: np.ascontiguousarray(a).reshape(-1).view(dt)[0]


_register(Op("normalize", "normalize", "call",
             _float(lambda dt: lambda v: v / _length(v)), _normalize_rule))
_register(Op("mix", "mix", "call", _float(lambda dt: lambda a, b, t: a * (dt(1) - t) + b * t),
             _mix_rule))
_register(Op("dot", "dot", "call", _dot, _dot_rule))
_register(Op("length", "length", "call", _float(lambda dt: _length), _length_rule))
_register(Op("distance", "distance", "call", _float(lambda dt: lambda a, b: _length(a - b)),
             _distance_rule))
_register(Op("cross", "cross", "call",
             lambda types, rt: lambda a, b: np.cross(a, b).astype(V.dtype_of(rt)), _cross_rule))
_register(Op("select", "select", "call", _select, _select_rule))
_register(Op("all_", "all", "call", _plain(lambda v: np.bool_(np.all(v))), _bool_test_rule("all")))
_register(Op("any_", "any", "call", _plain(lambda v: np.bool_(np.any(v))), _bool_test_rule("any")))
_register(Op("array_length", "arrayLength", "call", _plain(lambda buf: np.uint32(len(buf))),
             _array_length_rule))


def _bitcast_rule(t, x):
    x = as_expr(x)
    if T.size_and_align(t)[0] != T.size_and_align(x.type)[0]:
        raise type_error(f"bitcast from {x.type} to {t}: sizes differ")
    return (x,), t


# bitcast<T>(x) and the constructors T(...) are spelled by their result type.
_register(Op("bitcast", "bitcast<{type}>", "call", _bitcast, _bitcast_rule,
             doc="(T, x): reinterpret the bits of x as type T (same size)"))


def _construct(types, rt):
    """T(x) conversion, vecN(x) splat, vecN(v) conversion or vecN(a, b, ...)."""
    dst = T.scalar_of(rt)
    if isinstance(rt, T.Scalar):
        return V.convert(types[0], rt)
    dt = V.dtype_of(rt)
    if len(types) == 1:
        if isinstance(types[0], T.Vector):
            conv = V.convert(types[0].scalar, dst)
            return lambda a: np.asarray(conv(a), dt)
        return lambda a: np.full(rt.size, a, dt)
    if all(isinstance(t, T.Scalar) for t in types):
        return lambda *xs: np.array(xs, dt)
    return lambda *xs: np.concatenate([np.atleast_1d(x) for x in xs]).astype(dt)


CONSTRUCT = Op("construct", "{type}", "call", _construct,
               doc="type constructors and conversions: f32(x), vec4f(a, b, c, d)")


# ---- atomics: side effects on an atomic location, emitted as statements

def _atomic_rule(wgsl: str, n_values: int, returns: bool = True):
    def rule(target, *values):
        if len(values) != n_values:
            raise type_error(f"{wgsl}() takes {n_values + 1} argument(s), got {len(values) + 1}")
        if not isinstance(target, Expr) or not isinstance(target.type, T.Atomic):
            got = target.type if isinstance(target, Expr) else type(target).__name__
            raise type_error(f"{wgsl}() needs an atomic<u32|i32> location such as hist[i], got {got}")
        if not is_assignable(target):
            raise type_error(f"{wgsl}() target must be in a read_write buffer or workgroup array")
        s = target.type.scalar
        args = (AddressOf(target),) + tuple(as_expr(v, s) for v in values)
        for v in args[1:]:
            if v.type != s:
                raise type_error(f"{wgsl}() value must be {s}, got {v.type}")
        return args, (s if returns else None)
    return rule


def _update(new):
    """Semantics of an atomic: (old, value) -> the value stored, from new(scalar type)."""
    return lambda types, rt: new(types[0].scalar)


def _infix(symbol):
    """The semantics of an infix operator on two values of one type t: t -> f."""
    return lambda t: INFIX[symbol].semantics((t, t), t)


for _name, _wgsl, _new in (
        ("atomic_add", "atomicAdd", _infix("+")),
        ("atomic_sub", "atomicSub", _infix("-")),
        ("atomic_max", "atomicMax", lambda s: np.maximum),
        ("atomic_min", "atomicMin", lambda s: np.minimum),
        ("atomic_and", "atomicAnd", _infix("&")),
        ("atomic_or", "atomicOr", _infix("|")),
        ("atomic_xor", "atomicXor", _infix("^")),
        ("atomic_exchange", "atomicExchange", lambda s: lambda old, v: v)):
    _register(Op(_name, _wgsl, "atomic", _update(_new), _atomic_rule(_wgsl, 1),
                 doc="(target, value): returns the old value"))
_register(Op("atomic_load", "atomicLoad", "atomic", lambda types, rt: lambda old: old,
             _atomic_rule("atomicLoad", 0)))
_register(Op("atomic_store", "atomicStore", "atomic", lambda types, rt: lambda old, v: v,
             _atomic_rule("atomicStore", 1, returns=False)))


# ---- subgroups: semantics over the lanes that take part
#
# A collective's semantics(types, rt) gives f(lanes, args) -> one result per
# lane, where ``lanes`` are the subgroup_invocation_ids (sorted) of the
# invocations that reached the call together and ``args[k]`` lane k's arguments.

def _fold(combine, scan=None):
    """A reduction (every lane gets the total) or an inclusive/exclusive scan,
    with ``combine(rt)`` giving the binary function."""
    def make(types, rt):
        op = combine(rt)

        def f(lanes, args):
            values = [a[0] for a in args]
            if scan is None:
                total = values[0]
                for v in values[1:]:
                    total = op(total, v)
                return [V.copy(total) for _ in lanes]
            out, acc = [], V.zero_value(rt)
            for v in values:
                if scan == "exclusive":
                    out.append(V.copy(acc))
                acc = op(acc, v)
                if scan == "inclusive":
                    out.append(V.copy(acc))
            return out
        return f
    return make


def _extreme(which):
    def combine(rt):
        if T.scalar_of(rt).is_float:
            return np.fmax if which == "max" else np.fmin
        return np.maximum if which == "max" else np.minimum
    return combine


def _lane_read(source):
    """subgroupShuffle and friends: each lane reads lane source(lane, x). Reading
    a lane that is not active is undefined in WGSL; the interpreter returns the
    reader's own value."""
    def make(types, rt):
        def f(lanes, args):
            by_lane = {lane: a[0] for lane, a in zip(lanes, args)}
            return [V.copy(by_lane.get(source(lane, int(a[1]) if len(a) > 1 else 0), a[0]))
                    for lane, a in zip(lanes, args)]
        return f
    return make


def _ballot(types, rt):
    def f(lanes, args):
        mask = np.zeros(4, np.uint32)
        for lane, a in zip(lanes, args):
            if bool(a[0]):
                mask[lane // 32] |= np.uint32(1 << (lane % 32))
        return [mask.copy() for _ in lanes]
    return f


def _vote(test):
    return lambda types, rt: lambda lanes, args: [np.bool_(test(bool(a[0]) for a in args))] * len(lanes)


def _subgroup_rule(wgsl: str, kind: str):
    def rule(value):
        (e,) = unify(wgsl, (value,))
        check_kind(wgsl, e.type, kind)
        return (e,), e.type
    return rule


def _subgroup_lane_rule(wgsl: str, const_lane: bool = False):
    def rule(value, lane):
        (e,) = unify(wgsl, (value,))
        check_kind(wgsl, e.type, "any")
        if const_lane and isinstance(lane, Expr):
            raise type_error(f"{wgsl}() needs a constant lane (a Python int)")
        lane = as_expr(lane, T.u32)
        if lane.type != T.u32:
            raise type_error(f"{wgsl}() lane must be u32, got {lane.type}")
        return (e, lane), e.type
    return rule


def _subgroup_bool_rule(wgsl: str, result):
    def rule(cond):
        c = as_expr(cond, T.bool_)
        if c.type != T.bool_:
            raise type_error(f"{wgsl}() needs bool, got {c.type}")
        return (c,), result
    return rule


def _subgroup(name, wgsl, semantics, rule):
    _register(Op(name, wgsl, "subgroup", semantics, rule, feature="subgroup"))


for _name, _wgsl, _kind, _combine, _scan in (
        ("subgroup_add", "subgroupAdd", "numeric", _infix("+"), None),
        ("subgroup_mul", "subgroupMul", "numeric", _infix("*"), None),
        ("subgroup_max", "subgroupMax", "numeric", _extreme("max"), None),
        ("subgroup_min", "subgroupMin", "numeric", _extreme("min"), None),
        ("subgroup_and", "subgroupAnd", "int", _infix("&"), None),
        ("subgroup_or", "subgroupOr", "int", _infix("|"), None),
        ("subgroup_xor", "subgroupXor", "int", _infix("^"), None),
        ("subgroup_inclusive_add", "subgroupInclusiveAdd", "numeric", _infix("+"), "inclusive"),
        ("subgroup_exclusive_add", "subgroupExclusiveAdd", "numeric", _infix("+"), "exclusive")):
    _subgroup(_name, _wgsl, _fold(_combine, _scan), _subgroup_rule(_wgsl, _kind))
_subgroup("subgroup_broadcast_first", "subgroupBroadcastFirst",
          _plain(lambda lanes, args: [V.copy(args[0][0]) for _ in lanes]),
          _subgroup_rule("subgroupBroadcastFirst", "any"))
for _name, _wgsl, _source in (
        ("subgroup_broadcast", "subgroupBroadcast", lambda lane, x: x),
        ("subgroup_shuffle", "subgroupShuffle", lambda lane, x: x),
        ("subgroup_shuffle_xor", "subgroupShuffleXor", lambda lane, x: lane ^ x),
        ("subgroup_shuffle_up", "subgroupShuffleUp", lambda lane, x: lane - x),
        ("subgroup_shuffle_down", "subgroupShuffleDown", lambda lane, x: lane + x)):
    _subgroup(_name, _wgsl, _lane_read(_source),
              _subgroup_lane_rule(_wgsl, const_lane=_name == "subgroup_broadcast"))
_subgroup("subgroup_all", "subgroupAll", _vote(all), _subgroup_bool_rule("subgroupAll", T.bool_))
_subgroup("subgroup_any", "subgroupAny", _vote(any), _subgroup_bool_rule("subgroupAny", T.bool_))
_subgroup("subgroup_ballot", "subgroupBallot", _ballot,
          _subgroup_bool_rule("subgroupBallot", T.vec4u))


def spellings() -> frozenset[str]:
    """The WGSL function names the registry uses (names.py reserves them)."""
    return frozenset(op.wgsl for op in BUILTINS.values() if "{" not in op.wgsl)
