"""A numpy interpreter for shaderdsl kernels: run a kernel's tree on the CPU.

The interpreter runs the same tree (``Kernel.ir``) that the emitter turned
into WGSL, one invocation at a time, with numpy scalars of the WGSL types
(np.float32, np.float16, np.int32 and np.uint32 with wrapping, np.bool_) and
small numpy arrays for vectors; each operation means what its registry entry
(``shaderdsl.ops``) says. It is slow (Python per invocation and per node) and
meant for small inputs: to check a kernel against numpy without a GPU, to get
a Python exception with a location where the GPU would silently clamp an
out-of-bounds index, and to step through a kernel (``trace=``).

Execution model:

* every invocation of every workgroup runs; workgroups one after another
  (x fastest, then y, then z), the invocations of a workgroup in
  ``local_invocation_index`` order, each until it finishes or reaches a
  ``workgroupBarrier``/``storageBarrier`` or a subgroup operation;
* workgroup memory is fresh for each workgroup; reading an element that no
  invocation of the workgroup wrote raises UninitializedReadError (GPUs do
  not reliably zero it; ``check_uninitialized=False`` reads zeros instead);
* at a barrier every unfinished invocation of the workgroup must wait at the
  same barrier statement (else InterpreterError names where each one is);
* subgroups are runs of ``subgroup_size`` consecutive local indices; a
  subgroup operation is resolved across the lanes of one subgroup that wait
  at it together (lanes that returned, or are elsewhere, do not take part);
* atomics are trivially atomic (one invocation runs at a time); two
  invocations touching one element of workgroup memory between the same two
  workgroupBarrier()s, one of them writing (not both atomically), raise
  RaceError naming both lines (``check_races=False``: the order above decides);
  a subgroup-matrix load or store touches each of its elements from every lane
  of the subgroup (which lane moves which element is the hardware's choice).
  Storage buffers are not checked for races; ``interp.Device`` runs a dispatch
  of several workgroups a second time with the last workgroup first, and
  raises InterpreterError where the results differ (a workgroup read what
  another wrote in the same dispatch: no order is promised on a GPU).

Modules: ``exprs`` and ``stmts`` compile the tree to Python functions,
``access`` logs workgroup-memory accesses to ``shared``'s checks,
``schedule`` runs a workgroup, ``host`` binds numpy arrays, ``device`` and
``buffers`` give the GPU Device's host API.
Entry points: :func:`run` (build, dispatch, return the read_write buffers),
:class:`Interpreter` (build once, dispatch many times) and :class:`Device`
(the host code written for ``shaderdsl.runtime.Device``, run here).
"""
from ..errors import InterpreterError, OutOfBoundsError, RaceError, UninitializedReadError
from .buffers import Buffer
from .device import SUPPORTED_FEATURES, Batch, Device
from .interpreter import DEFAULT_MAX_LOOP_ITERATIONS, DEFAULT_SUBGROUP_SIZE, Interpreter, run
from .schedule import TraceEvent

InterpDevice = Device   # the name to use where runtime.Device is imported too

__all__ = ["run", "Interpreter", "Device", "InterpDevice", "Buffer", "Batch",
           "InterpreterError", "OutOfBoundsError", "RaceError", "UninitializedReadError",
           "TraceEvent", "DEFAULT_SUBGROUP_SIZE", "DEFAULT_MAX_LOOP_ITERATIONS",
           "SUPPORTED_FEATURES"]
