"""The kernel tree: expression nodes, statement nodes and the Module they form.

Plain data. Every expression carries its WGSL type, the Python 'file:line'
that built it, and the names of the mutable things it reads (vars, buffers,
workgroup arrays), so the builder can refuse an expression whose meaning
changed since it was built (Hesper's live-reference bug). Operator nodes hold
their entry of the operation registry (``shaderdsl.ops``), which gives their
WGSL spelling and their numpy meaning.

Python operators on expressions build nodes through the typing rules of the
layer above: ``shaderdsl.expr`` fills ``hooks`` when it is imported (and
``shaderdsl.emit`` the WGSL text used by ``repr``), so this module imports
nothing of the DSL but types and the builder stack.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

from . import context
from . import types as T
from .errors import ShaderTypeError
from .location import caller_location

_seq = itertools.count()

# Filled by shaderdsl.expr (binary, unary, index, member) and shaderdsl.emit (text).
hooks = SimpleNamespace(binary=None, unary=None, index=None, member=None, text=None)

SWIZZLE = re.compile(r"^([xyzw]{1,4}|[rgba]{1,4})$")
TRACKED = ("var", "let", "loop", "buffer", "workgroup")


def next_seq() -> int:
    """A build-order number: larger means built later."""
    return next(_seq)


def type_error(msg: str, where: str | None = None) -> ShaderTypeError:
    return ShaderTypeError(f"{where or caller_location()}: {msg}")


class Expr:
    """A WGSL expression with a known type. Build with operators and builtins."""

    __slots__ = ("type", "where", "deps", "seq", "blocks")

    def __init__(self, type: T.WType, children: tuple = ()):
        put = object.__setattr__
        put(self, "type", type)
        put(self, "where", caller_location())
        put(self, "deps", frozenset().union(*(reads(c) for c in children)) if children
            else frozenset())
        put(self, "seq", next(_seq))
        # Blocks (if/loop bodies) this expression was built in: using it after
        # one has closed means a Python `=` was meant as a WGSL assignment.
        builder = context.active()
        here = builder.block_id if builder is not None else 0
        inner = frozenset().union(*(c.blocks for c in children)) if children else frozenset()
        put(self, "blocks", inner | {here} if here else inner)

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

    # arithmetic, bits, comparisons: typed by the rules in shaderdsl.expr
    def __add__(self, o): return hooks.binary("+", self, o)
    def __radd__(self, o): return hooks.binary("+", o, self)
    def __sub__(self, o): return hooks.binary("-", self, o)
    def __rsub__(self, o): return hooks.binary("-", o, self)
    def __mul__(self, o): return hooks.binary("*", self, o)
    def __rmul__(self, o): return hooks.binary("*", o, self)
    def __truediv__(self, o): return hooks.binary("/", self, o)
    def __rtruediv__(self, o): return hooks.binary("/", o, self)
    def __floordiv__(self, o): return hooks.binary("//", self, o)
    def __rfloordiv__(self, o): return hooks.binary("//", o, self)
    def __mod__(self, o): return hooks.binary("%", self, o)
    def __rmod__(self, o): return hooks.binary("%", o, self)
    def __and__(self, o): return hooks.binary("&", self, o)
    def __rand__(self, o): return hooks.binary("&", o, self)
    def __or__(self, o): return hooks.binary("|", self, o)
    def __ror__(self, o): return hooks.binary("|", o, self)
    def __xor__(self, o): return hooks.binary("^", self, o)
    def __rxor__(self, o): return hooks.binary("^", o, self)
    def __lshift__(self, o): return hooks.binary("<<", self, o)
    def __rlshift__(self, o): return hooks.binary("<<", o, self)
    def __rshift__(self, o): return hooks.binary(">>", self, o)
    def __rrshift__(self, o): return hooks.binary(">>", o, self)
    def __lt__(self, o): return hooks.binary("<", self, o)
    def __le__(self, o): return hooks.binary("<=", self, o)
    def __gt__(self, o): return hooks.binary(">", self, o)
    def __ge__(self, o): return hooks.binary(">=", self, o)
    def __eq__(self, o): return hooks.binary("==", self, o)  # type: ignore[override]
    def __ne__(self, o): return hooks.binary("!=", self, o)  # type: ignore[override]
    def __neg__(self): return hooks.unary("-", self)
    def __pos__(self): return self
    def __invert__(self): return hooks.unary("~", self)

    # compound assignment: a statement on an assignable target
    def _compound(self, op, o):
        if not is_assignable(self):
            if isinstance(self, Ref) and self.kind == "let":
                raise type_error(f"`{self.name}` is a let (immutable); declare it with m.var(...) to update it")
            return hooks.binary(op, self, o)
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
    def __getitem__(self, index):
        return hooks.index(self, index)

    def __setitem__(self, index, value):
        if isinstance(value, Assigned):  # `buf[i] += v` already emitted its statement
            return
        context.current().assign(hooks.index(self, index), value)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        t = object.__getattribute__(self, "type")
        if not isinstance(t, T.Vector):
            if SWIZZLE.match(name):
                raise type_error(f"{t} has no member {name!r}: only vectors have components")
            raise AttributeError(f"a shader expression of type {t} has no attribute {name!r}")
        return hooks.member(self, name)

    def __setattr__(self, name, value):
        if isinstance(value, Assigned):
            return
        if name in Expr.__slots__ or name in getattr(type(self), "__slots__", ()):
            object.__setattr__(self, name, value)
            return
        t = object.__getattribute__(self, "type")
        if not isinstance(t, T.Vector):
            raise type_error(f"cannot set member {name!r} of a {t}: only vectors have components")
        if len(name) != 1:
            raise type_error(f"WGSL cannot assign to a swizzle ({name!r}); assign one "
                             f"component at a time or the whole vector")
        context.current().assign(hooks.member(self, name), value)

    def __iter__(self):
        raise type_error("a shader expression is not iterable; use m.loop(...) for a runtime loop")

    def __repr__(self):
        text = hooks.text(self) if hooks.text else type(self).__name__
        return f"<Expr {text}: {self.type}>"


def _init(node, **fields) -> None:
    """Set a node's own fields (Expr.__setattr__ is the DSL's member store)."""
    for k, v in fields.items():
        object.__setattr__(node, k, v)


def reads(e: Expr) -> frozenset:
    """What ``e`` reads, as (name, version, seq) triples.

    A name read directly is captured now, at the version the builder has for
    it; composite nodes keep the triples captured when their children were
    combined. The builder compares them with its versions when the expression
    is used, which is how a stale read is caught.
    """
    if isinstance(e, Ref):
        if e.kind not in TRACKED:
            return frozenset()
        builder = context.active()
        version = builder.version(e.name) if builder is not None else 0
        return frozenset(((e.name, version, next(_seq)),))
    return e.deps


class Assigned:
    """Returned by `target op= value`: tells __setitem__/__setattr__ the store was emitted."""

    __slots__ = ("target",)

    def __init__(self, target):
        self.target = target


class Lit(Expr):
    __slots__ = ("value",)

    def __init__(self, value, type: T.Scalar):
        super().__init__(type)
        _init(self, value=value)


class Ref(Expr):
    """A name: buffer, uniform, workgroup array, override, builtin, var, let or loop counter.

    ``block`` is the id of the block that declared a local (None at module scope).
    """

    __slots__ = ("name", "kind", "block", "access", "shape")

    def __init__(self, name: str, type: T.WType, kind: str, block=None, access: str = "read",
                 shape: tuple | None = None):
        super().__init__(type)
        # names are scope-checked by the builder instead of by blocks
        _init(self, blocks=frozenset(), name=name, kind=kind, block=block, access=access,
              shape=shape)


class Unary(Expr):
    """``op a``; ``op`` is an entry of the operation registry."""

    __slots__ = ("op", "a")

    def __init__(self, op, a: Expr, type: T.WType):
        super().__init__(type, (a,))
        _init(self, op=op, a=a)


class Binary(Expr):
    """``a op b``; ``op`` is an entry of the operation registry."""

    __slots__ = ("op", "a", "b")

    def __init__(self, op, a: Expr, b: Expr, type: T.WType):
        super().__init__(type, (a, b))
        _init(self, op=op, a=a, b=b)


class Call(Expr):
    """A call of a builtin function, constructor or conversion (``op`` from the registry).
    ``type`` is None for a call that returns nothing (atomicStore)."""

    __slots__ = ("op", "args")

    def __init__(self, op, args: tuple, type: T.WType | None):
        super().__init__(type, tuple(args))
        _init(self, op=op, args=tuple(args))

    @property
    def feature(self) -> str | None:
        return self.op.feature


class AddressOf(Expr):
    """``&target``: only an argument of atomic builtins and arrayLength."""

    __slots__ = ("target",)

    def __init__(self, target: Expr):
        super().__init__(target.type, (target,))
        _init(self, target=target)


class Index(Expr):
    """``base[index]``; for a shaped array ``axes`` keeps each axis's (index,
    size) so the interpreter can check them, while ``index`` is the flat one."""

    __slots__ = ("base", "index", "axes")

    def __init__(self, base: Expr, index: Expr, type: T.WType, axes: tuple | None = None):
        super().__init__(type, (base, index))
        _init(self, base=base, index=index, axes=axes)


class Member(Expr):
    """A vector component or swizzle: ``v.x``, ``v.xy``."""

    __slots__ = ("base", "name")

    def __init__(self, base: Expr, name: str, type: T.WType):
        super().__init__(type, (base,))
        _init(self, base=base, name=name)

    @property
    def components(self) -> list[int]:
        letters = "xyzw" if self.name[0] in "xyzw" else "rgba"
        return [letters.index(c) for c in self.name]


def operands(e: Expr) -> tuple:
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
        return e.kind in ("var", "workgroup") or (e.kind == "buffer" and e.access == "read_write")
    if isinstance(e, (Index, Member)):
        return is_assignable(e.base)
    return False


def root(e: Expr) -> Expr:
    """The named thing an index/member chain starts from."""
    while isinstance(e, (Index, Member)):
        e = e.base
    return e


# ---------------------------------------------------------------- statements

@dataclass
class Block:
    id: int
    stmts: list = field(default_factory=list)


@dataclass
class Let:
    ref: Ref
    value: Expr
    where: str


@dataclass
class VarDecl:
    ref: Ref
    init: Expr | None
    where: str


@dataclass
class Assign:
    """``target = value`` or, with ``op`` (a registry entry), ``target op= value``."""
    target: Expr
    value: Expr
    op: object
    where: str


@dataclass
class Effect:
    """A call with side effects (atomics), bound to ``ref`` when it returns a value."""
    call: Call
    ref: Ref | None
    where: str


@dataclass
class If:
    branches: list  # [(cond, Block)], the first is `if`, the rest `else if`
    else_body: Block | None
    where: str
    else_where: str = ""


@dataclass
class For:
    """``for (var i = start; i < end; i += step)``; ``i > end`` when ``descending``."""
    var: Ref
    start: Expr
    end: Expr
    step: Expr
    descending: bool
    body: Block
    where: str


@dataclass
class While:
    cond: Expr
    body: Block
    where: str


@dataclass
class Jump:
    """``break``, ``continue`` or ``return``."""
    kind: str
    where: str


@dataclass
class Barrier:
    """``workgroupBarrier()`` or ``storageBarrier()``."""
    kind: str
    where: str


@dataclass
class Comment:
    text: str
    where: str


@dataclass(eq=False)
class FunctionDef:
    """A WGSL ``fn``: typed parameters (let-like Refs), a body, and the value
    it returns (None: returns nothing). ``builtins``: the builtin values the
    body uses, passed by each caller as extra parameters of the same names."""
    name: str
    params: tuple
    body: Block
    result: Expr | None
    where: str
    builtins: tuple = ()

    @property
    def returns(self):
        return None if self.result is None else self.result.type


@dataclass
class CallFunction:
    """A call of a FunctionDef, its result bound to ``ref`` (a let) if it has one."""
    fn: FunctionDef
    args: tuple
    ref: Ref | None
    where: str


def expressions(st) -> tuple:
    """The expressions a statement evaluates itself (not those of its blocks)."""
    if isinstance(st, Let):
        return (st.value,)
    if isinstance(st, VarDecl):
        return () if st.init is None else (st.init,)
    if isinstance(st, Assign):
        return (st.target, st.value)
    if isinstance(st, Effect):
        return st.call.args
    if isinstance(st, If):
        return tuple(c for c, _ in st.branches)
    if isinstance(st, For):
        return (st.start, st.end, st.step)
    if isinstance(st, While):
        return (st.cond,)
    if isinstance(st, CallFunction):
        return st.args
    return ()


# ---------------------------------------------------------------- the module

# name -> (WGSL builtin, type, feature or None); declared as entry-point parameters on use.
BUILTIN_VALUES = {
    "global_id": ("global_invocation_id", T.vec3u, None),
    "local_id": ("local_invocation_id", T.vec3u, None),
    "workgroup_id": ("workgroup_id", T.vec3u, None),
    "num_workgroups": ("num_workgroups", T.vec3u, None),
    "local_index": ("local_invocation_index", T.u32, None),
    "subgroup_invocation_id": ("subgroup_invocation_id", T.u32, "subgroup"),
    "subgroup_size": ("subgroup_size", T.u32, "subgroup"),
}


@dataclass(frozen=True, eq=False)
class Module:
    """One built kernel: what the emitter prints and the interpreter runs."""

    name: str
    workgroup_size: tuple[int, int, int]
    bindings: tuple            # Ref of each storage buffer and uniform, in binding order
    overrides: tuple           # (Ref, Lit or None)
    workgroup_vars: tuple      # Ref of each var<workgroup>
    builtins: dict             # DSL name -> Ref of each builtin value used
    features: frozenset        # features the declarations need (builtin values)
    body: Block
    functions: tuple = ()      # FunctionDef of each @function called, callees first
