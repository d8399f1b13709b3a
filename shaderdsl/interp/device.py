"""The interpreter as a device: the host API of ``shaderdsl.runtime.Device``.

Host code written for the GPU (make buffers, dispatch, batch, read) runs
unchanged on :class:`Device`, which interprets each dispatch on the CPU
(``Interpreter``) over numpy memory, with the interpreter's checks: out of
bounds indices, races and unwritten reads of workgroup memory. Bad input is
refused by the same checks (``shaderdsl.checks``), with the same exceptions
and messages, before anything runs. Work recorded in a batch runs in order
when the batch ends or something reads, as a GPU submit does.
"""
from __future__ import annotations

import numpy as np

from .. import checks
from .. import types as T
from ..checks import MAX_WORKGROUPS
from ..errors import InterpreterError
from ..hostdevice import HostBatch, HostDevice, locked
from .buffers import Buffer
from .interpreter import DEFAULT_MAX_LOOP_ITERATIONS, DEFAULT_SUBGROUP_SIZE, Interpreter

SUBGROUP_SWEEP = (4, 64)  # besides 32: SwiftShader's and AMD's (lavapipe's 8 runs on CI's GPU)

SUPPORTED_FEATURES = frozenset({"shader-f16", "subgroup", T.SUBGROUP_MATRIX_FEATURE})
# The subgroup-matrix shapes Dawn reported for the H200 (wgpudawn 0.32.0.4 with
# allow_unsafe_apis and vulkan_enable_f16_on_nvidia, 2026-12-03): the interpreter
# claims them by default, emulating any shape exactly.
H200_MATRIX_CONFIGS = tuple(T.MatrixConfig(c, r, m, n, k) for c, r, m, n, k in (
    ("f16", "f16", 16, 16, 16), ("f16", "f32", 16, 16, 16), ("f16", "f16", 16, 8, 16),
    ("f16", "f32", 16, 8, 16), ("f16", "f16", 16, 8, 8), ("f16", "f32", 16, 8, 8),
    ("i8", "i32", 16, 16, 32), ("u8", "u32", 16, 16, 32), ("i8", "i32", 16, 8, 32),
    ("u8", "u32", 16, 8, 32)))
# WebGPU's default limits for compute, which every adapter meets: by default
# the interpreter refuses what some WebGPU device would refuse.
DEFAULT_LIMITS = {
    "max-storage-buffer-binding-size": 134217728, "max-buffer-size": 268435456,
    "max-uniform-buffer-binding-size": 65536, MAX_WORKGROUPS: 65535,
    "max-compute-invocations-per-workgroup": 256, "max-compute-workgroup-storage-size": 16384,
    "max-compute-workgroup-size-x": 256, "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64, "max-storage-buffers-per-shader-stage": 8,
    "max-uniform-buffers-per-shader-stage": 12, "max-bindings-per-bind-group": 1000,
    "max-bind-groups": 4, "max-dynamic-uniform-buffers-per-pipeline-layout": 8,
    "min-storage-buffer-offset-alignment": 256,
    "min-uniform-buffer-offset-alignment": 256,
}


class Device(HostDevice):
    """A device that runs kernels in the interpreter.

    ``features`` are those it claims (default: all it supports, "shader-f16"
    and "subgroup"), so a kernel needing another one raises FeatureError as
    on a GPU without it; ``limits`` update WebGPU's defaults (DEFAULT_LIMITS),
    and are checked as a GPU device checks its own: pass a GPU device's
    ``limits`` to refuse exactly what it refuses. ``subgroup_size``,
    ``max_loop_iterations``, ``check_races``, ``check_uninitialized`` and
    ``robust_access`` go to every Interpreter. ``subgroup_matrix_configs``: its
    subgroup-matrix shapes (default: the H200's, where it claims the feature), kept in
    ``matrix_configs``; the attribute ``subgroup_matrix_configs`` lists those that run
    on subgroups of ``subgroup_size`` (what kernels may use). A kernel of another
    shape, of shapes that run on other subgroup sizes, or with a workgroup x size not a
    multiple of their subgroup size is refused (``checks.check_subgroup_matrices``),
    as Dawn refuses it.

    Subgroup sizes differ between GPUs (4 on SwiftShader, 8 on lavapipe, 32 on
    NVIDIA, 64 on AMD): unless ``subgroup_size`` is given, a kernel that uses
    subgroups first runs at each size of ``SUBGROUP_SWEEP`` on copies of its
    buffers, and an error at any of them (a race between subgroups that
    assumed 32 lanes, an out-of-bounds index) is raised naming the size; then
    it runs at 32 for the results.
    """

    def __init__(self, *, subgroup_size: int | None = None, features=None,
                 limits=None, check_races: bool = True, check_uninitialized: bool = True,
                 robust_access: bool = False,
                 max_loop_iterations: int = DEFAULT_MAX_LOOP_ITERATIONS,
                 subgroup_matrix_configs=None):
        super().__init__()
        feats = SUPPORTED_FEATURES if features is None else frozenset(features)
        if feats - SUPPORTED_FEATURES:
            raise ValueError(f"the interpreter supports features {sorted(SUPPORTED_FEATURES)}, "
                             f"not {sorted(feats - SUPPORTED_FEATURES)}")
        self.subgroup_sweep = SUBGROUP_SWEEP if subgroup_size is None else ()
        subgroup_size = DEFAULT_SUBGROUP_SIZE if subgroup_size is None else subgroup_size
        if not isinstance(subgroup_size, int) or not 1 <= subgroup_size <= 128:
            raise ValueError(f"subgroup_size must be an int in 1..128, got {subgroup_size!r}")
        self.name, self.backend, self.adapter_type = "shaderdsl interpreter", "interpreter", "CPU"
        self.features: frozenset = feats
        self.limits: dict = {**DEFAULT_LIMITS, **dict(limits or {})}
        self.subgroup_size = subgroup_size
        self.matrix_configs: tuple = () if T.SUBGROUP_MATRIX_FEATURE not in feats else \
            H200_MATRIX_CONFIGS if subgroup_matrix_configs is None else \
            tuple(subgroup_matrix_configs)
        # what kernels may use: the shapes that run on subgroups of its size (none of the
        # H200's at 8, as on a GPU of subgroups of 8 without them)
        self.subgroup_matrix_configs = tuple(
            c for c in self.matrix_configs
            if c.subgroup_sizes[0] <= subgroup_size <= c.subgroup_sizes[1])
        self._options: dict = dict(subgroup_size=subgroup_size, check_races=check_races,
                             check_uninitialized=check_uninitialized,
                             robust_access=robust_access,
                             max_loop_iterations=max_loop_iterations)
        self._recorded: list = []        # work recorded in a batch, run in order

    def __repr__(self) -> str:
        return f"<interp.Device subgroup_size={self.subgroup_size} {sorted(self.features)}>"

    @staticmethod
    def adapters_with(feature: str) -> list[str]:
        """Where ``feature`` is to be had (named in FeatureError's message)."""
        if feature in SUPPORTED_FEATURES:
            return [f"interp.Device(features=[..., {feature!r}])"]
        return []

    # -- the device's part of the host API (HostDevice checks first) -------

    def _alloc(self, shape, dtype, kind: str, name, data, size: int) -> Buffer:
        buf = Buffer(self, shape, dtype, kind, size, name)
        if data is not None:
            buf.array[...] = data
        return buf

    def _write(self, buf: Buffer, array) -> None:
        self._flush()  # as on a GPU, a write lands after the work recorded before it
        buf.array[...] = array

    def _read(self, buf: Buffer) -> np.ndarray:
        self._flush()
        return buf.array.copy()

    def _release(self, buf: Buffer) -> None:
        self._flush()
        buf.free()

    def _copy(self, src: Buffer, dst: Buffer, nbytes: int) -> None:
        def run():
            dst.memory[:nbytes] = src.memory[:nbytes]
        self._record(run)

    def _new_entry(self, kernel) -> tuple:
        """A kernel's Interpreter and, for the subgroup sweep where it applies,
        one per size: (interpreter, ((size, interpreter), ...)); a kernel with
        subgroup matrices checked against every configured shape, at this
        device's subgroup size, first."""
        checks.check_subgroup_matrices(kernel, self, self.matrix_configs, self.subgroup_size)
        sizes = self.subgroup_sweep if _sweeps(kernel) else ()
        self.stats["modules"] += 1
        self.stats["pipelines"] += 1
        return (Interpreter(kernel, **self._options),
                tuple((n, Interpreter(kernel, **{**self._options, "subgroup_size": n}))
                      for n in sizes))

    def _prepare(self, kernel, entry, okey: tuple, uniform_values: bool) -> None:
        """Nothing beyond the Interpreters (``uniform_values`` changes nothing here)."""

    def _dispatch(self, kernel, entry, buffers, values, grid, okey) -> None:
        """Record the dispatch; each plain uniform value becomes a Buffer of its own."""
        if values:
            buffers = [self._new(values[i].shape, values[i].dtype, "uniform", b.name, values[i])
                       if i in values else buffers[i] for i, b in enumerate(kernel.bindings)]
        given = dict(okey)
        self.stats["dispatches"] += 1
        interp, trials = entry
        self._record(lambda: _run(interp, trials, kernel, buffers, grid, given))

    # -- batching and waiting --------------------------------------------

    def batch(self, timestamps: bool = False) -> "Batch":
        """``with device.batch():`` runs the dispatches and copies recorded in it
        in order at its end (or at a read); an exception inside drops them."""
        return Batch(self, timestamps)

    @locked
    def sync(self) -> None:
        """Run anything recorded (the interpreter has nothing else to wait for)."""
        self._flush()

    def _record(self, work) -> None:
        self._recorded.append(work)
        if not self._depth:
            self._flush()

    def _flush(self) -> None:
        """Run the recorded work in order; if one piece raises, the rest is dropped."""
        work, self._recorded = self._recorded, []
        if work:
            self.stats["submits"] += 1
        for w in work:
            w()


class Batch(HostBatch):
    """Context manager from ``device.batch()``; nested batches join the outer one.
    ``gpu_time_ns`` is always None: the interpreter has no timestamps."""

    def __init__(self, device: Device, timestamps: bool = False):
        super().__init__(device, timestamps)
        self.gpu_time_ns = None

    def _begin(self) -> None:
        self.device._flush()

    def _end(self) -> None:
        self.device._flush()

    def _drop(self) -> None:
        self.device._recorded = []

    def flush(self) -> None:
        """Run what is recorded so far (the batch stays open)."""
        with self.device.lock:
            self.device._flush()


def _first_difference(first: dict, second: dict):
    """(name, index, value in first, in second, how many differ) of the first
    element two runs' results differ in, bit for bit (NaN too); or None."""
    for name, got in first.items():
        a, b = got.reshape(-1), second[name].reshape(-1)
        bits = [np.ascontiguousarray(v).view(np.uint8).reshape(v.size, -1) for v in (a, b)]
        differ = np.flatnonzero((bits[0] != bits[1]).any(axis=1))
        if differ.size:
            i = int(differ[0])
            return name, i, a[i].item(), b[i].item(), differ.size
    return None


def _differs(kernel, diff, how: tuple, what: str, advice: str) -> InterpreterError:
    name, i, a, b, count = diff
    return InterpreterError(
        f"kernel {kernel.name!r}: the results depend on {what}: '{name}'[{i}] is {a!r} "
        f"{how[0]} and {b!r} {how[1]} ({count} element(s) differ). {advice}")


def _writers(interp: Interpreter, arrays: dict, grid: tuple, overrides: dict, name: str,
             index: int) -> str:
    """Where element ``index`` of buffer ``name`` changed in a run in order
    ("k.py:12 in workgroup (1, 0, 0)"): the statement traced before each change
    wrote it, as invocations run one at a time. Run on the error path only."""
    seen, last, writes = [None], [None], []

    def note(event):
        value = event.invocation.env[name].reshape(-1)[index].tobytes()
        if seen[0] is not None and value != seen[0] and last[0] is not None:
            writes.append(f"{last[0].where} in workgroup {last[0].workgroup_id}")
        seen[0], last[0] = value, event
    interp.dispatch(arrays, grid, overrides, trace=note)
    return ", then ".join(dict.fromkeys(writes)) or "no statement"


WORKGROUP_ORDER = (
    "the order its workgroups run in",
    "A workgroup reads what another wrote in this dispatch, or two write one element: "
    "WebGPU promises no order between workgroups (they run at once on a GPU); split the "
    "work into two dispatches, or give each element one writer")


def _lane_reads(where: set) -> tuple:
    return (f"reads of subgroup lanes that are not active (at {', '.join(sorted(where))})",
            "WGSL leaves such a read indeterminate (NVIDIA gives 0, others what they "
            "like): read only lanes below subgroup_size that take part (a workgroup that "
            "fills its subgroups, uniform control flow), or ignore what such reads give")


def _sweeps(kernel) -> bool:
    """Kernels whose meaning may hang on the subgroup size (subgroup matrices
    come in the sizes of their configs: not swept)."""
    return "subgroup" in kernel.features and T.SUBGROUP_MATRIX_FEATURE not in kernel.features


def _run(interp: Interpreter, trials: tuple, kernel, buffers: list, grid: tuple,
         overrides: dict) -> None:
    """One dispatch: the buffers' memory in, the read_write bindings' results
    back; first on copies with each (subgroup size, interpreter) of ``trials``
    (errors only); then again with the workgroups the other way round, and
    with other values for reads of inactive lanes where there were some: the
    results must not change."""
    arrays = {}
    for b, buf in zip(kernel.bindings, buffers):
        flat = buf.elements()
        if b.access != "uniform":  # whole elements only, as arrayLength counts them
            comps = T.components(b.elem)
            flat = flat[:len(flat) // comps * comps]
        arrays[b.name] = flat
    for size, trial in trials:
        try:
            trial.dispatch({k: v.copy() for k, v in arrays.items()}, grid, overrides)
        except InterpreterError as e:
            raise type(e)(f"with subgroups of {size} (a GPU may have them; interp.Device("
                          f"subgroup_size=...) runs one size only): {e}") from e
    outs = interp.dispatch(arrays, grid, overrides)
    reads = interp.lane_reads
    diff = None if grid == (1, 1, 1) else \
        _first_difference(outs, interp.dispatch(arrays, grid, overrides, reverse=True))
    if diff:  # the workgroups the other way round: no order is promised
        what, advice = WORKGROUP_ORDER
        wrote = _writers(interp, arrays, grid, overrides, diff[0], diff[1])
        raise _differs(kernel, diff, ("with workgroup (0, 0, 0) first", "with the last first"),
                       what, f"'{diff[0]}'[{diff[1]}] was written at {wrote}. {advice}")
    diff = reads.where and _first_difference(
        outs, interp.dispatch(arrays, grid, overrides, lanes_read_own=True))
    if diff:  # reads of inactive lanes given another value: nothing may hang on them
        raise _differs(kernel, diff, ("where they read 0", "where they read the reader's own "
                                      "value"), *_lane_reads(reads.where))
    for b, buf in zip(kernel.bindings, buffers):
        if b.name in outs:
            out = outs[b.name].reshape(-1)
            buf.elements()[:out.size] = out
