"""Workgroup collectives: reduce and scan over the invocations of a workgroup,
with the barriers inside.

Every invocation of the workgroup must call a collective, in uniform control
flow (not inside an ``if_`` that depends on the invocation), like a barrier.
``reduce`` gives every invocation the combination of all the values (or, with
``lanes``, of its group of ``lanes`` consecutive invocations); ``scan`` gives
invocation k the combination of the values of invocations 0..k (inclusive)
or 0..k-1 (exclusive). ``op`` is "sum", "max", "min" or a function of two
expressions (an associative combine such as ``lambda a, b: a * b``).

With ``subgroups=True`` (the kernel then needs the "subgroup" feature) the
subgroup operations do most of the work and one barrier remains; otherwise a
tree in workgroup memory, one barrier per level. Any workgroup size works: a
size that is not a power of two leaves the missing tree nodes out.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import overload

from . import builtins as B
from . import types as T
from .context import type_error
from .expr import ExprLike, Ref, as_expr

SHARED_FLOATS = 4096  # 16 KiB: WebGPU's default maxComputeWorkgroupStorageSize
_SUBGROUP = {"sum": B.subgroup_add, "max": B.subgroup_max, "min": B.subgroup_min}
_COMBINE = {"sum": lambda a, b: a + b, "max": B.max, "min": B.min}


def _combine(op):
    if callable(op):
        return op
    if op not in _COMBINE:
        raise type_error(f"op must be 'sum', 'max', 'min' or a function of two expressions, "
                         f"got {op!r}")
    return _COMBINE[op]


def _identity(op, t: T.WType):
    """The value that leaves ``op`` unchanged, for the types WGSL literals reach."""
    s = T.component(t)
    big = {"f32": 3.4028234663852886e38, "f16": 65504.0, "i32": 2 ** 31 - 1, "u32": 2 ** 32 - 1}
    least = {"f32": -big["f32"], "f16": -big["f16"], "i32": -2 ** 31, "u32": 0}
    if op == "sum":
        return 0.0 if s.is_float else 0
    if op == "min":
        return big[s.name]
    if op == "max":
        return least[s.name]
    raise ValueError(f"op {op!r} has no known identity: pass identity=")


def _constant(value, t: T.WType):
    """``value`` as an expression of type ``t``: a Python number is splat over
    a vector's components, so vector values reduce and scan like scalars."""
    e = as_expr(value, t)
    return t(e) if isinstance(t, T.Vector) and not isinstance(e.type, T.Vector) else e


def _numbers(what: str, values) -> list:
    """The values to combine as expressions: numeric scalars or vectors of one type."""
    exprs = [as_expr(v) for v in values]
    for e in exprs:
        if not (isinstance(e.type, (T.Scalar, T.Vector)) and e.type.is_numeric):
            hint = " (count a condition as u32(cond))" if T.scalar_of(e.type) == T.bool_ else ""
            raise type_error(f"collectives.{what} combines numbers (f32, f16, i32, u32 or "
                             f"vectors of them), got {e.type}{hint}")
    if len({e.type for e in exprs}) > 1:
        raise type_error(f"collectives.{what} of several values needs them of one type, got "
                         f"{', '.join(str(e.type) for e in exprs)}")
    return exprs


def _names(names, count: int) -> list:
    """One let name (or None) per reduced value; a str names a single value."""
    if names is None:
        return [None] * count
    if isinstance(names, str):
        names = [names]
    if len(names) != count:
        raise type_error(f"names must give one name per reduced value ({count}), got {names!r}")
    return list(names)


def _threads(m) -> int:
    x, y, z = m.workgroup_size
    return x * y * z


# One expression gives its let, a list theirs (what a type checker sees: the overloads).
@overload
def reduce(m, values: ExprLike, op: str | Callable = "sum", *, subgroups: bool = False,
           lanes: int | None = None, names=None) -> Ref: ...


@overload
def reduce(m, values: list | tuple, op: str | Callable = "sum", *, subgroups: bool = False,
           lanes: int | None = None, names=None) -> list[Ref]: ...


def reduce(m, values, op: str | Callable = "sum", *, subgroups: bool = False,
           lanes: int | None = None, names=None):
    """Each value combined over the workgroup (or over groups of ``lanes``
    consecutive invocations); a let each invocation can read. ``values`` is one
    expression or a list (reduced together, sharing the barriers)."""
    single = not isinstance(values, (list, tuple))
    exprs = _numbers("reduce", [values] if single else values)
    names = _names(names, len(exprs))
    threads = _threads(m)
    lanes = threads if lanes is None else lanes
    if not (isinstance(lanes, int) and lanes >= 1 and threads % lanes == 0):
        raise type_error(f"lanes must divide the workgroup's {threads} invocations into "
                         f"groups, got {lanes!r}")
    if subgroups and not callable(op) and lanes == threads:
        out = _subgroup_reduce(m, exprs, op, threads, names)
    else:
        out = []

        def finish(red, chunk, g0):
            out.extend(m.let(red[q * threads + m.local_index() // lanes * lanes], names[g0 + q])
                       if lanes != threads else m.let(red[q * threads], names[g0 + q])
                       for q in range(len(chunk)))

        lane = m.local_index() if lanes == threads else m.let(m.local_index() % lanes, "lane")
        tree(m, exprs, op, lanes, lane, finish)
    return out[0] if single else out


def _subgroup_reduce(m, exprs, op, threads, names):
    """One subgroup op per value, a slot per subgroup in workgroup memory, then
    every subgroup combines the slots itself: one barrier, and the subgroup
    ops stay in uniform control flow, as Tint requires."""
    sub, combine = _SUBGROUP[op], _combine(op)
    t = exprs[0].type
    slots = -(-threads // 4)  # subgroups are at least 4 wide
    part = m.shared(t, len(exprs) * slots, m.free_name("partial"))
    lane, size = m.subgroup_invocation_id(), m.subgroup_size()
    sg = m.let(m.local_index() / size, "sg")
    parts = [m.let(sub(a)) for a in exprs]
    with m.if_(lane == 0):
        for r, s in enumerate(parts):
            part[r * slots + sg] = s
    m.barrier()
    count = m.let((threads + size - 1) / size, "nsg")
    # lanes stride over the slots: a power-of-two workgroup has one partial
    # subgroup at most, and then a single slot; otherwise the last subgroup
    # may have fewer active lanes than slots
    pow2 = threads & (threads - 1) == 0
    stride = size if pow2 else m.let(B.min(size, threads - sg * size), "active")
    vs = [m.var(t, _constant(_identity(op, t), t), f"v{r}") for r in range(len(exprs))]
    with m.loop(lane, count, stride, name="j") as j:
        for r in range(len(exprs)):
            if op == "sum":
                vs[r] += part[r * slots + j]
            else:
                m.assign(vs[r], combine(vs[r], part[r * slots + j]))
    return [m.let(sub(v), names[r] or f"h{r}") for r, v in enumerate(vs)]


def tree(m, values, op, lanes, lane, finish, floats=SHARED_FLOATS):
    """Combine each value over groups of ``lanes`` consecutive invocations in
    workgroup memory, a group of values at a time so the array fits ``floats``
    words; ``lane`` is the invocation's index in its group; ``finish(red,
    chunk, g0)`` reads the results (at red[q * threads + group start]).

    Few levels are unrolled in Python (constant offsets); many values make the
    halving a runtime loop, which keeps compile times short on software drivers.
    """
    combine = _combine(op)
    threads = _threads(m)
    tid = m.local_index()
    count = len(values)
    group = max(1, min(count, 4 * floats // (threads * T.stride(values[0].type))))
    red = m.shared(values[0].type, group * threads, m.free_name("red"))
    top = 1 << max(0, math.ceil(math.log2(lanes)))  # the tree's width, a power of two
    levels = top.bit_length() - 1
    for g0 in range(0, count, group):
        chunk = values[g0:g0 + group]
        for q, a in enumerate(chunk):
            red[q * threads + tid] = a
        m.barrier()

        def level(s):
            inside = lane < s if top == lanes else (lane < s) & (lane + s < lanes)
            with m.if_(inside):
                for q in range(len(chunk)):
                    here = red[q * threads + tid]
                    if op == "sum":
                        red[q * threads + tid] += red[q * threads + tid + s]
                    else:
                        red[q * threads + tid] = combine(here, red[q * threads + tid + s])
            m.barrier()

        if len(chunk) * levels <= 64:
            s = top // 2
            while s > 0:
                level(s)
                s //= 2
        else:
            s = m.var(T.u32, top // 2, "s")
            with m.while_(s > 0):
                level(s)
                s >>= 1
        finish(red, chunk, g0)
        m.barrier()  # the next group reuses `red`


def scan(m, value, op: str | Callable = "sum", *, inclusive: bool = True, subgroups: bool = False,
         identity=None, name=None):
    """The prefix combination of ``value`` over the workgroup in local_index
    order: invocation k gets values 0..k (inclusive) or 0..k-1 (exclusive; the
    first gets ``identity``, known for sum, max and min). A let."""
    (v,) = _numbers("scan", [value])
    if not inclusive and identity is None:
        identity = _identity(op, v.type)
    last = (name or "scan") if inclusive else "prefix"   # the let the scan ends in
    if subgroups and op == "sum":
        total = _subgroup_scan(m, v, last)
    else:
        total = _tree_scan(m, v, _combine(op), last)
    if inclusive:
        return total
    return _exclusive(m, total, v.type, identity, name)


def _tree_scan(m, v, combine, name: str):
    """Hillis-Steele in workgroup memory: log2(n) rounds of two barriers."""
    n = _threads(m)
    tid = m.local_index()
    buf = m.shared(v.type, n, m.free_name("scan_buf"))
    buf[tid] = v
    m.barrier()
    s = 1
    while s < n:
        mine = m.var(v.type, buf[tid], "mine")
        with m.if_(tid >= s):
            m.assign(mine, combine(buf[tid - s], mine))
        m.barrier()
        buf[tid] = mine
        m.barrier()
        s *= 2
    return m.let(buf[tid], name)


def _subgroup_scan(m, v, name: str):
    """subgroupInclusiveAdd within each subgroup, then the totals of the
    subgroups before this one, from workgroup memory (one barrier)."""
    n = _threads(m)
    lane, size = m.subgroup_invocation_id(), m.subgroup_size()
    inside = m.let(B.subgroup_inclusive_add(v), "inside")
    totals = m.shared(v.type, -(-n // 4), m.free_name("sg_totals"))  # subgroups are at least 4 wide
    sg = m.let(m.local_index() / size, "sg")
    # the last active lane (a workgroup may end inside its last subgroup)
    with m.if_((lane == size - 1) | (m.local_index() == n - 1)):
        totals[sg] = inside
    m.barrier()
    before = m.var(v.type, _constant(_identity("sum", v.type), v.type), "before")
    with m.loop(0, sg, name="k") as k:
        before += totals[k]
    return m.let(before + inside, name)


def _exclusive(m, inclusive, t, identity, name):
    """The exclusive scan from the inclusive one: the previous invocation's
    inclusive value, read from workgroup memory."""
    n = _threads(m)
    tid = m.local_index()
    prev = m.shared(t, n, m.free_name("scan_prev"))
    prev[tid] = inclusive
    m.barrier()
    first = _constant(identity, t)
    return m.let(B.select(prev[B.max(tid, 1) - 1], first, tid == 0), name or "scan")
