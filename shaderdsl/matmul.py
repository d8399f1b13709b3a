"""The GEMM engine: every f16 product on matrix units (subgroup matrices), one kernel family.

``tiled_product(m, tiling, a, b, M, N, K, out)`` computes the (M x N)
product of ``a`` (M x K) and ``b`` (K x N) in the kernel being built, one
(tiling.rows x tiling.cols) block of it per workgroup (workgroup (x, y) is
column block x, row block y; z the batch):

* the **tiling** (:class:`MatrixTiling`) names every choice of the pipeline:
  the fragment config, subgroups per workgroup and fragments per subgroup
  (the tile), ``k_step`` (K per staged slice), ``stages`` (two copies of
  each slice: the next slice's reads in flight while the subgroups multiply
  this one, one barrier per step; one copy: half the workgroup memory, two
  barriers), ``read_width`` (four elements per global read, or eight f16 in
  16 bytes), ``pad`` (of each staged row: workgroup-memory banks),
  ``group`` (the workgroup order over L2) and ``exact`` (M, N, K whole
  blocks and steps: no edge tests);
* the **prologue** is each factor's :class:`Operand`: its buffer, row- or
  column-major, a row stride and offset (a block of wider rows), a batch
  stride (workgroup z), a sum of ``parts`` partial products (split-K
  slices of an earlier product, f32) and a scale, all applied as the slice
  is staged (zero past the matrix's edge, so no size needs to be a
  multiple of a tile), converted to the fragments' component type;
* each subgroup owns ``fragments`` accumulators and reuses every left and
  right fragment it loads across its row and column of them;
* the **epilogue** (:class:`Epilogue`) is written once: scale, bias,
  activation, an add into the output as it is, the cast to its element type
  (f16 or f32), a row stride, column offset and batch stride. Results
  leave through workgroup memory one fragment at a time, drained
  coalesced: four lanes cover a 16-column row of the fragment, each writing
  four consecutive columns (a vec4 store where the output's rows allow it),
  so the output's rows are written by consecutive threads where the
  fragment's own layout would scatter them. ``in_place`` instead keeps the
  output's own fragments as the accumulators (loaded from it, multiplied
  into, stored back: no workgroup round trip) wherever a block lies wholly
  inside the output; blocks at the edge drain as above.

Every workgroup-array index is built from ``local_index``, constants, ``/``,
``%`` and ``min``, which Tint's integer range analysis proves in bounds, so
Dawn's robustness (with ``enable_integer_range_analysis_in_robustness``)
leaves them unclamped (docs/optimisation-notes.md, note 37).

``gemm(m, M, N, K, tiling, ...)`` is a whole kernel on it with every
prologue and epilogue option a parameter (examples/matrix_gemm.py; ``python
-m lora bench --gemm`` sweeps it: docs/optimisation-notes.md, notes 40, 42-46).

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
from typing import Any, Callable

from . import builtins as B
from . import types as T
from .errors import is_positive_int
from .types import vec2h, vec4f, vec4h, vec4u

MAJORS = ("row", "col")


@dataclass(frozen=True)
class MatrixTiling:
    """How one workgroup computes its block of the product: ``subgroups``
    (along rows, along columns), each owning ``fragments`` (along rows,
    along columns) result matrices of ``config``'s shape; ``k_step`` columns
    of ``a`` (rows of ``b``) per staged slice; ``pad`` extra elements per
    row of a staged slice (fewer workgroup-memory bank conflicts); ``group``
    row blocks per group of the workgroup order (0: the dispatch's order,
    see ``origin``); ``read_width`` elements per read of an f16 factor (4,
    or 8 in 16 bytes: Operand; an f32 factor is read as vec4<f32>, 16 bytes,
    either way); ``stages`` copies of each staged slice (2: double
    buffered, one barrier per step; 1: half the workgroup memory, two
    barriers per step); ``exact``: the product is a whole number of blocks
    and steps (checked by ``tiled_product``), so reads and results skip the
    edge tests; ``prefetch``: slices read ahead into registers (1: the next
    slice's reads in flight during this step's multiply; 2: the one after,
    held a step in registers, so each read has two steps to arrive). A
    config with f16 results sums in f16 (an in-place epilogue on an f16
    output)."""

    config: T.MatrixConfig
    subgroups: tuple = (2, 2)
    fragments: tuple = (2, 2)
    k_step: int = 16
    pad: int = 8
    group: int = 0
    read_width: int = 4
    stages: int = 2
    exact: bool = False
    prefetch: int = 1

    def __post_init__(self):
        if self.config.component != "f16" or self.config.result not in ("f16", "f32"):
            raise ValueError(f"the GEMM engine multiplies f16 into f16 or f32, not {self.config}")
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
        if self.read_width not in (4, 8):
            raise ValueError(f"read_width: expected 4, or 8 (16 bytes of f16), got "
                             f"{self.read_width!r}")
        if self.stages not in (1, 2):
            raise ValueError(f"stages: expected 1 or 2 copies of each staged slice, "
                             f"got {self.stages!r}")
        if self.prefetch not in (1, 2):
            raise ValueError(f"prefetch: expected 1 or 2 slices read ahead into registers, "
                             f"got {self.prefetch!r}")
        if type(self.group) is not int or self.group < 0:
            raise ValueError(f"group: expected 0 (off) or a positive int of row blocks, "
                             f"got {self.group!r}")
        if type(self.pad) is not int or self.pad < 0 or self.pad % 8:
            raise ValueError(f"pad: expected a multiple of 8 elements (16 bytes), got "
                             f"{self.pad!r}")
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

    def grid(self, M: int, N: int, batches: int = 1) -> tuple[int, int, int]:
        """The workgroups an (M x N) product (``batches`` of them) takes."""
        return (-(-N // self.cols), -(-M // self.rows), batches)

    def whole(self, M, N, K) -> bool:
        """Whether an (M x K)(K x N) product is a whole number of blocks and
        steps (at least ``prefetch`` of them), as ``exact`` needs (M, N, K ints)."""
        dims = (M, N, K)
        return all(isinstance(d, int) for d in dims) and not (
            M % self.rows or N % self.cols or K % self.k_step) and K >= self.prefetch * self.k_step

    def shared_bytes(self, a_major: str = "row", b_major: str = "row",
                     in_place: bool = False) -> int:
        """The workgroup memory of a product on this tiling: the staged slices
        (their layout follows each factor's major) and the drain (none where
        ``exact`` and ``in_place`` leave nothing to drain)."""
        halves = sum(_slice_size(h, w, _axis(major), self.pad) for h, w, major in (
            (self.rows, self.k_step, a_major), (self.k_step, self.cols, b_major)))
        drain = 0 if in_place and self.exact else \
            self.threads // self.subgroup_size * self.config.m * self.config.n
        return 2 * self.stages * halves + (4 if self.config.result == "f32" else 2) * drain

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
        pad = f", pad {self.pad}" if self.pad != 8 else ""
        ahead = f", prefetch {self.prefetch}" if self.prefetch != 1 else ""
        exact = ", exact" if self.exact else ""
        return (f"{self.config} x {sr}x{sc} subgroups x {fr}x{fc} fragments, "
                f"k_step {self.k_step}{grouped}{wide}{single}{pad}{ahead}{exact}")


def _axis(major: str) -> int:
    """The contiguous axis of a factor stored ``major``: 1 (along a row) or 0."""
    if major not in MAJORS:
        raise ValueError(f"major: expected 'row' or 'col', got {major!r}")
    return 1 if major == "row" else 0


def _slice_size(height: int, width: int, axis: int, pad: int) -> int:
    """Elements of one copy of a staged (height x width) slice, its contiguous
    axis padded."""
    along, across = (width, height) if axis == 1 else (height, width)
    return across * (along + pad)


@dataclass(frozen=True)
class Operand:
    """One factor of the product as stored (the prologue): element (i, j) of
    an (R x C) factor (A: M x K, B: K x N) is at ``offset + i * stride + j``
    (``major`` "row") or ``offset + j * stride + i`` ("col"), plus ``batch``
    times the batch (workgroup z) and, for each of ``parts`` partial sums of
    an earlier product (its split-K slices, summed as staged), ``part_stride``
    times the part; the value is multiplied by ``scale`` as it is staged.
    ``stride`` 0 is the factor's own width along its rows (C for "row", R
    for "col"). ``buffer`` holds the elements as vec4<f16> or vec4<f32>, or
    f16 as vec4<u32> (eight a read: a tiling of ``read_width`` 8; f16 only,
    one part); strides and offsets must keep each read whole (multiples of
    its width), and the factor's extent along its contiguous axis must be a
    multiple of it (``f16_factor`` declares such a buffer)."""

    buffer: Any
    major: str = "row"
    stride: Any = 0
    offset: Any = 0
    batch: Any = 0
    parts: int = 1
    part_stride: Any = 0
    scale: float = 1.0

    def __post_init__(self):
        _axis(self.major)
        if not is_positive_int(self.parts):
            raise ValueError(f"parts: expected a positive int, got {self.parts!r}")

    def width(self, tiling: MatrixTiling) -> int:
        """Elements per read of this factor under ``tiling``."""
        elem = self.buffer.type.elem
        if elem == vec4u:
            if tiling.read_width != 8 or self.parts != 1:
                raise TypeError(f"an Operand bound as vec4<u32> (eight f16 a read) needs a "
                                f"tiling of read_width 8 and one part, got read_width "
                                f"{tiling.read_width} and {self.parts} parts")
            return 8
        if elem not in (vec4h, vec4f):
            raise TypeError(f"an Operand's buffer holds vec4<f16>, vec4<f32> or (16-byte f16 "
                            f"reads) vec4<u32>, got {elem}")
        if elem == vec4h and tiling.read_width == 8:
            raise TypeError("read_width 8: an f16 Operand's buffer must be bound as vec4<u32> "
                            "(eight f16 a read), got vec4<f16>")
        return 4


def _relu(m, v):
    return B.max(v, vec4f(0.0))


def _silu(m, v):
    return v / (1.0 + B.exp(-v))


def _tanh(m, v):
    return B.tanh(B.clamp(v, vec4f(-15.0), vec4f(15.0)))  # exp overflows past 15 in some tanhs


ACTIVATIONS: dict[str, Callable] = {"relu": _relu, "silu": _silu, "tanh": _tanh}


@dataclass(frozen=True)
class Epilogue:
    """What becomes of each result (written once for every product):
    ``v = activation(scale * acc + bias[col])``, then the output's element
    at (row, col) is ``v`` (or, with ``accumulate``, its value plus ``v``)
    cast to ``buffer``'s element type (f16 or f32; vec4 elements are
    written a vec4 at a time, scalars four stores). The element is at
    ``offset + row * stride + col`` plus ``batch`` times the batch
    (``stride`` 0: N). ``bias``: a buffer of per-column values (f16 or f32
    scalars) or None; ``activation``: None, a name of ACTIVATIONS or
    ``f(m, v)`` for a vec4<f32> v.

    ``in_place``: the output's own fragments are the accumulators (loaded
    first with ``accumulate``, stored at the end) where a block lies wholly
    inside the output; the buffer's elements must be the config's result
    type as scalars, with no scale, bias or activation (scale a factor
    instead: Operand.scale)."""

    buffer: Any
    stride: Any = 0
    offset: Any = 0
    batch: Any = 0
    scale: float = 1.0
    bias: Any = None
    activation: Any = None
    accumulate: bool = False
    in_place: bool = False

    def check(self, tiling: MatrixTiling) -> None:
        if isinstance(self.activation, str) and self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)} or a "
                             f"function, got {self.activation!r}")
        elem = self.buffer.type.elem
        if elem not in (T.f16, T.f32, vec4h, vec4f):
            raise TypeError(f"an Epilogue's buffer holds f16 or f32 (scalars or vec4s), "
                            f"got {elem}")
        if not self.in_place:
            return
        result = T.SCALARS[tiling.config.result]
        if elem != result or self.scale != 1.0 or self.bias is not None or self.activation:
            raise ValueError(f"in_place: the output's own {result} fragments are the "
                             f"accumulators, so its buffer must hold {result} scalars (got "
                             f"{elem}) and the epilogue no scale, bias or activation (scale "
                             f"a factor: Operand.scale)")

    def write(self, m, at_row, col, value) -> None:
        """The epilogue of four results (a vec4<f32>) at columns col.. of the
        element index ``at_row`` (where row ``row``'s column 0 is)."""
        v = value if self.scale == 1.0 else self.scale * value
        if self.bias is not None:
            v = v + _four(self.bias, col, vec4f)
        if self.activation is not None:
            act = ACTIVATIONS[self.activation] if isinstance(self.activation, str) \
                else self.activation
            v = act(m, m.let(v, "pre"))
        elem, at = self.buffer.type.elem, m.let(at_row + col, "at")
        if isinstance(elem, T.Vector):
            i = m.let(at / 4, "at4")
            total = vec4f(self.buffer[i]) + v if self.accumulate else v
            self.buffer[i] = elem(total)
            return
        v = m.let(v, "v")
        for e, lane in enumerate("xyzw"):
            part = getattr(v, lane)
            self.buffer[at + e] = elem(T.f32(self.buffer[at + e]) + part) if self.accumulate \
                else elem(part)


def _four(buffer, col, as_type):
    """Elements col..col+3 of a buffer of scalars or vec4s, as ``as_type``."""
    if isinstance(buffer.type.elem, T.Vector):
        return as_type(buffer[col / 4])
    return as_type(*(T.f32(buffer[col + e]) for e in range(4)))


def tiled_product(m, tiling: MatrixTiling, a: Operand, b: Operand, M, N, K,
                  out: Epilogue, batches=1, ablate=frozenset()) -> None:
    """Emit the product of ``a`` (M x K) and ``b`` (K x N) into the kernel being
    built with ``m`` (its workgroup size must be ``tiling.threads``, its grid
    ``tiling.grid(M, N, batches)``) and hand the results to ``out``. M, N and
    K are ints or u32 expressions uniform over the dispatch (K may differ
    between batches); N must be a multiple of 4. ``batches`` > 1: workgroup z
    is the batch, each factor and the output offset by their batch strides.
    ``ablate`` (``bench --gemm``'s ceilings only: the results are wrong):
    "loads", the slices staged from their positions, no global read; "stores",
    one element of each read staged, not all (the reads stay live)."""
    out.check(tiling)
    if tiling.exact and not tiling.whole(M, N, K):
        raise ValueError(f"an exact tiling needs M, N, K ints and multiples of "
                         f"({tiling.rows}, {tiling.cols}, {tiling.k_step}) (its block "
                         f"and step; K at least {tiling.prefetch} steps), got {(M, N, K)}")
    cfg, sgs = tiling.config, tiling.subgroup_size
    row0, col0 = tiling.origin(m)
    z = _batch(m, batches)
    sg = m.let(m.local_index() / sgs, "sg")
    sub = (m.let(sg / tiling.subgroups[1] * (tiling.fragments[0] * cfg.m), "sub_r"),
           m.let(sg % tiling.subgroups[1] * (tiling.fragments[1] * cfg.n), "sub_c"))
    sa = _Slice(m, tiling, a, (M, K), (tiling.rows, tiling.k_step), "stage_a", z, ablate)
    sb = _Slice(m, tiling, b, (K, N), (tiling.k_step, tiling.cols), "stage_b", z, ablate)
    place = _Place(m, tiling, out, (row0, col0), sub, (M, N), z)
    acc = place.accumulators()
    sa.store(sa.fetch((row0, 0), "a"), 0)
    sb.store(sb.fetch((0, col0), "b"), 0)
    held = None
    if tiling.prefetch == 2:  # slice 1 waits in registers while slice 0 multiplies
        held = (_hold(m, sa.fetch((row0, tiling.k_step), "pa")),
                _hold(m, sb.fetch((tiling.k_step, col0), "pb")))
    m.barrier()
    total = (K + (tiling.k_step - 1)) / tiling.k_step if not isinstance(K, int) \
        else -(-K // tiling.k_step)
    # exact: the last steps after the loop, reading nothing past K
    looped = total - tiling.prefetch if tiling.exact else total
    if not (isinstance(looped, int) and looped == 0):
        with m.loop(looped, name="kt") as kt:
            _step(m, tiling, (sa, sb), kt, (row0, col0), sub, acc, held)
    if tiling.exact:
        for kt in range(looped, total - 1):  # prefetch 2: the step whose slice is held
            _step(m, tiling, (sa, sb), kt, (row0, col0), sub, acc, held, fetch=False)
        _multiply(m, tiling, sa, sb, (total - 1) % tiling.stages, sub, acc)
    place.finish(acc)


def _hold(m, reads):
    """A slice's reads kept in vars (prefetch 2), to be stored a step later."""
    return [(line, quad, m.var(v.type, v, "held")) for line, quad, v in reads]


def _batch(m, batches):
    """The batch index (workgroup z; ``min``-bounded where ``batches`` is an
    int, so Tint proves what it indexes), or None for one batch."""
    if isinstance(batches, int) and batches == 1:
        return None
    if isinstance(batches, int):
        return m.let(B.min(m.workgroup_id().z, batches - 1), "batch")
    return m.let(m.workgroup_id().z, "batch")


def _base(m, offset, batch, z, name):
    """``offset + z * batch``: an int where it is one, else a let."""
    total = offset if z is None or (isinstance(batch, int) and batch == 0) \
        else offset + z * batch
    return total if isinstance(total, int) else m.let(total, name)


class _Slice:
    """One operand's staged slice: where it lives in workgroup memory
    (``tiling.stages`` copies) and how the threads fill it (the prologue)."""

    def __init__(self, m, tiling, operand: Operand, extent, shape, name, z, ablate=frozenset()):
        # shape: (height x width) of the operand per step; extent: its (rows, cols) in all
        self.m, self.operand, self.extent, self.ablate = m, operand, extent, ablate
        self.height, self.width = shape
        self.axis = _axis(operand.major)
        self.stride = (self.width if self.axis == 1 else self.height) + tiling.pad
        self.size = _slice_size(self.height, self.width, self.axis, tiling.pad)
        self.array = m.shared(T.SCALARS[tiling.config.component], tiling.stages * self.size,
                              name)
        self.per_read, self.exact = operand.width(tiling), tiling.exact
        self.reads = self.height * self.width // self.per_read // tiling.threads
        self.threads = tiling.threads
        self.lead = operand.stride or extent[self.axis]   # elements between stored lines
        self.base = _base(m, operand.offset, operand.batch, z, f"{name}_base")

    def at(self, stage, *terms):
        """The sum of ``terms``, an offset into copy ``stage`` (a u32
        expression, or the int 0: no term for it), added left to right."""
        first = isinstance(stage, int) and stage == 0
        total = terms[0] if first else stage * self.size + terms[0]
        for t in terms[1:]:
            total = total + t
        return total

    def _read(self, i, j):
        """The stored value of elements (i, j), (i, j + 1), ... (row-major) or
        (i, j), (i + 1, j), ... (col-major): the parts summed, scaled."""
        op, w = self.operand, self.per_read
        at = i * self.lead + j if self.axis == 1 else j * self.lead + i
        at = at if isinstance(self.base, int) and self.base == 0 else self.base + at
        value = op.buffer[at / w]
        for p in range(1, op.parts):
            value = value + op.buffer[(at + p * op.part_stride) / w]
        if op.scale != 1.0 and w == 4:
            value = op.scale * vec4f(value)
        return value

    def fetch(self, origin, name):
        """This thread's reads of the slice at ``origin`` (row, col)."""
        m, w = self.m, self.per_read
        per_line = (self.width if self.axis == 1 else self.height) // w
        out = []
        for q in range(self.reads):
            idx = m.local_index() + q * self.threads
            line, quad = idx / per_line, idx % per_line * w
            r, c = (line, quad) if self.axis == 1 else (quad, line)
            gr, gc = origin[0] + r, origin[1] + c
            if "loads" in self.ablate:  # a value of the position, no memory read
                elem = self.operand.buffer.type.elem
                fake = elem(gr + gc) if w == 8 else elem(T.component(elem)(gr + gc))
                out.append((line, quad, m.let(fake, f"{name}{q}")))
                continue
            if self.exact:
                out.append((line, quad, m.let(self._read(gr, gc), f"{name}{q}")))
                continue
            inside = (gr < self.extent[0]) & (gc < self.extent[1])
            # the read itself stays inside the matrix (its value is dropped past the edge)
            last = [e - (w if axis == self.axis else 1) for axis, e in enumerate(self.extent)]
            value = self._read(B.min(gr, last[0]), B.min(gc, last[1]))
            zero = value.type(0 if w == 8 else 0.0)
            out.append((line, quad, m.let(B.select(zero, value, inside), f"{name}{q}")))
        return out

    def store(self, reads, stage):
        """Write ``fetch``'s reads into copy ``stage`` of the slice."""
        elem = self.array.type.elem
        for line, quad, v in reads:
            base = self.m.let(self.at(stage, line * self.stride, quad))
            parts = self._elements(v)
            for e, part in enumerate(parts[:1] if "stores" in self.ablate else parts):
                self.array[base + e] = part if part.type == elem else elem(part)

    def _elements(self, v) -> list:
        """The read's elements in order: a vec4's lanes, or a vec4<u32>'s eight f16."""
        if self.per_read == 4:
            return [getattr(v, lane) for lane in "xyzw"]
        pairs = [self.m.let(B.bitcast(vec2h, getattr(v, lane))) for lane in "xyzw"]
        halves = [getattr(p, half) for p in pairs for half in "xy"]
        scale = self.operand.scale
        return halves if scale == 1.0 else [scale * T.f32(h) for h in halves]

    def load(self, matrix_type, stage, r, c):
        """A fragment whose first element is (r, c) of copy ``stage``."""
        if self.axis == 1:
            return B.subgroup_matrix_load(matrix_type, self.array,
                                          self.at(stage, r * self.stride, c), self.stride)
        return B.subgroup_matrix_load_col_major(matrix_type, self.array,
                                                self.at(stage, c * self.stride, r),
                                                self.stride)


def _step(m, tiling, slices, kt, origin, sub, acc, held=None, fetch=True) -> None:
    """Step ``kt`` of the loop over K: this slice multiplied while the reads of
    slice ``kt + prefetch`` are in flight; then slice ``kt + 1`` (just read,
    or read a step ago and ``held``) stored for step ``kt + 1``. ``fetch``
    False: no slice left to read (an exact tiling's tail)."""
    sa, sb = slices
    # double buffered: multiply copy kt % 2 while the next slice goes into the other
    # (not kt & 1: Tint's range analysis bounds only %); single: copy 0 for both
    stage = (m.let(kt % 2, "stage") if not isinstance(kt, int) else kt % 2) \
        if tiling.stages == 2 else 0
    ahead = None
    if fetch:   # in flight while this step multiplies
        k_ahead = m.let((kt + tiling.prefetch) * tiling.k_step, "k_ahead")
        ahead = (sa.fetch((origin[0], k_ahead), "na"), sb.fetch((k_ahead, origin[1]), "nb"))
    _multiply(m, tiling, sa, sb, stage, sub, acc)
    if tiling.stages == 1:
        m.barrier()                                 # every subgroup done with the copy
    following = held if held is not None else ahead
    assert following is not None, "an exact step without prefetch reads the next slice"
    other = 1 - stage if tiling.stages == 2 else 0
    sa.store(following[0], other)
    sb.store(following[1], other)
    if held is not None and ahead is not None:      # slice kt + 2 waits for the next step
        for kept, fresh in zip(held, ahead):
            for (_, _, var), (_, _, value) in zip(kept, fresh):
                m.assign(var, value)
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


class _Place:
    """Where this subgroup's results go: the accumulators' start and the
    epilogue (drained through workgroup memory, or in place)."""

    def __init__(self, m, tiling, out: Epilogue, origin, sub, extent, z):
        self.m, self.tiling, self.out, self.extent = m, tiling, out, extent
        self.first = (origin[0] + sub[0], origin[1] + sub[1])   # this subgroup's first result
        self.stride = out.stride or extent[1]
        self.base = _base(m, out.offset, out.batch, z, "out_base")
        self.whole = None
        if out.in_place and not tiling.exact:  # uniform over the workgroup: barriers may follow
            self.whole = m.let((origin[0] + tiling.rows <= extent[0])
                               & (origin[1] + tiling.cols <= extent[1]), "whole")

    def _at(self, row, col=0):
        """The output element index of (row, col): base + row * stride + col."""
        at = row * self.stride + col
        return at if isinstance(self.base, int) and self.base == 0 else self.base + at

    def _fragment_at(self, i, j):
        cfg = self.tiling.config
        return self.m.let(self._at(self.first[0] + i * cfg.m, self.first[1] + j * cfg.n), "frag")

    def accumulators(self) -> list:
        """The accumulators, zero, or the output's fragments (in place, accumulating)."""
        m, (fr, fc) = self.m, self.tiling.fragments
        result_t = self.tiling.config.types()[2]
        acc = [[m.var(result_t, name=f"acc{i}_{j}") for j in range(fc)] for i in range(fr)]
        if self.out.in_place and self.out.accumulate:
            with _when(m, self.whole):
                for i, row in enumerate(acc):
                    for j, a in enumerate(row):
                        m.assign(a, B.subgroup_matrix_load(result_t, self.out.buffer,
                                                           self._fragment_at(i, j), self.stride))
        return acc

    def finish(self, acc) -> None:
        """The results into the output: in place where the block is whole, else drained."""
        if not self.out.in_place:
            return self._drain(acc)
        with _when(self.m, self.whole):
            for i, row in enumerate(acc):
                for j, a in enumerate(row):
                    B.subgroup_matrix_store(self.out.buffer, self._fragment_at(i, j), a,
                                            self.stride)
        if self.whole is not None:
            with self.m.else_():
                self._drain(acc)

    def _drain(self, acc) -> None:
        """Each fragment through workgroup memory to the epilogue, four lanes a
        16-column row, four columns per lane."""
        m, tiling, out = self.m, self.tiling, self.out
        cfg, sgs = tiling.config, tiling.subgroup_size
        cells = cfg.m * cfg.n
        drain = m.shared(T.SCALARS[cfg.result], tiling.threads // sgs * cells, "drain")
        sg, lane = m.local_index() / sgs, m.local_index() % sgs
        for i, row in enumerate(acc):
            for j, value in enumerate(row):
                B.subgroup_matrix_store(drain, sg * cells, value, cfg.n)
                m.barrier()
                for q in range(0, cells // 4, sgs):
                    e = m.let(lane + q, "e")
                    r, c = e / (cfg.n // 4), e % (cfg.n // 4) * 4
                    row_i = m.let(self.first[0] + i * cfg.m + r, "row")
                    col_i = m.let(self.first[1] + j * cfg.n + c, "col")
                    test = (row_i < self.extent[0]) & (col_i < self.extent[1])
                    with _when(m, None if tiling.exact else test):
                        at = m.let(sg * cells + r * cfg.n + c, "d")
                        value4 = vec4f(*(T.f32(drain[at + k]) for k in range(4)))
                        out.write(m, self._at(row_i), col_i, value4)
                m.barrier()


def _when(m, test):
    """``m.if_(test)``, or no test where ``test`` is None (an exact tiling)."""
    return contextlib.nullcontext() if test is None else m.if_(test)


def f16_factor(m, name: str, count, tiling: MatrixTiling):
    """An input buffer of ``count`` f16 values for an Operand under ``tiling``:
    vec4<f16>, or with ``read_width`` 8 vec4<u32> holding f16 (an f16 buffer
    binds to it; eight values a read). ``count`` None: runtime-sized."""
    w = tiling.read_width
    length = None if count is None else count // w
    if w == 4:
        return m.declare_input_buffer(name, vec4h, length)
    return m.declare_input_buffer(name, vec4u, length, holds=T.f16)


def gemm(m, M: int, N: int, K: int, tiling: MatrixTiling, a_major: str = "row",
         b_major: str = "row", out: str = "f32", batches: int = 1, scale: float = 1.0,
         bias: bool = False, activation: str | None = None, accumulate: bool = False,
         in_place: bool = False, c_stride: int = 0, c_offset: int = 0,
         ablate: str = "") -> None:
    """A whole kernel (workgroup size ``tiling.threads``, grid
    ``tiling.grid(M, N, batches)``): ``C = activation(scale * A @ B + bias)``
    (``accumulate``: C +=), A [M, K] (``a_major`` "row") or stored [K, M]
    ("col"), B [K, N] or stored [N, K], f16; C f16 or f32 (``out``), rows of
    ``c_stride`` (0: N) from column ``c_offset``; ``batches`` of each, one
    after another. A and B are read as vec4<f16> (their contiguous extents
    multiples of 4), or with ``tiling.read_width = 8`` 16 bytes at a time
    (multiples of 8; f16_factor). ``ablate``: "loads", "stores" or "loads+stores"
    (tiled_product's; wrong results, for the bench's ceilings)."""
    A = f16_factor(m, "A", batches * M * K, tiling)
    Bm = f16_factor(m, "B", batches * K * N, tiling)
    rows = c_stride or N
    scalar = T.SCALARS[out]
    vector = not in_place and rows % 4 == 0 and c_offset % 4 == 0
    C = m.declare_output_buffer("C", T.vec4(scalar) if vector else scalar,
                                batches * M * rows // (4 if vector else 1))
    b = m.declare_input_buffer("bias", scalar, N) if bias else None
    tiled_product(m, tiling, Operand(A, a_major, batch=M * K), Operand(Bm, b_major, batch=K * N),
                  M, N, K, Epilogue(C, c_stride, c_offset, M * rows, scale, b, activation,
                                    accumulate, in_place), batches,
                  frozenset(ablate.split("+")) - {""})
