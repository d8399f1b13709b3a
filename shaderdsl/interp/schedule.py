"""Running one workgroup: its invocations, meeting at barriers and subgroup operations.

Every invocation is a generator (the compiled body). The scheduler runs each
runnable invocation, in local_invocation_index order, until it finishes or
stops at a barrier or a subgroup operation. Subgroup operations are resolved
across the lanes of one subgroup that wait at the same call; a barrier is
passed when every unfinished invocation waits at the same barrier statement
(else InterpreterError names where each one is).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import nodes as N
from .. import values as V
from ..errors import InterpreterError
from ..ops import INACTIVE_LANE
from .stmts import SUBGROUP


class Invocation:
    """One invocation's state: its names (``env``) and builtin ids.

    ``env`` maps every name the kernel uses to its value: buffers and
    workgroup arrays (numpy arrays shared with others), uniforms, overrides,
    builtins and locals.
    """

    __slots__ = ("env", "global_id", "local_id", "workgroup_id", "local_index", "sg",
                 "local_names", "wg", "st")

    def __init__(self, env, global_id, local_id, workgroup_id, local_index, local_names):
        self.env = env
        self.global_id = global_id
        self.local_id = local_id
        self.workgroup_id = workgroup_id
        self.local_index = local_index
        self.sg = {}                   # subgroup call -> its result, for the statement running
        self.local_names = local_names
        self.wg = None                 # workgroup array name -> its ArrayLog, when checked
        self.st = None                 # the workgroup's StorageLog, when storage is checked

    def locals(self) -> dict:
        """Local lets, vars and loop counters declared so far, by WGSL name."""
        return {k: V.copy(v) for k, v in self.env.items() if k in self.local_names}

    def describe(self) -> str:
        g, w = self.global_id, self.workgroup_id
        return (f"global_id=({g[0]}, {g[1]}, {g[2]}), workgroup_id=({w[0]}, {w[1]}, {w[2]}), "
                f"local_index={self.local_index}")


@dataclass
class TraceEvent:
    """What ``trace`` gets before each statement runs (see Interpreter.dispatch)."""

    where: str          # Python file:line that built the statement
    text: str           # its first WGSL line
    global_id: tuple
    local_id: tuple
    workgroup_id: tuple
    local_index: int
    invocation: Invocation
    statement: object   # the stmt node

    @property
    def locals(self) -> dict:
        return self.invocation.locals()

    def __str__(self) -> str:
        return f"{self.global_id} {self.where}: {self.text}"


def invocations(module, genv: dict, wid: tuple, subgroup_size: int, local_names,
                log=None, storage=None) -> list:
    """The invocations of workgroup ``wid``, sharing fresh zeroed workgroup memory
    (and ``log``, the WorkgroupLog that checks its use, and ``storage``, the
    StorageLog that checks storage buffers, if given)."""
    X, Y, Z = module.workgroup_size
    shared = {r.name: V.zero_value(r.type) for r in module.workgroup_vars}
    out = []
    for li in range(X * Y * Z):
        lid = (li % X, (li // X) % Y, li // (X * Y))
        gid = (wid[0] * X + lid[0], wid[1] * Y + lid[1], wid[2] * Z + lid[2])
        ids = {"global_id": gid, "local_id": lid, "workgroup_id": wid, "local_index": li,
               "subgroup_invocation_id": li % subgroup_size, "subgroup_size": subgroup_size}
        env = dict(genv)
        env.update(shared)
        for key, ref in module.builtins.items():
            if key in ids:
                env[key] = np.array(ids[key], np.uint32) if isinstance(ids[key], tuple) \
                    else np.uint32(ids[key])
        inv = Invocation(env, gid, lid, wid, li, local_names)
        inv.wg = log.arrays if log is not None else None
        inv.st = storage
        out.append(inv)
    return out


@dataclass
class LaneReads:
    """What a read of a subgroup lane that is not active gets (WGSL: an
    indeterminate value): zero, as NVIDIA gives, or with ``own`` the reader's
    own value; ``where`` collects the Python lines that made such reads, so two
    runs whose results differ can say what the results hang on."""

    own: bool = False
    where: set = field(default_factory=set)

    def fill(self, call, args: tuple, where: str):
        self.where.add(where)
        return V.copy(args[0]) if self.own else V.zero_value(call.type)


def run_workgroup(name: str, invs: list, body, subgroup_size: int, log=None,
                  lane_reads: LaneReads | None = None, storage=None) -> None:
    """Run one workgroup's invocations to the end; ``log`` (a WorkgroupLog)
    hears of every workgroupBarrier() passed and of the end, ``storage`` (a
    StorageLog) of every barrier; ``lane_reads`` fills reads of lanes
    that are not active (default: zero)."""
    lane_reads = LaneReads() if lane_reads is None else lane_reads
    n = len(invs)
    gens = [body(inv) for inv in invs]
    events: list = [None] * n
    sends: list = [None] * n
    alive = [True] * n
    runnable = list(range(n))
    while True:
        for k in runnable:
            try:
                events[k] = gens[k].send(sends[k])
            except StopIteration:
                events[k] = None
                alive[k] = False
            sends[k] = None
        live = [k for k in range(n) if alive[k]]
        if not live:
            if log is not None:
                log.finish()
            return
        waiting = [k for k in live if events[k][0] is SUBGROUP]
        if waiting:
            runnable = _resolve_subgroups(waiting, events, sends, subgroup_size, lane_reads,
                                          log)
            continue
        _check_same_barrier(name, invs, events, alive, live)
        kind = events[live[0]][1].kind
        if log is not None and kind == N.BarrierKind.WORKGROUP:
            log.barrier()
        if storage is not None:
            storage.barrier()
        runnable = live


def _resolve_subgroups(waiting: list, events: list, sends: list, subgroup_size: int,
                       lane_reads: LaneReads, log=None) -> list:
    """Compute each subgroup call for the lanes waiting at it together; ``log``
    (a WorkgroupLog) hears of the subgroup-matrix loads and stores among them."""
    groups: dict = {}
    for k in waiting:
        groups.setdefault((k // subgroup_size, id(events[k][1])), []).append(k)
    runnable = []
    for ks in groups.values():
        call = events[ks[0]][1]
        collective = call.op.semantics(tuple(a.type for a in call.args), call.type)
        results = collective([k % subgroup_size for k in ks], [events[k][2] for k in ks])
        if log is not None:
            log.matrix(call, events[ks[0]][2], ks, events[ks[0]][3])
        for k, r in zip(ks, results):
            sends[k] = r if r is not INACTIVE_LANE else \
                lane_reads.fill(call, events[k][2], events[k][3])
            runnable.append(k)
    return sorted(runnable)


def _check_same_barrier(name, invs, events, alive, live) -> None:
    """Everyone left is at a barrier: it must be the same one, and nobody returned."""
    n = len(invs)
    first = events[live[0]][1]
    if len(live) == n and all(events[k][1] is first for k in live):
        return
    at: dict = {}
    for k in range(n):
        where = f"{events[k][1].kind}Barrier() at {events[k][1].where}" if alive[k] else "returned"
        at.setdefault(where, []).append(k)
    summary = "; ".join(f"{w}: local_index {_ranges(ks)}" for w, ks in at.items())
    raise InterpreterError(
        f"kernel {name!r}, workgroup {invs[0].workgroup_id}: a barrier must be "
        f"reached by every invocation of the workgroup (uniform control flow), "
        f"but they diverged: {summary}")


def _ranges(ks: list[int]) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive numbers
    for k in ks:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
