"""A numpy interpreter for shaderdsl kernels: run a kernel's AST on the CPU.

The interpreter walks the same typed tree (ShaderM) that ``emit`` turns into
WGSL, one invocation at a time, with numpy scalars of the WGSL types
(np.float32, np.float16, np.int32 and np.uint32 with wrapping, np.bool_) and
small numpy arrays for vectors. It is slow (Python per invocation and per
node) and meant for small inputs: to check a kernel against numpy without a
GPU, to get a Python exception with a location where the GPU would silently
clamp an out-of-bounds index, and to step through a kernel (``trace=``).

Execution model:

* every invocation of every workgroup runs; workgroups one after another
  (x fastest, then y, then z), the invocations of a workgroup in
  ``local_invocation_index`` order, each until it finishes or reaches a
  ``workgroupBarrier``/``storageBarrier`` or a subgroup operation;
* workgroup memory is fresh and zero-filled for each workgroup;
* at a barrier every unfinished invocation of the workgroup must wait at the
  same barrier statement (else InterpreterError names where each one is);
* subgroups are runs of ``subgroup_size`` consecutive local indices; a
  subgroup operation is resolved across the lanes of one subgroup that wait
  at it together (lanes that returned, or are elsewhere, do not take part);
* atomics are trivially atomic (one invocation runs at a time), and there
  are no data races: the order above decides who writes last.

Entry points: :func:`run` (build, dispatch, return the read_write buffers)
and :class:`Interpreter` (build once, dispatch many times).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import stmt as S
from . import types as T
from .build import _workgroup_size
from .errors import BindingError, DispatchError, ShaderDSLError
from .expr import AddressOf, Binary, Call, Expr, Index, Lit, Member, Ref, Unary
from .monad import ShaderM, _active

DEFAULT_SUBGROUP_SIZE = 32
DEFAULT_MAX_LOOP_ITERATIONS = 1_000_000

_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i32": np.dtype(np.int32),
           "u32": np.dtype(np.uint32), "bool": np.dtype(np.bool_)}
_I64 = np.dtype(np.int64)
_F64 = np.dtype(np.float64)
# Float -> integer conversions saturate (WGSL); these are the limits that an
# f32 can hold exactly (2**31 - 1 and 2**32 - 1 are not f32 values).
_FLOAT_TO_INT = {"i32": (-2.0 ** 31, 2147483520.0), "u32": (0.0, 4294967040.0)}

_BREAK, _CONTINUE, _RETURN = "break", "continue", "return"
_BARRIER, _SUBGROUP = "barrier", "subgroup"


class InterpreterError(ShaderDSLError):
    """The kernel did something the interpreter cannot give a meaning to
    (barrier divergence, a runaway loop, missing bindings)."""


class OutOfBoundsError(InterpreterError, IndexError):
    """An index outside a buffer, workgroup array, array var or vector.

    A GPU clamps or drops such an access (WebGPU's robustness rules); the
    interpreter stops and says which index, where and in which invocation.
    """


# ------------------------------------------------------------------ type helpers

def dtype_of(t: T.WType) -> np.dtype:
    """numpy dtype of one component of ``t`` (scalar, vector, atomic or array thereof)."""
    while isinstance(t, T.Array):
        t = t.elem
    s = T.scalar_of(t)
    if s is None:
        raise TypeError(f"no numpy dtype for {t}")
    return _DTYPES[s.name]


def shape_of(t: T.WType) -> tuple:
    """numpy shape of a value of type ``t`` (() for scalars)."""
    if isinstance(t, T.Array):
        if t.length is None:
            raise TypeError(f"{t} has no fixed shape")
        return (t.length,) + shape_of(t.elem)
    if isinstance(t, T.Vector):
        return (t.size,)
    return ()


def zero_value(t: T.WType):
    """WGSL's zero value of ``t`` as the interpreter holds it."""
    shape, dt = shape_of(t), dtype_of(t)
    return np.zeros(shape, dt) if shape else dt.type(0)


def _scalar(x):
    """A numpy scalar for a 0-d result, the array itself otherwise."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


def _copy(v):
    return v.copy() if isinstance(v, np.ndarray) else v


def _wrap(r, dt):
    """An int64 result wrapped to the 32-bit dtype (two's complement), scalar or vector."""
    return _scalar(np.asarray(r).astype(dt))


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


_INT_OPS = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "/": _idiv,
    "%": _irem,
    "&": lambda x, y: x & y,
    "|": lambda x, y: x | y,
    "^": lambda x, y: x ^ y,
    # WGSL: a runtime shift amount is taken modulo the bit width (32).
    "<<": lambda x, y: x << (y & 31),
    ">>": lambda x, y: x >> (y & 31),
}

_FLOAT_OPS = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "/": lambda x, y: x / y,
    "%": np.fmod,
}

_COMPARE_OPS = {
    "<": lambda x, y: x < y, "<=": lambda x, y: x <= y, ">": lambda x, y: x > y,
    ">=": lambda x, y: x >= y, "==": lambda x, y: x == y, "!=": lambda x, y: x != y,
}

_BOOL_OPS = {"&": lambda x, y: x & y, "|": lambda x, y: x | y}


def binop(op: str, ta: T.WType, tb: T.WType, rt: T.WType) -> Callable:
    """f(a, b) for ``a op b`` with WGSL semantics (not the short-circuit && and ||)."""
    sa = T.scalar_of(ta)
    if op in _COMPARE_OPS:
        return _COMPARE_OPS[op]
    if sa == T.bool_:
        return _BOOL_OPS[op]
    dt = dtype_of(rt)
    if sa.is_int:
        f = _INT_OPS[op]
        return lambda a, b: _wrap(f(a.astype(_I64), b.astype(_I64)), dt)
    f = _FLOAT_OPS[op]
    return lambda a, b: f(a, b)


def convert(src: T.Scalar, dst: T.Scalar) -> Callable:
    """WGSL value conversion ``dst(x)`` for x of scalar type ``src`` (componentwise)."""
    dt = _DTYPES[dst.name]
    if src == dst:
        return _copy
    if dst == T.bool_:
        return lambda v: _scalar(np.asarray(v != 0))
    if src.is_float and dst.is_int:
        lo, hi = _FLOAT_TO_INT[dst.name]

        def f2i(v):
            x = np.trunc(np.asarray(v, _F64))
            x = np.where(np.isnan(x), 0.0, np.clip(x, lo, hi))
            return _scalar(x.astype(dt))
        return f2i
    # int <-> int reinterprets the bits; int/bool -> float rounds to nearest;
    # float <-> float rounds; bool -> int gives 0 or 1.
    return lambda v: _scalar(np.asarray(v).astype(dt))


def _bits(v: int) -> int:
    return int(v) & 0xFFFFFFFF


def _signed(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def _first_leading_bit(signed: bool):
    def f(v):
        if signed:
            x = _signed(v)
            if x in (0, -1):
                return -1
            return (~x).bit_length() - 1 if x < 0 else x.bit_length() - 1
        x = _bits(v)
        return -1 if x == 0 else x.bit_length() - 1
    return f


_BIT_FUNCS = {
    "countOneBits": lambda s: lambda v: bin(_bits(v)).count("1"),
    "reverseBits": lambda s: lambda v: int(f"{_bits(v):032b}"[::-1], 2),
    "firstLeadingBit": lambda s: _first_leading_bit(s),
    "firstTrailingBit": lambda s: lambda v: -1 if _bits(v) == 0 else
    (_bits(v) & -_bits(v)).bit_length() - 1,
}


def _per_component(fn, dt):
    """Apply a Python-int function to each component; the result wraps to ``dt``."""
    def f(v):
        if isinstance(v, np.ndarray):
            return np.array([fn(int(c)) for c in v], _I64).astype(dt)
        return _wrap(np.int64(fn(int(v))), dt)
    return f


def _fdot(a, b):
    """Sum of products in the vector's float type, left to right."""
    s = a[0] * b[0]
    for k in range(1, len(a)):
        s = s + a[k] * b[k]
    return s


def _length(v):
    if isinstance(v, np.ndarray):
        return np.sqrt(_fdot(v, v))
    return np.abs(v)


def _smoothstep(lo, hi, x):
    dt = np.asarray(x).dtype.type
    t = np.clip((x - lo) / (hi - lo), dt(0), dt(1))
    return _scalar(np.asarray(t * t * (dt(3) - dt(2) * t)))


def _float_math(name: str, dt: np.dtype) -> Callable | None:
    one = dt.type(1)
    table = {
        "sqrt": np.sqrt, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
        "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh, "floor": np.floor,
        "ceil": np.ceil, "round": np.rint, "trunc": np.trunc,
        "inverseSqrt": lambda x: one / np.sqrt(x),
        "fract": lambda x: x - np.floor(x),
        "saturate": lambda x: np.clip(x, dt.type(0), one),
        "pow": np.power,
        "step": lambda edge, x: _scalar(np.where(x >= edge, one, dt.type(0)).astype(dt)),
        "fma": lambda a, b, c: _scalar((np.asarray(a, _F64) * b + np.asarray(c, _F64)).astype(dt)),
        "smoothstep": _smoothstep,
        "mix": lambda a, b, t: a * (one - t) + b * t,
        "normalize": lambda v: v / _length(v),
        "length": _length,
        "distance": lambda a, b: _length(a - b),
        "cross": lambda a, b: np.cross(a, b).astype(dt),
    }
    return table.get(name)


# ------------------------------------------------------------------ subgroups

def _reduce(values, op):
    acc = values[0]
    for v in values[1:]:
        acc = op(acc, v)
    return acc


def _subgroup_result(fn: str, t: T.WType, lanes: list[int], args: list[tuple]) -> list:
    """Results of subgroup op ``fn`` for the lanes (subgroup_invocation_id,
    sorted) that reached it together; ``args[k]`` are lane k's arguments."""
    values = [a[0] for a in args]
    s = T.scalar_of(t)
    n = len(lanes)
    if fn in ("subgroupAdd", "subgroupMul", "subgroupInclusiveAdd", "subgroupExclusiveAdd",
              "subgroupMax", "subgroupMin", "subgroupAnd", "subgroupOr", "subgroupXor"):
        if fn in ("subgroupMax", "subgroupMin"):
            if s.is_float:
                op = np.fmax if fn == "subgroupMax" else np.fmin
            else:
                op = np.maximum if fn == "subgroupMax" else np.minimum
        else:
            base = {"subgroupAdd": "+", "subgroupInclusiveAdd": "+", "subgroupExclusiveAdd": "+",
                    "subgroupMul": "*", "subgroupAnd": "&", "subgroupOr": "|",
                    "subgroupXor": "^"}[fn]
            op = binop(base, t, t, t)
        if fn == "subgroupInclusiveAdd" or fn == "subgroupExclusiveAdd":
            out, acc = [], zero_value(t)
            for v in values:
                if fn == "subgroupExclusiveAdd":
                    out.append(_copy(acc))
                acc = op(acc, v)
                if fn == "subgroupInclusiveAdd":
                    out.append(_copy(acc))
            return out
        total = _reduce(values, op)
        return [_copy(total) for _ in range(n)]
    if fn == "subgroupAll":
        r = np.bool_(all(bool(v) for v in values))
        return [r] * n
    if fn == "subgroupAny":
        r = np.bool_(any(bool(v) for v in values))
        return [r] * n
    if fn == "subgroupBallot":
        mask = np.zeros(4, np.uint32)
        for lane, v in zip(lanes, values):
            if bool(v):
                mask[lane // 32] |= np.uint32(1 << (lane % 32))
        return [mask.copy() for _ in range(n)]
    by_lane = dict(zip(lanes, values))
    if fn == "subgroupBroadcastFirst":
        return [_copy(values[0]) for _ in range(n)]
    # Lane-addressed reads. Reading a lane that is not active or not in the
    # subgroup is undefined in WGSL; the interpreter returns the reader's own value.
    out = []
    for lane, (v, *rest) in zip(lanes, args):
        x = int(rest[0]) if rest else 0
        src = {"subgroupBroadcast": x, "subgroupShuffle": x, "subgroupShuffleXor": lane ^ x,
               "subgroupShuffleUp": lane - x, "subgroupShuffleDown": lane + x}[fn]
        out.append(_copy(by_lane.get(src, v)))
    return out


# ------------------------------------------------------------------ runtime state

class Invocation:
    """One invocation's state: its names (``env``) and builtin ids.

    ``env`` maps every name the kernel uses to its value: buffers and
    workgroup arrays (numpy arrays shared with others), uniforms, overrides,
    builtins and locals.
    """

    __slots__ = ("env", "global_id", "local_id", "workgroup_id", "local_index", "sg",
                 "interpreter")

    def __init__(self, env, global_id, local_id, workgroup_id, local_index, interpreter):
        self.env = env
        self.global_id = global_id
        self.local_id = local_id
        self.workgroup_id = workgroup_id
        self.local_index = local_index
        self.sg = {}                   # subgroup call -> its result, for the statement running
        self.interpreter = interpreter

    def locals(self) -> dict:
        """Local lets, vars and loop counters declared so far, by WGSL name."""
        names = self.interpreter._local_names
        return {k: _copy(v) for k, v in self.env.items() if k in names}

    def describe(self) -> str:
        g, w = self.global_id, self.workgroup_id
        return (f"global_id=({g[0]}, {g[1]}, {g[2]}), workgroup_id=({w[0]}, {w[1]}, {w[2]}), "
                f"local_index={self.local_index}")


@dataclass
class TraceEvent:
    """What ``trace`` gets before each statement runs (see Interpreter.dispatch)."""

    where: str          # Python file:line that built the statement
    text: str           # its first WGSL line
    global_id: tuple
    local_id: tuple
    workgroup_id: tuple
    local_index: int
    invocation: Invocation
    statement: object   # the stmt node

    @property
    def locals(self) -> dict:
        return self.invocation.locals()

    def __str__(self) -> str:
        return f"{self.global_id} {self.where}: {self.text}"


# ------------------------------------------------------------------ building

def build_shader(fn, workgroup_size=64, *, name: str | None = None, **params) -> ShaderM:
    """Run ``fn(m, **params)`` on a new ShaderM, as ``shaderdsl.compile`` does,
    and return the ShaderM itself (its tree is what the interpreter runs)."""
    ws = _workgroup_size(workgroup_size)
    m = ShaderM(ws, name or getattr(fn, "__name__", "kernel"))
    _active.append(m)
    try:
        fn(m, **params)
    finally:
        _active.pop()
    return m


def _operands(e: Expr) -> tuple:
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


def _walk_subgroup_calls(e: Expr, out: list) -> None:
    """Subgroup calls inside ``e``, innermost first."""
    for sub in _operands(e):
        _walk_subgroup_calls(sub, out)
    if isinstance(e, Call) and e.feature == "subgroup":
        out.append(e)


def _root(e: Expr):
    while isinstance(e, (Index, Member)):
        e = e.base
    return e


_KIND_WORDS = {"buffer": "storage buffer", "workgroup": "workgroup array", "var": "var",
               "let": "let", "uniform": "uniform", "builtin": "builtin", "override": "override",
               "loop": "loop counter"}


class Interpreter:
    """Runs one kernel's tree on the CPU.

    ``source`` is a kernel function (built here with ``workgroup_size`` and
    ``params``, as ``shaderdsl.compile`` would) or a ShaderM already built.
    ``subgroup_size`` sets the emulated subgroup width; ``max_loop_iterations``
    bounds each execution of a loop, so a loop that never ends raises
    InterpreterError instead of hanging.
    """

    def __init__(self, source, workgroup_size=64, *, name: str | None = None,
                 subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                 max_loop_iterations: int = DEFAULT_MAX_LOOP_ITERATIONS, **params):
        if isinstance(source, ShaderM):
            if params:
                raise TypeError("params are only for a kernel function, not a built ShaderM")
            m = source
        elif getattr(source, "shader", None) is not None and isinstance(source.shader, ShaderM):
            m = source.shader  # a Kernel that keeps its ShaderM
        elif callable(source):
            m = build_shader(source, workgroup_size, name=name, **params)
        else:
            raise TypeError(f"Interpreter needs a kernel function or a ShaderM, got "
                            f"{type(source).__name__} (a Kernel holds only WGSL: pass the "
                            f"function and its params instead)")
        if not isinstance(subgroup_size, int) or subgroup_size < 1 or subgroup_size > 128:
            raise ValueError(f"subgroup_size must be an int in 1..128, got {subgroup_size!r}")
        self.shader = m
        self.name = m.name
        self.workgroup_size = tuple(m.workgroup_size)
        self.subgroup_size = subgroup_size
        self.max_loop_iterations = max_loop_iterations
        self._local_names: set[str] = set()
        self._traced = False
        self._body = None        # compiled body (plain or generator function)
        self._body_traced = None
        self._body_gen = False
        self._trace = None

    @property
    def wgsl(self) -> str:
        """The WGSL that ``emit`` gives for the interpreted tree."""
        from .emit import emit
        return emit(self.shader)[0]

    # -------------------------------------------------------------- expressions

    def _cx(self, e: Expr) -> Callable:
        """Compile an expression to ``f(inv) -> value``."""
        if isinstance(e, Lit):
            v = _DTYPES[e.type.name].type(e.value)
            return lambda inv: v
        if isinstance(e, Ref):
            return self._cx_ref(e)
        if isinstance(e, Unary):
            return self._cx_unary(e)
        if isinstance(e, Binary):
            return self._cx_binary(e)
        if isinstance(e, Call):
            return self._cx_call(e)
        if isinstance(e, (Index, Member)):
            root = _root(e)
            if isinstance(root, Ref):
                place = self._place(e)

                def load(inv):
                    c, k = place(inv)
                    v = c[k]
                    return v.copy() if isinstance(v, np.ndarray) else v
                return load
            return self._cx_value_access(e)
        if isinstance(e, AddressOf):
            raise InterpreterError(f"{e.where}: `&` is only meaningful as an atomic or "
                                   f"arrayLength argument")
        raise InterpreterError(f"{e.where}: cannot interpret {type(e).__name__}")

    def _cx_ref(self, e: Ref) -> Callable:
        name = e.name
        if e.kind in ("var", "workgroup", "buffer") and isinstance(e.type, (T.Vector, T.Array)):
            return lambda inv: inv.env[name].copy()   # a snapshot, not a view of the variable
        return lambda inv: inv.env[name]

    def _cx_unary(self, e: Unary) -> Callable:
        a = self._cx(e.a)
        s = T.scalar_of(e.type)
        dt = dtype_of(e.type)
        if e.op == "!":
            return lambda inv: _scalar(np.asarray(np.logical_not(a(inv))))
        if s.is_int:
            if e.op == "-":
                return lambda inv: _wrap(-a(inv).astype(_I64), dt)
            return lambda inv: _wrap(~a(inv).astype(_I64), dt)
        return lambda inv: -a(inv)

    def _cx_binary(self, e: Binary) -> Callable:
        a, b = self._cx(e.a), self._cx(e.b)
        if e.op == "&&":
            return lambda inv: np.bool_(a(inv) and b(inv))
        if e.op == "||":
            return lambda inv: np.bool_(a(inv) or b(inv))
        f = binop(e.op, e.a.type, e.b.type, e.type)
        return lambda inv: f(a(inv), b(inv))

    def _cx_value_access(self, e: Expr) -> Callable:
        """Index/Member on a computed value (not a named location)."""
        base = self._cx(e.base)
        if isinstance(e, Member):
            comps = "xyzw" if e.name[0] in "xyzw" else "rgba"
            ks = [comps.index(c) for c in e.name]
            if len(ks) == 1:
                k = ks[0]
                return lambda inv: base(inv)[k]
            return lambda inv: base(inv)[ks]
        idx = self._cx(e.index)
        check = self._bounds_check(e)

        def f(inv):
            v = base(inv)
            return _copy(v[check(inv, v, idx(inv))])
        return f

    def _bounds_check(self, e: Index) -> Callable:
        root = _root(e)
        if isinstance(root, Ref):
            what = f"{_KIND_WORDS.get(root.kind, root.kind)} `{root.name}`"
        else:
            what = f"a value of type {e.base.type}"
        where = e.where

        def check(inv, container, i):
            i = int(i)
            n = len(container)
            if not 0 <= i < n:
                raise OutOfBoundsError(
                    f"{where}: index {i} is out of bounds for {what} ({n} elements) in "
                    f"kernel {self.name!r}, invocation {inv.describe()}")
            return i
        return check

    def _place(self, e: Expr) -> Callable:
        """``f(inv) -> (container, key)`` for a location rooted at a name."""
        if isinstance(e, Ref):
            name = e.name
            return lambda inv: (inv.env, name)
        parent = self._place(e.base)
        if isinstance(e, Member):
            comps = "xyzw" if e.name[0] in "xyzw" else "rgba"
            ks = [comps.index(c) for c in e.name]
            key = ks[0] if len(ks) == 1 else ks

            def member(inv):
                c, k = parent(inv)
                return c[k], key
            return member
        idx = self._cx(e.index)
        check = self._bounds_check(e)

        def index(inv):
            c, k = parent(inv)
            arr = c[k]
            return arr, check(inv, arr, idx(inv))
        return index

    def _cx_call(self, e: Call) -> Callable:
        fn, t = e.fn, e.type
        if e.feature == "subgroup":
            key = id(e)
            return lambda inv: inv.sg[key]
        if isinstance(t, (T.Scalar, T.Vector)) and fn == str(t):
            return self._cx_construct(e)
        if fn.startswith("bitcast<"):
            (a,) = (self._cx(x) for x in e.args)
            dt = dtype_of(t)
            if isinstance(t, T.Vector):
                return lambda inv: np.ascontiguousarray(a(inv)).view(dt).copy()
            return lambda inv: np.ascontiguousarray(a(inv)).reshape(-1).view(dt)[0]
        if fn == "arrayLength":
            name = e.args[0].target.name
            return lambda inv: np.uint32(len(inv.env[name]))
        args = [self._cx(x) for x in e.args]
        at = e.args[0].type if e.args else None
        s = T.scalar_of(at) if at is not None else None
        if fn == "select":
            f, tr, c = args
            if isinstance(t, T.Vector):
                dt = dtype_of(t)
                return lambda inv: np.where(c(inv), tr(inv), f(inv)).astype(dt)
            return lambda inv: tr(inv) if c(inv) else f(inv)
        if fn in ("all", "any"):
            (a,) = args
            red = np.all if fn == "all" else np.any
            return lambda inv: np.bool_(red(a(inv)))
        if fn == "dot":
            a, b = args
            if s.is_float:
                return lambda inv: _fdot(a(inv), b(inv))
            dt = dtype_of(t)
            return lambda inv: _wrap(np.sum(a(inv).astype(_I64) * b(inv).astype(_I64)), dt)
        if fn in ("abs", "sign", "min", "max", "clamp") and s.is_int:
            dt = dtype_of(t)
            if fn == "abs":
                (a,) = args
                return lambda inv: _wrap(np.abs(a(inv).astype(_I64)), dt)
            if fn == "sign":
                (a,) = args
                return lambda inv: np.sign(a(inv))
            if fn == "clamp":
                x, lo, hi = args
                return lambda inv: np.minimum(np.maximum(x(inv), lo(inv)), hi(inv))
            op = np.minimum if fn == "min" else np.maximum
            a, b = args
            return lambda inv: op(a(inv), b(inv))
        if fn in ("abs", "sign", "min", "max", "clamp"):
            if fn == "clamp":
                x, lo, hi = args
                return lambda inv: np.fmin(np.fmax(x(inv), lo(inv)), hi(inv))
            op = {"abs": np.abs, "sign": np.sign, "min": np.fmin, "max": np.fmax}[fn]
            if len(args) == 1:
                (a,) = args
                return lambda inv: op(a(inv))
            a, b = args
            return lambda inv: op(a(inv), b(inv))
        if fn in _BIT_FUNCS:
            (a,) = args
            g = _per_component(_BIT_FUNCS[fn](s == T.i32), dtype_of(t))
            return lambda inv: g(a(inv))
        if s is not None and s.is_float:
            g = _float_math(fn, _DTYPES[s.name])
            if g is not None:
                if len(args) == 1:
                    (a,) = args
                    return lambda inv: g(a(inv))
                if len(args) == 2:
                    a, b = args
                    return lambda inv: g(a(inv), b(inv))
                a, b, c = args
                return lambda inv: g(a(inv), b(inv), c(inv))
        if fn.startswith("atomic"):
            raise InterpreterError(f"{e.where}: {fn}() is a statement; it cannot appear inside "
                                   f"an expression")
        raise InterpreterError(f"{e.where}: the interpreter does not implement {fn}() for {at}")

    def _cx_construct(self, e: Call) -> Callable:
        t = e.type
        dst = T.scalar_of(t)
        args = [self._cx(x) for x in e.args]
        if isinstance(t, T.Scalar):
            conv = convert(e.args[0].type, t)
            (a,) = args
            return lambda inv: conv(a(inv))
        dt = dtype_of(t)
        if len(e.args) == 1:
            at = e.args[0].type
            (a,) = args
            if isinstance(at, T.Vector):
                conv = convert(at.scalar, dst)
                return lambda inv: np.asarray(conv(a(inv)), dt)
            n = t.size
            return lambda inv: np.full(n, a(inv), dt)
        if all(isinstance(x.type, T.Scalar) for x in e.args):
            return lambda inv: np.array([a(inv) for a in args], dt)
        return lambda inv: np.concatenate([np.atleast_1d(a(inv)) for a in args]).astype(dt)

    # -------------------------------------------------------------- statements

    def _pre(self, exprs) -> Callable | None:
        """A generator function that computes the subgroup operations in
        ``exprs`` (innermost first), yielding each to the scheduler."""
        calls: list = []
        for x in exprs:
            if x is not None:
                _walk_subgroup_calls(x, calls)
        if not calls:
            return None
        items = [(c, [self._cx(a) for a in c.args]) for c in calls]

        def pre(inv):
            for call, argfns in items:
                args = tuple(a(inv) for a in argfns)
                inv.sg[id(call)] = yield (_SUBGROUP, call, args)
        return pre

    def _block(self, block: S.Block):
        """(is_generator, f(inv) -> signal) for a block."""
        items = [self._stmt(st) for st in block.stmts]
        if not any(g for g, _ in items):
            fns = [f for _, f in items]
            if len(fns) == 1:
                return False, fns[0]

            def run(inv):
                for f in fns:
                    sig = f(inv)
                    if sig is not None:
                        return sig
                return None
            return False, run

        def run_gen(inv):
            for g, f in items:
                sig = (yield from f(inv)) if g else f(inv)
                if sig is not None:
                    return sig
            return None
        return True, run_gen

    def _stmt(self, st):
        gen, f = self._stmt_inner(st)
        if not self._traced:
            return gen, f
        text = self._text(st)
        where = st.where

        def note(inv):
            trace = self._trace
            if trace is not None:
                trace(TraceEvent(where, text, tuple(int(v) for v in inv.global_id),
                                 tuple(int(v) for v in inv.local_id),
                                 tuple(int(v) for v in inv.workgroup_id), int(inv.local_index),
                                 inv, st))
        if gen:
            def traced_gen(inv):
                note(inv)
                return (yield from f(inv))
            return True, traced_gen

        def traced(inv):
            note(inv)
            return f(inv)
        return False, traced

    def _text(self, st) -> str:
        from .emit import Emitter
        out: list = []
        Emitter().stmt(st, 0, out)
        return out[0][0] if out else ""

    def _with_pre(self, pre, plain):
        """Statement ``plain`` preceded by its subgroup operations, if any."""
        if pre is None:
            return False, plain

        def run(inv):
            yield from pre(inv)
            return plain(inv)
        return True, run

    def _stmt_inner(self, st):
        if isinstance(st, S.Let):
            name, val = st.ref.name, self._cx(st.value)
            self._local_names.add(name)

            def let(inv):
                inv.env[name] = val(inv)
            return self._with_pre(self._pre([st.value]), let)

        if isinstance(st, S.VarDecl):
            name = st.ref.name
            self._local_names.add(name)
            if st.init is None:
                zero = zero_value(st.ref.type)

                def var0(inv):
                    inv.env[name] = _copy(zero)
                return False, var0
            val = self._cx(st.init)

            def var(inv):
                inv.env[name] = _copy(val(inv))
            return self._with_pre(self._pre([st.init]), var)

        if isinstance(st, S.Assign):
            place, val = self._place(st.target), self._cx(st.value)
            if st.op:
                f = binop(st.op, st.target.type, st.value.type, st.target.type)

                def compound(inv):
                    c, k = place(inv)
                    v = val(inv)
                    c[k] = f(c[k], v)
                plain = compound
            else:
                def assign(inv):
                    v = val(inv)
                    c, k = place(inv)
                    c[k] = _copy(v)
                plain = assign
            return self._with_pre(self._pre([st.target, st.value]), plain)

        if isinstance(st, S.Effect):
            return self._with_pre(self._pre(list(st.call.args)), self._atomic(st))

        if isinstance(st, S.If):
            branches = []
            gen = False
            for cond, body in st.branches:
                pre = self._pre([cond])
                g, f = self._block(body)
                gen = gen or g or pre is not None
                branches.append((pre, self._cx(cond), g, f))
            if st.else_body is not None:
                eg, ef = self._block(st.else_body)
                gen = gen or eg
            else:
                eg, ef = False, None
            if not gen:
                def if_(inv):
                    for _, c, _, f in branches:
                        if c(inv):
                            return f(inv)
                    if ef is not None:
                        return ef(inv)
                    return None
                return False, if_

            def if_gen(inv):
                for pre, c, g, f in branches:
                    if pre is not None:
                        yield from pre(inv)
                    if c(inv):
                        return (yield from f(inv)) if g else f(inv)
                if ef is not None:
                    return (yield from ef(inv)) if eg else ef(inv)
                return None
            return True, if_gen

        if isinstance(st, S.For):
            return self._for(st)

        if isinstance(st, S.While):
            return self._while(st)

        if isinstance(st, S.Jump):
            sig = {"break": _BREAK, "continue": _CONTINUE, "return": _RETURN}[st.kind]
            return False, lambda inv: sig

        if isinstance(st, S.Barrier):
            event = (_BARRIER, st)

            def barrier(inv):
                yield event
            return True, barrier

        if isinstance(st, S.Comment):
            return False, lambda inv: None

        raise InterpreterError(f"cannot interpret statement {type(st).__name__}")

    def _loop_limit(self, where):
        limit = self.max_loop_iterations

        def over(inv):
            raise InterpreterError(f"{where}: loop ran more than {limit} iterations in kernel "
                                   f"{self.name!r}, invocation {inv.describe()} (raise "
                                   f"max_loop_iterations if that is intended)")
        return limit, over

    def _for(self, st: S.For):
        name = st.var.name
        self._local_names.add(name)
        start, end, step = self._cx(st.start), self._cx(st.end), self._cx(st.step)
        pre_start = self._pre([st.start])
        pre_iter = self._pre([st.end, st.step])
        g, body = self._block(st.body)
        ty = st.var.type
        advance = binop("-" if st.descending else "+", ty, ty, ty)
        more = (lambda i, e: i > e) if st.descending else (lambda i, e: i < e)
        limit, over = self._loop_limit(st.where)
        if not (g or pre_start or pre_iter):
            def for_(inv):
                env = inv.env
                i = start(inv)
                n = 0
                while more(i, end(inv)):
                    n += 1
                    if n > limit:
                        over(inv)
                    env[name] = i
                    sig = body(inv)
                    if sig is _RETURN:
                        return sig
                    if sig is _BREAK:
                        break
                    i = advance(i, step(inv))
                return None
            return False, for_

        def for_gen(inv):
            env = inv.env
            if pre_start is not None:
                yield from pre_start(inv)
            i = start(inv)
            n = 0
            while True:
                if pre_iter is not None:
                    yield from pre_iter(inv)
                if not more(i, end(inv)):
                    break
                n += 1
                if n > limit:
                    over(inv)
                env[name] = i
                sig = (yield from body(inv)) if g else body(inv)
                if sig is _RETURN:
                    return sig
                if sig is _BREAK:
                    break
                if pre_iter is not None:
                    yield from pre_iter(inv)
                i = advance(i, step(inv))
            return None
        return True, for_gen

    def _while(self, st: S.While):
        cond = self._cx(st.cond)
        pre = self._pre([st.cond])
        g, body = self._block(st.body)
        limit, over = self._loop_limit(st.where)
        if not (g or pre):
            def while_(inv):
                n = 0
                while cond(inv):
                    n += 1
                    if n > limit:
                        over(inv)
                    sig = body(inv)
                    if sig is _RETURN:
                        return sig
                    if sig is _BREAK:
                        break
                return None
            return False, while_

        def while_gen(inv):
            n = 0
            while True:
                if pre is not None:
                    yield from pre(inv)
                if not cond(inv):
                    break
                n += 1
                if n > limit:
                    over(inv)
                sig = (yield from body(inv)) if g else body(inv)
                if sig is _RETURN:
                    return sig
                if sig is _BREAK:
                    break
            return None
        return True, while_gen

    def _atomic(self, st: S.Effect) -> Callable:
        call = st.call
        fn = call.fn
        target = call.args[0].target
        place = self._place(target)
        values = [self._cx(a) for a in call.args[1:]]
        s = target.type.scalar
        t = s
        bind = st.ref.name if st.ref is not None else None
        if bind is not None:
            self._local_names.add(bind)
        if fn in ("atomicAdd", "atomicSub", "atomicAnd", "atomicOr", "atomicXor"):
            op = binop({"atomicAdd": "+", "atomicSub": "-", "atomicAnd": "&", "atomicOr": "|",
                        "atomicXor": "^"}[fn], t, t, t)
        elif fn in ("atomicMax", "atomicMin"):
            op = np.maximum if fn == "atomicMax" else np.minimum
        elif fn == "atomicExchange":
            op = lambda old, v: v
        elif fn in ("atomicLoad", "atomicStore"):
            op = None
        else:
            raise InterpreterError(f"{st.where}: the interpreter does not implement {fn}()")

        def atomic(inv):
            c, k = place(inv)
            old = c[k]
            if fn == "atomicStore":
                c[k] = values[0](inv)
            elif op is not None:
                c[k] = op(old, values[0](inv))
            if bind is not None:
                inv.env[bind] = old
        return atomic

    # -------------------------------------------------------------- compile

    def _compiled(self, traced: bool):
        if traced and self._body_traced is not None:
            return self._body_traced
        if not traced and self._body is not None:
            return self._body
        self._traced = traced
        try:
            gen, body = self._block(self.shader.body)
        finally:
            self._traced = False
        result = (gen, body)
        if traced:
            self._body_traced = result
        else:
            self._body = result
        return result

    # -------------------------------------------------------------- dispatch

    def _globals(self, buffers: dict, overrides) -> tuple[dict, dict]:
        m = self.shader
        env: dict = {}
        outputs: dict = {}
        names = {r.name for r in m.bindings}
        extra = sorted(set(buffers) - names)
        if extra:
            raise BindingError(f"kernel {self.name!r} has no binding(s) {extra}; it has "
                               f"{[r.name for r in m.bindings]}")
        for r in m.bindings:
            if r.name not in buffers:
                raise BindingError(f"kernel {self.name!r}: no array given for binding "
                                   f"{r.name!r}")
            value = buffers[r.name]
            if r.kind == "uniform":
                env[r.name] = self._uniform(r, value)
                continue
            elem = r.type.elem
            dt = dtype_of(elem)
            arr = np.asarray(value)
            if arr.dtype != dt:
                raise BindingError(f"kernel {self.name!r}: binding {r.name!r} ({r.type}) needs "
                                   f"a {dt.name} array, got {arr.dtype.name}")
            comps = T.components(elem)
            if arr.size % comps:
                raise BindingError(f"kernel {self.name!r}: binding {r.name!r} holds {elem} "
                                   f"elements, but the array has {arr.size} values, not a "
                                   f"multiple of {comps}")
            work = arr.reshape(-1).copy()
            view = work.reshape(-1, comps) if comps > 1 else work
            length = r.type.length
            if length is not None:
                if len(view) < length:
                    raise BindingError(f"kernel {self.name!r}: binding {r.name!r} ({r.type}) "
                                       f"needs {length} elements, got {len(view)}")
                view = view[:length]
            env[r.name] = view
            if r.access == "read_write":
                outputs[r.name] = (work, arr.shape)
        given = dict(overrides or {})
        known = {r.name for r, _ in m.overrides}
        if set(given) - known:
            raise BindingError(f"kernel {self.name!r} has no override(s) "
                               f"{sorted(set(given) - known)}; it has {sorted(known)}")
        for r, default in m.overrides:
            if r.name in given:
                from .expr import literal
                v = literal(given[r.name], r.type).value
            elif default is not None:
                v = default.value
            else:
                raise BindingError(f"kernel {self.name!r}: override {r.name!r} has no default; "
                                   f"pass overrides={{{r.name!r}: ...}}")
            env[r.name] = _DTYPES[r.type.name].type(v)
        return env, outputs

    def _uniform(self, r: Ref, value):
        dt = dtype_of(r.type)
        if isinstance(value, (bool, np.bool_)):
            raise BindingError(f"uniform {r.name!r}: bool is not host-shareable")
        if isinstance(value, (int, float)):
            from .expr import literal
            value = literal(value, T.scalar_of(r.type)).value
            arr = np.asarray(value, dt)
        else:
            arr = np.asarray(value)
            if arr.dtype != dt:
                raise BindingError(f"uniform {r.name!r} ({r.type}) needs {dt.name}, got "
                                   f"{arr.dtype.name}")
        arr = arr.reshape(-1)
        n = T.components(r.type)
        if arr.size < n:
            raise BindingError(f"uniform {r.name!r} ({r.type}) needs {n} value(s), got {arr.size}")
        return arr[:n].copy() if isinstance(r.type, T.Vector) else arr[0]

    def dispatch(self, buffers: dict, workgroups=1, overrides: dict | None = None, *,
                 trace: Callable | None = None) -> dict:
        """Run the kernel over ``workgroups`` (int or up to 3 ints).

        ``buffers``: binding name -> numpy array (copied in; dtype must match
        the binding) or, for uniforms, a number/array. Returns the read_write
        buffers after the dispatch, name -> array shaped like the input.
        ``trace(event)``, when given, is called before every statement of
        every invocation with a :class:`TraceEvent`.
        """
        wg = workgroups
        if isinstance(wg, int):
            wg = (wg,)
        wg = tuple(wg)
        if not 1 <= len(wg) <= 3 or not all(isinstance(v, (int, np.integer)) and v >= 1
                                             for v in wg):
            raise DispatchError(f"kernel {self.name!r}: workgroups must be 1 to 3 positive ints, "
                                f"got {workgroups!r}")
        wg = tuple(int(v) for v in wg) + (1,) * (3 - len(wg))
        env, outputs = self._globals(buffers, overrides)
        gen, body = self._compiled(trace is not None)
        self._trace = trace
        m = self.shader
        X, Y, Z = self.workgroup_size
        if "num_workgroups" in m.builtins:
            env["num_workgroups"] = np.array(wg, np.uint32)
        try:
            with np.errstate(all="ignore"):
                for wz in range(wg[2]):
                    for wy in range(wg[1]):
                        for wx in range(wg[0]):
                            self._workgroup(env, (wx, wy, wz), gen, body)
        finally:
            self._trace = None
        return {name: work.reshape(shape) for name, (work, shape) in outputs.items()}

    def _workgroup(self, genv: dict, wid: tuple, gen: bool, body) -> None:
        m = self.shader
        X, Y, Z = self.workgroup_size
        n = X * Y * Z
        shared = {r.name: zero_value(r.type) for r in m.workgroup_vars}
        used = m.builtins
        wid_arr = np.array(wid, np.uint32)
        sgs = self.subgroup_size
        invs = []
        for li in range(n):
            lid = (li % X, (li // X) % Y, li // (X * Y))
            gid = (wid[0] * X + lid[0], wid[1] * Y + lid[1], wid[2] * Z + lid[2])
            env = dict(genv)
            env.update(shared)
            if "global_id" in used:
                env["global_id"] = np.array(gid, np.uint32)
            if "local_id" in used:
                env["local_id"] = np.array(lid, np.uint32)
            if "workgroup_id" in used:
                env["workgroup_id"] = wid_arr
            if "local_index" in used:
                env["local_index"] = np.uint32(li)
            if "subgroup_invocation_id" in used:
                env["subgroup_invocation_id"] = np.uint32(li % sgs)
            if "subgroup_size" in used:
                env["subgroup_size"] = np.uint32(sgs)
            invs.append(Invocation(env, gid, lid, wid, li, self))
        k = 0
        try:
            if not gen:
                for k in range(n):
                    body(invs[k])
                return
            self._schedule(invs, body)
        except ShaderDSLError:
            raise
        except Exception as e:
            e.add_note(f"while interpreting kernel {self.name!r} (workgroup_id={wid})")
            raise

    def _schedule(self, invs: list, body) -> None:
        """Run one workgroup's invocations as generators, meeting at barriers
        and subgroup operations."""
        n = len(invs)
        sgs = self.subgroup_size
        gens = [body(inv) for inv in invs]
        events: list = [None] * n
        sends: list = [None] * n
        alive = [True] * n
        runnable = list(range(n))
        while True:
            for k in runnable:
                try:
                    events[k] = gens[k].send(sends[k])
                except StopIteration:
                    events[k] = None
                    alive[k] = False
                sends[k] = None
            live = [k for k in range(n) if alive[k]]
            if not live:
                return
            waiting_sg = [k for k in live if events[k][0] is _SUBGROUP]
            if waiting_sg:
                groups: dict = {}
                for k in waiting_sg:
                    groups.setdefault((k // sgs, id(events[k][1])), []).append(k)
                runnable = []
                for ks in groups.values():
                    call = events[ks[0]][1]
                    results = _subgroup_result(call.fn, call.type, [k % sgs for k in ks],
                                               [events[k][2] for k in ks])
                    for k, r in zip(ks, results):
                        sends[k] = r
                        runnable.append(k)
                runnable.sort()
                continue
            # Everyone left is at a barrier: the same one, and nobody returned.
            first = events[live[0]][1]
            stray = [k for k in live if events[k][1] is not first]
            if stray or len(live) < n:
                at = {}
                for k in range(n):
                    where = (f"{events[k][1].kind}Barrier() at {events[k][1].where}"
                             if alive[k] else "returned")
                    at.setdefault(where, []).append(k)
                summary = "; ".join(f"{w}: local_index {_ranges(ks)}" for w, ks in at.items())
                raise InterpreterError(
                    f"kernel {self.name!r}, workgroup {invs[0].workgroup_id}: a barrier must be "
                    f"reached by every invocation of the workgroup (uniform control flow), "
                    f"but they diverged: {summary}")
            runnable = live


def _ranges(ks: list) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]."""
    out, start, prev = [], None, None
    for k in ks + [None]:
        if start is None:
            start = prev = k
        elif k is not None and k == prev + 1:
            prev = k
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = k
    return ", ".join(out)


def run(fn, workgroup_size, workgroups, buffers: dict, overrides: dict | None = None, *,
        subgroup_size: int = DEFAULT_SUBGROUP_SIZE, trace: Callable | None = None,
        name: str | None = None, **params) -> dict:
    """Build ``fn(m, **params)`` and run it on the CPU over ``workgroups``.

    ``buffers`` maps binding names to numpy arrays (copied; never modified);
    the result maps each read_write binding to its contents after the
    dispatch, shaped like the array given. See :class:`Interpreter`.
    """
    interp = Interpreter(fn, workgroup_size, name=name, subgroup_size=subgroup_size, **params)
    return interp.dispatch(buffers, workgroups, overrides, trace=trace)


__all__ = ["run", "Interpreter", "build_shader", "InterpreterError", "OutOfBoundsError",
           "TraceEvent", "DEFAULT_SUBGROUP_SIZE"]
