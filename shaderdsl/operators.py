"""The registry's operators: the type of its entries (:class:`Op`), the
entries of Python's infix and prefix operators and of the type constructors,
and the typing rules of the operators.

An entry says everything the library knows about an operation:

- its WGSL spelling (``wgsl``) and, for infix operators, its precedence
  ``group`` (the emitter parenthesizes from it), its compound assignment
  (``compound``) and, for ``&&`` and ``||``, the left value that decides
  alone (``short_circuit``);
- its meaning on numpy values (``semantics(arg_types, result_type)`` gives
  a function of the argument values), which the interpreter runs and which
  constant evaluation (``shaderdsl.consts``) uses;
- for a builtin function, its typing rule (``rule``: the arguments as the
  user gave them -> the checked argument expressions and the result type,
  or a ShaderTypeError naming the user's line); the adapter feature it needs
  and whether it is a side effect (atomics, emitted as a statement) or a
  subgroup collective (values across lanes).

The operator rules here read only the operands' types and, for integer
division and shifts, their constant values (``shaderdsl.consts``); the
expressions (``shaderdsl.expr``) apply them when Python's operators build a
node. The builtin functions' entries are in ``shaderdsl.ops``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

import numpy as np

from . import consts
from . import types as T
from . import values as V
from .context import type_error


class Form(StrEnum):
    """How an operation is written and run."""
    INFIX = "infix"
    PREFIX = "prefix"
    CALL = "call"
    ATOMIC = "atomic"                  # a side effect on an atomic, emitted as a statement
    SUBGROUP = "subgroup"              # a collective: values across the subgroup's lanes
    SUBGROUP_STORE = "subgroup_store"  # a collective that writes memory


class Group(StrEnum):
    """An infix operator's precedence group (the emitter parenthesizes from it)."""
    MUL = "mul"
    ADD = "add"
    SHIFT = "shift"
    REL = "rel"
    BIT = "bit"
    LOGIC = "logic"


class Access(StrEnum):
    """What an operation does to the memory it is given."""
    READ = "read"
    WRITE = "write"
    UPDATE = "update"  # reads, then writes


@dataclass(frozen=True, eq=False)
class Op:
    """One operation."""

    name: str                       # the DSL's name (registry key)
    wgsl: str                       # WGSL spelling; "{type}" is replaced by the result type
    form: Form
    semantics: Callable             # (arg types, result type) -> f(*values)
    rule: Callable | None = None    # calls: (*user args) -> (arg exprs, result type)
    feature: str | None = None
    group: Group | None = None      # infix operators
    doc: str = ""
    uniform_args: tuple = ()        # arguments WGSL requires uniform (a shuffle's delta)
    params: tuple[str, ...] = ()    # a call's argument names when its rule takes *args
    void: bool = False              # a call that gives no value (the stores)
    access: Access = Access.UPDATE  # an atomic's access to its target
    compound: str | None = None     # infix: WGSL's compound assignment, None where it has none
    short_circuit: bool | None = None  # && and ||: the left value that decides alone

    def __post_init__(self):
        # a plain string is checked and made the member ("call" -> Form.CALL)
        object.__setattr__(self, "form", Form(self.form))
        if self.group is not None:
            object.__setattr__(self, "group", Group(self.group))

    @property
    def effect(self) -> bool:
        """Atomics and subgroup matrix stores change memory: the builder emits
        them as statements."""
        return self.form in (Form.ATOMIC, Form.SUBGROUP_STORE)

    @property
    def collective(self) -> bool:
        """Subgroup operations combine the values of several invocations."""
        return self.form in (Form.SUBGROUP, Form.SUBGROUP_STORE)

    @property
    def template_like(self) -> bool:
        """``<``, ``<=``, ``>``, ``>=``: unparenthesized among a call's arguments
        they read as a WGSL template list (``f(a < b, c > d)``)."""
        return self.group == Group.REL and self.wgsl[0] in "<>"

    def spell(self, result_type) -> str:
        """The WGSL name for a call with this result type ("{component}": a
        subgroup matrix's component type)."""
        if "{" not in self.wgsl:
            return self.wgsl
        return self.wgsl.format(type=result_type,
                                component=getattr(result_type, "component", result_type))

    def __repr__(self) -> str:
        return f"<Op {self.name} {self.wgsl!r}>"


# ================================================================ operators

def _int_arith(f):
    """Integer semantics: in int64 (Python ints for two scalars), wrapped to the
    32-bit result type."""
    def make(types, rt):
        dt = V.dtype_of(rt)
        wrap_int = V.int_wrapper(dt)

        def apply(a, b):
            if type(a) is np.ndarray or type(b) is np.ndarray:
                return V.wrap(f(np.asarray(a).astype(V.I64), np.asarray(b).astype(V.I64)), dt)
            return wrap_int(f(int(a), int(b)))
        return apply
    return make


def _idiv(x, y):
    """WGSL integer division on int64 values or Python ints: truncates; x / 0 = x
    (and, after wrapping, i32 MIN / -1 = MIN)."""
    if isinstance(x, int) and isinstance(y, int):
        if y == 0:
            return x
        q = abs(x) // abs(y)
        return -q if (x < 0) != (y < 0) else q
    zero = y == 0
    ys = np.where(zero, 1, y)
    q = np.abs(x) // np.abs(ys)
    q = np.where((x < 0) != (ys < 0), -q, q)
    return np.where(zero, x, q)


def _irem(x, y):
    """WGSL integer remainder: sign of x; x % 0 = 0 (and i32 MIN % -1 = 0)."""
    if isinstance(x, int) and isinstance(y, int):
        return 0 if y == 0 else x - _idiv(x, y) * y
    zero = y == 0
    ys = np.where(zero, 1, y)
    q = np.abs(x) // np.abs(ys)
    q = np.where((x < 0) != (ys < 0), -q, q)
    return np.where(zero, 0, x - q * ys)


def _by_kind(int_fn, float_fn, bool_fn=None):
    """Semantics choosing by the scalar type of the first operand."""
    def make(types, rt):
        s = T.component(types[0])
        if s == T.bool_:
            return bool_fn
        if s.is_int:
            return _int_arith(int_fn)(types, rt)
        return float_fn
    return make


def plain(f):
    """Semantics that need no types (comparisons, logic)."""
    return lambda types, rt: f


_G = Group
INFIX = {op.name: op for op in (
    # name, wgsl, form, semantics, precedence group, compound assignment
    Op("add", "+", Form.INFIX, _by_kind(lambda x, y: x + y, lambda x, y: x + y), group=_G.ADD,
       compound="+="),
    Op("sub", "-", Form.INFIX, _by_kind(lambda x, y: x - y, lambda x, y: x - y), group=_G.ADD,
       compound="-="),
    Op("mul", "*", Form.INFIX, _by_kind(lambda x, y: x * y, lambda x, y: x * y), group=_G.MUL,
       compound="*="),
    Op("div", "/", Form.INFIX, _by_kind(_idiv, lambda x, y: x / y), group=_G.MUL, compound="/="),
    Op("rem", "%", Form.INFIX, _by_kind(_irem, np.fmod), group=_G.MUL, compound="%="),
    Op("bit_and", "&", Form.INFIX, _by_kind(lambda x, y: x & y, None, lambda x, y: x & y),
       group=_G.BIT, compound="&="),
    Op("bit_or", "|", Form.INFIX, _by_kind(lambda x, y: x | y, None, lambda x, y: x | y),
       group=_G.BIT, compound="|="),
    Op("bit_xor", "^", Form.INFIX, _by_kind(lambda x, y: x ^ y, None), group=_G.BIT,
       compound="^="),
    # WGSL: a run-time shift amount is taken modulo the bit width (32).
    Op("shl", "<<", Form.INFIX, _int_arith(lambda x, y: x << (y & 31)), group=_G.SHIFT,
       compound="<<="),
    Op("shr", ">>", Form.INFIX, _int_arith(lambda x, y: x >> (y & 31)), group=_G.SHIFT,
       compound=">>="),
    Op("lt", "<", Form.INFIX, plain(lambda x, y: x < y), group=_G.REL),
    Op("le", "<=", Form.INFIX, plain(lambda x, y: x <= y), group=_G.REL),
    Op("gt", ">", Form.INFIX, plain(lambda x, y: x > y), group=_G.REL),
    Op("ge", ">=", Form.INFIX, plain(lambda x, y: x >= y), group=_G.REL),
    Op("eq", "==", Form.INFIX, plain(lambda x, y: x == y), group=_G.REL),
    Op("ne", "!=", Form.INFIX, plain(lambda x, y: x != y), group=_G.REL),  # bool `^`: no `^=`
    # && and || (bool `&` and `|`) short-circuit: the interpreter evaluates the
    # right operand only when the left one does not decide; `a &= b` on bool.
    Op("and", "&&", Form.INFIX, plain(lambda x, y: np.bool_(x and y)), group=_G.LOGIC,
       compound="&=", short_circuit=False),
    Op("or", "||", Form.INFIX, plain(lambda x, y: np.bool_(x or y)), group=_G.LOGIC,
       compound="|=", short_circuit=True),
)}
# Python's operator symbols (what expr's dunders pass) -> entries; `//` is integer `/`.
_PYTHON = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "div", "%": "rem",
           "&": "bit_and", "|": "bit_or", "^": "bit_xor", "<<": "shl", ">>": "shr",
           "<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}


def _negate(types, rt):
    if T.component(rt).is_int:
        dt = V.dtype_of(rt)
        return lambda a: V.wrap(-np.asarray(a).astype(V.I64), dt)
    return lambda a: -a


def _complement(types, rt):
    dt = V.dtype_of(rt)
    return lambda a: V.wrap(~np.asarray(a).astype(V.I64), dt)


PREFIX = {op.name: op for op in (
    Op("neg", "-", Form.PREFIX, _negate),
    Op("complement", "~", Form.PREFIX, _complement),
    Op("not", "!", Form.PREFIX, plain(lambda a: V.scalar(np.asarray(np.logical_not(a))))),
)}

SHIFT = {symbol for symbol, name in _PYTHON.items() if INFIX[name].group == Group.SHIFT}


def value_type(e, op: str) -> T.WType:
    """The type of an operand, refusing atomics and arrays."""
    t = e.type
    if isinstance(t, T.Atomic):
        raise type_error(f"cannot use an atomic<{t.scalar}> directly in `{op}`; "
                         f"use atomic_load(...)")
    if not isinstance(t, (T.Scalar, T.Vector)):
        raise type_error(f"operator `{op}` does not apply to {t}")
    return t


def _shift_rule(op, a, b, ta, tb):
    sa = T.component(ta)
    if not sa.is_int:
        raise type_error(f"`{op}` needs an integer left operand, got {ta}")
    want = T.u32 if isinstance(ta, T.Scalar) else T.Vector(ta.size, T.u32)
    if tb != want:
        raise type_error(f"`{op}` needs a shift amount of type {want}, got {tb}")
    why = consts.refuse_shift(op, a, b, sa)
    if why:
        raise type_error(why)
    return INFIX[_PYTHON[op]], ta


def _compare_rule(op, ta, tb):
    if ta != tb:
        raise type_error(f"`{op}` needs operands of the same type, got {ta} and {tb}")
    if T.component(ta) == T.bool_ and op not in ("==", "!="):
        raise type_error(f"`{op}` does not apply to bool")
    return INFIX[_PYTHON[op]], (T.bool_ if isinstance(ta, T.Scalar) else T.Vector(ta.size, T.bool_))


def _bits_rule(op, ta, tb):
    if ta != tb:
        raise type_error(f"`{op}` needs operands of the same type, got {ta} and {tb}")
    s = T.component(ta)
    if s == T.bool_:
        if op == "^":
            return INFIX["ne"], ta
        if isinstance(ta, T.Scalar):
            return INFIX["and" if op == "&" else "or"], ta
        return INFIX[_PYTHON[op]], ta
    if not s.is_int:
        raise type_error(f"`{op}` needs integer or bool operands, got {ta}")
    return INFIX[_PYTHON[op]], ta


def _arith_rule(op, a, b, ta, tb):
    s = T.component(ta)
    if not s.is_numeric:
        raise type_error(f"`{op}` does not apply to {ta}")
    if op == "//":
        if not s.is_int:
            raise type_error(f"`//` needs integer operands, got {ta}; use `/` for floats")
        op = "/"
    why = consts.refuse_division(op, a, b, s) if op in ("/", "%") and s.is_int else None
    if why:
        raise type_error(why)
    if ta == tb or (isinstance(ta, T.Vector) and tb == s):
        return INFIX[_PYTHON[op]], ta
    if isinstance(tb, T.Vector) and ta == T.component(tb):
        return INFIX[_PYTHON[op]], tb
    raise type_error(f"`{op}` between {ta} and {tb}: vector sizes differ")


def binary_rule(op: str, a, b) -> tuple[Op, T.WType]:
    """The entry and result type of ``a op b`` (Python's operator symbol)."""
    if op not in _PYTHON:
        raise type_error(f"unknown operator {op!r}")
    group = INFIX[_PYTHON[op]].group
    ta, tb = value_type(a, op), value_type(b, op)
    if group == Group.SHIFT:
        return _shift_rule(op, a, b, ta, tb)
    sa, sb = T.component(ta), T.component(tb)
    if sa != sb:
        raise type_error(f"`{op}` between {ta} and {tb}: convert one side explicitly, "
                         f"e.g. {sa}(...) or {sb}(...)")
    if group == Group.REL:
        return _compare_rule(op, ta, tb)
    if group == Group.BIT:
        return _bits_rule(op, ta, tb)
    return _arith_rule(op, a, b, ta, tb)


def unary_rule(op: str, a) -> tuple[Op, T.WType]:
    """The entry and result type of ``-a`` or ``~a``."""
    t = value_type(a, op)
    s = T.component(t)
    if op == "-":
        if s not in (T.f32, T.f16, T.i32):
            raise type_error(f"unary minus needs a signed type (f32, f16, i32), got {t}")
        return PREFIX["neg"], t
    if op == "~":
        if s == T.bool_:
            return PREFIX["not"], t
        if not s.is_int:
            raise type_error(f"`~` needs an integer or bool operand, got {t}")
        return PREFIX["complement"], t
    raise type_error(f"unknown unary operator {op!r}")


# ================================================================ constructors

def _construct(types, rt):
    """T(x) conversion, vecN(x) splat, vecN(v) conversion or vecN(a, b, ...)."""
    dst = T.component(rt)
    if isinstance(rt, T.Scalar):
        return V.convert(types[0], rt)
    dt = V.dtype_of(rt)
    if len(types) == 1:
        if isinstance(types[0], T.Vector):
            conv = V.convert(types[0].scalar, dst)
            return lambda a: np.asarray(conv(a), dt)
        return lambda a: np.full(rt.size, a, dt)
    if all(isinstance(t, T.Scalar) for t in types):
        return lambda *xs: np.array(xs, dt)
    return lambda *xs: np.concatenate([np.atleast_1d(x) for x in xs]).astype(dt)


CONSTRUCT = Op("construct", "{type}", Form.CALL, _construct,
               doc="type constructors and conversions: f32(x), vec4f(a, b, c, d)")
