"""WGSL's uniformity analysis on the built tree, so that a kernel naga takes
but Tint (every browser) refuses is refused at build, at the user's line.

WGSL requires barriers and subgroup operations to be reached by every
invocation of the workgroup together: never under a condition, a loop bound
or a return that varies between invocations. Values vary ("non-uniform")
when they come from ``local_id``, ``global_id``, ``local_index`` or
``subgroup_invocation_id``, from a read_write buffer or a workgroup array,
from an atomic or a subgroup operation, or from a var assigned under varying
control flow; ``workgroup_id``, ``num_workgroups``, ``subgroup_size``,
read-only buffers, uniforms and overrides do not. After a varying ``return``
the rest of the function varies; after a varying ``break`` or ``continue``
the rest of the loop does (not what follows it). A ``@function`` that
contains a barrier or collective may only be called where control flow is
uniform, and an argument that decides whether its barrier runs must be
uniform, as must a subgroup shuffle's delta or mask (``Op.uniform_args``).
Subgroup-matrix builtins are left out: their check is turned off in
the WGSL (emit.py) and the interpreter makes it.

Tint agrees with this analysis on tests/test_uniformity.py's corpus.
"""
from __future__ import annotations

from enum import StrEnum

from . import nodes as S
from .errors import UniformityError
from .expr import AddressOf, Call, Expr, Index, Lit, Member, Ref, RefKind, operands
from .location import shown
from .operators import Form
from .types import SUBGROUP_MATRIX_FEATURE

VARYING_BUILTINS = ("local_id", "global_id", "local_index", "subgroup_invocation_id")
NONE = frozenset()


class Source(StrEnum):
    """The first element of a taint's pair: what the second one is."""
    VARYING = "n"  # (VARYING, why): varies between invocations, because of why
    PARAM = "p"    # (PARAM, i): varies where the function's parameter i does


VARYING, PARAM = Source.VARYING, Source.PARAM


def check(module: S.Module) -> None:
    """Raise UniformityError naming the first barrier or collective in
    varying control flow (and how many more there are)."""
    problems = find(module)
    if problems:
        more = f" ({len(problems) - 1} more in this kernel)" if len(problems) > 1 else ""
        raise UniformityError(problems[0] + more)


def find(module: S.Module) -> list[str]:
    """Every barrier, collective and call of one in varying control flow."""
    summaries: dict = {}
    problems: list[str] = []
    for fn in module.functions:  # callees first
        walker = _Walker(summaries, {p.name: i for i, p in enumerate(fn.params)})
        walker.block(fn.body, NONE)
        if fn.result is not None:  # `return subgroupAdd(v)`: a collective in the result
            walker._collectives(fn.result, walker.cf(NONE))
        result = NONE if fn.result is None else walker.value(fn.result)
        summaries[fn] = (walker.needs_uniform, walker.param_needs, result)
        problems += walker.problems
    walker = _Walker(summaries, {})
    walker.block(module.body, NONE)
    return problems + walker.problems


def _why(taint) -> str:
    """The first varying source of ``taint``, for a message."""
    return next(text for kind, text in sorted(taint) if kind == VARYING)


def _varies(taint) -> bool:
    return any(kind == VARYING for kind, _ in taint)


class _Walker:
    """One function body (or the kernel's): the taint of each local and of
    control flow. A taint is a frozenset of (VARYING, why) (varies) and (PARAM, i)
    (as parameter i of the function being walked does)."""

    def __init__(self, summaries: dict, params: dict):
        self.summaries = summaries
        self.locals = {name: frozenset({(PARAM, i)}) for name, i in params.items()}
        self.returned = NONE          # taint of the returns so far: the rest of the function
        self.jumps: list = []         # per enclosing loop: taint of its breaks and continues
        self.exits: list = []         # per enclosing loop: the locals at its breaks, continues
        self.problems: list[str] = []
        self.needs_uniform = None     # where this function's first barrier or collective is
        self.param_needs: dict = {}   # parameter index -> the barrier its value decides

    # ------------------------------------------------------------ values

    def value(self, e) -> frozenset:
        if isinstance(e, (Lit, AddressOf)) or not isinstance(e, Expr):
            return NONE
        if isinstance(e, Ref):
            return self._ref(e)
        out = NONE
        for part in operands(e):
            out |= self.value(part)
        if isinstance(e, Call) and (e.op.form == Form.ATOMIC or e.op.collective):
            out |= {(VARYING, f"the result of {e.op.name}()")}
        return out

    def _ref(self, r: Ref) -> frozenset:
        if r.kind == RefKind.BUILTIN:
            return frozenset({(VARYING, r.name)}) if r.name in VARYING_BUILTINS else NONE
        if r.kind == RefKind.BUFFER and r.access == "read_write":
            return frozenset({(VARYING, f"the read_write buffer '{r.name}'")})
        if r.kind == RefKind.WORKGROUP:
            return frozenset({(VARYING, f"the workgroup array '{r.name}'")})
        return self.locals.get(r.name, NONE)

    # ------------------------------------------------------------ control flow

    def cf(self, base) -> frozenset:
        return base | self.returned | (self.jumps[-1] if self.jumps else NONE)

    def block(self, block: S.Block, cf) -> None:
        for st in block.stmts:
            self.statement(st, cf)

    def statement(self, st, base) -> None:
        cf = self.cf(base)
        for e in S.expressions(st):
            self._collectives(e, cf)
        if isinstance(st, S.Let):
            self.locals[st.ref.name] = self.value(st.value)
        elif isinstance(st, S.VarDecl):
            self.locals[st.ref.name] = cf | self.value(st.init)
        elif isinstance(st, S.Assign):
            self._assign(st, cf)
        elif isinstance(st, S.Effect) and st.ref is not None:
            self.locals[st.ref.name] = self.value(st.call)
        elif isinstance(st, S.Barrier):
            via = f" of {st.via}()" if st.via else ""
            self._uniform_here(f"{st.kind}Barrier(){via} at {st.where}", cf)
        elif isinstance(st, S.CallFunction):
            self._call(st, cf)
        elif isinstance(st, S.If):
            self._if(st, cf)
        elif isinstance(st, (S.For, S.While)):
            self._loop(st, cf)
        elif isinstance(st, S.Jump):
            if st.kind == S.JumpKind.RETURN:
                self.returned |= self._decided(cf, f"the return at {st.where}")
            elif self.jumps:
                self.jumps[-1] |= self._decided(cf, f"the {st.kind} at {st.where}")

    @staticmethod
    def _decided(cf, what: str) -> frozenset:
        """Control flow after ``what``, taken under ``cf``: varying if cf varies."""
        out = frozenset(x for x in cf if x[0] == PARAM)
        return out | ({(VARYING, f"{what}, which only some invocations take, comes before it "
                                 f"(rather than leaving early, guard the work with m.if_)")}
                      if _varies(cf) else NONE)

    def _assign(self, st: S.Assign, cf) -> None:
        root, parts = st.target, NONE
        while isinstance(root, (Index, Member)):  # v[i].x = ...: the var v
            if isinstance(root, Index):
                parts |= self.value(root.index)
            root = root.base
        if isinstance(root, Ref) and root.kind in (RefKind.VAR, RefKind.LET, RefKind.LOOP):
            whole = root is st.target and not st.op
            old = NONE if whole else self.locals.get(root.name, NONE)
            self.locals[root.name] = old | parts | cf | self.value(st.value)

    def _if(self, st: S.If, cf) -> None:
        before, ends, taken = dict(self.locals), [], cf
        bodies = []
        for cond, body in st.branches:
            c = self.value(cond)
            taken = taken | (frozenset({(VARYING, f"the if at {st.where}, whose condition reads "
                                              f"{_why(c)}, which varies between invocations")})
                             if _varies(c) else NONE) | \
                {x for x in c if x[0] == PARAM}
            bodies.append((body, taken))
        bodies.append((st.else_body, taken))
        for body, branch in bodies:
            self.locals = dict(before)
            if body is not None:
                self.block(body, branch)
            ends.append(self._leaving(body))
        self.locals = _merge([e for e in ends if e is not None] or [before])

    def _leaving(self, body) -> dict | None:
        """The locals after ``body`` where control goes on after the if; a body
        that ends in break or continue hands them to its loop instead, and one
        that returns to no one."""
        last = body.stmts[-1] if body is not None and body.stmts else None
        if not isinstance(last, S.Jump):
            return self.locals
        if last.kind != S.JumpKind.RETURN and self.exits:
            self.exits[-1][last.kind].append(self.locals)
        return None

    def _loop(self, st, cf) -> None:
        self.jumps.append(NONE)
        self.exits.append({"break": [], "continue": []})
        if isinstance(st, S.For):
            self.locals[st.var.name] = self.value(st.start) | self.value(st.step) | cf
        bounds = (st.start, st.end, st.step) if isinstance(st, S.For) else (st.cond,)
        seen = len(self.problems)
        for _ in range(len(self.locals) + 4):  # to a fixed point: taints only grow
            del self.problems[seen:]  # each pass finds them again
            head = (dict(self.locals), self.returned, self.jumps[-1])
            c = NONE
            for b in bounds:
                c |= self.value(b)
            if isinstance(st, S.For):
                c |= self.locals[st.var.name]
            body_cf = cf | (frozenset({(VARYING, f"the loop at {st.where}, whose bounds read "
                                             f"{_why(c)}, which varies between invocations")})
                            if _varies(c) else NONE) | \
                {x for x in c if x[0] == PARAM}
            self.block(st.body, body_cf)
            self.locals = _merge([head[0], self.locals, *self.exits[-1]["continue"]])
            if (self.locals, self.returned, self.jumps[-1]) == head:
                break
        self.jumps.pop()
        self.locals = _merge([self.locals, *self.exits.pop()["break"]])

    # ------------------------------------------------------------ what must be uniform

    def _collectives(self, e, cf) -> None:
        if isinstance(e, Call) and e.op.collective and e.op.feature != SUBGROUP_MATRIX_FEATURE:
            what = f"{e.op.name}() at {shown(e._at)}"
            self._uniform_here(what, cf)
            for i in e.op.uniform_args:
                self._uniform_argument(i, self.value(e.args[i]), what)
        if isinstance(e, Expr) and not isinstance(e, Ref):
            for part in operands(e):
                self._collectives(part, cf)

    def _uniform_here(self, what: str, cf) -> None:
        self.needs_uniform = self.needs_uniform or what
        for kind, i in cf:
            if kind == PARAM:
                self.param_needs.setdefault(i, what)
        if _varies(cf):
            self._problem(f"{what} runs in non-uniform control flow: {_why(cf)}")

    def _uniform_argument(self, i: int, taint, what: str, needed: str = "") -> None:
        """Argument ``i`` of ``what`` must be uniform (``needed``: because it
        decides whether that barrier or collective runs, or is its argument)."""
        for kind, j in taint:
            if kind == PARAM:
                self.param_needs.setdefault(j, needed or f"argument {i + 1} of {what}")
        if not _varies(taint):
            return
        text = f"argument {i + 1} of {what} reads {_why(taint)}, which varies between invocations"
        if needed:
            self._problem(f"{text}, and it decides whether {needed} runs")
        else:
            self.problems.append(f"{text}; WGSL requires it uniform (the same in every "
                                 f"invocation): Tint (Dawn, every browser) refuses the kernel")

    def _call(self, st: S.CallFunction, cf) -> None:
        needs, param_needs, result = self.summaries[st.fn]
        args = [self.value(a) for a in st.args]
        if needs:
            self._uniform_here(f"{st.fn.name}() at {st.where} (it reaches {needs})", cf)
        for i, what in param_needs.items():
            self._uniform_argument(i, args[i], f"{st.fn.name}() at {st.where}", what)
        if st.ref is not None:
            out = NONE
            for kind, x in result:
                out |= args[x] if kind == PARAM else {(kind, x)}
            self.locals[st.ref.name] = out

    def _problem(self, text: str) -> None:
        self.problems.append(f"{text}. WGSL requires every invocation of the workgroup to "
                             f"reach it together: Tint (Dawn, every browser) refuses the "
                             f"kernel; make the condition uniform (workgroup_id, uniforms, "
                             f"read-only buffers) or move the call out of it")


def _merge(states: list) -> dict:
    out: dict = {}
    for state in states:
        for name, taint in state.items():
            out[name] = out.get(name, NONE) | taint
    return out
