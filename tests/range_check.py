"""Which workgroup-array indices of a WGSL kernel Tint's integer range analysis proves.

The rules of google/dawn's src/tint/lang/core/ir/analysis/integer_range_analysis.cc
(docs/optimisation-notes.md, note 37), applied to the WGSL text the DSL emits:
``local_invocation_index`` is [0, workgroup size - 1]; constants, ``let``s, the
control variable of ``for (var i = C0; i < C1; i += 1u)``, ``+ - * / % << >>``
and ``min``/``max`` (one unbounded side taken as the whole u32 range) carry an
interval; ``%`` by a constant bounds even an unbounded left side; anything else
(``workgroup_id``, ``&``, other vars, other calls) is unbounded. u32 only, which
is what the DSL's index math is.

``unproven(wgsl)`` lists the accesses ``name[index]`` to workgroup arrays whose
index interval is not inside the array: the ones Tint still clamps.
"""
from __future__ import annotations

import re

U32_MAX = 2**32 - 1
_TOKEN = re.compile(r"\s*(\d+[ui]?\b|[A-Za-z_]\w*|<<|>>|<=|>=|==|!=|&&|\|\||\S)")
_TEMPLATED = ("vec2", "vec3", "vec4", "array", "bitcast", "subgroupMatrixLoad",
              "subgroupMatrixStore")
_LEVELS = [("||",), ("&&",), ("|", "&", "^"), ("<", ">", "<=", ">=", "==", "!="),
           ("<<", ">>"), ("+", "-"), ("*", "/", "%")]


def _binary(op, lhs, rhs):
    if op == "%":  # Tint: a constant positive right side bounds any left side
        if rhs is None or rhs[0] != rhs[1] or rhs[0] == 0:
            return None
        (a, b), c = lhs or (0, U32_MAX), rhs[0]
        return (a % c, b % c) if a // c == b // c else (0, c - 1)
    if lhs is None or rhs is None:
        return None
    (a, b), (c, d) = lhs, rhs
    if op == "+":
        out = (a + c, b + d)
    elif op == "-":
        out = (a - d, b - c) if a >= d else None
    elif op == "*":
        out = (a * c, b * d)
    elif op == "/":
        out = (a // d, b // c) if c > 0 else None
    elif op in ("<<", ">>") and d < 32:
        out = (a << c, b << d) if op == "<<" else (a >> d, b >> c)
    else:
        return None
    return out if out is not None and out[1] <= U32_MAX else None


def _min_max(fn, x, y):
    if x is None and y is None:
        return None
    (a, b), (c, d) = x or (0, U32_MAX), y or (0, U32_MAX)
    out = (min(a, c), min(b, d)) if fn == "min" else (max(a, c), max(b, d))
    return None if out == (0, U32_MAX) else out


class _Expr:
    """A recursive-descent reader of one WGSL expression, giving its interval."""

    def __init__(self, text, env):
        self.tokens, self.at, self.env = _TOKEN.findall(text), 0, env

    def peek(self):
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self):
        self.at += 1
        return self.tokens[self.at - 1]

    def value(self, level=0):
        if level == len(_LEVELS):
            return self.unary()
        out = self.value(level + 1)
        while self.peek() in _LEVELS[level]:
            op = self.take()
            out = _binary(op, out, self.value(level + 1))
        return out

    def unary(self):
        if self.peek() in ("-", "!", "~", "&"):
            self.take()
            self.unary()
            return None
        return self.postfix(self.primary())

    def primary(self):
        tok = self.take()
        if tok == "(":
            out = self.value()
            self.take()
            return out
        if tok[0].isdigit():
            n = int(tok.rstrip("ui"))
            return (n, n)
        if self.peek() == "<" and tok in _TEMPLATED:  # skip the template
            depth = 0
            while True:
                t = self.take()
                depth += (t == "<") - (t == ">") + 2 * ((t == "<<") - (t == ">>"))
                if depth <= 0:
                    break
        if self.peek() == "(":
            self.take()
            args = []
            while self.peek() != ")":
                args.append(self.value())
                if self.peek() == ",":
                    self.take()
            self.take()
            if tok in ("min", "max") and len(args) == 2:
                return _min_max(tok, *args)
            return args[0] if tok == "u32" and len(args) == 1 else None
        return self.env.get(tok)

    def postfix(self, out):
        while self.peek() in (".", "["):
            if self.take() == ".":
                self.take()
            else:
                self.value()
                self.take()
            out = None
        return out


def _index_of(line, start):
    """The text between the ``[`` at ``start`` and its closing ``]``."""
    depth = 0
    for i in range(start, len(line)):
        depth += (line[i] == "[") - (line[i] == "]")
        if depth == 0:
            return line[start + 1:i]
    raise ValueError(f"no closing ] in {line!r}")


def unproven(wgsl: str, space: str = "workgroup") -> list[str]:
    """``name[index]`` for every access to an array of ``space`` ("workgroup"
    or "storage": the sized ones) that Tint's range analysis cannot prove
    inside the array."""
    arrays = {name: int(n) for name, n in re.findall(
        rf"var<{space}[^>]*>\s+(\w+)\s*:\s*array<(?:[^<>]|<[^<>]*>)+,\s*(\d+)u?>", wgsl)}
    size = re.search(r"@workgroup_size\((\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", wgsl)
    if size is None:
        raise ValueError("no @workgroup_size in the WGSL")
    threads = 1
    for d in size.groups():
        threads *= int(d or 1)
    env = {}
    index = re.search(r"@builtin\(local_invocation_index\)\s+(\w+)", wgsl)
    if index:
        env[index.group(1)] = (0, threads - 1)
    found = []
    for line in wgsl.splitlines():
        loop = re.match(r"\s*for \(var (\w+): u32 = (\d+)u; \1 < (\d+)u; \1 \+= 1u\)", line)
        if loop:
            env[loop.group(1)] = (int(loop.group(2)), int(loop.group(3)) - 1)
        for name, length in arrays.items():
            for hit in re.finditer(rf"\b{name}\[", line):
                text = _index_of(line, hit.end() - 1)
                got = _Expr(text, env).value()
                if got is None or got[1] >= length:
                    found.append(f"{name}[{text}]")
        let = re.match(r"\s*let (\w+) = (.*);\s*$", line)
        if let:
            env[let.group(1)] = _Expr(let.group(2), env).value()
    return found
