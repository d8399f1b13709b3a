"""The many-adapter forward on matrix units (subgroup matrices): segments
of rows of one adapter each (prefill), f16 pools, f32 sums.

The pool, its table and the tiles are lora.kernels.many's (``A`` rows
stacked, ``B`` blocks ``[out_dim, rank]`` one after another, a ``vec4<u32>``
per slot of (first row of A, first element of B, rank, the f32 bits of the
scale); ``tiles[w]`` = (first index into ``order``, row count, slot, 0)),
read at run time, so adapters come and go without new WGSL. One workgroup
(four subgroups of 32) per tile of ``tile_tokens`` rows (16, 32 or 64):

* shrink: h = x_tile A^T on f16 16x16x16 fragments with f32 results, the
  rows of x gathered through ``order`` and A's rows staged in slices of
  in_dim (two copies: the next slice's reads in flight while the subgroups
  multiply), rows past the adapter's rank (the next adapter's) and past the
  tile's rows staged as zero; the rank padded to a multiple of 16, a
  fragment of ranks skipped where the adapter has none of them. With 16 or 32
  rows the subgroups split in_dim between them and their sums meet in
  workgroup memory;
* scale * h is staged in workgroup memory as f16 (rounded as PyTorch's fp16
  h is), then the expand walks out_dim in blocks of ``columns`` columns:
  B's block (contiguous in the pool) staged with zeros past the rank, each
  subgroup's 16 x 16 ``column_fragments`` results through workgroup memory
  (f32), then every thread adds four columns of a row of the tile to the
  output at a time (vec4<f16>, rows scattered by ``order``).

Workgroup y of ``column_splits`` takes every ``column_splits``-th block of
columns (more workgroups for few tiles; each recomputes h). The same in two
dispatches: ``many_matrix_shrink`` (workgroup y of ``splits`` multiplies
slice y of in_dim and writes scale * its sums to the f32 scratch ``hp``
[rows, splits, ranks]) and ``many_matrix_expand`` (workgroup y takes block y
of the columns, h the slices summed; with ``column_splits``, every
``column_splits``-th block), more workgroups on both sides at the cost of
hp's round trip. f16 only: f32 has no matrix units on the H200, and the
pool's f32 forms are lora.kernels.many's. in_dim and out_dim must be multiples of 4 (rows read
as vec4); B's blocks then start at multiples of out_dim, so at multiples
of 4, and a block of columns is read as vec4 where the rank is a multiple
of 4 (scalars otherwise).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from shaderdsl import builtins as Bi
from shaderdsl import f16, f32, u32, vec4f, vec4h, vec4u

from .common import split_index, token_count
from .matrix import FRAGMENT

SUBGROUPS = 4  # per workgroup
TILES = (16, 32, 64)  # rows per tile: 1, 2 or 4 fragments of rows
PAD = 8  # extra f16s per staged row (fewer workgroup-memory bank conflicts)
F = FRAGMENT.m  # 16: the fragments' M, N and K


def matrix_threads() -> int:
    return SUBGROUPS * FRAGMENT.subgroup_sizes[0]


@dataclass(frozen=True)
class MatrixLayout:
    """The shapes of one many_matrix kernel, checked: ``tile`` rows,
    ``ranks`` (max_rank padded to 16), ``cf`` column fragments per subgroup."""

    tile: int
    ranks: int
    cf: int
    in_dim: int
    out_dim: int

    def __post_init__(self):
        if self.tile not in TILES:
            raise ValueError(f"many_matrix: tile_tokens must be one of {TILES} (fragments of "
                             f"16 rows), got {self.tile!r}")
        if not isinstance(self.cf, int) or self.cf < 1:
            raise ValueError(f"many_matrix: column_fragments must be a positive int, got "
                             f"{self.cf!r}")
        if self.in_dim % 4 or self.out_dim % 4:
            raise ValueError(f"many_matrix reads rows as vec4: in_dim ({self.in_dim}) and "
                             f"out_dim ({self.out_dim}) must be multiples of 4")

    @property
    def row_fragments(self) -> int:
        return self.tile // F

    @property
    def k_splits(self) -> int:
        """Subgroups sharing a fragment of rows in the shrink (in_dim split between them)."""
        return SUBGROUPS // self.row_fragments

    @property
    def k_step(self) -> int:
        """Columns of x (and A) per staged slice: a fragment for each k split, at least 32."""
        return max(32, F * self.k_splits)

    @property
    def columns(self) -> int:
        """Output columns per block of the expand."""
        return F * self.cf * self.k_splits

    @property
    def x_stride(self) -> int:
        return self.k_step + PAD

    @property
    def h_stride(self) -> int:
        return self.ranks + PAD

    @property
    def copy(self) -> int:
        """f16s of one copy of the shrink's staged slices (x's rows, then A's)."""
        return (self.tile + self.ranks) * self.x_stride

    def halves(self, shrink: bool = True, expand: bool = True) -> int:
        """The f16 workgroup array: the shrink's two copies, or h and B's block."""
        return max(2 * self.copy if shrink else 0,
                   (self.tile + self.columns) * self.h_stride if expand else 0)

    def floats(self, shrink: bool = True, expand: bool = True) -> int:
        """The f32 workgroup array: the shrink's partial sums, or a block's results."""
        return max(self.k_splits * self.tile * self.ranks if shrink else 0,
                   self.tile * self.columns if expand else 0)


def matrix_layout(tile_tokens, max_rank, in_dim, out_dim, column_fragments=None):
    """The layout of these parameters; ``column_fragments`` None: 4 with 64
    rows, else 2 (blocks of 64 or 128 columns)."""
    if not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"many_matrix: max_rank must be a positive int, got {max_rank!r}")
    cf = column_fragments or (4 if tile_tokens == 64 else 2)
    return MatrixLayout(tile_tokens, -(-max_rank // F) * F, cf, in_dim, out_dim)


def matrix_shared_bytes(tile_tokens, max_rank, in_dim, out_dim, column_fragments=None) -> int:
    """The workgroup memory a many_matrix kernel declares."""
    lay = matrix_layout(tile_tokens, max_rank, in_dim, out_dim, column_fragments)
    return 2 * lay.halves() + 4 * lay.floats()


class _Tile:
    """This workgroup's tile: its rows (``row(k)``; past ``count`` the last
    one), its adapter's (a_row, b_off, rank, scale) and ``r16`` (the rank
    padded to 16). A workgroup past the last tile, of a tile of 0 rows or of
    a free slot returns before any barrier (uniform over the workgroup)."""

    def __init__(self, m):
        table = m.declare_input_buffer("table", vec4u, None)
        self.order = m.declare_input_buffer("order", u32, None)
        tiles = m.declare_input_buffer("tiles", vec4u, None)
        w = split_index(m, "x", "item")
        with m.if_(w >= token_count(m, None)):
            m.return_()
        tile = m.let(tiles[w], "tile")
        self.first, self.count = tile.x, m.let(tile.y, "count")
        entry = m.let(table[tile.z], "entry")
        self.a_row, self.b_off, self.rank = entry.x, entry.y, m.let(entry.z, "rank")
        with m.if_((self.count == 0) | (self.rank == 0)):
            m.return_()
        self.scale = m.let(Bi.bitcast(f32, entry.w), "scale")
        self.r16 = m.let((self.rank + (F - 1)) / F * F, "r16")

    def row(self, m, k, name):
        return m.let(self.order[self.first + Bi.min(k, self.count - 1)], name)


def _check(name, tokens, dtype, **counts) -> None:
    if tokens is not None:
        raise ValueError(f"{name} reads its tile count at run time: tokens must be None, "
                         f"got {tokens!r}")
    if dtype != "f16":
        raise ValueError(f"{name} multiplies f16 fragments ({FRAGMENT}): dtype must be "
                         f"'f16', got {dtype!r}; f32 pools take lora.kernels.many's forms")
    for what, v in counts.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {what} must be a positive int, got {v!r}")


def _arrays(m, lay, shrink=True, expand=True):
    return (m.shared(f16, lay.halves(shrink, expand), "halves"),
            m.shared(f32, lay.floats(shrink, expand), "floats"))


def _subgroup(m):
    return m.let(m.local_index() / FRAGMENT.subgroup_sizes[0], "sg")


def many_matrix(m, in_dim, out_dim, max_rank=64, tokens=None, tile_tokens=16,
                column_fragments=None, column_splits=1, dtype="f16"):
    """output += scale_i B_i (A_i x) for each tile of rows sharing adapter i,
    on matrix units, one dispatch: grid (tiles, column_splits). ``tokens``
    must be None (the tile count is the uniform ``tokens``)."""
    _check("many_matrix", tokens, dtype, column_splits=column_splits)
    lay = matrix_layout(tile_tokens, max_rank, in_dim, out_dim, column_fragments)
    A = m.declare_input_buffer("A", vec4h, None)
    Bm = m.declare_input_buffer("B", vec4h, None)
    x = m.declare_input_buffer("x", vec4h, None)
    out = m.declare_output_buffer("output", vec4h, None)
    arrays = _arrays(m, lay)
    tile = _Tile(m)
    sg = _subgroup(m)
    _shrink(m, lay, (A, x), tile, arrays, sg)
    floats = arrays[1]

    def h_of(k, r):
        total = floats[k * lay.ranks + r]
        for s in range(1, lay.k_splits):
            total = total + floats[(s * lay.tile + k) * lay.ranks + r]
        return tile.scale * total

    _stage_h(m, lay, tile, arrays[0], h_of)
    _expand(m, lay, (Bm, out), tile, arrays, (sg, column_splits))


def many_matrix_shrink(m, in_dim, max_rank=64, tokens=None, tile_tokens=16, splits=1,
                       dtype="f16"):
    """The first of the two-dispatch form: hp[row, s, r] = scale_i (A_i x[row])[r]
    summed over slice s of ``splits`` slices of in_dim (f32, ``ranks`` = max_rank
    padded to 16 per slice; ranks below the adapter's padded to 16 written),
    for the rows of each tile: grid (tiles, splits)."""
    _check("many_matrix_shrink", tokens, dtype, splits=splits)
    lay = matrix_layout(tile_tokens, max_rank, in_dim, 4)
    A = m.declare_input_buffer("A", vec4h, None)
    x = m.declare_input_buffer("x", vec4h, None)
    hp = m.declare_output_buffer("hp", f32, None)
    arrays = _arrays(m, lay, expand=False)
    tile = _Tile(m)
    steps = -(-in_dim // (splits * lay.k_step))  # per slice
    k0 = m.let(m.workgroup_id().y * (steps * lay.k_step), "k0")
    _shrink(m, lay, (A, x), tile, arrays, _subgroup(m), (k0, steps))
    floats = arrays[1]
    with _each(m, lay.tile * lay.ranks, "e") as e:
        k, r = m.let(e / lay.ranks, "k"), m.let(e % lay.ranks, "r")
        with m.if_((r < tile.r16) & (k < tile.count)):
            total = floats[k * lay.ranks + r]
            for s in range(1, lay.k_splits):
                total = total + floats[(s * lay.tile + k) * lay.ranks + r]
            row = tile.row(m, k, "row")
            hp[(row * splits + m.workgroup_id().y) * lay.ranks + r] = tile.scale * total


def many_matrix_expand(m, out_dim, max_rank=64, tokens=None, tile_tokens=16, splits=1,
                       column_fragments=None, column_splits=0, dtype="f16"):
    """The second: output[rows] += (sum_s hp[row, s]) B_i^T for each tile:
    grid (tiles, expand_groups(...)): ``column_splits`` workgroups per tile
    share its blocks of columns (0: a workgroup per block); each stages h
    (reads hp) once for its blocks."""
    _check("many_matrix_expand", tokens, dtype, splits=splits)
    groups = expand_groups(out_dim, tile_tokens, max_rank, column_fragments, column_splits)
    lay = matrix_layout(tile_tokens, max_rank, 4, out_dim, column_fragments)
    Bm = m.declare_input_buffer("B", vec4h, None)
    hp = m.declare_input_buffer("hp", f32, None)
    out = m.declare_output_buffer("output", vec4h, None)
    arrays = _arrays(m, lay, shrink=False)
    tile = _Tile(m)

    def h_of(k, r):
        at = m.let(tile.row(m, k, "hrow") * (splits * lay.ranks) + r, "hat")
        total = hp[at]
        for s in range(1, splits):
            total = total + hp[at + s * lay.ranks]
        return total

    _stage_h(m, lay, tile, arrays[0], h_of)
    _expand(m, lay, (Bm, out), tile, arrays, (_subgroup(m), groups))


def hp_columns(max_rank: int, splits: int) -> int:
    """The f32s of hp per row: a slice's sums of every rank (padded to 16) per slice."""
    return splits * -(-max_rank // F) * F


def expand_groups(out_dim, tile_tokens, max_rank=64, column_fragments=None,
                  column_splits=0) -> int:
    """The workgroups along y of many_matrix_expand: ``column_splits``, at most
    one per block of columns (0: one per block)."""
    if not isinstance(column_splits, int) or column_splits < 0:
        raise ValueError(f"many_matrix_expand: column_splits must be an int >= 0 (0: a "
                         f"workgroup per block of columns), got {column_splits!r}")
    blocks = -(-out_dim // matrix_layout(tile_tokens, max_rank, 4, out_dim,
                                         column_fragments).columns)
    return min(column_splits, blocks) if column_splits else blocks


def _slice_reads(m, lay, A, x, tile):
    """This thread's vec4 reads of a staged slice, as (offset of its line in
    a copy, quad, base index of its row in the buffer, whether the row is
    real, the buffer, whether the line is multiplied: A's rows from r16 on are
    not, so they are not stored); ``_fetch`` reads them at a column of in_dim."""
    threads, quads = matrix_threads(), lay.k_step // 4
    n4 = lay.in_dim // 4
    reads = []
    for q in range(lay.tile * quads // threads):
        idx = m.let(m.local_index() + q * threads, f"xi{q}")
        line = m.let(idx / quads, f"xl{q}")
        base = m.let(tile.row(m, line, f"xr{q}") * n4, f"xb{q}")
        reads.append((line * lay.x_stride, idx % quads, base, line < tile.count, x, None))
    for q in range(lay.ranks * quads // threads):
        idx = m.let(m.local_index() + q * threads, f"ai{q}")
        line = m.let(idx / quads, f"al{q}")
        base = m.let((tile.a_row + Bi.min(line, tile.rank - 1)) * n4, f"ab{q}")
        reads.append(((lay.tile + line) * lay.x_stride, idx % quads, base, line < tile.rank, A,
                      line < tile.r16))
    return reads


def _fetch(m, lay, reads, col, name):
    """Each read's vec4 at column ``col`` (zero past in_dim and for rows that are not real)."""
    values = []
    for q, (_, quad, base, real, buf, _) in enumerate(reads):
        v = m.var(vec4h(0.0), name=f"{name}{q}")
        with m.if_(real & (col + quad * 4 < lay.in_dim)):
            m.assign(v, buf[base + col / 4 + quad])
        values.append(v)
    return values


def _store(m, lay, reads, values, stage, halves):
    for (at, quad, *_, used), v in zip(reads, values):
        base = m.let(stage * lay.copy + at + quad * 4)

        def put(base=base, v=v):
            for e, lane in enumerate("xyzw"):
                halves[base + e] = getattr(v, lane)
        if used is None:
            put()
            continue
        with m.if_(used):
            put()


def _shrink(m, lay, bufs, tile, arrays, sg, k_range=None):
    """h = x_tile A^T (f32 sums, unscaled) of each subgroup's fragment of rows
    and share of in_dim, left in ``floats`` as [k_splits, tile, ranks];
    ``k_range``: (first column, steps of k_step) of in_dim, default all."""
    (A, x), (halves, floats) = bufs, arrays
    k0, steps = k_range or (u32(0), -(-lay.in_dim // lay.k_step))
    left_t, right_t, result_t = FRAGMENT.types()
    rows, splits = lay.row_fragments, lay.k_splits
    rf, ks = m.let(sg % rows, "rf"), m.let(sg / rows, "ks")
    reads = _slice_reads(m, lay, A, x, tile)
    acc = [m.var(result_t, name=f"hacc{j}") for j in range(lay.ranks // F)]
    _store(m, lay, reads, _fetch(m, lay, reads, k0, "v"), u32(0), halves)
    m.barrier()
    with m.loop(steps, name="kt") as kt:
        stage = m.let(kt % 2, "stage")
        ahead = _fetch(m, lay, reads, k0 + (kt + 1) * lay.k_step, "nv")
        for i in range(lay.k_step // F // splits):
            kcol = m.let(stage * lay.copy + (ks + splits * i) * F, f"kc{i}")
            left = m.let(Bi.subgroup_matrix_load(left_t, halves, kcol + rf * F * lay.x_stride,
                                                 lay.x_stride), f"hl{i}")
            for j, a in enumerate(acc):
                with m.if_(u32(j * F) < tile.rank):
                    at = kcol + (lay.tile + j * F) * lay.x_stride
                    right = Bi.subgroup_matrix_load_col_major(right_t, halves, at, lay.x_stride)
                    m.assign(a, Bi.subgroup_matrix_multiply_accumulate(left, right, a))
        _store(m, lay, reads, ahead, 1 - stage, halves)
        m.barrier()
    for j, a in enumerate(acc):
        with m.if_(u32(j * F) < tile.rank):
            Bi.subgroup_matrix_store(floats, (ks * lay.tile + rf * F) * lay.ranks + j * F, a,
                                     lay.ranks)
    m.barrier()


@contextmanager
def _each(m, n: int, name: str):
    """``with _each(m, n, name) as i``: i = local_index + j threads for each j
    with i < n: a loop of a constant count and a ``min``, so Tint's range
    analysis proves i < n (workgroup indices built from it go unclamped)."""
    threads = matrix_threads()
    with m.loop(0, -(-n // threads), name=f"{name}_j") as j:
        at = m.let(m.local_index() + j * threads, f"{name}_at")
        with m.if_(at < n):
            yield m.let(Bi.min(at, n - 1), name)


def _stage_h(m, lay, tile, halves, h_of):
    """scale * h as f16 in ``halves`` [tile, h_stride] for the ranks below
    r16 (``h_of(k, r)``: its f32 value at row k of the tile, rank r), zero
    above; B's block after it zeroed (its ranks past the adapter's stay zero)."""
    with _each(m, lay.tile * lay.ranks, "e") as e:
        k, r = m.let(e / lay.ranks, "k"), m.let(e % lay.ranks, "r")
        at = m.let(k * lay.h_stride + r, "hs")
        with m.if_(r < tile.r16):
            halves[at] = f16(h_of(k, r))
        with m.else_():  # read by the left fragments, not multiplied
            halves[at] = f16(0.0)
    b_at = lay.tile * lay.h_stride
    with _each(m, lay.columns * lay.h_stride, "z") as z:
        halves[b_at + z] = f16(0.0)
    m.barrier()


def _stage_b(m, lay, Bm, tile, c0, halves):
    """B's rows c0 .. c0 + columns (past out_dim: left as they were) into
    ``halves`` after h, [columns, h_stride], ranks below the adapter's:
    vec4 reads where the rank is a multiple of 4, else one element at a time."""
    b_at, rank = lay.tile * lay.h_stride, tile.rank
    cols = m.let(Bi.min(u32(lay.columns), lay.out_dim - c0), "cols")
    quads = lay.ranks // 4
    with m.if_(rank % 4 == 0):
        with _each(m, lay.columns * quads, "bq") as q:
            o, rq = m.let(q / quads, "bo"), m.let(q % quads * 4, "br")
            with m.if_((rq < rank) & (o < cols)):
                v = m.let(Bm[(tile.b_off + (c0 + o) * rank + rq) / 4], "bv")
                at = m.let(b_at + o * lay.h_stride + rq, "bat")
                for e, lane in enumerate("xyzw"):
                    halves[at + e] = getattr(v, lane)
    with m.else_():
        with _each(m, lay.columns * lay.ranks, "be") as q:
            o, r = m.let(q / lay.ranks, "bo"), m.let(q % lay.ranks, "br")
            with m.if_((r < rank) & (o < cols)):
                el = m.let(tile.b_off + (c0 + o) * rank + r, "bel")
                halves[b_at + o * lay.h_stride + r] = Bm[el / 4][el % 4]


def _expand(m, lay, bufs, tile, arrays, split):
    """output[rows] += (scale h) B^T, a block of columns at a time: B's block
    staged, each subgroup's fragments of it multiplied and stored to
    ``floats`` [tile, columns], then added to the output rows."""
    (Bm, out), (halves, floats), (sg, column_splits) = bufs, arrays, split
    left_t, right_t, result_t = FRAGMENT.types()
    rf, cg = m.let(sg % lay.row_fragments, "erf"), m.let(sg / lay.row_fragments, "cg")
    lefts = [m.let(Bi.subgroup_matrix_load(left_t, halves, rf * F * lay.h_stride + kf * F,
                                           lay.h_stride), f"el{kf}")
             for kf in range(lay.ranks // F)]
    adds = _add_rows(m, lay, tile)
    b_at = lay.tile * lay.h_stride
    first = m.let(m.workgroup_id().y * lay.columns, "c_first")
    with m.loop(first, lay.out_dim, lay.columns * column_splits, name="c0") as c0:
        olds = _read_block(m, lay, out, adds, c0)  # in flight while B's block is staged
        _stage_b(m, lay, Bm, tile, c0, halves)
        m.barrier()
        acc = [m.var(result_t, name=f"oacc{j}") for j in range(lay.cf)]
        for kf, left in enumerate(lefts):
            with m.if_(u32(kf * F) < tile.rank):
                for j, a in enumerate(acc):
                    at = b_at + (cg * lay.cf + j) * F * lay.h_stride + kf * F
                    right = Bi.subgroup_matrix_load_col_major(right_t, halves, at, lay.h_stride)
                    m.assign(a, Bi.subgroup_matrix_multiply_accumulate(left, right, a))
        for j, a in enumerate(acc):
            Bi.subgroup_matrix_store(floats, rf * F * lay.columns + (cg * lay.cf + j) * F, a,
                                     lay.columns)
        m.barrier()
        for (k, c, _, _), (at, old, inside) in zip(adds, olds):
            with m.if_(inside):
                d = m.let(k * lay.columns + c, "dat")
                delta = vec4f(floats[d], floats[d + 1], floats[d + 2], floats[d + 3])
                out[at] = vec4h(vec4f(old) + delta)


def _read_block(m, lay, out, adds, c0):
    """This thread's vec4s of the output in the block of columns from ``c0``:
    (index, value, whether inside the batch's rows and out_dim)."""
    olds = []
    for q, (_, c, row, real) in enumerate(adds):
        inside = m.let(real & (c0 + c < lay.out_dim), f"oin{q}")
        at = m.let(row + (c0 + c) / 4, f"oat{q}")
        old = m.var(vec4h(0.0), name=f"old{q}")
        with m.if_(inside):
            m.assign(old, out[at])
        olds.append((at, old, inside))
    return olds


def _add_rows(m, lay, tile):
    """This thread's vec4s of a block's results: (row of the tile, column in
    the block, the output row's first vec4, whether the row is real)."""
    threads, quads = matrix_threads(), lay.columns // 4
    n4 = lay.out_dim // 4
    adds = []
    for q in range(lay.tile * quads // threads):
        idx = m.let(m.local_index() + q * threads, f"oi{q}")
        k = m.let(idx / quads, f"ok{q}")
        row = m.let(tile.row(m, k, f"orow{q}") * n4, f"ob{q}")
        adds.append((k, m.let(idx % quads * 4, f"oc{q}"), row, k < tile.count))
    return adds
