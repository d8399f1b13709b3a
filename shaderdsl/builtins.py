"""WGSL builtin functions: math, bit, atomic and subgroup operations.

Each function checks its argument types and returns a typed Expr. Python
numbers among the arguments take the type of the first shader expression.
Atomic operations have side effects, so they are emitted as a statement at
the point of the call and return the name holding their result.
"""
from __future__ import annotations

from . import types as T
from .expr import AddressOf, Call, Expr, as_expr, default_scalar, is_assignable, type_error


def _unify(fn: str, args) -> tuple[Expr, ...]:
    like = next((a.type for a in args if isinstance(a, Expr)), None)
    if like is None:
        like = default_scalar(args[0])
    exprs = tuple(as_expr(a, like) for a in args)
    for e in exprs:
        if isinstance(e.type, T.Atomic):
            raise type_error(f"{fn}() got an atomic; read it with atomic_load(...) first")
    return exprs


def _same(fn: str, exprs) -> T.WType:
    t = exprs[0].type
    for e in exprs[1:]:
        if e.type != t:
            raise type_error(f"{fn}() needs arguments of one type, got "
                             f"{', '.join(str(x.type) for x in exprs)}")
    return t


def _check(fn: str, t: T.WType, kind: str) -> None:
    s = T.scalar_of(t)
    ok = {
        "float": s is not None and s.is_float,
        "numeric": s is not None and s.is_numeric,
        "signed": s in (T.f32, T.f16, T.i32),
        "int": s is not None and s.is_int,
        "any": s is not None,
    }[kind]
    if not ok or not isinstance(t, (T.Scalar, T.Vector)):
        raise type_error(f"{fn}() does not accept {t} (needs {kind} scalar or vector)")


def _elementwise(wgsl: str, kind: str, arity: int):
    def fn(*args):
        if len(args) != arity:
            raise type_error(f"{wgsl}() takes {arity} argument(s), got {len(args)}")
        exprs = _unify(wgsl, args)
        t = _same(wgsl, exprs)
        _check(wgsl, t, kind)
        return Call(wgsl, exprs, t)
    fn.__name__ = wgsl
    fn.__doc__ = f"WGSL ``{wgsl}`` ({arity} argument(s) of one {kind} scalar or vector type)."
    return fn


# float math, one argument
sqrt = _elementwise("sqrt", "float", 1)
inverse_sqrt = _elementwise("inverseSqrt", "float", 1)
exp = _elementwise("exp", "float", 1)
exp2 = _elementwise("exp2", "float", 1)
log = _elementwise("log", "float", 1)
log2 = _elementwise("log2", "float", 1)
sin = _elementwise("sin", "float", 1)
cos = _elementwise("cos", "float", 1)
tan = _elementwise("tan", "float", 1)
tanh = _elementwise("tanh", "float", 1)
floor = _elementwise("floor", "float", 1)
ceil = _elementwise("ceil", "float", 1)
round = _elementwise("round", "float", 1)
trunc = _elementwise("trunc", "float", 1)
fract = _elementwise("fract", "float", 1)
saturate = _elementwise("saturate", "float", 1)
# float math, several arguments
pow = _elementwise("pow", "float", 2)
step = _elementwise("step", "float", 2)
fma = _elementwise("fma", "float", 3)
smoothstep = _elementwise("smoothstep", "float", 3)
# any numeric
abs = _elementwise("abs", "numeric", 1)
sign = _elementwise("sign", "signed", 1)
min = _elementwise("min", "numeric", 2)
max = _elementwise("max", "numeric", 2)
clamp = _elementwise("clamp", "numeric", 3)
# bits
count_ones = _elementwise("countOneBits", "int", 1)
reverse_bits = _elementwise("reverseBits", "int", 1)
first_leading_bit = _elementwise("firstLeadingBit", "int", 1)
first_trailing_bit = _elementwise("firstTrailingBit", "int", 1)


def normalize(v) -> Expr:
    """WGSL ``normalize`` of a float vector."""
    (v,) = _unify("normalize", (v,))
    if not (isinstance(v.type, T.Vector) and v.type.scalar.is_float):
        raise type_error(f"normalize() needs a float vector, got {v.type}")
    return Call("normalize", (v,), v.type)


def mix(a, b, t) -> Expr:
    """WGSL ``mix(a, b, t)``; ``t`` may be a scalar when a and b are vectors."""
    a, b = _unify("mix", (a, b))
    ty = _same("mix", (a, b))
    _check("mix", ty, "float")
    t = as_expr(t, ty)
    if t.type not in (ty, T.scalar_of(ty)):
        raise type_error(f"mix() blend factor must be {ty} or {T.scalar_of(ty)}, got {t.type}")
    return Call("mix", (a, b, t), ty)


def dot(a, b) -> Expr:
    a, b = _unify("dot", (a, b))
    t = _same("dot", (a, b))
    if not isinstance(t, T.Vector) or not t.scalar.is_numeric:
        raise type_error(f"dot() needs two numeric vectors of one type, got {a.type} and {b.type}")
    return Call("dot", (a, b), t.scalar)


def length(v) -> Expr:
    (v,) = _unify("length", (v,))
    _check("length", v.type, "float")
    return Call("length", (v,), T.scalar_of(v.type))


def distance(a, b) -> Expr:
    a, b = _unify("distance", (a, b))
    t = _same("distance", (a, b))
    _check("distance", t, "float")
    return Call("distance", (a, b), T.scalar_of(t))


def cross(a, b) -> Expr:
    a, b = _unify("cross", (a, b))
    t = _same("cross", (a, b))
    if not (isinstance(t, T.Vector) and t.size == 3 and t.scalar.is_float):
        raise type_error(f"cross() needs two vec3 of a float type, got {t}")
    return Call("cross", (a, b), t)


def select(if_false, if_true, cond) -> Expr:
    """WGSL ``select(f, t, cond)``: ``t`` where cond is true, else ``f`` (argument order as WGSL)."""
    f, t = _unify("select", (if_false, if_true))
    ty = _same("select", (f, t))
    c = as_expr(cond, T.bool_)
    want = T.bool_ if isinstance(ty, T.Scalar) else T.Vector(ty.size, T.bool_)
    if c.type != want and c.type != T.bool_:
        raise type_error(f"select() condition must be {want}, got {c.type}")
    return Call("select", (f, t, c), ty)


def bitcast(t: T.WType, x) -> Expr:
    """Reinterpret the bits of ``x`` as type ``t`` (same size)."""
    x = as_expr(x)
    if T.size_and_align(t)[0] != T.size_and_align(x.type)[0]:
        raise type_error(f"bitcast from {x.type} to {t}: sizes differ")
    return Call(f"bitcast<{t}>", (x,), t)


def array_length(buffer: Expr) -> Expr:
    """Element count of a runtime-sized storage buffer (``arrayLength(&buf)``)."""
    from .expr import Ref
    if not (isinstance(buffer, Ref) and buffer.kind == "buffer"
            and isinstance(buffer.type, T.Array) and buffer.type.length is None):
        raise type_error("array_length() needs a runtime-sized storage buffer")
    return Call("arrayLength", (AddressOf(buffer),), T.u32)


def all_(v) -> Expr:
    v = as_expr(v, T.bool_)
    if T.scalar_of(v.type) != T.bool_:
        raise type_error(f"all() needs bool or vecN<bool>, got {v.type}")
    return Call("all", (v,), T.bool_)


def any_(v) -> Expr:
    v = as_expr(v, T.bool_)
    if T.scalar_of(v.type) != T.bool_:
        raise type_error(f"any() needs bool or vecN<bool>, got {v.type}")
    return Call("any", (v,), T.bool_)


# ---------------------------------------------------------------- atomics

def _atomic(wgsl: str, target, *values, returns: bool = True):
    from .monad import current_builder
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
    call = Call(wgsl, args, s if returns else None)
    return current_builder().effect(call)


def atomic_add(target, value): return _atomic("atomicAdd", target, value)
def atomic_sub(target, value): return _atomic("atomicSub", target, value)
def atomic_max(target, value): return _atomic("atomicMax", target, value)
def atomic_min(target, value): return _atomic("atomicMin", target, value)
def atomic_and(target, value): return _atomic("atomicAnd", target, value)
def atomic_or(target, value): return _atomic("atomicOr", target, value)
def atomic_xor(target, value): return _atomic("atomicXor", target, value)
def atomic_exchange(target, value): return _atomic("atomicExchange", target, value)
def atomic_load(target): return _atomic("atomicLoad", target)
def atomic_store(target, value): return _atomic("atomicStore", target, value, returns=False)


# ---------------------------------------------------------------- subgroups

def _subgroup(wgsl: str, kind: str):
    def fn(value):
        (e,) = _unify(wgsl, (value,))
        _check(wgsl, e.type, kind)
        return Call(wgsl, (e,), e.type, feature="subgroup")
    fn.__name__ = wgsl
    fn.__doc__ = f"WGSL ``{wgsl}`` across the subgroup (needs the 'subgroup' feature)."
    return fn


subgroup_add = _subgroup("subgroupAdd", "numeric")
subgroup_mul = _subgroup("subgroupMul", "numeric")
subgroup_max = _subgroup("subgroupMax", "numeric")
subgroup_min = _subgroup("subgroupMin", "numeric")
subgroup_and = _subgroup("subgroupAnd", "int")
subgroup_or = _subgroup("subgroupOr", "int")
subgroup_xor = _subgroup("subgroupXor", "int")
subgroup_inclusive_add = _subgroup("subgroupInclusiveAdd", "numeric")
subgroup_exclusive_add = _subgroup("subgroupExclusiveAdd", "numeric")
subgroup_broadcast_first = _subgroup("subgroupBroadcastFirst", "any")


def _subgroup_lane(wgsl: str, const_lane: bool = False):
    def fn(value, lane):
        (e,) = _unify(wgsl, (value,))
        _check(wgsl, e.type, "any")
        if const_lane and isinstance(lane, Expr):
            raise type_error(f"{wgsl}() needs a constant lane (a Python int)")
        lane = as_expr(lane, T.u32)
        if lane.type != T.u32:
            raise type_error(f"{wgsl}() lane must be u32, got {lane.type}")
        return Call(wgsl, (e, lane), e.type, feature="subgroup")
    fn.__name__ = wgsl
    fn.__doc__ = f"WGSL ``{wgsl}(value, lane)`` (needs the 'subgroup' feature)."
    return fn


subgroup_broadcast = _subgroup_lane("subgroupBroadcast", const_lane=True)
subgroup_shuffle = _subgroup_lane("subgroupShuffle")
subgroup_shuffle_xor = _subgroup_lane("subgroupShuffleXor")
subgroup_shuffle_up = _subgroup_lane("subgroupShuffleUp")
subgroup_shuffle_down = _subgroup_lane("subgroupShuffleDown")


def subgroup_all(cond) -> Expr:
    c = as_expr(cond, T.bool_)
    if c.type != T.bool_:
        raise type_error(f"subgroupAll() needs bool, got {c.type}")
    return Call("subgroupAll", (c,), T.bool_, feature="subgroup")


def subgroup_any(cond) -> Expr:
    c = as_expr(cond, T.bool_)
    if c.type != T.bool_:
        raise type_error(f"subgroupAny() needs bool, got {c.type}")
    return Call("subgroupAny", (c,), T.bool_, feature="subgroup")


def subgroup_ballot(cond) -> Expr:
    c = as_expr(cond, T.bool_)
    if c.type != T.bool_:
        raise type_error(f"subgroupBallot() needs bool, got {c.type}")
    return Call("subgroupBallot", (c,), T.vec4u, feature="subgroup")
