"""A matrix product on matrix units (subgroup matrices), tiled over a workgroup.

``tiled_product(m, tiling, a, b, M, N, K, epilogue)`` computes the (M x N)
product of ``a`` (M x K) and ``b`` (K x N) in the kernel being built, one
(tiling.rows x tiling.cols) block of it per workgroup (workgroup (x, y) is
column block x, row block y):

* the workgroup's threads copy a (rows x k_step) slice of ``a`` and a
  (k_step x cols) slice of ``b`` into workgroup memory, four elements per
  read (or eight f16, 16 bytes: ``tiling.read_width``), zero past the
  matrix's edge (so no size needs to be a multiple of a tile), converted to
  the matrix component type;
* two copies of each slice (double buffering): while the subgroups multiply
  one, the next slice's reads are already in flight, and one barrier per
  step of K suffices; ``tiling.stages = 1`` keeps one copy (half the
  workgroup memory, so deeper steps or bigger tiles fit) at the cost of a
  second barrier per step, the next slice's reads still in flight;
* ``tiling.exact`` (M, N and K ints, multiples of the block and the step)
  drops the edge handling: no bounds tests or selects on the reads, the
  last step multiplied after the loop so that no read passes K, and no
  test around the epilogue;
* each subgroup owns ``fragments`` result matrices and reuses every left and
  right fragment it loads across its row and column of them;
* the results leave through workgroup memory, one fragment at a time, to
  ``epilogue(row, col, value)``: four consecutive columns, a vec4<f32>, only
  inside the product; it writes them wherever it likes (a store, a scaled
  add to the output, ...);
* ``tiling.group`` orders the workgroups in groups of row blocks (Triton's
  GROUP_SIZE_M), so that the workgroups running together share operand
  blocks in L2 (on the H200, 1.7 % either way at 4096^3: note 37).

Every workgroup-array index is built from ``local_index``, constants, ``/``,
``%`` and ``min``, which Tint's integer range analysis proves in bounds, so
Dawn's robustness (with ``enable_integer_range_analysis_in_robustness``)
leaves them unclamped: on the H200 the robust build runs as fast as one
without robustness (docs/optimisation-notes.md, note 37).

``gemm(m, M, N, K, tiling)`` is a whole kernel on it: C = A @ B, f16 in,
f32 out (examples/matrix_gemm.py, ``python -m lora bench --gemm``, which
times the variants: docs/optimisation-notes.md, note 40).

Subgroups are consecutive runs of ``subgroup_size`` local indices, and the
tile each one owns is derived from ``local_index``: uniform within a
subgroup, not within the workgroup. Tint's uniformity analysis only knows
workgroup uniformity, so the module turns its subgroup-matrix check off
(emit.py); the interpreter checks the subgroup uniformity instead, at run
time, for every call.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from . import builtins as B
from . import types as T
from .errors import is_positive_int
from .types import vec2h, vec4f, vec4h, vec4u


@dataclass(frozen=True)
class Operand:
    """One factor of the product, read ``tiling.read_width`` elements at a
    time: ``fetch(i, j)`` gives elements (i, j), (i, j+1), ..., when ``axis``
    is 1, or (i, j), (i+1, j), ... when it is 0: four as a vec4 (of any
    float type), or eight f16 as a vec4<u32> (two a component, the first in
    the low half: a ``vec4<u32>`` view of f16 storage). It is called with
    the first of them inside the matrix and at a multiple of the width on
    ``axis``: the matrix's extent along ``axis`` must be a multiple of it."""

    fetch: Callable
    axis: int = 1


@dataclass(frozen=True)
class MatrixTiling:
    """How one workgroup computes its block of the product: ``subgroups``
    (along rows, along columns), each owning ``fragments`` (along rows,
    along columns) result matrices of ``config``'s shape; ``k_step`` columns
    of ``a`` (rows of ``b``) per staged slice; ``pad`` extra elements per
    row of a staged slice (fewer workgroup-memory bank conflicts); ``group``
    row blocks per group of the workgroup order (0: the dispatch's order,
    see ``origin``); ``read_width`` elements per read of either factor (4,
    or 8 f16 in 16 bytes: Operand); ``stages`` copies of each staged slice
    (2: double buffered, one barrier per step; 1: half the workgroup
    memory, two barriers per step); ``exact``: the product is a whole
    number of blocks and steps (checked by ``tiled_product``), so reads and
    results skip the edge tests."""

    config: T.MatrixConfig
    subgroups: tuple = (2, 2)
    fragments: tuple = (2, 2)
    k_step: int = 16
    pad: int = 8
    group: int = 0
    read_width: int = 4
    stages: int = 2
    exact: bool = False

    def __post_init__(self):
        if self.config.result != "f32":
            raise ValueError(f"tiled_product sums in f32: {self.config} has {self.config.result} "
                             f"results")
        low, high = self.config.subgroup_sizes
        if low != high:
            raise ValueError(f"tiled_product needs one subgroup size, but {self.config} runs "
                             f"on subgroups of {low} to {high}")
        for name in ("subgroups", "fragments"):
            v = getattr(self, name)
            if len(v) != 2 or not all(is_positive_int(d) for d in v):
                raise ValueError(f"{name}: expected (along rows, along columns) positive "
                                 f"ints, got {v!r}")
        if self.k_step < 1 or self.k_step % self.config.k or self.k_step % 4:
            raise ValueError(f"k_step must be a multiple of {self.config.k} (the config's K) "
                             f"and of 4, got {self.k_step}")
        if self.read_width not in (4, 8) or (self.read_width == 8
                                             and self.config.component != "f16"):
            raise ValueError(f"read_width: expected 4, or 8 for f16 factors (16 bytes), got "
                             f"{self.read_width!r} for {self.config}")
        if self.stages not in (1, 2):
            raise ValueError(f"stages: expected 1 or 2 copies of each staged slice, "
                             f"got {self.stages!r}")
        if type(self.group) is not int or self.group < 0:
            raise ValueError(f"group: expected 0 (off) or a positive int of row blocks, "
                             f"got {self.group!r}")
        cells = self.config.m * self.config.n
        if cells % (4 * self.subgroup_size):
            raise ValueError(f"a {self.config} fragment ({cells} results) must split into "
                             f"vec4s evenly over a subgroup of {self.subgroup_size}")
        for what, n in (("a", self.rows * self.k_step), ("b", self.k_step * self.cols)):
            if n % (self.read_width * self.threads):
                reads = "vec4" if self.read_width == 4 else "16-byte (8 f16)"
                raise ValueError(f"a staged slice of {what} ({n} elements) must split into "
                                 f"{reads} reads evenly over {self.threads} threads")

    @property
    def subgroup_size(self) -> int:
        return self.config.subgroup_sizes[0]

    @property
    def threads(self) -> int:
        """The workgroup size this tiling needs."""
        return self.subgroups[0] * self.subgroups[1] * self.subgroup_size

    @property
    def rows(self) -> int:
        return self.subgroups[0] * self.fragments[0] * self.config.m

    @property
    def cols(self) -> int:
        return self.subgroups[1] * self.fragments[1] * self.config.n

    def grid(self, M: int, N: int) -> tuple[int, int, int]:
        """The workgroups an (M x N) product takes."""
        return (-(-N // self.cols), -(-M // self.rows), 1)

    def whole(self, M, N, K) -> bool:
        """Whether an (M x K)(K x N) product is a whole number of blocks and
        steps, as ``exact`` needs (M, N, K ints)."""
        dims = (M, N, K)
        return all(isinstance(d, int) for d in dims) and not (
            M % self.rows or N % self.cols or K % self.k_step)

    def origin(self, m) -> tuple:
        """(first row, first column) of this workgroup's block of the product.
        Workgroup (x, y) takes column block x of row block y; with ``group``
        the workgroups, in dispatch order (x fastest), walk down ``group`` row
        blocks of one column block, then the next column block (Triton's
        GROUP_SIZE_M): those running at once read a few blocks of either
        factor, which stay in L2, where the plain order reads one row block
        against every column block of the other factor."""
        wg = m.workgroup_id()
        if not self.group:
            return m.let(wg.y * self.rows, "row0"), m.let(wg.x * self.cols, "col0")
        grid = m.num_workgroups()
        linear = m.let(wg.y * grid.x + wg.x, "linear")
        per_group = m.let(self.group * grid.x, "per_group")
        first = m.let(linear / per_group * self.group, "first_block")
        blocks = m.let(B.min(grid.y - first, self.group), "group_blocks")  # the last: fewer
        within = m.let(linear % per_group, "within")
        return (m.let((first + within % blocks) * self.rows, "row0"),
                m.let(within / blocks * self.cols, "col0"))

    def __str__(self) -> str:
        (sr, sc), (fr, fc) = self.subgroups, self.fragments
        grouped = f", group {self.group}" if self.group else ""
        wide = ", 16-byte reads" if self.read_width == 8 else ""
        single = ", single-buffered" if self.stages == 1 else ""
        exact = ", exact" if self.exact else ""
        return (f"{self.config} x {sr}x{sc} subgroups x {fr}x{fc} fragments, "
                f"k_step {self.k_step}{grouped}{wide}{single}{exact}")


class _Slice:
    """One operand's staged slice: where it lives in workgroup memory
    (``tiling.stages`` copies) and how the threads fill it."""

    def __init__(self, m, tiling, operand, extent, height, width, name):
        # (height x width) of the operand per step; extent: its (rows, cols) in all
        self.m, self.operand, self.extent = m, operand, extent
        self.height, self.width = height, width
        along = width if operand.axis == 1 else height     # the contiguous axis
        across = height if operand.axis == 1 else width
        self.stride = along + tiling.pad
        self.size = across * self.stride
        self.array = m.shared(T.SCALARS[tiling.config.component], tiling.stages * self.size,
                              name)
        self.per_read, self.exact = tiling.read_width, tiling.exact
        self.reads = height * width // self.per_read // tiling.threads
        self.threads = tiling.threads

    def at(self, stage, *terms):
        """The sum of ``terms``, an offset into copy ``stage`` (a u32
        expression, or the int 0: no term for it), added left to right."""
        first = isinstance(stage, int) and stage == 0
        total = terms[0] if first else stage * self.size + terms[0]
        for t in terms[1:]:
            total = total + t
        return total

    def fetch(self, origin, name):
        """This thread's reads of the slice at ``origin`` (row, col)."""
        m, op, w = self.m, self.operand, self.per_read
        per_line = (self.width if op.axis == 1 else self.height) // w
        out = []
        for q in range(self.reads):
            idx = m.local_index() + q * self.threads
            line, quad = idx / per_line, idx % per_line * w
            r, c = (line, quad) if op.axis == 1 else (quad, line)
            gr, gc = origin[0] + r, origin[1] + c
            if self.exact:
                out.append((line, quad, m.let(self._checked(op.fetch(gr, gc)), f"{name}{q}")))
                continue
            inside = (gr < self.extent[0]) & (gc < self.extent[1])
            # the read itself stays inside the matrix (its value is dropped past the edge)
            last = [e - (w if axis == op.axis else 1) for axis, e in enumerate(self.extent)]
            value = self._checked(op.fetch(B.min(gr, last[0]), B.min(gc, last[1])))
            zero = value.type(0 if w == 8 else 0.0)
            out.append((line, quad, m.let(B.select(zero, value, inside), f"{name}{q}")))
        return out

    def _checked(self, value):
        if self.per_read == 8 and value.type != vec4u:
            raise TypeError(f"read_width 8: an Operand's fetch must give eight f16 as a "
                            f"vec4<u32>, got {value.type}")
        return value

    def store(self, reads, stage):
        """Write ``fetch``'s reads into copy ``stage`` of the slice."""
        elem = self.array.type.elem
        for line, quad, v in reads:
            base = self.m.let(self.at(stage, line * self.stride, quad))
            for e, part in enumerate(self._elements(v)):
                self.array[base + e] = part if part.type == elem else elem(part)

    def _elements(self, v) -> list:
        """The read's elements in order: a vec4's lanes, or a vec4<u32>'s eight f16."""
        if self.per_read == 4:
            return [getattr(v, lane) for lane in "xyzw"]
        pairs = [self.m.let(B.bitcast(vec2h, getattr(v, lane))) for lane in "xyzw"]
        return [getattr(p, half) for p in pairs for half in "xy"]

    def load(self, matrix_type, stage, r, c):
        """A fragment whose first element is (r, c) of copy ``stage``."""
        if self.operand.axis == 1:
            return B.subgroup_matrix_load(matrix_type, self.array,
                                          self.at(stage, r * self.stride, c), self.stride)
        return B.subgroup_matrix_load_col_major(matrix_type, self.array,
                                                self.at(stage, c * self.stride, r),
                                                self.stride)


def tiled_product(m, tiling: MatrixTiling, a: Operand, b: Operand, M, N, K,
                  epilogue: Callable) -> None:
    """Emit the product of ``a`` (M x K) and ``b`` (K x N) into the kernel being
    built with ``m`` (its workgroup size must be ``tiling.threads``); hand
    each four result columns to ``epilogue(row, col, vec4<f32>)``. M, N and K
    are ints or u32 expressions uniform over the dispatch; N must be a
    multiple of 4."""
    cfg = tiling.config
    result_t = cfg.types()[2]
    (fr, fc), sgs = tiling.fragments, tiling.subgroup_size
    row0, col0 = tiling.origin(m)
    sg = m.let(m.local_index() / sgs, "sg")
    sub_r = m.let(sg / tiling.subgroups[1] * (fr * cfg.m), "sub_r")
    sub_c = m.let(sg % tiling.subgroups[1] * (fc * cfg.n), "sub_c")
    sa = _Slice(m, tiling, a, (M, K), tiling.rows, tiling.k_step, "stage_a")
    sb = _Slice(m, tiling, b, (K, N), tiling.k_step, tiling.cols, "stage_b")
    acc = [[m.var(result_t, name=f"acc{i}_{j}") for j in range(fc)] for i in range(fr)]
    sa.store(sa.fetch((row0, 0), "a"), 0)
    sb.store(sb.fetch((0, col0), "b"), 0)
    m.barrier()
    steps = (K + (tiling.k_step - 1)) / tiling.k_step if not isinstance(K, int) \
        else -(-K // tiling.k_step)
    if tiling.exact:
        if not tiling.whole(M, N, K):
            raise ValueError(f"an exact tiling needs M, N, K ints and multiples of "
                             f"({tiling.rows}, {tiling.cols}, {tiling.k_step}) (its block "
                             f"and step), got {(M, N, K)}")
        steps -= 1    # the last step after the loop, reading nothing past K
    if not (isinstance(steps, int) and steps == 0):   # exact and one step: no loop
        with m.loop(steps, name="kt") as kt:
            _step(m, tiling, (sa, sb), kt, (row0, col0), (sub_r, sub_c), acc)
    if tiling.exact:
        _multiply(m, tiling, sa, sb, steps % tiling.stages, (sub_r, sub_c), acc)
    _drain(m, tiling, acc, (row0 + sub_r, col0 + sub_c), (M, N), epilogue)


def _step(m, tiling, slices, kt, origin, sub, acc) -> None:
    """Step ``kt`` of the loop over K: this slice multiplied while the next
    one's reads are in flight, then stored for step ``kt + 1``."""
    sa, sb = slices
    # double buffered: multiply copy kt % 2 while the next slice goes into the other
    # (not kt & 1: Tint's range analysis bounds only %); single: copy 0 for both
    stage = m.let(kt % 2, "stage") if tiling.stages == 2 else 0
    k_next = m.let((kt + 1) * tiling.k_step, "k_next")
    next_a = sa.fetch((origin[0], k_next), "na")    # in flight while this step multiplies
    next_b = sb.fetch((k_next, origin[1]), "nb")
    _multiply(m, tiling, sa, sb, stage, sub, acc)
    if tiling.stages == 1:
        m.barrier()                                 # every subgroup done with the copy
    sa.store(next_a, 1 - stage if tiling.stages == 2 else 0)
    sb.store(next_b, 1 - stage if tiling.stages == 2 else 0)
    m.barrier()


def _multiply(m, tiling, sa, sb, stage, sub, acc) -> None:
    """One staged step: each subgroup's fragments of copy ``stage`` of both
    slices into its accumulators, every left and right fragment loaded once
    per 16 (the config's K) of the step; ``sub``: its first (row, column)."""
    cfg = tiling.config
    left_t, right_t, _ = cfg.types()
    fr, fc = tiling.fragments
    for kk in range(0, tiling.k_step, cfg.k):
        lefts = [m.let(sa.load(left_t, stage, sub[0] + i * cfg.m, kk), f"l{i}")
                 for i in range(fr)]
        rights = [m.let(sb.load(right_t, stage, kk, sub[1] + j * cfg.n), f"r{j}")
                  for j in range(fc)]
        for i in range(fr):
            for j in range(fc):
                m.assign(acc[i][j], B.subgroup_matrix_multiply_accumulate(
                    lefts[i], rights[j], acc[i][j]))


def _drain(m, tiling, acc, origin, extent, epilogue) -> None:
    """Each fragment through workgroup memory (f32) to ``epilogue``, four
    columns per call; ``origin``: this subgroup's first result element."""
    cfg, sgs = tiling.config, tiling.subgroup_size
    cells = cfg.m * cfg.n
    out = m.shared(T.SCALARS[cfg.result], tiling.threads // sgs * cells, "drain")
    sg, lane = m.local_index() / sgs, m.local_index() % sgs
    for i, row in enumerate(acc):
        for j, value in enumerate(row):
            B.subgroup_matrix_store(out, sg * cells, value, cfg.n)
            m.barrier()
            for q in range(0, cells // 4, sgs):
                e = m.let(lane + q, "e")
                r, c = e / (cfg.n // 4), e % (cfg.n // 4) * 4
                row_i = m.let(origin[0] + i * cfg.m + r, "row")
                col_i = m.let(origin[1] + j * cfg.n + c, "col")
                with _inside(m, tiling, (row_i < extent[0]) & (col_i < extent[1])):
                    at = m.let(sg * cells + r * cfg.n + c, "at")
                    epilogue(row_i, col_i, T.vec4f(out[at], out[at + 1], out[at + 2],
                                                   out[at + 3]))
            m.barrier()


def _inside(m, tiling, test):
    """``m.if_(test)``, or no test where the tiling is exact."""
    return contextlib.nullcontext() if tiling.exact else m.if_(test)


def gemm(m, M: int, N: int, K: int, tiling: MatrixTiling) -> None:
    """A whole kernel (workgroup size ``tiling.threads``, grid
    ``tiling.grid(M, N)``): ``C = A @ B`` for A [M, K] and B [K, N] f16,
    row-major, into C [M, N] f32. A and B are read as vec4<f16> (K and N
    multiples of 4), or with ``tiling.read_width = 8`` as vec4<u32> (K and N
    multiples of 8; bind the f16 data viewed as u32)."""
    w = tiling.read_width
    A = m.declare_input_buffer("A", vec4h if w == 4 else vec4u, M * K // w)
    Bm = m.declare_input_buffer("B", vec4h if w == 4 else vec4u, K * N // w)
    C = m.declare_output_buffer("C", vec4f, M * N // 4)

    def store(row, col, value):
        C[(row * N + col) / 4] = value

    tiled_product(m, tiling, Operand(lambda i, k: A[(i * K + k) / w]),
                  Operand(lambda k, j: Bm[(k * N + j) / w]), M, N, K, store)
