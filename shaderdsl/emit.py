"""Module -> WGSL text, in a fixed section order.

Sections: enables, overrides, bindings, workgroup variables, entry point.
Features are collected from the tree while it is printed, never by searching
the text. The output is deterministic: the same kernel gives the same bytes.
Expression and statement kinds are printed by functions looked up by node
type; operators are spelled and parenthesized from their registry entries.
"""
from __future__ import annotations

import math

import numpy as np

from . import expr as E
from . import nodes as N
from . import types as T
from .errors import ShaderTypeError
from .location import shown
from .operators import INFIX, Group

INDENT = "    "


def float_text(value: float, scalar: T.Scalar) -> str:
    """Shortest decimal that reads back as the same f32 (or f16), with suffix."""
    if not math.isfinite(value):
        raise ShaderTypeError(f"WGSL has no literal for {value}; pass it in a buffer or uniform")
    x = np.float16(value) if scalar == T.f16 else np.float32(value)
    text = str(abs(x))
    if float(text) > float(np.finfo(x.dtype).max):
        # The shortest decimal of the largest f32 (3.4028235e38) lies above it:
        # Tint refuses it ("cannot be represented"). The double's decimal is exact.
        text = repr(float(abs(x)))
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    elif "." not in text:
        text += ".0"
    sign = "-" if math.copysign(1.0, float(x)) < 0 else ""
    return f"{sign}{text}{'h' if scalar == T.f16 else 'f'}"


def literal_text(lit: E.Lit) -> str:
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


def _needs_parens(parent, child: E.Expr, left: bool) -> bool:
    """WGSL's grammar: bit and shift operands must be unary, and mixing && with ||
    or & with | needs parentheses; arithmetic follows the usual precedence."""
    if not isinstance(child, E.Binary):
        return False
    p, c = parent.group, child.op.group
    if p == Group.MUL:
        return not (c == Group.MUL and left)
    if p == Group.ADD:
        return not (c == Group.MUL or (c == Group.ADD and left))
    if p == Group.REL:
        # `v < x >> y` would read as the template `v<x>`: shifts get parentheses too
        return c not in (Group.MUL, Group.ADD)
    if p in (Group.BIT, Group.LOGIC):
        same = child.op is parent and left
        return not (same or (p == Group.LOGIC and c == Group.REL))
    return True  # shift operands must be unary expressions


# Features that need an `enable` directive in every compiler (the subgroup
# enable is Tint's alone: Kernel.wgsl_for adds it).
_ENABLES = (("shader-f16", "f16"),
            (T.SUBGROUP_MATRIX_FEATURE, "chromium_experimental_subgroup_matrix"))
# Tint proves only workgroup uniformity, but a subgroup matrix needs its
# arguments uniform in the subgroup alone (a workgroup of several subgroups
# gives each its own tile): the check is Tint's, the interpreter makes it
# exactly, at run time.
_MATRIX_UNIFORMITY = "diagnostic(off, chromium.subgroup_matrix_uniformity);"
# i32 `%` is printed as a call of a helper (_signed_remainder)
_REMAINDER = INFIX["rem"]


def _signed_remainder(t) -> tuple[str, list[str]]:
    """The name and text of a function computing WGSL's ``a % b`` on i32 ``t``
    (sign of a; 0 where b is 0) by division. naga prints ``%`` as SPIR-V's
    OpSRem, which Vulkan leaves undefined for a negative operand: NVIDIA's
    driver gave the unsigned remainder (-100 % 7 = 2; gfx-rs/wgpu#8191). Tint
    spells it this way itself, so the helper costs Dawn nothing."""
    name = "_rem_" + (t.name if isinstance(t, T.Scalar) else f"vec{t.size}i")
    one, zero = (("1i", "0i") if isinstance(t, T.Scalar)
                 else (f"{t}(1i)", f"{t}(0i)"))
    return name, [
        f"fn {name}(a: {t}, b: {t}) -> {t} {{",
        f"{INDENT}// a % b: OpSRem is undefined for negative operands under Vulkan (wgpu#8191)",
        f"{INDENT}let d = select(b, {one}, b == {zero});",
        f"{INDENT}return a - a / d * d;",
        "}",
        ""]


class Emitter:
    """Prints nodes; records the features the printed types and calls need,
    and the helper functions they call (name -> WGSL lines)."""

    def __init__(self):
        self.features: set[str] = set()
        self.first_use: dict[str, str] = {}  # feature -> the user's line that first needs it
        self.helpers: dict[str, list[str]] = {}

    def _need(self, feature: str, at) -> None:
        self.features.add(feature)
        if at is not None:
            self.first_use.setdefault(feature, shown(at))

    def _note_type(self, t, at=None) -> None:
        if t is not None and T.uses_f16(t):
            self._need("shader-f16", at)
        if isinstance(t, T.SubgroupMatrix):
            self._need(T.SUBGROUP_MATRIX_FEATURE, at)

    # ------------------------------------------------------------ expressions

    def expr(self, e: E.Expr) -> str:
        self._note_type(e.type, e._at)
        return _EXPR[type(e)](self, e)

    def _lit(self, e: E.Lit) -> str:
        return literal_text(e)

    def _ref(self, e: E.Ref) -> str:
        return e.name

    def _binary(self, e: E.Binary) -> str:
        if e.op is _REMAINDER and T.scalar_of(e.type) == T.i32:
            return self._remainder(e.type, e.a, e.b)
        a, b = self.expr(e.a), self.expr(e.b)
        if _needs_parens(e.op, e.a, True):
            a = f"({a})"
        if _needs_parens(e.op, e.b, False):
            b = f"({b})"
        return f"{a} {e.op.wgsl} {b}"

    def _remainder(self, t, a: E.Expr, b: E.Expr) -> str:
        """``a % b`` on i32 values of type ``t`` through its helper (a scalar
        operand of a vector remainder splat to ``t``)."""
        name, lines = _signed_remainder(t)
        self.helpers.setdefault(name, lines)
        args = [self.expr(x) if x.type == t else f"{t}({self.expr(x)})" for x in (a, b)]
        return f"{name}({args[0]}, {args[1]})"

    def _unary(self, e: E.Unary) -> str:
        a = self.expr(e.a)
        if isinstance(e.a, (E.Binary, E.Unary)) or (isinstance(e.a, E.Lit) and a.startswith("-")):
            a = f"({a})"
        return f"{e.op.wgsl}{a}"

    def _call(self, e: E.Call) -> str:
        if e.op.feature:
            self._need(e.op.feature, e._at)
        return f"{e.op.spell(e.type)}({', '.join(self._argument(a) for a in e.args)})"

    def _address_of(self, e: E.AddressOf) -> str:
        return f"&{self.expr(e.target)}"

    def _index(self, e: E.Index) -> str:
        return f"{self._primary(e.base)}[{self.expr(e.index)}]"

    def _member(self, e: E.Member) -> str:
        return f"{self._primary(e.base)}.{e.name}"

    def _argument(self, e: E.Expr) -> str:
        """A call argument. A `<` or `>` comparison is parenthesized: unwrapped,
        `f(a < b, c > d)` reads as the template list `a<b, c>` in WGSL."""
        text = self.expr(e)
        return f"({text})" if isinstance(e, E.Binary) and e.op.template_like else text

    def _primary(self, e: E.Expr) -> str:
        text = self.expr(e)
        if isinstance(e, (E.Binary, E.Unary)) or (isinstance(e, E.Lit) and text.startswith("-")):
            return f"({text})"
        return text

    def _operand(self, e: E.Expr) -> str:
        """A loop bound after `<`: anything but arithmetic gets parentheses."""
        text = self.expr(e)
        return f"({text})" if isinstance(e, E.Binary) and e.op.group not in (Group.MUL, Group.ADD) \
            else text

    # ------------------------------------------------------------ statements

    def block(self, block: N.Block, depth: int, out: list) -> None:
        for st in block.stmts:
            self.stmt(st, depth, out)

    def stmt(self, st, depth: int, out: list) -> None:
        """Append (text, python location) lines of one statement to ``out``."""
        _STMT[type(st)](self, st, depth, out)

    @staticmethod
    def _line(out: list, depth: int, text: str, where: str) -> None:
        out.append((INDENT * depth + text, where))

    def _let(self, st: N.Let, depth, out):
        self._line(out, depth, f"let {st.ref.name} = {self.expr(st.value)};", st.where)

    def _var(self, st: N.VarDecl, depth, out):
        self._note_type(st.ref.type)
        init = f" = {self.expr(st.init)}" if st.init is not None else ""
        if not init and isinstance(st.ref.type, T.SubgroupMatrix):
            # WGSL zeroes a var each time its declaration runs, but Tint's Vulkan
            # build on the H200 left a matrix var declared in a loop holding the last
            # iteration's value (many_matrix's accumulators): say the zero explicitly
            init = f" = {st.ref.type}()"
        self._line(out, depth, f"var {st.ref.name}: {st.ref.type}{init};", st.where)

    def _assign(self, st: N.Assign, depth, out):
        target, value = self.expr(st.target), self.expr(st.value)
        if st.op is None:
            text = f"{target} = {value};"
        elif st.op is _REMAINDER and T.scalar_of(st.target.type) == T.i32:
            text = f"{target} = {self._remainder(st.target.type, st.target, st.value)};"
        elif st.op.compound is None:  # `^=` on bool is `!=`: WGSL has no `!=` assignment
            text = f"{target} = {target} {st.op.wgsl} {self._primary(st.value)};"
        else:
            text = f"{target} {st.op.compound} {value};"
        self._line(out, depth, text, st.where)

    def _call_function(self, st: N.CallFunction, depth, out):
        args = [self.expr(a) for a in st.args] + list(st.fn.builtins)
        call = f"{st.fn.name}({', '.join(args)})"
        text = f"let {st.ref.name} = {call};" if st.ref is not None else f"{call};"
        self._line(out, depth, text, st.where)

    def function(self, fn: N.FunctionDef, out: list) -> None:
        """``fn name(params) -> type { body; return result; }`` and a blank line."""
        params = ", ".join([f"{p.name}: {p.type}" for p in fn.params] +
                           [f"{k}: {N.BUILTIN_VALUES[k][1]}" for k in fn.builtins])
        for p in fn.params:
            self._note_type(p.type)
        returns = f" -> {fn.returns}" if fn.result is not None else ""
        self._line(out, 0, f"fn {fn.name}({params}){returns} {{", fn.where)
        self.block(fn.body, 1, out)
        if fn.result is not None:
            self._line(out, 1, f"return {self.expr(fn.result)};", fn.where)
        self._line(out, 0, "}", fn.where)
        self._line(out, 0, "", fn.where)

    def _effect(self, st: N.Effect, depth, out):
        call = self.expr(st.call)
        text = f"let {st.ref.name} = {call};" if st.ref is not None else f"{call};"
        self._line(out, depth, text, st.where)

    def _if(self, st: N.If, depth, out):
        for k, (cond, body) in enumerate(st.branches):
            head = "if" if k == 0 else "} else if"
            self._line(out, depth, f"{head} ({self.expr(cond)}) {{", st.where)
            self.block(body, depth + 1, out)
        if st.else_body is not None:
            self._line(out, depth, "} else {", st.else_where or st.where)
            self.block(st.else_body, depth + 1, out)
        self._line(out, depth, "}", st.where)

    def _for(self, st: N.For, depth, out):
        i = st.var.name
        cmp, inc = (">", "-=") if st.descending else ("<", "+=")
        self._line(out, depth, f"for (var {i}: {st.var.type} = {self.expr(st.start)}; {i} {cmp} "
                               f"{self._operand(st.end)}; {i} {inc} {self.expr(st.step)}) {{",
                   st.where)
        self.block(st.body, depth + 1, out)
        self._line(out, depth, "}", st.where)

    def _while(self, st: N.While, depth, out):
        self._line(out, depth, f"while ({self.expr(st.cond)}) {{", st.where)
        self.block(st.body, depth + 1, out)
        self._line(out, depth, "}", st.where)

    def _jump(self, st: N.Jump, depth, out):
        self._line(out, depth, f"{st.kind};", st.where)

    def _barrier(self, st: N.Barrier, depth, out):
        self._line(out, depth, f"{st.kind}Barrier();", st.where)

    def _comment(self, st: N.Comment, depth, out):
        self._line(out, depth, f"// {st.text}", st.where)


_EXPR = {E.Lit: Emitter._lit, E.Ref: Emitter._ref, E.Binary: Emitter._binary,
         E.Unary: Emitter._unary, E.Call: Emitter._call, E.AddressOf: Emitter._address_of,
         E.Index: Emitter._index, E.Member: Emitter._member}
_STMT = {N.Let: Emitter._let, N.VarDecl: Emitter._var, N.Assign: Emitter._assign,
         N.Effect: Emitter._effect, N.If: Emitter._if, N.For: Emitter._for,
         N.While: Emitter._while, N.Jump: Emitter._jump, N.Barrier: Emitter._barrier,
         N.Comment: Emitter._comment, N.CallFunction: Emitter._call_function}


def _declarations(em: Emitter, m: N.Module) -> list[str]:
    """Overrides, bindings and workgroup variables, each section ended by a blank line."""
    decls: list[str] = []
    for ref, default in m.overrides:
        em._note_type(ref.type)
        init = f" = {em.expr(default)}" if default is not None else ""
        decls.append(f"override {ref.name}: {ref.type}{init};")
    if m.overrides:
        decls.append("")
    for k, ref in enumerate(m.bindings):
        em._note_type(ref.type)
        space = "uniform" if ref.kind == E.RefKind.UNIFORM else f"storage, {ref.access}"
        decls.append(f"@group(0) @binding({k}) var<{space}> {ref.name}: {ref.type};")
    if m.bindings:
        decls.append("")
    for ref in m.workgroup_vars:
        em._note_type(ref.type)
        decls.append(f"var<workgroup> {ref.name}: {ref.type};")
    if m.workgroup_vars:
        decls.append("")
    return decls


def _entry_point(m: N.Module) -> list[tuple[str, str]]:
    params = [f"@builtin({builtin}) {key}: {ty}"
              for key, (builtin, ty, _) in N.BUILTIN_VALUES.items() if key in m.builtins]
    x, y, z = m.workgroup_size
    head = [f"@compute @workgroup_size({x}, {y}, {z})"]
    if len(params) <= 1:
        head += [f"fn main({''.join(params)}) {{"]
    else:
        head += ["fn main("] + [f"{INDENT}{p}," for p in params] + [") {"]
    return [(text, "") for text in head]


def emit(m: N.Module) -> tuple[str, tuple[tuple[int, str], ...], frozenset[str], tuple]:
    """WGSL text, (line -> Python file:line) map, required features, and
    (feature, file:line) of the user's first line needing each, where known."""
    em = Emitter()
    em.features |= m.features
    for ref in (*(r for r, _ in m.overrides), *m.bindings, *m.workgroup_vars):
        em._note_type(ref.type, ref._at)  # a declaration of f16 is the first line needing it
    functions: list[tuple[str, str]] = []
    for fn in m.functions:
        em.function(fn, functions)
    body: list[tuple[str, str]] = []
    em.block(m.body, 1, body)
    decls = _declarations(em, m)
    enables = [f"enable {name};" for feature, name in _ENABLES if feature in em.features]
    if T.SUBGROUP_MATRIX_FEATURE in em.features:
        enables.append(_MATRIX_UNIFORMITY)
    enables += [""] if enables else []
    lines = [f"// kernel {m.name}", *enables, *decls]
    helpers = [(text, "") for name in sorted(em.helpers) for text in em.helpers[name]]
    source_map = []
    for part in (helpers, functions, _entry_point(m), body):
        for text, where in part:
            lines.append(text)
            if where:
                source_map.append((len(lines), where))
    lines.append("}")
    return ("\n".join(lines) + "\n", tuple(source_map), frozenset(em.features),
            tuple(sorted(em.first_use.items())))


def expr_text(e: E.Expr) -> str:
    """WGSL text of one expression (for error messages and debugging)."""
    return Emitter().expr(e)


def stmt_text(st) -> str:
    """The first WGSL line of one statement (for traces)."""
    out: list = []
    Emitter().stmt(st, 0, out)
    return out[0][0] if out else ""

