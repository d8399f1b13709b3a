"""ShaderM -> WGSL text, in a fixed section order.

Sections: enables, overrides, bindings, workgroup variables, entry point.
Features are collected from the tree while it is printed, never by searching
the text. The output is deterministic: the same kernel gives the same bytes.
"""
from __future__ import annotations

import math

import numpy as np

from . import stmt as S
from . import types as T
from .errors import ShaderTypeError
from .expr import AddressOf, Binary, Call, Expr, Index, Lit, Member, Ref, Unary
from .monad import BUILTIN_VALUES, ShaderM

INDENT = "    "

_MUL, _ADD, _SHIFT = {"*", "/", "%"}, {"+", "-"}, {"<<", ">>"}
_REL = {"<", "<=", ">", ">=", "==", "!="}
_BIT, _LOGIC = {"&", "|", "^"}, {"&&", "||"}


def float_text(value: float, scalar: T.Scalar) -> str:
    """Shortest decimal that reads back as the same f32 (or f16), with suffix."""
    if not math.isfinite(value):
        raise ShaderTypeError(f"WGSL has no literal for {value}; pass it in a buffer or uniform")
    x = np.float16(value) if scalar == T.f16 else np.float32(value)
    text = str(abs(x))
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    elif "." not in text:
        text += ".0"
    sign = "-" if math.copysign(1.0, float(x)) < 0 else ""
    return f"{sign}{text}{'h' if scalar == T.f16 else 'f'}"


def literal_text(lit: Lit) -> str:
    v, t = lit.value, lit.type
    if t == T.bool_:
        return "true" if v else "false"
    if t == T.u32:
        return f"{v}u"
    if t == T.i32:
        return "(-2147483647i - 1i)" if v == -(2 ** 31) else f"{v}i"
    try:
        return float_text(v, t)
    except ShaderTypeError as e:
        raise ShaderTypeError(f"{lit.where}: {e}") from None


def _needs_parens(parent: str, child: Expr, left: bool) -> bool:
    """WGSL's grammar: bit and shift operands must be unary, and mixing && with ||
    or & with | needs parentheses; arithmetic follows the usual precedence."""
    if not isinstance(child, Binary):
        return False
    c = child.op
    if parent in _MUL:
        return not (c in _MUL and left)
    if parent in _ADD:
        return not (c in _MUL or (c in _ADD and left))
    if parent in _SHIFT:
        return True
    if parent in _REL:
        # `v < x >> y` would read as the template `v<x>`: shifts get parentheses too
        return not (c in _MUL or c in _ADD)
    if parent in _BIT:
        return not (c == parent and left)
    if parent in _LOGIC:
        return not (c in _REL or (c == parent and left))
    return True


class Emitter:
    def __init__(self):
        self.features: set[str] = set()

    def _note_type(self, t) -> None:
        if t is not None and T.uses_f16(t):
            self.features.add("shader-f16")

    def expr(self, e: Expr) -> str:
        self._note_type(e.type)
        if isinstance(e, Lit):
            return literal_text(e)
        if isinstance(e, Ref):
            return e.name
        if isinstance(e, Binary):
            a, b = self.expr(e.a), self.expr(e.b)
            if _needs_parens(e.op, e.a, True):
                a = f"({a})"
            if _needs_parens(e.op, e.b, False):
                b = f"({b})"
            return f"{a} {e.op} {b}"
        if isinstance(e, Unary):
            a = self.expr(e.a)
            if isinstance(e.a, (Binary, Unary)) or (isinstance(e.a, Lit) and a.startswith("-")):
                a = f"({a})"
            return f"{e.op}{a}"
        if isinstance(e, Call):
            if e.feature:
                self.features.add(e.feature)
            return f"{e.fn}({', '.join(self._argument(a) for a in e.args)})"
        if isinstance(e, AddressOf):
            return f"&{self.expr(e.target)}"
        if isinstance(e, Index):
            return f"{self._primary(e.base)}[{self.expr(e.index)}]"
        if isinstance(e, Member):
            return f"{self._primary(e.base)}.{e.name}"
        raise TypeError(f"cannot emit {type(e).__name__}")

    def _argument(self, e: Expr) -> str:
        """A call argument. A `<` or `>` comparison is parenthesized: unwrapped,
        `f(a < b, c > d)` reads as the template list `a<b, c>` in WGSL."""
        text = self.expr(e)
        return f"({text})" if isinstance(e, Binary) and e.op in ("<", ">", "<=", ">=") else text

    def _primary(self, e: Expr) -> str:
        text = self.expr(e)
        if isinstance(e, (Binary, Unary)) or (isinstance(e, Lit) and text.startswith("-")):
            return f"({text})"
        return text

    def block(self, block: S.Block, depth: int, out: list) -> None:
        for st in block.stmts:
            self.stmt(st, depth, out)

    def stmt(self, st, depth: int, out: list) -> None:
        pad = INDENT * depth
        line = lambda text: out.append((pad + text, st.where))
        if isinstance(st, S.Let):
            line(f"let {st.ref.name} = {self.expr(st.value)};")
        elif isinstance(st, S.VarDecl):
            self._note_type(st.ref.type)
            init = f" = {self.expr(st.init)}" if st.init is not None else ""
            line(f"var {st.ref.name}: {st.ref.type}{init};")
        elif isinstance(st, S.Assign):
            line(f"{self.expr(st.target)} {st.op}= {self.expr(st.value)};")
        elif isinstance(st, S.Effect):
            call = self.expr(st.call)
            line(f"let {st.ref.name} = {call};" if st.ref is not None else f"{call};")
        elif isinstance(st, S.If):
            for k, (cond, body) in enumerate(st.branches):
                head = "if" if k == 0 else "} else if"
                line(f"{head} ({self.expr(cond)}) {{")
                self.block(body, depth + 1, out)
            if st.else_body is not None:
                line("} else {")
                self.block(st.else_body, depth + 1, out)
            line("}")
        elif isinstance(st, S.For):
            i = st.var.name
            cmp = ">" if st.descending else "<"
            inc = "-=" if st.descending else "+="
            line(f"for (var {i}: {st.var.type} = {self.expr(st.start)}; {i} {cmp} "
                 f"{self._operand(st.end)}; {i} {inc} {self.expr(st.step)}) {{")
            self.block(st.body, depth + 1, out)
            line("}")
        elif isinstance(st, S.While):
            line(f"while ({self.expr(st.cond)}) {{")
            self.block(st.body, depth + 1, out)
            line("}")
        elif isinstance(st, S.Jump):
            line(f"{st.kind};")
        elif isinstance(st, S.Barrier):
            line(f"{st.kind}Barrier();")
        elif isinstance(st, S.Comment):
            line(f"// {st.text}")
        else:
            raise TypeError(f"cannot emit statement {type(st).__name__}")

    def _operand(self, e: Expr) -> str:
        text = self.expr(e)
        return f"({text})" if isinstance(e, Binary) and e.op in _REL | _BIT | _LOGIC | _SHIFT else text


def emit(m: ShaderM) -> tuple[str, tuple[tuple[int, str], ...], frozenset[str]]:
    """WGSL text, (line -> Python file:line) map, and required features."""
    em = Emitter()
    em.features |= m.features
    body: list[tuple[str, str]] = []
    em.block(m.body, 1, body)

    decls: list[str] = []
    for ref, default in m.overrides:
        em._note_type(ref.type)
        init = f" = {em.expr(default)}" if default is not None else ""
        decls.append(f"override {ref.name}: {ref.type}{init};")
    if m.overrides:
        decls.append("")
    for k, ref in enumerate(m.bindings):
        em._note_type(ref.type)
        space = "uniform" if ref.kind == "uniform" else f"storage, {ref.access}"
        decls.append(f"@group(0) @binding({k}) var<{space}> {ref.name}: {ref.type};")
    if m.bindings:
        decls.append("")
    for ref in m.workgroup_vars:
        em._note_type(ref.type)
        decls.append(f"var<workgroup> {ref.name}: {ref.type};")
    if m.workgroup_vars:
        decls.append("")

    enables = ["enable f16;", ""] if "shader-f16" in em.features else []

    params = []
    for key, (builtin, ty, _) in BUILTIN_VALUES.items():
        if key in m.builtins:
            params.append(f"@builtin({builtin}) {key}: {ty}")
    x, y, z = m.workgroup_size
    head = [f"@compute @workgroup_size({x}, {y}, {z})"]
    if len(params) <= 1:
        head.append(f"fn main({''.join(params)}) {{")
    else:
        head.append("fn main(")
        head += [f"{INDENT}{p}," for p in params]
        head.append(") {")

    lines = [f"// kernel {m.name}", *enables, *decls, *head]
    source_map = []
    for text, where in body:
        lines.append(text)
        source_map.append((len(lines), where))
    lines.append("}")
    return "\n".join(lines) + "\n", tuple(source_map), frozenset(em.features)


def expr_text(e: Expr) -> str:
    """WGSL text of one expression (for repr and error messages)."""
    return Emitter().expr(e)
