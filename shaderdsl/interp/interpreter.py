"""The interpreter itself: build a kernel's tree into Python functions once,
then dispatch it over workgroups as often as needed (see the package
docstring for the execution model)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..builder import ShaderM
from ..compiler import compile
from ..emit import emit
from ..errors import DispatchError, ShaderDSLError, is_positive_int
from ..kernel import Kernel
from ..nodes import Module
from .access import CheckedExprCompiler
from .exprs import ExprCompiler
from .host import bind
from .schedule import Invocation, LaneReads, TraceEvent, invocations, run_workgroup
from .shared import WorkgroupLog, index_arrays
from .stmts import StmtCompiler
from .storage import StorageLog, checked_buffers

DEFAULT_SUBGROUP_SIZE = 32
DEFAULT_MAX_LOOP_ITERATIONS = 1_000_000


def _module(source, workgroup_size, name, params) -> Module:
    """The tree to run, from a Kernel, a Module, a ShaderM or a kernel function."""
    if isinstance(source, (Kernel, Module, ShaderM)) and params:
        raise TypeError("params are only for a kernel function, not a built kernel")
    if isinstance(source, Module):
        return source
    if isinstance(source, ShaderM):
        return source.module()
    if not isinstance(source, Kernel):
        if not callable(source):
            raise TypeError(f"Interpreter needs a kernel function, a Kernel or a ShaderM, got "
                            f"{type(source).__name__}")
        source = compile(source, workgroup_size, name=name, **params)
    if source.ir is None:
        raise TypeError("this Kernel holds only WGSL (no tree): pass the kernel function "
                        "and its params instead")
    return source.ir


def _grid(name: str, workgroups) -> tuple[int, int, int]:
    wg = tuple(workgroups) if isinstance(workgroups, (tuple, list)) else (workgroups,)
    sizes = [int(v) for v in wg if is_positive_int(v)]
    if not 1 <= len(wg) <= 3 or len(sizes) != len(wg):
        raise DispatchError(f"kernel {name!r}: workgroups must be 1 to 3 positive ints, "
                            f"got {workgroups!r}")
    x, y, z = sizes + [1] * (3 - len(sizes))
    return x, y, z


class Interpreter:
    """Runs one kernel's tree on the CPU.

    ``source`` is a Kernel (``shaderdsl.compile(...)``), a kernel function
    (compiled here with ``workgroup_size`` and ``params``) or a ShaderM.
    ``subgroup_size`` sets the emulated subgroup width; ``max_loop_iterations``
    bounds each execution of a loop, so a loop that never ends raises
    InterpreterError instead of hanging. ``check_races`` and
    ``check_uninitialized`` check the use of workgroup memory (see the module
    docstring); turned off, it is zero-filled and unchecked. ``robust_access``:
    an index out of bounds is clamped to the last element (as a GPU's robust
    access does) instead of raising OutOfBoundsError.
    """

    def __init__(self, source, workgroup_size: int | tuple = 64, *, name: str | None = None,
                 subgroup_size: int = DEFAULT_SUBGROUP_SIZE,
                 max_loop_iterations: int = DEFAULT_MAX_LOOP_ITERATIONS,
                 check_races: bool = True, check_uninitialized: bool = True,
                 robust_access: bool = False, **params):
        m = _module(source, workgroup_size, name, params)
        if not isinstance(subgroup_size, int) or subgroup_size < 1 or subgroup_size > 128:
            raise ValueError(f"subgroup_size must be an int in 1..128, got {subgroup_size!r}")
        self.module = m
        self.name = m.name
        self.workgroup_size = tuple(m.workgroup_size)
        self.subgroup_size = subgroup_size
        self.max_loop_iterations = max_loop_iterations
        self.check_races = bool(check_races)
        self.check_uninitialized = bool(check_uninitialized)
        self.robust_access = bool(robust_access)
        checked = (self.check_races or self.check_uninitialized) and bool(m.workgroup_vars)
        self._offsets = index_arrays(m) if checked else None
        self._storage = checked_buffers(m) if self.check_races else frozenset()
        self._bodies: dict = {}   # traced? -> (compiled body, local names)
        self._trace = None
        self.lane_reads = LaneReads()

    @property
    def wgsl(self) -> str:
        """The WGSL that ``emit`` gives for the interpreted tree."""
        return emit(self.module)[0]

    def _compiled(self, traced: bool):
        hit = self._bodies.get(traced)
        if hit is None:
            hook = self._note if traced else None
            cx = ExprCompiler(self.name, self.robust_access) \
                if self._offsets is None and not self._storage else \
                CheckedExprCompiler(self.name, self._offsets or {}, self.robust_access,
                                    self._storage)
            sc = StmtCompiler(self.name, cx, self.max_loop_iterations, hook)
            hit = self._bodies[traced] = (sc.block(self.module.body), sc.locals)
        return hit

    def _note(self, st, text: str, inv: Invocation) -> None:
        if self._trace is not None:
            self._trace(TraceEvent(st.where, text, tuple(int(v) for v in inv.global_id),
                                   tuple(int(v) for v in inv.local_id),
                                   tuple(int(v) for v in inv.workgroup_id), int(inv.local_index),
                                   inv, st))

    def dispatch(self, buffers: dict, workgroups: int | tuple = 1, overrides: dict | None = None, *,
                 trace: Callable | None = None, reverse: bool = False,
                 lanes_read_own: bool = False) -> dict:
        """Run the kernel over ``workgroups`` (int or up to 3 ints).

        ``buffers``: binding name -> numpy array (copied in; dtype must match
        the binding) or, for uniforms, a number/array. Returns the read_write
        buffers after the dispatch, name -> array shaped like the input.
        ``trace(event)``, when given, is called before every statement of
        every invocation with a :class:`TraceEvent`. ``reverse``: the
        workgroups in the opposite order (the last first). A subgroup read of
        a lane that is not active (indeterminate in WGSL) gives zero, or with
        ``lanes_read_own`` the reader's own value; ``self.lane_reads`` then
        holds the Python lines that made such reads.
        """
        wg = _grid(self.name, workgroups)
        env, outputs = bind(self.module, buffers, overrides)
        if "num_workgroups" in self.module.builtins:
            env["num_workgroups"] = np.array(wg, np.uint32)
        body, local_names = self._compiled(trace is not None)
        self._trace = trace
        self.lane_reads = LaneReads(own=lanes_read_own)
        try:
            order = [(x, y, z) for z in range(wg[2]) for y in range(wg[1]) for x in range(wg[0])]
            with np.errstate(all="ignore"):
                for wid in (order[::-1] if reverse else order):
                    self._workgroup(env, wid, body, local_names)
        finally:
            self._trace = None
        return {name: work.reshape(shape) for name, (work, shape) in outputs.items()}

    def _workgroup(self, env: dict, wid: tuple, body, local_names) -> None:
        log = None if self._offsets is None else WorkgroupLog(
            self.name, wid, self.module, self._offsets, self.check_races,
            self.check_uninitialized)
        storage = StorageLog(self.name, wid) if self._storage else None
        invs = invocations(self.module, env, wid, self.subgroup_size, local_names, log, storage)
        try:
            run_workgroup(self.name, invs, body, self.subgroup_size, log, self.lane_reads,
                          storage)
        except ShaderDSLError:
            raise
        except Exception as e:
            e.add_note(f"while interpreting kernel {self.name!r} (workgroup_id={wid})")
            raise


def run(fn, workgroup_size, workgroups, buffers: dict, overrides: dict | None = None, *,
        subgroup_size: int = DEFAULT_SUBGROUP_SIZE, trace: Callable | None = None,
        name: str | None = None, check_races: bool = True, check_uninitialized: bool = True,
        **params) -> dict:
    """Build ``fn(m, **params)`` and run it on the CPU over ``workgroups``.

    ``buffers`` maps binding names to numpy arrays (copied; never modified);
    the result maps each read_write binding to its contents after the
    dispatch, shaped like the array given. See :class:`Interpreter`.
    """
    interp = Interpreter(fn, workgroup_size, name=name, subgroup_size=subgroup_size,
                         check_races=check_races, check_uninitialized=check_uninitialized,
                         **params)
    return interp.dispatch(buffers, workgroups, overrides, trace=trace)
