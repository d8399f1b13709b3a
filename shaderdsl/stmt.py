"""Statement nodes of a kernel body. Plain data, built by ShaderM, read by emit."""
from __future__ import annotations

from dataclasses import dataclass, field

from .expr import Expr, Ref


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
    """``target = value`` or, with ``op``, ``target op= value``."""
    target: Expr
    value: Expr
    op: str
    where: str


@dataclass
class Effect:
    """A call with side effects (atomics), bound to ``ref`` when it returns a value."""
    call: Expr
    ref: Ref | None
    where: str


@dataclass
class If:
    branches: list  # [(cond, Block)], the first is `if`, the rest `else if`
    else_body: Block | None
    where: str


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
