"""Statements to Python functions, one compiler per node type, control flow written once.

A compiled statement is ``(is_generator, f)``: ``f(inv)`` runs it for one
invocation and returns a signal (None, "break", "continue" or "return").
Control flow (blocks, if, for, while) and barriers are generators, so an
invocation can stop at a barrier or a subgroup operation and let the
scheduler run the others of its workgroup up to the same point; straight-line
statements are plain functions unless they hold a subgroup call.
"""
from __future__ import annotations

from typing import Callable

from .. import expr as E
from .. import nodes as N
from .. import values as V
from ..emit import stmt_text
from ..errors import InterpreterError
from ..operators import INFIX, Access

BREAK, RETURN = N.JumpKind.BREAK, N.JumpKind.RETURN  # the signals of a jump: its kind
BARRIER, SUBGROUP = "barrier", "subgroup"


def subgroup_calls(exprs) -> list:
    """The subgroup calls inside ``exprs``, innermost first."""
    out: list = []

    def walk(e):
        for sub in E.operands(e):
            walk(sub)
        if isinstance(e, E.Call) and e.op.collective:
            out.append(e)
    for e in exprs:
        if e is not None:
            walk(e)
    return out


class StmtCompiler:
    """Compiles the statements of one kernel.

    ``cx`` compiles expressions; ``locals`` collects the local names (for
    ``Invocation.locals``); ``trace``, when set, is called with
    ``(statement, text, inv)`` before every statement runs.
    """

    def __init__(self, name: str, cx, max_loop_iterations: int, trace: Callable | None = None):
        self.name = name
        self.cx = cx
        self.limit = max_loop_iterations
        self.trace = trace
        self.locals: set[str] = set()
        self.functions: dict = {}  # name -> (body, result) of each called function

    # ------------------------------------------------------------ blocks and statements

    def block(self, block: N.Block) -> Callable:
        """A generator function running the block's statements in order."""
        items = [self.stmt(st) for st in block.stmts]

        def run(inv):
            for gen, f in items:
                sig = (yield from f(inv)) if gen else f(inv)
                if sig is not None:
                    return sig
            return None
        return run

    def stmt(self, st) -> tuple[bool, Callable]:
        gen, f = _STMT[type(st)](self, st)
        if self.trace is None:
            return gen, f
        trace, text = self.trace, stmt_text(st)

        def traced(inv):
            trace(st, text, inv)
            return (yield from f(inv)) if gen else f(inv)
        return True, traced

    def _pre(self, exprs, where: str) -> Callable | None:
        """A generator function computing the subgroup calls in ``exprs``
        (innermost first), yielding each to the scheduler with ``where`` (the
        statement's line); None if there are none."""
        calls = subgroup_calls(exprs)
        if not calls:
            return None
        items = [(c, [self.cx(a) for a in c.args]) for c in calls]

        def pre(inv):
            for call, argfns in items:
                args = tuple(a(inv) for a in argfns)
                inv.sg[id(call)] = yield (SUBGROUP, call, args, where)
        return pre

    def _simple(self, st, plain: Callable) -> tuple[bool, Callable]:
        """A straight-line statement, preceded by its subgroup calls if it has any."""
        pre = self._pre(N.expressions(st), st.where)
        if pre is None:
            return False, plain

        def run(inv):
            yield from pre(inv)
            return plain(inv)
        return True, run

    # ------------------------------------------------------------ straight-line statements

    def _let(self, st: N.Let):
        name, val = st.ref.name, self.cx(st.value)
        self.locals.add(name)

        def let(inv):
            inv.env[name] = val(inv)
        return self._simple(st, let)

    def _var(self, st: N.VarDecl):
        name = st.ref.name
        self.locals.add(name)
        if st.init is None:
            zero = V.zero_value(st.ref.type)
            return self._simple(st, lambda inv: inv.env.__setitem__(name, V.copy(zero)))
        val = self.cx(st.init)
        return self._simple(st, lambda inv: inv.env.__setitem__(name, V.copy(val(inv))))

    def _place(self, target, mode: Access, where: str) -> Callable:
        """Where a store goes; a checking expression compiler also logs the
        access to workgroup memory."""
        logged = getattr(self.cx, "logged_place", None)
        return self.cx.place(target) if logged is None else logged(target, mode, where)

    def _assign(self, st: N.Assign):
        place = self._place(st.target, Access.WRITE if st.op is None else Access.UPDATE, st.where)
        val = self.cx(st.value)
        if st.op is None:
            def assign(inv):
                v = val(inv)
                c, k = place(inv)
                c[k] = V.copy(v)
            return self._simple(st, assign)
        f = st.op.semantics((st.target.type, st.value.type), st.target.type)

        def compound(inv):
            c, k = place(inv)
            c[k] = f(c[k], val(inv))
        return self._simple(st, compound)

    def _effect(self, st: N.Effect):
        """An atomic: read the old value, store the new one, bind the old one."""
        call = st.call
        if call.op.collective:  # subgroupMatrixStore: the subgroup stores together
            return True, self._collective_store(st)
        place = self._place(call.args[0].target, call.op.access, st.where)
        values = [self.cx(a) for a in call.args[1:]]
        update = call.op.semantics(tuple(a.type for a in call.args), call.type)
        bind = st.ref.name if st.ref is not None else None
        if bind is not None:
            self.locals.add(bind)

        def atomic(inv):
            c, k = place(inv)
            old = c[k]
            if values:
                c[k] = update(old, values[0](inv))
            if bind is not None:
                inv.env[bind] = old
        return self._simple(st, atomic)

    def _collective_store(self, st: N.Effect) -> Callable:
        """A store by the whole subgroup: the collective writes the memory (and
        the scheduler logs it for the race checks)."""
        pre = self._pre((st.call,), st.where)
        assert pre is not None, "the store is itself a subgroup call"
        return pre

    def _call_function(self, st: N.CallFunction):
        """Arguments into the parameters' names, the body (it may wait at a
        barrier), then the result into the let; one compiled body per function."""
        fn = st.fn
        if fn.name not in self.functions:
            self.functions[fn.name] = (self.block(fn.body),
                                       None if fn.result is None else self.cx(fn.result),
                                       None if fn.result is None
                                       else self._pre([fn.result], fn.where))
            self.locals.update(p.name for p in fn.params)
        body, result, result_pre = self.functions[fn.name]
        args = [(p.name, self.cx(a)) for p, a in zip(fn.params, st.args)]
        pre, bind = self._pre(st.args, st.where), st.ref.name if st.ref is not None else None
        if bind is not None:
            self.locals.add(bind)

        def call(inv):
            if pre is not None:
                yield from pre(inv)
            values = [(name, V.copy(a(inv))) for name, a in args]
            inv.env.update(values)
            yield from body(inv)
            if result_pre is not None:
                yield from result_pre(inv)
            if bind is not None:
                inv.env[bind] = result(inv)
        return True, call

    def _jump(self, st: N.Jump):
        sig = st.kind
        return False, lambda inv: sig

    def _comment(self, st: N.Comment):
        return False, lambda inv: None

    def _barrier(self, st: N.Barrier):
        event = (BARRIER, st)

        def barrier(inv):
            yield event
        return True, barrier

    # ------------------------------------------------------------ control flow

    def _if(self, st: N.If):
        branches = [(self._pre([c], st.where), self.cx(c), self.block(b)) for c, b in st.branches]
        other = self.block(st.else_body) if st.else_body is not None else None

        def if_(inv):
            for pre, cond, body in branches:
                if pre is not None:
                    yield from pre(inv)
                if cond(inv):
                    return (yield from body(inv))
            if other is not None:
                return (yield from other(inv))
            return None
        return True, if_

    def _loop_guard(self, where: str) -> Callable:
        """Raises once a loop has run more than max_loop_iterations times."""
        limit, name = self.limit, self.name

        def over(inv, n):
            if n > limit:
                raise InterpreterError(f"{where}: loop ran more than {limit} iterations in kernel "
                                       f"{name!r}, invocation {inv.describe()} (raise "
                                       f"max_loop_iterations if that is intended)")
        return over

    def _for(self, st: N.For):
        name = st.var.name
        self.locals.add(name)
        start, end, step = self.cx(st.start), self.cx(st.end), self.cx(st.step)
        pre_start = self._pre([st.start], st.where)
        pre_iter = self._pre([st.end, st.step], st.where)
        body, guard = self.block(st.body), self._loop_guard(st.where)
        ty = st.var.type
        advance = INFIX["sub" if st.descending else "add"].semantics((ty, ty), ty)  # wraps
        more = (lambda i, e: i > e) if st.descending else (lambda i, e: i < e)

        def for_(inv):
            if pre_start is not None:
                yield from pre_start(inv)
            i, n = start(inv), 0
            while True:
                if pre_iter is not None:
                    yield from pre_iter(inv)
                if not more(i, end(inv)):
                    return None
                n += 1
                guard(inv, n)
                inv.env[name] = i
                sig = yield from body(inv)
                if sig is RETURN:
                    return sig
                if sig is BREAK:
                    return None
                if pre_iter is not None:
                    yield from pre_iter(inv)
                i = advance(i, step(inv))
        return True, for_

    def _while(self, st: N.While):
        cond, pre = self.cx(st.cond), self._pre([st.cond], st.where)
        body, guard = self.block(st.body), self._loop_guard(st.where)

        def while_(inv):
            n = 0
            while True:
                if pre is not None:
                    yield from pre(inv)
                if not cond(inv):
                    return None
                n += 1
                guard(inv, n)
                sig = yield from body(inv)
                if sig is RETURN:
                    return sig
                if sig is BREAK:
                    return None
        return True, while_


_STMT = {N.Let: StmtCompiler._let, N.VarDecl: StmtCompiler._var, N.Assign: StmtCompiler._assign,
         N.Effect: StmtCompiler._effect, N.If: StmtCompiler._if, N.For: StmtCompiler._for,
         N.While: StmtCompiler._while, N.Jump: StmtCompiler._jump,
         N.Barrier: StmtCompiler._barrier, N.Comment: StmtCompiler._comment,
         N.CallFunction: StmtCompiler._call_function}
