"""Expressions to Python closures ``f(inv) -> value``, one compiler per node type.

Values are numpy values (``shaderdsl.values``); what each operator and
builtin does is its registry entry's semantics (``shaderdsl.ops``), the same
functions constant evaluation uses. Subgroup calls are computed before the
statement that holds them runs (see ``stmts``) and read here from ``inv.sg``.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import expr as E
from .. import types as T
from .. import values as V
from ..errors import InterpreterError, OutOfBoundsError

_KIND_WORDS = {E.RefKind.BUFFER: "storage buffer", E.RefKind.WORKGROUP: "workgroup array",
               E.RefKind.LOOP: "loop counter"}  # the other kinds' words are their values


class ExprCompiler:
    """Compiles the expressions of one kernel; ``name`` is used in messages.
    ``robust``: an index past the end is clamped to the last element, as
    Tint's and naga's robustness do on a GPU, instead of raising."""

    def __init__(self, name: str, robust: bool = False):
        self.name = name
        self.robust = robust

    def __call__(self, e: E.Expr) -> Callable:
        return _EXPR[type(e)](self, e)

    def _lit(self, e: E.Lit) -> Callable:
        v = V.DTYPES[e.type.name].type(e.value)
        return lambda inv: v

    def _ref(self, e: E.Ref) -> Callable:
        name = e.name
        copied = (E.RefKind.VAR, E.RefKind.WORKGROUP, E.RefKind.BUFFER)
        if e.kind in copied and isinstance(e.type, (T.Vector, T.Array)):
            return lambda inv: inv.env[name].copy()   # a snapshot, not a view of the variable
        return lambda inv: inv.env[name]

    def _unary(self, e: E.Unary) -> Callable:
        a = self(e.a)
        f = e.op.semantics((e.a.type,), e.type)
        return lambda inv: f(a(inv))

    def _binary(self, e: E.Binary) -> Callable:
        a, b = self(e.a), self(e.b)
        decides = e.op.short_circuit
        if decides is not None:  # && and ||: b is evaluated only when a does not decide
            return lambda inv: np.bool_(decides) if bool(a(inv)) is decides else np.bool_(b(inv))
        f = e.op.semantics((e.a.type, e.b.type), e.type)
        return lambda inv: f(a(inv), b(inv))

    def _call(self, e: E.Call) -> Callable:
        if e.op.collective:
            key = id(e)
            return lambda inv: inv.sg[key]
        if e.op.effect:
            raise InterpreterError(f"{e.where}: {e.op.name}() is a statement; it cannot appear "
                                   f"inside an expression")
        args = [self(x) for x in e.args]
        f = e.op.semantics(tuple(x.type for x in e.args), e.type)
        if len(args) == 1:
            (a,) = args
            return lambda inv: f(a(inv))
        if len(args) == 2:
            a, b = args
            return lambda inv: f(a(inv), b(inv))
        return lambda inv: f(*[a(inv) for a in args])

    def _address_of(self, e: E.AddressOf) -> Callable:
        """``&buf`` (arrayLength's argument): the buffer itself."""
        if isinstance(e.target, E.Ref):
            name = e.target.name
            return lambda inv: inv.env[name]
        raise InterpreterError(f"{e.where}: `&` is only meaningful as an atomic or "
                               f"arrayLength argument")

    def _access(self, e) -> Callable:
        """Index/Member: a load from a named location, or a part of a computed value."""
        if isinstance(E.root(e), E.Ref):
            place = self.place(e)

            def load(inv):
                c, k = place(inv)
                return V.copy(c[k])
            return load
        base = self(e.base)
        if isinstance(e, E.Member):
            ks = e.components
            if len(ks) == 1:
                k = ks[0]
                return lambda inv: base(inv)[k]
            return lambda inv: base(inv)[ks]
        idx, check = self(e.index), self.bounds_check(e)

        def part(inv):
            v = base(inv)
            return V.copy(v[check(inv, v, idx(inv))])
        return part

    def bounds_check(self, e: E.Index) -> Callable:
        r = E.root(e)
        what = f"{_KIND_WORDS.get(r.kind, r.kind)} `{r.name}`" if isinstance(r, E.Ref) \
            else f"a value of type {e.base.type}"
        where, name, robust = e.where, self.name, self.robust

        def check(inv, container, i):
            i = int(i)
            n = len(container)
            if not 0 <= i < n:
                if robust and n:
                    return min(max(i, 0), n - 1)
                raise OutOfBoundsError(
                    f"{where}: index {i} is out of bounds for {what} ({n} elements) in "
                    f"kernel {name!r}, invocation {inv.describe()}")
            return i
        return self._axes_check(e, what, check) if e.axes and not robust else check

    def _axes_check(self, e: E.Index, what: str, check) -> Callable:
        """A shaped array's index checked on each axis (``x[r, c]`` with c past the
        columns is out of bounds even where the flat index is not)."""
        axes = [(k, self(i), self(d)) for k, (i, d) in enumerate(e.axes)]
        where, name = e.where, self.name

        def check_axes(inv, container, i):
            sizes = [int(d(inv)) for _, _, d in axes]
            for (k, a, _), n in zip(axes, sizes):
                if not 0 <= int(a(inv)) < n:
                    raise OutOfBoundsError(
                        f"{where}: index {int(a(inv))} on axis {k} is out of bounds for {what} "
                        f"of shape {tuple(sizes)} in kernel {name!r}, invocation {inv.describe()}")
            return check(inv, container, i)
        return check_axes

    def place(self, e: E.Expr) -> Callable:
        """``f(inv) -> (container, key)`` for a location rooted at a name."""
        if isinstance(e, E.Ref):
            name = e.name
            return lambda inv: (inv.env, name)
        assert isinstance(e, (E.Member, E.Index)), f"not a location: {e!r}"
        parent = self.place(e.base)
        if isinstance(e, E.Member):
            ks = e.components
            key = ks[0] if len(ks) == 1 else ks

            def member(inv):
                c, k = parent(inv)
                return c[k], key
            return member
        idx, check = self(e.index), self.bounds_check(e)

        def index(inv):
            c, k = parent(inv)
            arr = c[k]
            return arr, check(inv, arr, idx(inv))
        return index


_EXPR = {E.Lit: ExprCompiler._lit, E.Ref: ExprCompiler._ref, E.Unary: ExprCompiler._unary,
         E.Binary: ExprCompiler._binary, E.Call: ExprCompiler._call,
         E.AddressOf: ExprCompiler._address_of, E.Index: ExprCompiler._access,
         E.Member: ExprCompiler._access}
