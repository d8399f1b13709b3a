"""The LoRA delta for a batch whose rows each name an adapter of a pool
(multi-LoRA serving, as Punica's SGMV and S-LoRA's unpadded pool).

The pool of one layer, read at run time, so adapters come and go without
new WGSL: ``A`` holds every adapter's rows stacked (``[sum of ranks,
in_dim]``), ``B`` each adapter's ``[out_dim, rank]`` block one after another
(no padding to the largest rank), and ``table`` one ``vec4<u32>`` per slot:
(first row of its A, first element of its B, rank, the f32 bits of its
scale); rank 0 marks a free slot. Sums are f32; A, B, x and the output are
stored as ``dtype``.

The work comes in items, as many as the u32 uniform ``tokens`` says:
``segments=False``: item w is row w of x, its slot ``ids[w]`` (i32, -1: no
delta; decode's scattered ids). ``segments=True``: item w is a tile
``tiles[w]`` = (first index into ``order``, row count <= tile_tokens, slot,
0) of rows ``order[first + k]`` sharing one adapter (prefill, rows sorted by
adapter), so each tile reads its adapter's A and B once (a tile of 0 rows
does nothing: lora.kernels.many_sort pads its tiles so). ``check_ids``
(rows only): an id that names no adapter is counted in the sticky
``flags`` (bad rows, the first one complemented, the largest of their ids
as u32 bits: the same whatever order the rows run in), and its row gets no
delta.

The forward is ``many_fused`` (h of the item in workgroup memory, then the
output), or ``many_shrink`` (h = scale * A x into the f32 ``h``, ``max_rank``
per row) and ``many_expand`` (output += B h) as the two-dispatch form;
``many_place`` writes an adapter into the pool (or copies one out of it).
"""
from __future__ import annotations

from shaderdsl import atomic, f32, i32, u32, vec4f, vec4u
from shaderdsl import builtins as B

from .common import (
    check_threads,
    dot_or_mul,
    input_matrix,
    output_buffer,
    split_index,
    storage_scalar,
    store_output,
    token_count,
    unrolled_or_loop,
    widen,
)

FLAGS = 3  # the flags buffer: bad rows seen, ~(the first), the largest of their ids as u32 bits


def check_layout(max_rank, threads, lanes, tile_tokens, segments, check_ids, rank_rows=1):
    """The parameters every many_* kernel shares, refused with what they must be."""
    check_threads(threads)
    if rank_rows not in (1, 4):
        raise ValueError(f"rank_rows must be 1 or 4, got {rank_rows!r}")
    if not isinstance(max_rank, int) or max_rank < 4 or max_rank % 4:
        raise ValueError(f"max_rank must be a multiple of 4 (h is read as vec4), got "
                         f"{max_rank!r}")
    if not isinstance(lanes, int) or lanes < 1 or lanes & (lanes - 1) or lanes > threads:
        raise ValueError(f"lanes must be a power of two up to threads ({threads}), got "
                         f"{lanes!r}")
    if not isinstance(tile_tokens, int) or tile_tokens < 1 or tile_tokens > 1 and not segments:
        raise ValueError(f"tile_tokens must be 1 for rows (one row per item) and >= 1 for "
                         f"segments, got {tile_tokens!r} with segments={segments}")
    if check_ids and segments:
        raise ValueError("check_ids applies to rows (ids read on the GPU); segments come "
                         "from checked ids (the host's, or lora.kernels.many_sort's)")


class Item:
    """This workgroup's work item: its rows (``rows[k]``, k < tile_tokens; a
    partial tile repeats its last row), ``count`` (rows that are real: an
    expression, or 1), and its adapter (a_row, b_off, rank, scale) from the
    table. Rows with no adapter (-1, or a bad id) return before any barrier
    (a condition uniform over the workgroup)."""

    def __init__(self, m, axis, segments, tile_tokens, check_ids):
        table = m.declare_input_buffer("table", vec4u, None)
        w = split_index(m, axis, "item")
        if segments:
            order = m.declare_input_buffer("order", u32, None)
            tiles = m.declare_input_buffer("tiles", vec4u, None)
            self._past_the_end(m, w)
            tile = m.let(tiles[w], "tile")
            self.count = m.let(tile.y, "count")
            with m.if_(self.count == 0):  # past the last tile the GPU's sort made
                m.return_()
            last = self.count - 1
            self.rows = [m.let(order[tile.x + B.min(u32(k), last)], f"row{k}")
                         for k in range(tile_tokens)]
            slot = m.let(tile.z, "slot")
        else:
            ids = m.declare_input_buffer("ids", i32, None)
            flags = m.declare_output_buffer("flags", atomic(u32), FLAGS) if check_ids else None
            self._past_the_end(m, w)
            self.rows, self.count = [w], 1
            slot = self._slot_of(m, ids, table, w, flags)
        entry = m.let(table[slot], "entry")
        self.a_row, self.b_off, self.rank = entry.x, entry.y, m.let(entry.z, "rank")
        self.scale = m.let(B.bitcast(f32, entry.w), "scale")

    def _past_the_end(self, m, w):
        with m.if_(w >= token_count(m, None)):
            m.return_()

    @staticmethod
    def _slot_of(m, ids, table, w, flags):
        """ids[w] as a slot; -1 returns; an id naming no adapter (outside the
        table, or a free slot) is flagged (``flags``) and returns."""
        idv = m.let(ids[w], "id")
        slots = m.let(B.array_length(table), "slots")
        slot = m.let(B.min(u32(B.max(idv, 0)), slots - 1), "slot")
        named = m.let((idv >= 0) & (u32(B.max(idv, 0)) < slots), "named")
        good = m.let(named & (table[slot].z > 0), "good")
        if flags is not None:
            with m.if_((idv != -1) & ~good & (m.local_index() == 0)):  # once per row
                B.atomic_add(flags[0], 1)  # add and max: the same flags in any order of rows
                B.atomic_max(flags[1], ~w)  # the first bad row, complemented (flags start at 0)
                B.atomic_max(flags[2], B.bitcast(u32, idv))
        with m.if_(~good):
            m.return_()
        return slot


def h_phase(m, A, x, in_dim, item, layout, store, unroll, ranks=None):
    """scale * A_slot @ x for every row of the item. ``layout`` = (threads,
    lanes, tile_tokens, rank_rows): ``lanes`` threads share ``rank_rows``
    rank rows (a strided slice of in_dim each; every load of A serves all the
    tile's rows, every load of x all the group's rank rows), threads / lanes
    groups at a time, a runtime loop over the rank; the lanes' sums meet in
    workgroup memory and lane 0 calls ``store(k, r, value)`` for row k of the
    tile and rank r. ``ranks``: (first, end) of the ranks to compute, default all."""
    threads, lanes, tile_tokens, rank_rows = layout
    n4 = in_dim // (4 if in_dim % 4 == 0 else 1)
    tid = m.local_index()
    group, lane = m.let(tid / lanes, "group"), m.let(tid % lanes, "lane")
    red = m.shared(f32, tile_tokens * threads, "red")
    first, end = ranks or (0, item.rank)
    with m.loop(first, end, threads // lanes * rank_rows, name="r0") as r0:
        rs = [m.let(r0 + group * rank_rows + j, f"r{j}") for j in range(rank_rows)]
        arows = [m.let((item.a_row + B.min(r, item.rank - 1)) * n4, f"arow{j}")
                 for j, r in enumerate(rs)]
        accs = [[m.var(f32, 0.0, f"acc{k}_{j}") for j in range(rank_rows)]
                for k in range(tile_tokens)]
        xrows = [m.let(row * n4, f"xrow{k}") for k, row in enumerate(item.rows)]

        def column(c):
            xs = [widen(x[xrow + c]) for xrow in xrows]
            if rank_rows > 1:
                xs = [m.let(v, f"xv{k}") for k, v in enumerate(xs)]
            for j, arow in enumerate(arows):
                a = m.let(widen(A[arow + c]), f"a{j}")
                for k in range(tile_tokens):
                    accs[k][j] += dot_or_mul(a, xs[k])

        unrolled_or_loop(m, lane, n4, lanes, (tile_tokens + 1) * rank_rows + tile_tokens,
                         column, "c", unroll)
        for j, r in enumerate(rs):
            sums = lanes_sum(m, red, [acc[j] for acc in accs], threads, lanes, lane)
            with m.if_((lane == 0) & (r < end)):
                for k in range(tile_tokens):
                    store(k, r, item.scale * sums[k])


def lanes_sum(m, red, accs, threads, lanes, lane):
    """Each accumulator summed over the ``lanes`` threads of each group (a
    tree in ``red``, one slot per thread and accumulator); the sums, as
    lane 0 of the group reads them."""
    tid = m.local_index()
    for k, acc in enumerate(accs):
        red[k * threads + tid] = acc
    m.barrier()
    s = lanes // 2
    while s:
        with m.if_(lane < s):
            for k in range(len(accs)):
                red[k * threads + tid] += red[k * threads + tid + s]
        m.barrier()
        s //= 2
    return [red[k * threads + tid] for k in range(len(accs))]


def out_column(m, Bm, out, out_dim, item, i, h_of, tile_tokens):
    """output[row, i] += B_slot[i, :] . h[row] for every real row of the item:
    the rank in steps of 4 (``h_of(k, rs)`` the vec4 of h[k, r] for the four
    ranks rs), a last step of the rank's remainder with B's missing ranks as
    zero (and their h read at the last rank: every value read was written)."""
    rank = item.rank
    base = m.let(item.b_off + i * rank, "bi")
    accs = [m.var(f32, 0.0, f"o{k}") for k in range(tile_tokens)]

    def add(rs, b):
        b = m.let(b, "bv")
        for k in range(tile_tokens):
            accs[k] += B.dot(b, h_of(k, rs))

    with m.loop(0, rank / 4, name="q") as q:
        r = m.let(q * 4, "rq")
        add([r + j for j in range(4)], vec4f(*[widen(Bm[base + r + j]) for j in range(4)]))
    with m.if_(rank % 4 != 0):
        r = m.let(rank / 4 * 4, "rt")  # the first rank of the remainder
        rs = [m.let(B.min(r + j, rank - 1), f"rt{j}") for j in range(4)]
        add(rs, vec4f(*[B.select(0.0, widen(Bm[base + rj]), r + j < rank)
                        for j, rj in enumerate(rs)]))
    for k in range(tile_tokens):
        at = m.let(item.rows[k] * out_dim + i, f"at{k}")

        def store(k=k, at=at):
            store_output(out, at, widen(out[at]) + accs[k])
        if tile_tokens == 1:
            store()
        else:
            with m.if_(u32(k) < item.count):
                store()


def shared_floats(threads, max_rank, tile_tokens, fused=True) -> int:
    """The f32s of workgroup memory a many_fused (or many_shrink) kernel
    declares: the lanes' sums and, fused, h of the tile. Over the device's
    max-compute-workgroup-storage-size, a plan is refused when it is built."""
    return tile_tokens * (threads + (max_rank if fused else 0))


def _vec4_of(buf, at, rs):
    """vec4(buf[at + rs[0]], ..., buf[at + rs[3]])."""
    return vec4f(*[buf[at + r] for r in rs])


def many_fused(m, in_dim, out_dim, max_rank=64, tokens=None, threads=256, lanes=16,
               tile_tokens=1, segments=False, check_ids=False, dtype="f32", unroll=True,
               rank_rows=1):
    """output += scale_i B_i (A_i x) for each row's adapter i, one dispatch:
    phase 1 (``h_phase``) leaves scale * h of the item in workgroup memory,
    phase 2 gives each thread output columns (strided by threads) of every
    row of the item. ``tokens`` must be None: the item count is a uniform.
    ``rank_rows``: rank rows per group of lanes in phase 1 (1 or 4: each load
    of x then serves four rows of A)."""
    _run_time(tokens)
    check_layout(max_rank, threads, lanes, tile_tokens, segments, check_ids, rank_rows)
    A, _ = input_matrix(m, "A", None, in_dim, dtype)
    Bm = m.declare_input_buffer("B", storage_scalar(dtype), None)
    x, _ = input_matrix(m, "x", None, in_dim, dtype)
    out = output_buffer(m, None, dtype)
    hw = m.shared(f32, tile_tokens * max_rank, "hw")
    item = Item(m, "x", segments, tile_tokens, check_ids)

    def keep(k, r, value):
        hw[k * max_rank + r] = value

    h_phase(m, A, x, in_dim, item, (threads, lanes, tile_tokens, rank_rows), keep, unroll)
    m.barrier()

    def h_of(k, rs):
        return _vec4_of(hw, k * max_rank, rs)

    with m.loop(m.local_index(), out_dim, threads, name="i") as i:
        out_column(m, Bm, out, out_dim, item, i, h_of, tile_tokens)


def many_shrink(m, in_dim, max_rank=64, tokens=None, threads=256, lanes=16, tile_tokens=1,
                segments=False, check_ids=False, dtype="f32", unroll=True, rank_block=0,
                rank_rows=1):
    """h[row, r] = scale_i (A_i x[row])[r] for r < rank_i (f32, rows of
    ``max_rank``), one workgroup per item: the first of the two dispatches.
    ``rank_block``: workgroup y computes ranks [y rank_block, (y + 1)
    rank_block) only (grid y: max_rank / rank_block), so a high-rank
    adapter's A is read by several workgroups at once; 0: all ranks.
    ``rank_rows`` as for many_fused."""
    _run_time(tokens)
    check_layout(max_rank, threads, lanes, tile_tokens, segments, check_ids, rank_rows)
    step = threads // lanes * rank_rows
    if rank_block and (rank_block % step or max_rank % rank_block):
        raise ValueError(f"rank_block ({rank_block}) must be a multiple of threads / lanes x "
                         f"rank_rows ({step}, the ranks of one step) and divide max_rank "
                         f"({max_rank})")
    A, _ = input_matrix(m, "A", None, in_dim, dtype)
    x, _ = input_matrix(m, "x", None, in_dim, dtype)
    h = m.declare_output_buffer("h", f32, None)
    item = Item(m, "x", segments, tile_tokens, check_ids)

    def keep(k, r, value):
        if tile_tokens == 1:
            h[item.rows[k] * max_rank + r] = value
            return
        with m.if_(u32(k) < item.count):
            h[item.rows[k] * max_rank + r] = value

    ranks = None
    if rank_block:
        first = m.let(m.workgroup_id().y * rank_block, "first")
        with m.if_(first >= item.rank):
            m.return_()
        ranks = (first, B.min(first + rank_block, item.rank))
    h_phase(m, A, x, in_dim, item, (threads, lanes, tile_tokens, rank_rows), keep, unroll,
            ranks)


def many_expand(m, out_dim, max_rank=64, tokens=None, threads=256, tile_tokens=1,
                segments=False, dtype="f32"):
    """output[row] += B_i h[row] (h from many_shrink, already scaled): one
    thread per output column, a row of workgroups per item (grid y)."""
    _run_time(tokens)
    check_layout(max_rank, threads, 1, tile_tokens, segments, False)
    Bm = m.declare_input_buffer("B", storage_scalar(dtype), None)
    h = m.declare_input_buffer("h", f32, None)
    out = output_buffer(m, None, dtype)
    item = Item(m, "y", segments, tile_tokens, False)
    i = m.let(m.workgroup_id().x * threads + m.local_index(), "i")

    def h_of(k, rs):
        return _vec4_of(h, item.rows[k] * max_rank, rs)

    with m.if_(i < out_dim):
        out_column(m, Bm, out, out_dim, item, i, h_of, tile_tokens)


def _run_time(tokens):
    if tokens is not None:
        raise ValueError(f"the many_* kernels read their item count at run time: tokens must "
                         f"be None, got {tokens!r}")


def many_place(m, tokens=None, threads=256, dtype="f32"):
    """dst[at + i] = src[src_at + i] for i < tokens (the uniform: the element
    count): an adapter's A rows or B block written into the pool at its
    offset, leaving the other adapters alone, or copied out of it (the host
    API writes and copies whole buffers only)."""
    _run_time(tokens)
    check_threads(threads)
    src = m.declare_input_buffer("src", storage_scalar(dtype), None)
    dst = m.declare_output_buffer("dst", storage_scalar(dtype), None)
    at = m.declare_uniform("at", u32)
    src_at = m.declare_uniform("src_at", u32)
    i = m.let(split_index(m, "x", "block") * threads + m.local_index(), "i")
    with m.if_(i < token_count(m, None)):
        dst[at + i] = src[src_at + i]
