"""Checks on storage buffers: data races between the invocations of a workgroup.

Two invocations of a workgroup that touch one element of a read_write
storage buffer, one of them writing, with no storageBarrier() between them,
race on a GPU: ``total[0] += x[i]`` from every invocation (a sum that needed
``atomic_add``) loses most of its updates there, while the interpreter, one
invocation at a time, would add them all. :class:`StorageLog` makes such a
race a RaceError naming both lines.

Only storageBarrier() orders storage memory (workgroupBarrier() orders
workgroup memory only), so the log starts afresh at each storageBarrier().
Elements are the buffer's array elements (a vec4 is one element). Atomic
buffers do not race. Workgroups are not compared with one another here:
``interp.Device`` runs a dispatch in two workgroup orders and compares the
results instead.
"""
from __future__ import annotations

from .. import types as T
from ..errors import RaceError


def checked_buffers(module) -> frozenset:
    """The names of the read_write storage buffers whose elements can race."""
    return frozenset(r.name for r in module.bindings
                     if r.access == "read_write" and isinstance(r.type, T.Array)
                     and not isinstance(r.type.elem, T.Atomic))


class StorageLog:
    """One workgroup's accesses to read_write storage since its last storageBarrier()."""

    __slots__ = ("kernel", "wid", "writes", "reads")

    def __init__(self, kernel: str, wid: tuple):
        self.kernel, self.wid = kernel, tuple(wid)
        self.writes: dict = {}   # (buffer, element) -> (local_index, where) of the last write
        self.reads: dict = {}    # (buffer, element) -> (local_index, where) of a read, per reader

    def read(self, name: str, i: int, k: int, where: str) -> None:
        key = (name, i)
        w = self.writes.get(key)
        if w is not None and w[0] != k:
            self._race(name, i, (w[0], w[1], "written"), (k, where, "read"))
        readers = self.reads.setdefault(key, {})
        readers.setdefault(k, where)

    def write(self, name: str, i: int, k: int, where: str) -> None:
        key = (name, i)
        w = self.writes.get(key)
        if w is not None and w[0] != k:
            self._race(name, i, (w[0], w[1], "written"), (k, where, "written"))
        for r, at in self.reads.get(key, {}).items():
            if r != k:
                self._race(name, i, (r, at, "read"), (k, where, "written"))
        self.writes[key] = (k, where)

    def barrier(self) -> None:
        """A storageBarrier() passed: what came before is ordered before what follows."""
        self.writes.clear()
        self.reads.clear()

    def _race(self, name: str, i: int, first: tuple, second: tuple) -> None:
        (k1, at1, did1), (k2, at2, did2) = first, second
        raise RaceError(
            f"{at2}: data race on storage buffer element {name}[{i}] in kernel {self.kernel!r}, "
            f"workgroup {self.wid}: {did1} by local_index {k1} at {at1}, then {did2} by "
            f"local_index {k2} at {at2}, with no storageBarrier() between them. On a GPU they "
            f"run at once, so the read may see either value and one write may undo another: "
            f"give each element one writer, sum into one element with an atomic "
            f"(B.atomic_add on an atomic buffer) or a workgroup reduction, or put "
            f"m.storage_barrier() between the two")
