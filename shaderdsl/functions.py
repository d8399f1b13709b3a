"""``@function``: a Python helper that becomes one typed WGSL ``fn``.

A plain Python helper is inlined: each call repeats its statements, and an
argument not bound with ``m.let`` is repeated as text. A helper decorated
with ``@shaderdsl.function`` is emitted once per module, before the entry
point, and each call is a statement ``let r = name(args);`` (the result bound
to a let, so it is computed once). Parameters are typed by annotations::

    @sd.function
    def gelu(m, x: f32) -> f32:
        inner = m.let(0.7978846 * (x + 0.044715 * x * x * x))
        return 0.5 * x * (1.0 + sd.builtins.tanh(inner))

The body sees its parameters and module-scope names (buffers, uniforms,
overrides, workgroup arrays), not the caller's locals. Builtin values it uses
(``m.local_index()``) become extra parameters that every call passes on.
"""
from __future__ import annotations

import functools
import inspect

from . import nodes as S
from . import types as T
from .context import type_error
from .expr import as_expr
from .location import caller_location


class Function:
    """A decorated helper: ``f(m, *args)`` calls it from a kernel."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        hints = inspect.get_annotations(fn, eval_str=True)
        names = list(inspect.signature(fn).parameters)[1:]  # after the builder
        for name in names:
            if not isinstance(hints.get(name), (T.Scalar, T.Vector)):
                raise type_error(f"@function {fn.__name__}: annotate parameter {name!r} with a "
                                 f"shaderdsl scalar or vector type (x: f32), got "
                                 f"{hints.get(name, 'no annotation')!r}")
        self.params = tuple((name, hints[name]) for name in names)
        self.returns = hints.get("return")
        if self.returns is not None and not isinstance(self.returns, (T.Scalar, T.Vector)):
            raise type_error(f"@function {fn.__name__}: the return annotation must be a "
                             f"shaderdsl scalar or vector type, got {self.returns!r}")

    def __repr__(self) -> str:
        return f"<shaderdsl function {self.fn.__name__}>"

    def __call__(self, m, *args):
        fdef = self._define(m)
        if len(args) != len(self.params):
            raise type_error(f"{self.fn.__name__}() takes {len(self.params)} argument(s) "
                             f"after m, got {len(args)}")
        values = []
        for (name, t), a in zip(self.params, args):
            e = as_expr(a, t)
            if e.type != t:
                raise type_error(f"{self.fn.__name__}(): argument {name!r} must be {t}, "
                                 f"got {e.type}")
            values.append(e)
        return m.call_function(fdef, tuple(values), m.function_writes[self])

    def _define(self, m) -> S.FunctionDef:
        """The function's definition in this module, built at its first call."""
        if self in m.functions:
            if m.functions[self] is None:
                raise type_error(f"{self.fn.__name__} calls itself; WGSL functions cannot be "
                                 f"recursive")
            return m.functions[self]
        where = caller_location()
        # the Python name without leading '_' (kept for generated names), made unique
        name = m._declare_name(m.free_name(self.fn.__name__.lstrip("_") or "fn"), "fn")
        m.functions[self] = None  # being built
        body = m.next_block()
        before = m.versions()
        with m.function_scope(name, body) as builtins:
            params = [m.param(pname, t, body) for pname, t in self.params]
            result = self.fn(m, *params)
            result = None if result is None else m.check_use(as_expr(result, self.returns))
        if self.returns is not None and (result is None or result.type != self.returns):
            raise type_error(f"function {self.fn.__name__} is annotated -> {self.returns} but "
                             f"returns {'nothing' if result is None else result.type}", where)
        m.function_writes[self] = m.assigned_since(before)
        fdef = S.FunctionDef(name, tuple(params), body, result, where,
                             tuple(k for k in S.BUILTIN_VALUES if k in builtins))
        del m.functions[self]  # re-insert after its callees, in definition order
        m.functions[self] = fdef
        return fdef


def function(fn) -> Function:
    """Decorator: ``fn(m, a: T, ...) -> R`` becomes one WGSL function."""
    return Function(fn)
