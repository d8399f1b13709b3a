"""The operation registry's builtin functions: one entry each, defined once.

Each entry (``shaderdsl.operators.Op``, the type the operators' entries
share) says everything the library knows about a builtin function:

- its typing rule (``rule``: the arguments as the user gave them -> the
  checked argument expressions and the result type, or a ShaderTypeError
  naming the user's line);
- its WGSL spelling (``wgsl``);
- its meaning on numpy values (``semantics(arg_types, result_type)`` gives
  a function of the argument values), which the interpreter runs;
- the adapter feature it needs and whether it is a side effect (atomics,
  emitted as a statement) or a subgroup collective (values across lanes).

``shaderdsl.builtins`` exposes the functions, ``shaderdsl.emit`` prints
them, ``shaderdsl.interp`` runs them, ``shaderdsl.names`` reserves their
names, and docs/dsl.md's table of builtins is tested against
:data:`BUILTINS`. Python's operators and the type constructors are entries of
``shaderdsl.operators``.
"""
from __future__ import annotations

import numpy as np

from . import types as T
from . import values as V
from .context import type_error
from .errors import InterpreterError, OutOfBoundsError
from .expr import AddressOf, Expr, Ref, RefKind, as_expr, is_assignable
from .literals import default_scalar
from .operators import INFIX, Access, Form, Op, plain

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


def _elementwise_rule(fn: str, kind: str, params: tuple[str, ...]):
    def rule(*args):
        _arity(fn, args, len(params))
        exprs = unify(fn, args)
        t = same_type(fn, exprs)
        check_kind(fn, t, kind)
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
    # dsl name, wgsl, argument names, semantics given the dtype's type
    ("sqrt", "sqrt", ("x",), lambda dt: np.sqrt),
    ("inverse_sqrt", "inverseSqrt", ("x",), lambda dt: lambda x: dt(1) / np.sqrt(x)),
    ("exp", "exp", ("x",), lambda dt: np.exp),
    ("exp2", "exp2", ("x",), lambda dt: np.exp2),
    ("log", "log", ("x",), lambda dt: np.log),
    ("log2", "log2", ("x",), lambda dt: np.log2),
    ("sin", "sin", ("x",), lambda dt: np.sin),
    ("cos", "cos", ("x",), lambda dt: np.cos),
    ("tan", "tan", ("x",), lambda dt: np.tan),
    ("tanh", "tanh", ("x",), lambda dt: np.tanh),
    ("floor", "floor", ("x",), lambda dt: np.floor),
    ("ceil", "ceil", ("x",), lambda dt: np.ceil),
    ("round", "round", ("x",), lambda dt: np.rint),
    ("trunc", "trunc", ("x",), lambda dt: np.trunc),
    ("fract", "fract", ("x",), lambda dt: lambda x: x - np.floor(x)),
    ("saturate", "saturate", ("x",), lambda dt: lambda x: np.clip(x, dt(0), dt(1))),
    ("pow", "pow", ("x", "y"), lambda dt: np.power),
    ("step", "step", ("edge", "x"), lambda dt: lambda edge, x: V.scalar(
        np.where(x >= edge, dt(1), dt(0)).astype(dt))),
    ("fma", "fma", ("a", "b", "c"), lambda dt: lambda a, b, c: V.scalar(
        (np.asarray(a, V.F64) * b + np.asarray(c, V.F64)).astype(dt))),
    ("smoothstep", "smoothstep", ("low", "high", "x"), _smoothstep),
]
for _name, _wgsl, _params, _sem in _FLOAT_FUNCTIONS:
    _register(Op(_name, _wgsl, Form.CALL, _float(_sem), _elementwise_rule(_name, "float", _params),
                 doc=f"{len(_params)} argument(s) of one float scalar or vector type",
                 params=_params))


def _numeric(int_fn, float_fn):
    """Integer and float semantics of abs/sign/min/max/clamp."""
    def make(types, rt):
        if T.component(types[0]).is_int:
            return int_fn(V.dtype_of(rt))
        return float_fn
    return make


_register(Op("abs", "abs", Form.CALL,
             _numeric(lambda dt: lambda a: V.wrap(np.abs(np.asarray(a).astype(V.I64)), dt), np.abs),
             _elementwise_rule("abs", "numeric", ("x",)), params=("x",)))
_register(Op("sign", "sign", Form.CALL, _numeric(lambda dt: np.sign, np.sign),
             _elementwise_rule("sign", "signed", ("x",)), params=("x",)))
_register(Op("min", "min", Form.CALL, _numeric(lambda dt: np.minimum, np.fmin),
             _elementwise_rule("min", "numeric", ("a", "b")), params=("a", "b")))
_register(Op("max", "max", Form.CALL, _numeric(lambda dt: np.maximum, np.fmax),
             _elementwise_rule("max", "numeric", ("a", "b")), params=("a", "b")))
_register(Op("clamp", "clamp", Form.CALL,
             _numeric(lambda dt: lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
                      lambda x, lo, hi: np.fmin(np.fmax(x, lo), hi)),
             _elementwise_rule("clamp", "numeric", ("x", "low", "high")),
             params=("x", "low", "high")))


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
    _register(Op(_name, _wgsl, Form.CALL, _bit_function(_fn),
                 _elementwise_rule(_name, "int", ("x",)), params=("x",)))


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
    if T.component(rt).is_float:
        return _fdot
    dt = V.dtype_of(rt)
    return lambda a, b: V.wrap(np.sum(a.astype(V.I64) * b.astype(V.I64)), dt)


def _length_rule(v):
    (v,) = unify("length", (v,))
    check_kind("length", v.type, "float")
    return (v,), T.component(v.type)


def _distance_rule(a, b):
    a, b = unify("distance", (a, b))
    t = same_type("distance", (a, b))
    check_kind("distance", t, "float")
    return (a, b), T.component(t)


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
    want = T.Vector(ty.size, T.bool_) if isinstance(ty, T.Vector) else T.bool_
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
    if not (isinstance(buffer, Ref) and buffer.kind == RefKind.BUFFER
            and isinstance(buffer.type, T.Array) and buffer.type.length is None):
        raise type_error("array_length() needs a runtime-sized storage buffer")
    return (AddressOf(buffer),), T.u32


def _bitcast(types, rt):
    dt = V.dtype_of(rt)
    if isinstance(rt, T.Vector):
        return lambda a: np.ascontiguousarray(a).view(dt).copy()
    return lambda a: np.ascontiguousarray(a).reshape(-1).view(dt)[0]


_register(Op("normalize", "normalize", Form.CALL,
             _float(lambda dt: lambda v: v / _length(v)), _normalize_rule))
_register(Op("mix", "mix", Form.CALL, _float(lambda dt: lambda a, b, t: a * (dt(1) - t) + b * t),
             _mix_rule))
_register(Op("dot", "dot", Form.CALL, _dot, _dot_rule))
_register(Op("length", "length", Form.CALL, _float(lambda dt: _length), _length_rule))
_register(Op("distance", "distance", Form.CALL, _float(lambda dt: lambda a, b: _length(a - b)),
             _distance_rule))
_register(Op("cross", "cross", Form.CALL,
             lambda types, rt: lambda a, b: np.cross(a, b).astype(V.dtype_of(rt)), _cross_rule))
_register(Op("select", "select", Form.CALL, _select, _select_rule))
_register(Op("all_", "all", Form.CALL, plain(lambda v: np.bool_(np.all(v))),
             _bool_test_rule("all_")))
_register(Op("any_", "any", Form.CALL, plain(lambda v: np.bool_(np.any(v))),
             _bool_test_rule("any_")))
_register(Op("array_length", "arrayLength", Form.CALL, plain(lambda buf: np.uint32(len(buf))),
             _array_length_rule))


def _bitcast_rule(t: T.WType, x):
    x = as_expr(x)
    if T.size_and_align(t)[0] != T.size_and_align(x.type)[0]:
        raise type_error(f"bitcast from {x.type} to {t}: sizes differ")
    return (x,), t


# bitcast<T>(x) and the constructors T(...) are spelled by their result type.
_register(Op("bitcast", "bitcast<{type}>", Form.CALL, _bitcast, _bitcast_rule,
             doc="(T, x): reinterpret the bits of x as type T (same size)"))


# ---- packing: 8-bit integers four to a u32 (WGSL language extension
# packed_4x8_integer_dot_product), and normalized or half floats in a u32.
# Field i of a packed u32 is bits width*i .. width*i + width-1.

def _fixed_rule(fn: str, params: tuple, result):
    """Arguments of exactly the types ``params``; Python numbers take them."""
    def rule(*args):
        _arity(fn, args, len(params))
        exprs = tuple(as_expr(a, t) for a, t in zip(args, params))
        if any(e.type != t for e, t in zip(exprs, params)):
            raise type_error(f"{fn}() needs ({', '.join(map(str, params))}), got "
                             f"({', '.join(str(e.type) for e in exprs)})")
        return exprs, result
    return rule


def unpack_fields(x, count: int, width: int, signed: bool = False) -> np.ndarray:
    """The ``count`` fields of ``width`` bits of a u32, lowest first, as int64
    (two's complement fields sign-extended when ``signed``)."""
    f = (np.int64(V.bits(x)) >> (np.arange(count, dtype=V.I64) * width)) & ((1 << width) - 1)
    return np.where(f >> (width - 1) != 0, f - (1 << width), f) if signed else f


def pack_fields(fields, width: int) -> np.uint32:
    """The low ``width`` bits of each integer field, field i at bits width*i."""
    f = np.asarray(fields).astype(V.I64) & ((1 << width) - 1)
    return np.uint32(int(np.sum(f << (np.arange(f.size, dtype=V.I64) * width))))


def _norm_fields(scale: int, low: float):
    """pack*norm: floor(0.5 + scale * min(1, max(low, e))) of the exact product
    (in float64 an f32 times these scales is exact, and 0.5 + x only rounds far
    from an integer). max/min are the WGSL builtins: a NaN becomes ``low``."""
    def f(v):
        e = np.fmin(1.0, np.fmax(low, np.asarray(v, V.F64)))
        return np.floor(0.5 + scale * e).astype(V.I64)
    return f


def _unnorm(scale: int, signed: bool, count: int, width: int):
    """unpack*norm: max(v / scale, -1) for signed fields, v / scale for unsigned,
    rounded once to f32 (float64 holds v / scale closely enough: see tests)."""
    def f(x):
        q = unpack_fields(x, count, width, signed) / scale
        return np.maximum(q, -1.0).astype(np.float32)
    return f


def _pack_half(v):
    """pack2x16float: each f32 rounded to the nearest f16 (ties to even)."""
    with np.errstate(over="ignore"):
        h = np.asarray(v, np.float32).astype(np.float16)
    return pack_fields(h.view(np.uint16), 16)


def _unpack_half(x):
    return unpack_fields(x, 2, 16).astype(np.uint16).view(np.float16).astype(np.float32)


def _dot4(signed: bool):
    dt = np.int32 if signed else np.uint32
    return lambda a, b: dt(np.sum(unpack_fields(a, 4, 8, signed) * unpack_fields(b, 4, 8, signed)))


_PACKING = [
    # dsl name, wgsl, parameter types, result type, function of the values
    ("dot4_i8_packed", "dot4I8Packed", (T.u32, T.u32), T.i32, _dot4(True)),
    ("dot4_u8_packed", "dot4U8Packed", (T.u32, T.u32), T.u32, _dot4(False)),
    ("pack4x_i8", "pack4xI8", (T.vec4i,), T.u32, lambda v: pack_fields(v, 8)),
    ("pack4x_u8", "pack4xU8", (T.vec4u,), T.u32, lambda v: pack_fields(v, 8)),
    ("pack4x_i8_clamp", "pack4xI8Clamp", (T.vec4i,), T.u32,
     lambda v: pack_fields(np.clip(v.astype(V.I64), -128, 127), 8)),
    ("pack4x_u8_clamp", "pack4xU8Clamp", (T.vec4u,), T.u32,
     lambda v: pack_fields(np.minimum(v.astype(V.I64), 255), 8)),
    ("unpack4x_i8", "unpack4xI8", (T.u32,), T.vec4i,
     lambda x: unpack_fields(x, 4, 8, True).astype(np.int32)),
    ("unpack4x_u8", "unpack4xU8", (T.u32,), T.vec4u,
     lambda x: unpack_fields(x, 4, 8).astype(np.uint32)),
    ("pack4x8snorm", "pack4x8snorm", (T.vec4f,), T.u32,
     lambda v: pack_fields(_norm_fields(127, -1.0)(v), 8)),
    ("pack4x8unorm", "pack4x8unorm", (T.vec4f,), T.u32,
     lambda v: pack_fields(_norm_fields(255, 0.0)(v), 8)),
    ("pack2x16snorm", "pack2x16snorm", (T.vec2f,), T.u32,
     lambda v: pack_fields(_norm_fields(32767, -1.0)(v), 16)),
    ("pack2x16unorm", "pack2x16unorm", (T.vec2f,), T.u32,
     lambda v: pack_fields(_norm_fields(65535, 0.0)(v), 16)),
    ("pack2x16float", "pack2x16float", (T.vec2f,), T.u32, _pack_half),
    ("unpack4x8snorm", "unpack4x8snorm", (T.u32,), T.vec4f, _unnorm(127, True, 4, 8)),
    ("unpack4x8unorm", "unpack4x8unorm", (T.u32,), T.vec4f, _unnorm(255, False, 4, 8)),
    ("unpack2x16snorm", "unpack2x16snorm", (T.u32,), T.vec2f, _unnorm(32767, True, 2, 16)),
    ("unpack2x16unorm", "unpack2x16unorm", (T.u32,), T.vec2f, _unnorm(65535, False, 2, 16)),
    ("unpack2x16float", "unpack2x16float", (T.u32,), T.vec2f, _unpack_half),
]
for _name, _wgsl, _params, _result, _fn in _PACKING:
    _register(Op(_name, _wgsl, Form.CALL, plain(_fn), _fixed_rule(_name, _params, _result),
                 doc=f"({', '.join(map(str, _params))}) -> {_result}",
                 params=("a", "b") if len(_params) == 2 else ("x",)))


# ---- atomics: side effects on an atomic location, emitted as statements

def _atomic_rule(fn: str, n_values: int):
    def rule(target, *values):
        if len(values) != n_values:
            raise type_error(f"{fn}() takes {n_values + 1} argument(s), got {len(values) + 1}")
        if not isinstance(target, Expr) or not isinstance(target.type, T.Atomic):
            got = target.type if isinstance(target, Expr) else type(target).__name__
            raise type_error(f"{fn}() needs an atomic<u32|i32> location such as hist[i], got {got}")
        if not is_assignable(target):
            raise type_error(f"{fn}() target must be in a read_write buffer or workgroup array")
        s = target.type.scalar
        args = (AddressOf(target),) + tuple(as_expr(v, s) for v in values)
        for v in args[1:]:
            if v.type != s:
                raise type_error(f"{fn}() value must be {s}, got {v.type}")
        return args, s
    return rule


def _update(new):
    """Semantics of an atomic: (old, value) -> the value stored, from new(scalar type)."""
    return lambda types, rt: new(types[0].scalar)


def _infix(name):
    """The semantics of an infix operator on two values of one type t: t -> f."""
    return lambda t: INFIX[name].semantics((t, t), t)


for _name, _wgsl, _new in (
        ("atomic_add", "atomicAdd", _infix("add")),
        ("atomic_sub", "atomicSub", _infix("sub")),
        ("atomic_max", "atomicMax", lambda s: np.maximum),
        ("atomic_min", "atomicMin", lambda s: np.minimum),
        ("atomic_and", "atomicAnd", _infix("bit_and")),
        ("atomic_or", "atomicOr", _infix("bit_or")),
        ("atomic_xor", "atomicXor", _infix("bit_xor")),
        ("atomic_exchange", "atomicExchange", lambda s: lambda old, v: v)):
    _register(Op(_name, _wgsl, Form.ATOMIC, _update(_new), _atomic_rule(_name, 1),
                 doc="(target, value): returns the old value", params=("target", "value")))
_register(Op("atomic_load", "atomicLoad", Form.ATOMIC, lambda types, rt: lambda old: old,
             _atomic_rule("atomic_load", 0), params=("target",), access=Access.READ))
_register(Op("atomic_store", "atomicStore", Form.ATOMIC, lambda types, rt: lambda old, v: v,
             _atomic_rule("atomic_store", 1), params=("target", "value"), void=True,
             access=Access.WRITE))


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
        if T.component(rt).is_float:
            return np.fmax if which == "max" else np.fmin
        return np.maximum if which == "max" else np.minimum
    return combine


# What a read of a subgroup lane that is not active gives (an indeterminate
# value in WGSL): the interpreter's scheduler fills it (interp.schedule.LaneReads).
INACTIVE_LANE = object()


def _lane_read(source):
    """subgroupShuffle and friends: each lane reads lane source(lane, x), or
    INACTIVE_LANE where that lane is not active or does not exist."""
    def make(types, rt):
        def f(lanes, args):
            by_lane = {lane: a[0] for lane, a in zip(lanes, args)}
            read = (by_lane.get(source(lane, int(a[1]) if len(a) > 1 else 0))
                    for lane, a in zip(lanes, args))
            return [INACTIVE_LANE if v is None else V.copy(v) for v in read]
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
    """subgroupAll/Any: every lane gets test(the lanes' conditions)."""
    def make(types, rt):
        return lambda lanes, args: [np.bool_(test(bool(a[0]) for a in args))] * len(lanes)
    return make


def _subgroup_rule(fn: str, kind: str):
    def rule(value):
        (e,) = unify(fn, (value,))
        check_kind(fn, e.type, kind)
        return (e,), e.type
    return rule


def _subgroup_lane_rule(fn: str, const_lane: bool = False):
    def rule(value, lane):
        (e,) = unify(fn, (value,))
        check_kind(fn, e.type, "any")
        if const_lane and isinstance(lane, Expr):
            raise type_error(f"{fn}() needs a constant lane (a Python int)")
        lane = as_expr(lane, T.u32)
        if lane.type != T.u32:
            raise type_error(f"{fn}() lane must be u32, got {lane.type}")
        return (e, lane), e.type
    return rule


def _subgroup_bool_rule(fn: str, result):
    def rule(cond):
        c = as_expr(cond, T.bool_)
        if c.type != T.bool_:
            raise type_error(f"{fn}() needs bool, got {c.type}")
        return (c,), result
    return rule


def _subgroup(name, wgsl, semantics, rule, uniform_args=()):
    _register(Op(name, wgsl, Form.SUBGROUP, semantics, rule, feature="subgroup",
                 uniform_args=uniform_args))


for _name, _wgsl, _kind, _combine, _scan in (
        ("subgroup_add", "subgroupAdd", "numeric", _infix("add"), None),
        ("subgroup_mul", "subgroupMul", "numeric", _infix("mul"), None),
        ("subgroup_max", "subgroupMax", "numeric", _extreme("max"), None),
        ("subgroup_min", "subgroupMin", "numeric", _extreme("min"), None),
        ("subgroup_and", "subgroupAnd", "int", _infix("bit_and"), None),
        ("subgroup_or", "subgroupOr", "int", _infix("bit_or"), None),
        ("subgroup_xor", "subgroupXor", "int", _infix("bit_xor"), None),
        ("subgroup_inclusive_add", "subgroupInclusiveAdd", "numeric", _infix("add"), "inclusive"),
        ("subgroup_exclusive_add", "subgroupExclusiveAdd", "numeric", _infix("add"), "exclusive")):
    _subgroup(_name, _wgsl, _fold(_combine, _scan), _subgroup_rule(_name, _kind))
_subgroup("subgroup_broadcast_first", "subgroupBroadcastFirst",
          plain(lambda lanes, args: [V.copy(args[0][0]) for _ in lanes]),
          _subgroup_rule("subgroup_broadcast_first", "any"))
for _name, _wgsl, _source in (
        ("subgroup_broadcast", "subgroupBroadcast", lambda lane, x: x),
        ("subgroup_shuffle", "subgroupShuffle", lambda lane, x: x),
        ("subgroup_shuffle_xor", "subgroupShuffleXor", lambda lane, x: lane ^ x),
        ("subgroup_shuffle_up", "subgroupShuffleUp", lambda lane, x: lane - x),
        ("subgroup_shuffle_down", "subgroupShuffleDown", lambda lane, x: lane + x)):
    _subgroup(_name, _wgsl, _lane_read(_source),  # WGSL: a delta or mask must be uniform
              _subgroup_lane_rule(_name, const_lane=_name == "subgroup_broadcast"),
              uniform_args=(1,) if _name.startswith("subgroup_shuffle_") else ())
_subgroup("subgroup_all", "subgroupAll", _vote(all), _subgroup_bool_rule("subgroup_all", T.bool_))
_subgroup("subgroup_any", "subgroupAny", _vote(any), _subgroup_bool_rule("subgroup_any", T.bool_))
_subgroup("subgroup_ballot", "subgroupBallot", _ballot,
          _subgroup_bool_rule("subgroup_ballot", T.vec4u))


# ---- subgroup matrices (Dawn's chromium_experimental_subgroup_matrix)
#
# A subgroup matrix belongs to the subgroup: every lane holds a part and the
# builtins are collectives that all lanes reach together with the same
# arguments. The interpreter gives every lane the whole matrix (a (rows, cols)
# numpy array) and checks that the lanes' arguments agree.

SUBGROUP_MATRIX = T.SUBGROUP_MATRIX_FEATURE
_STORED_AS = {"i8": T.i32, "u8": T.u32}  # 8-bit components: four to an array element


def _matrix(fn: str, m, kind: T.MatrixKind | None = None) -> T.SubgroupMatrix:
    t = m if isinstance(m, T.SubgroupMatrix) else getattr(m, "type", None)
    if not isinstance(t, T.SubgroupMatrix) or (kind and t.kind != kind):
        got = m if isinstance(m, T.WType) else getattr(m, "type", type(m).__name__)
        raise type_error(f"{fn}() needs a subgroup_matrix_{kind or '*'}, got {got}")
    return t


def _matrix_array(fn: str, mt: T.SubgroupMatrix, array, store: bool) -> AddressOf:
    """``&array``: a whole storage buffer or workgroup array of the matrix's
    component type (i32/u32 holding four i8/u8 each), writable for a store."""
    want = _STORED_AS.get(mt.component) or T.SCALARS[mt.component]
    if not (isinstance(array, Ref) and array.kind in (RefKind.BUFFER, RefKind.WORKGROUP)
            and isinstance(array.type, T.Array) and array.type.elem == want):
        got = array.type if isinstance(array, Expr) else type(array).__name__
        raise type_error(f"{fn}() of {mt} needs a whole storage buffer or workgroup array "
                         f"of {want}, got {got}")
    if store and not is_assignable(array):
        raise type_error(f"{fn}() needs a writable array (an output buffer or a shared array)")
    return AddressOf(array)


def _u32s(fn: str, *values) -> tuple:
    out = tuple(as_expr(v, T.u32) for v in values)
    if any(e.type != T.u32 for e in out):
        raise type_error(f"{fn}() offset and stride must be u32, got "
                         f"{', '.join(str(e.type) for e in out)}")
    return out


def _load_rule(fn: str):
    def rule(mtype: T.SubgroupMatrix, array, offset, stride):
        mt = _matrix(fn, mtype)
        return (_matrix_array(fn, mt, array, False), *_u32s(fn, offset, stride)), mt
    return rule


def _store_rule(fn: str):
    def rule(array, offset, value, stride):
        if not isinstance(value, Expr):
            raise type_error(f"{fn}() needs a subgroup matrix value, got {type(value).__name__}")
        mt = _matrix(fn, value)
        ptr = _matrix_array(fn, mt, array, True)
        offset, stride = _u32s(fn, offset, stride)
        return (ptr, offset, value, stride), None
    return rule


def _same_kind(a: str, b: str) -> bool:
    """Float components multiply into float results, integers into integers."""
    return (a in ("f32", "f16")) == (b in ("f32", "f16"))


def _product_type(fn: str, left, right, component) -> T.SubgroupMatrix:
    lt, rt = _matrix(fn, left, T.MatrixKind.LEFT), _matrix(fn, right, T.MatrixKind.RIGHT)
    if lt.component != rt.component or lt.cols != rt.rows:
        raise type_error(f"{fn}(): {lt} times {rt} needs one component type and "
                         f"left's K (columns) = right's K (rows)")
    res = T.subgroup_matrix_result(component, rt.cols, lt.rows)
    if not _same_kind(lt.component, res.component):
        raise type_error(f"{fn}(): {lt.component} matrices multiply into an "
                         f"{'f32/f16' if lt.component in ('f32', 'f16') else 'i32/u32'} result, "
                         f"not {res.component}")
    return res


def _multiply_rule(component: T.Scalar | str, left, right):
    res = _product_type("subgroup_matrix_multiply", left, right, component)
    return (left, right), res


def _mma_rule(left, right, acc):
    fn = "subgroup_matrix_multiply_accumulate"
    at = _matrix(fn, acc, T.MatrixKind.RESULT)
    res = _product_type(fn, left, right, at.component)
    if res != at:
        raise type_error(f"{fn}(): the product is {res.cols} x {res.rows} (N x M) but the "
                         f"accumulator is {at}")
    return (left, right, acc), at


def _uniform(fn: str, lanes, args) -> tuple:
    """The arguments all lanes passed; they must agree (subgroup-uniform)."""
    first = args[0]
    for lane, a in zip(lanes, args):
        for k, (x, y) in enumerate(zip(a, first)):
            if x is not y and not np.array_equal(x, y):
                raise InterpreterError(
                    f"{fn}() needs the same arguments in every lane of the subgroup: "
                    f"argument {k + 1} of lane {lane} differs from lane {lanes[0]}'s")
    return first


def _matrix_cells(fn: str, mt, array, offset, stride, col_major: bool):
    """(``array`` as the matrix's components, (rows, cols) indices into it).

    Offset and stride count elements of the *array* (the WGSL proposal after
    gpuweb PR #6275): for 8-bit components packed four to an i32/u32 element,
    words, so the row (or column) starts at component 4 * (offset + r * stride)
    and its components follow one another. Element (r, c) is at offset +
    r*stride + c (row-major) or offset + c*stride + r, in those units."""
    flat = array.reshape(-1)
    pack = 4 if mt.is_8bit else 1
    if mt.is_8bit:
        flat = flat.view(V.MATRIX_DTYPES[mt.component])
    r, c = np.arange(mt.rows)[:, None], np.arange(mt.cols)[None, :]
    start = pack * (int(offset) + (c * int(stride) if col_major else r * int(stride)))
    idx = start + (r if col_major else c)
    if idx.max() >= flat.size:
        raise OutOfBoundsError(f"{fn}() of {mt} at offset {int(offset)}, stride {int(stride)} "
                               f"(elements of the array) reaches element {idx.max() // pack} of "
                               f"an array of {flat.size // pack}")
    return flat, idx


def _matrix_load(fn: str, col_major: bool):
    def make(types, rt):
        def f(lanes, args):
            array, offset, stride = _uniform(fn, lanes, args)
            flat, idx = _matrix_cells(fn, rt, array, offset, stride, col_major)
            return [flat[idx].copy() for _ in lanes]
        return f
    return make


def _matrix_store(fn: str, col_major: bool):
    def make(types, rt):
        mt = types[2]

        def f(lanes, args):
            array, offset, value, stride = _uniform(fn, lanes, args)
            flat, idx = _matrix_cells(fn, mt, array, offset, stride, col_major)
            flat[idx] = value
            return [None] * len(lanes)
        return f
    return make


def matrix_access(call, args: tuple) -> tuple[bool, np.ndarray] | None:
    """For a subgroup-matrix load or store (``call``, its arguments' values
    ``args``): (whether it writes, the flat indices of the array elements it
    touches, each once); None for any other call. The interpreter's race and
    unwritten-read checks log these accesses."""
    name = call.op.name
    store = name.startswith("subgroup_matrix_store")
    if not store and not name.startswith("subgroup_matrix_load"):
        return None
    mt = call.args[2].type if store else call.type
    array, offset, stride = (args[0], args[1], args[3]) if store else args
    _, idx = _matrix_cells(name, mt, array, offset, stride, name.endswith("_col_major"))
    return store, np.unique(idx // 4 if mt.is_8bit else idx)


def _matrix_product(types, rt):
    """left @ right (+ acc): exact in int64, wrapped to 32 bits, for integers;
    in float64, rounded once to the result type, for floats (GPUs may round
    and order the sums otherwise)."""
    dt = V.dtype_of(rt)
    wide = V.F64 if T.SCALARS[rt.component].is_float else V.I64

    def f(lanes, args):
        ms = [np.asarray(m).astype(wide) for m in _uniform("subgroup_matrix_multiply", lanes, args)]
        out = ms[0] @ ms[1] + (ms[2] if len(ms) == 3 else 0)
        with np.errstate(over="ignore"):
            out = out.astype(dt)
        return [out.copy() for _ in lanes]
    return f


for _suffix, _layout, _cm in (("", "row_major", False), ("_col_major", "col_major", True)):
    _register(Op(f"subgroup_matrix_load{_suffix}", f"subgroupMatrixLoad<{{type}}, {_layout}>",
                 Form.SUBGROUP, _matrix_load(f"subgroup_matrix_load{_suffix}", _cm),
                 _load_rule(f"subgroup_matrix_load{_suffix}"), feature=SUBGROUP_MATRIX,
                 doc=f"(matrix type, array, offset, stride), {_layout.replace('_', '-')}"))
    _register(Op(f"subgroup_matrix_store{_suffix}", f"subgroupMatrixStore<{_layout}>",
                 Form.SUBGROUP_STORE, _matrix_store(f"subgroup_matrix_store{_suffix}", _cm),
                 _store_rule(f"subgroup_matrix_store{_suffix}"), feature=SUBGROUP_MATRIX, void=True,
                 doc=f"(array, offset, matrix, stride), {_layout.replace('_', '-')}"))
_register(Op("subgroup_matrix_multiply", "subgroupMatrixMultiply<{component}>", Form.SUBGROUP,
             _matrix_product, _multiply_rule, feature=SUBGROUP_MATRIX,
             doc="(result component, left, right): left @ right"))
_register(Op("subgroup_matrix_multiply_accumulate", "subgroupMatrixMultiplyAccumulate",
             Form.SUBGROUP, _matrix_product, _mma_rule, feature=SUBGROUP_MATRIX,
             doc="(left, right, acc): left @ right + acc"))


def spellings() -> frozenset[str]:
    """The WGSL function names the registry uses (names.py reserves them), with
    and without template arguments (``subgroupMatrixStore<row_major>``)."""
    whole = {op.wgsl for op in BUILTINS.values() if "{" not in op.wgsl}
    return frozenset(whole | {op.wgsl.split("<")[0] for op in BUILTINS.values()} - {""})
