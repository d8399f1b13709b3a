"""Checks on workgroup memory: data races and reads of elements nobody wrote.

A GPU runs the invocations of a workgroup at once, so two of them touching
one element of a ``m.shared`` array between the same two workgroupBarrier()s,
one of them writing, get whatever the hardware's interleaving gives; and it
does not reliably zero workgroup memory (lavapipe returns garbage), so a read
of an element no invocation wrote is garbage too. The interpreter runs one
invocation at a time, which hides both; these logs make them errors instead.

Every workgroup gets a :class:`WorkgroupLog`: per array and per scalar
element, the last writer and the readers of the current *epoch* (the span
between two workgroupBarrier()s). A write races with a write or read by
another invocation in the same epoch, a read with a write by another. A read
of an element never written is held until the end of the epoch: if another
invocation writes that element before the barrier, the real mistake is the
missing barrier and a RaceError says so; otherwise UninitializedReadError.
Atomics do not race with each other; they are checked for reads only.

A subgroup-matrix load or store is one access by the whole subgroup: which
lane moves which element is the hardware's choice (and may differ between a
load and a store of one tile), so every element it touches counts as read or
written by *every* lane of the subgroup. The log records such an access
under a subgroup id (``WorkgroupLog.subgroup``, never a local_index): it
conflicts with any other invocation's access, with any access by a lane of
the same subgroup, and with the same subgroup's next matrix load or store of
the element; only reads do not conflict with reads.
"""
from __future__ import annotations

import numpy as np

from .. import types as T
from .. import values as V
from ..errors import RaceError, UninitializedReadError
from ..ops import matrix_access

_LANES = "xyzw"
SUBGROUP_IDS = 1 << 20   # ids from here up name a whole subgroup, not one local_index


def index_arrays(module) -> dict:
    """name -> array of flat scalar offsets, shaped like the workgroup array's value."""
    out = {}
    for r in module.workgroup_vars:
        shape = V.shape_of(r.type)
        out[r.name] = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return out


def _label(name: str, shape: tuple, dims, off: int, vector_last: bool) -> str:
    """``red[5]``, ``tile[2, 3]`` (a shaped array) or ``hw[3].y`` for a flat
    offset into ``name``, whose value has numpy ``shape``."""
    idx = [int(i) for i in np.unravel_index(off, shape)]
    outer = [int(i) for i in np.unravel_index(idx[0], dims)] if dims else idx[:1]
    text = f"{name}[{', '.join(map(str, outer))}]"
    inner = idx[1:]
    if vector_last and inner:
        return text + "".join(f"[{i}]" for i in inner[:-1]) + f".{_LANES[inner[-1]]}"
    return text + "".join(f"[{i}]" for i in inner)


class ArrayLog:
    """Per scalar element of one workgroup array: last write, readers this epoch."""

    __slots__ = ("name", "group", "epoch", "norace", "shape", "dims", "vector_last", "w_inv",
                 "w_ep", "w_at", "r_ep", "r_inv", "r_at", "r2_inv", "r2_at")

    def __init__(self, ref, group: "WorkgroupLog", shape: tuple, races: bool):
        n = int(np.prod(shape))
        self.name, self.group, self.epoch, self.shape = ref.name, group, 0, shape
        self.dims = getattr(ref, "shape", None)   # m.shared(elem, (rows, cols)): tile[r, c]
        elem = ref.type
        while isinstance(elem, T.Array):
            elem = elem.elem
        self.norace = isinstance(elem, T.Atomic) or not races   # atomics do not race
        self.vector_last = isinstance(elem, T.Vector)
        self.w_inv = [-1] * n      # last writer's local_index, -1: never written
        self.w_ep = [-1] * n       # the epoch of that write
        self.w_at: list = [None] * n
        self.r_ep = [-1] * n       # the epoch the readers below read in
        self.r_inv = [-1] * n      # the first reader in that epoch
        self.r_at: list = [None] * n
        self.r2_inv = [-1] * n     # another reader in that epoch, -1: none
        self.r2_at: list = [None] * n

    def read(self, off, k: int, where: str) -> None:
        """Invocation ``k`` reads the element(s) at ``off`` (an int or an int array)."""
        if type(off) is not int:
            if isinstance(off, np.ndarray) and off.ndim:
                for o in off.reshape(-1).tolist():
                    self.read(o, k, where)
                return
            off = int(off)
        ep = self.epoch
        w = self.w_inv[off]
        if w < 0:
            self.group.unwritten(self, off, k, where)
        elif self.w_ep[off] == ep and (w != k or k >= SUBGROUP_IDS) and not self.norace:
            self.group.race(self, off, (w, self.w_at[off], "written"), (k, where, "read"))
        if self.r_ep[off] != ep:
            self.r_ep[off], self.r_inv[off], self.r_at[off], self.r2_inv[off] = ep, k, where, -1
        elif self.r_inv[off] != k and self.r2_inv[off] < 0:
            self.r2_inv[off], self.r2_at[off] = k, where

    def write(self, off, k: int, where: str) -> None:
        """Invocation ``k`` writes the element(s) at ``off``."""
        if type(off) is not int:
            if isinstance(off, np.ndarray) and off.ndim:
                for o in off.reshape(-1).tolist():
                    self.write(o, k, where)
                return
            off = int(off)
        ep = self.epoch
        if not self.norace:
            whole = k >= SUBGROUP_IDS   # a matrix store: its own earlier accesses conflict too
            if self.w_ep[off] == ep and (self.w_inv[off] != k or whole):
                self.group.race(self, off, (self.w_inv[off], self.w_at[off], "written"),
                                (k, where, "written"))
            if self.r_ep[off] == ep:
                first = self.r_inv[off] != k or whole
                if first or self.r2_inv[off] >= 0:
                    r, at = (self.r_inv[off], self.r_at[off]) if first else \
                        (self.r2_inv[off], self.r2_at[off])
                    self.group.race(self, off, (r, at, "read"), (k, where, "written"))
        self.w_inv[off], self.w_ep[off], self.w_at[off] = k, ep, where

    def label(self, off: int) -> str:
        return _label(self.name, self.shape, self.dims, off, self.vector_last)


class WorkgroupLog:
    """The logs of one workgroup's arrays; ``arrays`` is what invocations see."""

    def __init__(self, kernel: str, wid: tuple, module, offsets: dict, races: bool,
                 uninitialized: bool):
        self.kernel, self.wid, self.uninitialized = kernel, tuple(wid), uninitialized
        self.arrays = {r.name: ArrayLog(r, self, offsets[r.name].shape, races)
                       for r in module.workgroup_vars}
        self.pending = None        # the first read of an unwritten element this epoch
        self.subgroups: list[str] = []   # what each subgroup id names ("local_index 0-31")

    def subgroup(self, lanes: list) -> int:
        """The id under which a subgroup-matrix access by ``lanes`` (the local
        indices of the subgroup that reached it) is logged: one per subgroup."""
        text = f"local_index {lanes[0]}-{lanes[-1]}" if len(lanes) > 1 else \
            f"local_index {lanes[0]}"
        if text not in self.subgroups:
            self.subgroups.append(text)
        return SUBGROUP_IDS + self.subgroups.index(text)

    def who(self, k: int) -> str:
        """``local_index 3``, or for a subgroup id ``the subgroup of local_index 0-31 (a
        subgroup-matrix load or store: any of its lanes)``."""
        if k < SUBGROUP_IDS:
            return f"local_index {k}"
        return (f"the subgroup of {self.subgroups[k - SUBGROUP_IDS]} (a subgroup-matrix load "
                f"or store: any of its lanes)")

    def unwritten(self, log: ArrayLog, off: int, k: int, where: str) -> None:
        if self.uninitialized and self.pending is None:
            self.pending = (log, off, k, where)

    def matrix(self, call, args: tuple, lanes: list, where: str) -> None:
        """Log a subgroup-matrix load or store from or into a workgroup array,
        just made by ``lanes`` with ``args`` (other subgroup calls: nothing)."""
        access = matrix_access(call, args)
        log = None if access is None else self.arrays.get(call.args[0].target.name)
        if access is None or log is None:   # not a matrix load or store, or of a buffer
            return
        writes, elements = access
        (log.write if writes else log.read)(elements, self.subgroup(lanes), where)

    def barrier(self) -> None:
        """A workgroupBarrier() passed: raise a held read, start a new epoch."""
        self.finish()
        for log in self.arrays.values():
            log.epoch += 1

    def finish(self) -> None:
        """The epoch (or the workgroup) ended: a held read of an unwritten element raises."""
        if self.pending is None:
            return
        log, off, k, where = self.pending
        raise UninitializedReadError(
            f"{where}: {self.who(k)} reads workgroup array element {log.label(off)}, which no "
            f"invocation of workgroup {self.wid} has written in this dispatch (kernel "
            f"{self.kernel!r}). GPUs do not reliably zero workgroup memory (lavapipe returns "
            f"garbage): write it first, then workgroupBarrier()")

    def race(self, log: ArrayLog, off: int, first: tuple, second: tuple) -> None:
        (k1, at1, did1), (k2, at2, did2) = first, second
        raise RaceError(
            f"{at2}: data race on workgroup array element {log.label(off)} in kernel "
            f"{self.kernel!r}, workgroup {self.wid}: {did1} by {self.who(k1)} at {at1}, then "
            f"{did2} by {self.who(k2)} at {at2}, with no workgroupBarrier() between them")
