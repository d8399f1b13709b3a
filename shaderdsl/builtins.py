"""WGSL builtin functions: math, bit, vector, atomic and subgroup operations.

One Python function per entry of the operation registry (``shaderdsl.ops``),
under the entry's name: ``sqrt``, ``inverse_sqrt``, ``atomic_add``,
``subgroup_add``, ... Each checks its arguments with the entry's rule and
returns a typed expression; Python numbers among the arguments take the type
of the first shader expression. Atomic operations have side effects, so they
are emitted as a statement at the point of the call and return the name
holding their result.
"""
from __future__ import annotations

from . import context
from .expr import Call
from .ops import BUILTINS, Op


def call(op: Op, *args):
    """Apply registry entry ``op`` to ``args``: a Call node, or for an atomic
    the statement emitted now and the let holding its result."""
    exprs, result = op.rule(*args)
    node = Call(op, exprs, result)
    return context.current().effect(node) if op.effect else node


def _function(op: Op):
    def fn(*args):
        return call(op, *args)
    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = f"WGSL ``{op.spell('T')}``" + (f": {op.doc}" if op.doc else "") + \
        (f" (needs the {op.feature!r} feature)" if op.feature else "")
    return fn


# sqrt, min, dot, select, bitcast, array_length, atomic_add, subgroup_add, ...
globals().update({name: _function(op) for name, op in BUILTINS.items()})

__all__ = ["call", *BUILTINS]
