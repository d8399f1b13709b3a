"""Compiling loads and stores of workgroup memory and storage buffers so
that each one is logged.

:class:`CheckedExprCompiler` is the expression compiler with one difference:
every access rooted at a ``m.shared`` array also reports the scalar elements
it touches to the workgroup's log (``shared.ArrayLog``), which finds races
and reads of unwritten elements; every access to an element of a read_write
storage buffer reports it to the workgroup's ``storage.StorageLog``, which
finds races. Everything else compiles as before, so a kernel with neither
pays nothing.
"""
from __future__ import annotations

from typing import Callable

from .. import expr as E
from .. import types as T
from .. import values as V
from ..operators import Access
from .exprs import ExprCompiler


def is_shared(e: E.Expr) -> bool:
    """Is ``e`` a location in (or the whole of) a workgroup array?"""
    if not isinstance(e, (E.Ref, E.Index, E.Member)):
        return False
    r = E.root(e)
    return isinstance(r, E.Ref) and r.kind == E.RefKind.WORKGROUP


class CheckedExprCompiler(ExprCompiler):
    """An ExprCompiler whose workgroup-memory accesses are logged.

    ``offsets`` maps each workgroup array's name to an int array shaped like
    its value holding the flat scalar offsets (``shared.index_arrays``).
    """

    def __init__(self, name: str, offsets: dict, robust: bool = False,
                 storage: frozenset = frozenset()):
        super().__init__(name, robust)
        self.offsets = offsets
        self.storage = storage   # the read_write storage buffers whose accesses are logged

    def __call__(self, e: E.Expr) -> Callable:
        if is_shared(e) and E.root(e).name in self.offsets:
            return self._load(e)
        if self._in_storage(e):
            return self._storage_load(e)
        return super().__call__(e)

    def _in_storage(self, e: E.Expr) -> bool:
        """Is ``e`` a location inside a logged storage buffer (not the whole buffer)?"""
        if not isinstance(e, (E.Index, E.Member)):
            return False
        r = E.root(e)
        return isinstance(r, E.Ref) and r.kind == E.RefKind.BUFFER and r.name in self.storage

    def _element(self, e: E.Expr) -> Callable:
        """``f(inv) -> int``: the index of the buffer element the location lies in."""
        while not (isinstance(e, E.Index) and isinstance(e.base, E.Ref)):
            e = e.base
        idx = self(e.index)
        return lambda inv: int(idx(inv))

    def _storage_load(self, e) -> Callable:
        load, element, name, where = super().__call__(e), self._element(e), E.root(e).name, \
            e.where

        def logged(inv):
            value = load(inv)
            inv.st.read(name, element(inv), inv.local_index, where)
            return value
        return logged

    def _load(self, e) -> Callable:
        place, where, name = self.shared_place(e), e.where, E.root(e).name

        def load(inv):
            c, k, off = place(inv)
            inv.wg[name].read(off, inv.local_index, where)
            return V.copy(c[k])
        return load

    def logged_place(self, e: E.Expr, mode: Access, where: str) -> Callable:
        """``place(e)`` that logs a read, a write or an update (both) of workgroup
        memory or of a storage buffer's element."""
        if self._in_storage(e):
            return self._storage_place(e, mode, where)
        if not (is_shared(e) and E.root(e).name in self.offsets):
            return self.place(e)
        place, name = self.shared_place(e), E.root(e).name
        read, write = mode != Access.WRITE, mode != Access.READ

        def logged(inv):
            c, k, off = place(inv)
            log = inv.wg[name]
            if read:
                log.read(off, inv.local_index, where)
            if write:
                log.write(off, inv.local_index, where)
            return c, k
        return logged

    def _storage_place(self, e: E.Expr, mode: Access, where: str) -> Callable:
        place, element, name = self.place(e), self._element(e), E.root(e).name
        read, write = mode != Access.WRITE, mode != Access.READ

        def logged(inv):
            c, k = place(inv)
            i = element(inv)
            if read:
                inv.st.read(name, i, inv.local_index, where)
            if write:
                inv.st.write(name, i, inv.local_index, where)
            return c, k
        return logged

    def shared_place(self, e: E.Expr) -> Callable:
        """``f(inv) -> (container, key, offsets)``: offsets is an int for one scalar
        element (the common ``sh[i]``), else an int array."""
        if isinstance(e, E.Index) and isinstance(e.base, E.Ref) and \
                isinstance(e.base.type.elem, (T.Scalar, T.Atomic)):
            name, idx, check = e.base.name, self(e.index), self.bounds_check(e)

            def element(inv):
                arr = inv.env[name]
                i = check(inv, arr, idx(inv))
                return arr, i, i
            return element
        path = self._path(e)

        def general(inv):
            c, k, oc = path(inv)
            return c, k, oc[k]
        return general

    def _path(self, e: E.Expr) -> Callable:
        """``f(inv) -> (container, key, offsets container)``, walking the value and
        its offsets array in step."""
        if isinstance(e, E.Ref):
            name, holder = e.name, {e.name: self.offsets[e.name]}
            return lambda inv: (inv.env, name, holder)
        assert isinstance(e, (E.Member, E.Index)), f"not a location: {e!r}"
        parent = self._path(e.base)
        if isinstance(e, E.Member):
            ks = e.components
            key = ks[0] if len(ks) == 1 else list(ks)

            def member(inv):
                c, k, oc = parent(inv)
                return c[k], key, oc[k]
            return member
        idx, check = self(e.index), self.bounds_check(e)

        def index(inv):
            c, k, oc = parent(inv)
            arr = c[k]
            return arr, check(inv, arr, idx(inv)), oc[k]
        return index
