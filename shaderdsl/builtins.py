"""WGSL builtin functions: math, bit, vector, atomic and subgroup operations.

One Python function per entry of the operation registry (``shaderdsl.ops``),
under the entry's name: ``sqrt``, ``inverse_sqrt``, ``atomic_add``,
``subgroup_add``, ... Each checks its arguments with the entry's rule and
returns a typed expression; Python numbers among the arguments take the type
of the first shader expression. Atomic operations have side effects, so they
are emitted as a statement at the point of the call and return the name
holding their result.

The functions are made from the registry at import; ``builtins.pyi`` names
them with their signatures for editors and type checkers. It is generated
from the registry (tests/test_builtins.py checks it is current):

    .venv/bin/python -c "import shaderdsl.builtins as B; B.write_stub()"
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from . import context
from .expr import Call, Expr
from .ops import BUILTINS, Op


def call(op: Op, *args) -> Expr | None:
    """Apply registry entry ``op`` to ``args``: a Call node, or for an atomic
    the statement emitted now and the let holding its result (None for a store)."""
    if op.rule is None:
        raise TypeError(f"{op.name} is an operator, not a builtin function")
    exprs, result = op.rule(*args)
    node = Call(op, exprs, None if op.void else result)
    return context.current().effect(node) if op.effect else node


def _doc(op: Op) -> str:
    return f"WGSL ``{op.spell('T')}``" + (f": {op.doc}" if op.doc else "") + \
        (f" (needs the {op.feature!r} feature)" if op.feature else "")


def _function(op: Op):
    def fn(*args):
        return call(op, *args)
    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = _doc(op)
    return fn


# sqrt, min, dot, select, bitcast, array_length, atomic_add, subgroup_add, ...
globals().update({name: _function(op) for name, op in BUILTINS.items()})

__all__ = ["call", *BUILTINS]


# ---- the stub, builtins.pyi

def _definition(op: Op) -> list[str]:
    """``def sqrt(x: ExprLike, /) -> Expr:``: the rule's parameters (or the
    entry's ``params`` where the rule takes *args), typed by the rule's
    annotations, one to a line where they do not fit on one."""
    assert op.rule is not None, op.name
    rule = inspect.signature(op.rule).parameters
    names = op.params or tuple(rule)
    args = [f"{n}: {rule[n].annotation}" if n in rule and rule[n].annotation is not rule[n].empty
            else f"{n}: ExprLike" for n in names] + ["/"]
    returns = f") -> {'None' if op.void else 'Expr'}:"
    line = f"def {op.name}({', '.join(args)}{returns}"
    if len(line) <= 100:
        return [line]
    return [f"def {op.name}(", *(f"    {a}," for a in args), returns]


def stub() -> str:
    """The text of builtins.pyi: one typed function per registry entry."""
    lines = ['"""Generated from the registry (shaderdsl.ops.BUILTINS); do not edit. Regenerate:',
             "", f"    {_REGENERATE}", '"""',
             "from pathlib import Path", "", "from . import types as T",
             "from .expr import Expr, ExprLike", "from .ops import Op",
             "", "__all__ = [", '    "call",', *(f'    "{name}",' for name in BUILTINS), "]", "",
             "def call(op: Op, *args: object) -> Expr | None: ...",
             "def stub() -> str: ...", "def write_stub(path: Path = ...) -> None: ..."]
    for op in BUILTINS.values():
        doc = textwrap.wrap(_doc(op), 88, break_on_hyphens=False)
        doc[0] = '"""' + doc[0]
        doc[-1] += '"""'
        lines += [*_definition(op), *(f"    {line}" for line in doc)]
    return "\n".join(lines) + "\n"


_REGENERATE = '.venv/bin/python -c "import shaderdsl.builtins as B; B.write_stub()"'


def write_stub(path: Path = Path(__file__).with_suffix(".pyi")) -> None:
    """Write builtins.pyi from the registry (after adding or changing an entry)."""
    path.write_text(stub())
