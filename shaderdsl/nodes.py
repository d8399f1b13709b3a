"""The kernel tree's statements and the Module they form: plain data.

Statements hold expressions (``shaderdsl.expr``) and the Python ``file:line``
that made them; a Module is one built kernel, what the emitter prints and
the interpreter runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from . import types as T
from .expr import Call, Expr, Ref
from .operators import Op

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
    op: Op | None
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


class JumpKind(StrEnum):
    BREAK = "break"
    CONTINUE = "continue"
    RETURN = "return"


@dataclass
class Jump:
    """``break``, ``continue`` or ``return``."""
    kind: JumpKind
    where: str

    def __post_init__(self):
        self.kind = JumpKind(self.kind)


class BarrierKind(StrEnum):
    WORKGROUP = "workgroup"
    STORAGE = "storage"


@dataclass
class Barrier:
    """``workgroupBarrier()`` or ``storageBarrier()``; ``via``: the library
    function the user called that emitted it (``collectives.reduce``), if any."""
    kind: BarrierKind
    where: str
    via: str = ""

    def __post_init__(self):
        self.kind = BarrierKind(self.kind)


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
    holds: dict = field(default_factory=dict)  # buffer name -> the values its host data holds
