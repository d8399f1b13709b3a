"""The LoRA forward for many tokens in one dispatch, a tile of tokens per
workgroup (the tiled strategy): phase 1 leaves scale * h of the tile in
workgroup memory, phase 2 adds B @ it to the tile's outputs."""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f32, vec4f

from .common import (
    SHARED_FLOATS,
    b_row,
    check_threads,
    input_matrix,
    output_buffer,
    partial_dots,
    row_dot,
    store_output,
    sum_terms,
    tile_origin,
    token_rows,
    tree_sum,
    unrolled_or_loop,
    widen,
    width,
)

MAX_BLOCK_ACCS = 64  # accumulators per thread in tiled_forward's phase 1 before ranks are split
QUAD_MAX_RANK = 16  # tiled_forward's quad columns: four rows of B in registers per thread
WIDE_MAX_RANK = 8  # its wide columns: eight rows of B in registers per thread


def _rank_split(rank: int, token_block: int, w: int) -> tuple[int, int]:
    """(ranks per thread, rank groups) for tiled_forward's phase 1: at most
    MAX_BLOCK_ACCS accumulators per thread, a power-of-two number of groups
    (so the lanes per group stay a power of two), and whole vec4s of h."""
    if token_block * rank <= MAX_BLOCK_ACCS:
        return rank, 1
    per = max(1, MAX_BLOCK_ACCS // token_block)
    groups = 1 << (-(-rank // per) - 1).bit_length()
    per = -(-rank // groups)
    per += -per % w
    return per, groups


def tiled_fits(rank: int, threads: int, tile_tokens: int, token_block: int) -> bool:
    """Whether tiled_forward's phase 1 has a thread for every (token block, rank group)."""
    return tile_tokens // token_block * _rank_split(rank, token_block, width(rank))[1] <= threads


def tile_layout(rank, threads, tile_tokens, token_block):
    """(vector width of h, ranks per thread group, rank groups, lanes per group),
    after checking the tile fits the workgroup."""
    check_threads(threads)
    if tile_tokens > threads or threads % tile_tokens:
        raise ValueError(f"tile_tokens ({tile_tokens}) must divide threads ({threads})")
    if token_block < 1 or tile_tokens % token_block:
        raise ValueError(f"token_block ({token_block}) must divide tile_tokens ({tile_tokens})")
    w = width(rank)  # scale * h of the tile, as vec4 when rank allows: fewer loads in phase 2
    per, rank_groups = _rank_split(rank, token_block, w)
    if not tiled_fits(rank, threads, tile_tokens, token_block):
        raise ValueError(f"tiled_forward: rank {rank} in blocks of {token_block} tokens needs "
                         f"more than {threads} threads")
    return w, per, rank_groups, threads // (tile_tokens // token_block * rank_groups)


def _tile_partials(m, A, x, rank, in_n, tokens, t0, lanes, per, rank_groups, token_block, unroll,
                   span=1, half=False):
    """Phase 1's partial sums: (accumulators, lane, first token of each block
    row within the tile, first rank r0 of the thread's group)."""
    tid = m.local_index()
    if token_block == 1 and rank_groups == 1:
        tl = m.let(tid / lanes, "tl")
        lane = m.let(tid % lanes, "lane")
        t = m.let(B.min(t0 + tl, tokens - 1), "t")  # a partial last tile recomputes a real token
        accs = partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll, span=span, half=half)
        return accs, lane, [tl], 0
    group = m.let(tid / lanes, "group")
    lane = m.let(tid % lanes, "lane")
    tg = m.let(group / rank_groups if rank_groups > 1 else group, "tg")
    first = m.let(tg * token_block, "tl")  # the block's first token within the tile
    ts = [m.let(B.min(t0 + first + j, tokens - 1), f"tk{j}") for j in range(token_block)]
    if rank_groups > 1:
        r0 = m.let((group % rank_groups) * per, "r0")
        rows = [m.let(B.min(r0 + q, rank - 1) * in_n, f"row{q}") for q in range(per)]
    else:
        r0, rows = 0, None
    accs = [a for block in partial_dots(m, A, x, per, in_n, ts, lane, lanes, unroll, rows, span,
                                        half) for a in block]
    return accs, lane, [first + j for j in range(token_block)], r0


def _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0, scale, saved):
    """The ``finish`` of phase 1's reduction: lane 0 of each group stores scale * h
    (and, with ``saved`` = (h buffer or None, t0, tokens), h itself for the backward)."""
    tid = m.local_index()
    h, t0, tokens = saved

    def finish(red, chunk, g0):
        with m.if_(lane == 0):
            for q in range(len(chunk)):
                j, k = divmod(g0 + q, per)  # token of the block, rank of the group
                value = scale * red[q * threads + tid]
                ragged = rank_groups * per > rank and k >= rank - (rank_groups - 1) * per

                def store_h():  # r0 is a multiple of 4 when w == 4 (_rank_split)
                    if w == 4:
                        at = firsts[j] * (rank // 4) + r0 // 4 + k // 4
                        setattr(hw[at], "xyzw"[k % 4], value)
                    else:
                        hw[firsts[j] * rank + r0 + k] = value
                    if h is not None:
                        with m.if_(t0 + firsts[j] < tokens):
                            h[(t0 + firsts[j]) * rank + r0 + k] = red[q * threads + tid]

                if ragged:
                    with m.if_(r0 + k < rank):
                        store_h()
                else:
                    store_h()
    return finish


class TileColumns:
    """Phase 2's items: item i is a group of output columns (``vecs`` 0: column
    i; 1 (quad): columns 4i .. 4i + 3, out read and written as a vec4; 2
    (wide): 8 columns as two adjacent vec4s) for ``block`` tokens of the tile
    (the whole tile; or item i takes group i % groups and the block i // groups).
    ``tokens``: an int, or the run-time count (then any tile may be the last).
    ``column(i)`` loads the group's rows of B once, then every token's output
    (all in flight together), then stores; ``outputs`` and ``update`` are its
    halves, for a kernel that loads the outputs before phase 1 (``preload``)."""

    def __init__(self, m, Bm, out, hw, rank, out_dim, tokens, tile_tokens, t0, vecs, block):
        self.m, self.Bm, self.out, self.hw, self.rank = m, Bm, out, hw, rank
        self.tokens, self.tile_tokens, self.t0, self.vecs = tokens, tile_tokens, t0, vecs
        self.w, self.block = width(rank), block
        self.ragged = not isinstance(tokens, int) or tokens % tile_tokens != 0
        self.row_len = out_dim // 4 if vecs else out_dim
        self.cols, self.per = (4 * vecs, vecs) if vecs else (1, 1)  # columns, elements per token
        self.groups = out_dim // self.cols
        self.items = self.groups * (tile_tokens // block)

    def split(self, i):
        """(column group, first token of the block within the tile) of item i."""
        if self.block == self.tile_tokens:
            return i, 0
        return self.m.let(i % self.groups, "g"), self.m.let(i / self.groups * self.block, "k0")

    def outputs(self, g, k0, wide_now=True, only=None):
        """(index of each token's first output element, its values): widened
        to f32 now, or (``wide_now`` False) kept as stored until used;
        ``only``: a condition, where not met the values stay zero (not loaded)."""
        m, t0, tokens = self.m, self.t0, self.tokens
        dests = [m.let((B.min(t0 + k0 + k, tokens - 1) if self.ragged else t0 + k0 + k)
                       * self.row_len + g * self.per, f"d{k}") for k in range(self.block)]
        names = [[f"o{k}" + (f"_{q}" if self.per > 1 else "") for q in range(self.per)]
                 for k in range(self.block)]
        if only is None:
            return dests, [[m.let(widen(self.out[d + q]) if wide_now else self.out[d + q],
                                  names[k][q]) for q in range(self.per)]
                           for k, d in enumerate(dests)]
        olds = [[m.var(self.out.type.elem, None, name) for name in row] for row in names]
        with m.if_(only):
            for k, d in enumerate(dests):
                for q in range(self.per):
                    m.assign(olds[k][q], self.out[d + q])
        return dests, olds

    def rows(self, g):
        """The rows of B of column group g."""
        if not self.vecs:
            return [b_row(self.m, self.Bm, g, self.rank)]
        return [b_row(self.m, self.Bm, g * self.cols + c, self.rank) for c in range(self.cols)]

    def column(self, i):
        g, k0 = self.split(i)
        rows = self.rows(g)
        self.update(rows, k0, *self.outputs(g, k0))

    def update(self, rows, k0, dests, olds):
        """Store old + B @ (scale * h) for each token of the item (those < tokens)."""
        for k in range(self.block):
            hs = self._h_of(k0 + k)
            totals = [vec4f(*[self._dot_h(row, hs) for row in rows[4 * q:4 * q + 4]])
                      for q in range(self.per)] if self.vecs else [self._dot_h(rows[0], hs)]
            if self.ragged:
                with self.m.if_(self.t0 + k0 + k < self.tokens):
                    self._store(dests[k], olds[k], totals)
            else:
                self._store(dests[k], olds[k], totals)

    def _store(self, dest, olds, totals):
        for q in range(self.per):
            store_output(self.out, dest + q, widen(olds[q]) + totals[q])

    def _h_of(self, k):
        """scale * h of token k, in lets where eight columns read it."""
        hs = [self.hw[k * (self.rank // self.w) + q] for q in range(self.rank // self.w)]
        return [self.m.let(v, "hk") for v in hs] if self.vecs == 2 else hs

    def _dot_h(self, row, hs):
        if self.w != 4:
            return row_dot(row, hs)
        return sum_terms([B.dot(v, h) for v, h in zip(row, hs)])


def tiled_forward(m, rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                  unroll=True, dtype="f32", token_block=1, save_h=False, quad=False,
                  wide=False, out_block=0, preload=False, half=False):
    """The LoRA delta for many tokens in one dispatch, tile_tokens per workgroup.

    Phase 1 (``phase_h``): h = A @ x for the tile, left as scale * h in
    workgroup memory. Each thread sums a strided slice of in_dim for
    ``token_block`` tokens at once (each load of A serves them all) and for
    all ranks, or, when that would be more than MAX_BLOCK_ACCS accumulators,
    for a group of ranks; the threads sharing (tokens, ranks) then reduce.
    Phase 2 (``phase_out``): each thread owns output columns (``quad``: four
    adjacent ones, read and written as vec4); it loads their rows of B once
    and updates them for every token of the tile (``out_block``: for a block
    of that many tokens, a (columns, block) pair per item, so more threads
    share a tile's columns). A and B are read once per tile (per token block
    in phase 1, per item in phase 2), not once per token, which is what
    limits the one-token-per-workgroup kernel. ``wide``: every access of x,
    A and the output moves two adjacent vec4s (16 bytes of f16, 32 of f32):
    phase 1 steps over pairs and each thread of phase 2 owns eight adjacent
    columns, so the memory-bound forward issues half the loads and stores.
    ``preload``: each thread (one item each) loads its outputs before phase 1,
    so they are in flight with x's loads, and stores them after it.
    ``half`` (f16 only): phase 1's products of A and x summed in f16 four at
    a time (lora.kernels.common.half_dot), so A is never converted to f32.
    With ``save_h`` phase 1 also writes h (f32) for the backward.
    """
    tile_layout(rank, threads, tile_tokens, token_block)
    check_half(half, dtype)
    if wide and in_dim % 8:
        raise ValueError(f"wide accesses need in_dim divisible by 8 (pairs of vec4), got "
                         f"in_dim {in_dim}")
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    Bm, out = tile_outputs(m, rank, out_dim, tokens, dtype, quad, wide)
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank)) if save_h else None
    n, t0 = tile_origin(m, tokens, tile_tokens)
    hw = tile_memory(m, rank, tile_tokens)
    def h_phase():
        phase_h(m, hw, A, x, in_n, n, t0, rank, scale, threads, tile_tokens, token_block, unroll,
                h, 2 if wide else 1, half)

    if preload:
        cols = tile_columns(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, quad, wide,
                            out_block)
        preloaded(m, cols, threads, h_phase)
        return
    h_phase()
    phase_out(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, threads, quad, unroll, wide,
              out_block)


def preloaded(m, cols, threads, h_phase):
    """Phase 2 with each thread's outputs (one item per thread) loaded before
    ``h_phase`` computes h, so they are in flight with its loads of x."""
    if cols.items > threads:
        raise ValueError(f"preload keeps one item of phase 2 per thread: {cols.items} items "
                         f"({cols.groups} column groups x {cols.tile_tokens // cols.block} token "
                         f"blocks) need at most {threads} threads; raise out_block or threads")
    tid = m.local_index()
    spare = cols.items < threads  # threads past the last item: load and store nothing
    g, k0 = cols.split(m.let(B.min(tid, cols.items - 1), "item") if spare else tid)
    dests, olds = cols.outputs(g, k0, False, tid < cols.items if spare else None)
    h_phase()
    if not spare:
        cols.update(cols.rows(g), k0, dests, olds)
        return
    with m.if_(tid < cols.items):
        cols.update(cols.rows(g), k0, dests, olds)


def tile_memory(m, rank, tile_tokens):
    """``hw``: scale * h of the tile in workgroup memory, as vec4 when rank allows
    (fewer loads in phase 2)."""
    w = width(rank)
    return m.shared(vec4f if w == 4 else f32, tile_tokens * rank // w, "hw")


def check_half(half, dtype):
    if half and dtype != "f16":
        raise ValueError(f"half sums products of f16 A and x in f16; the weight is {dtype} "
                         f"(leave half off)")


def phase_h(m, hw, A, x, in_n, n, t0, rank, scale, threads, tile_tokens, token_block, unroll,
            h=None, span=1, half=False):
    """Phase 1 of a tile: hw = scale * A @ x for its tokens (and h = A @ x where
    ``h``, the f32 buffer, is given); ``span``: vec4s of x and A per access;
    ``half``: products summed in f16 four at a time."""
    w, per, rank_groups, lanes = tile_layout(rank, threads, tile_tokens, token_block)
    accs, lane, firsts, r0 = _tile_partials(m, A, x, rank, in_n, n, t0, lanes, per,
                                            rank_groups, token_block, unroll, span, half)
    finish = _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0,
                           scale, (h, t0, n))
    tree_sum(m, accs, threads, lanes, lane, finish, SHARED_FLOATS - tile_tokens * rank)


def tile_outputs(m, rank, out_dim, tokens, dtype, quad, wide=False):
    """B and the output buffer of phase 2 (``quad`` or ``wide``: the output as vec4)."""
    if quad and wide:
        raise ValueError("quad and wide are two layouts of phase 2 (four or eight columns per "
                         "thread): choose one")
    if quad and (out_dim % 4 or rank > QUAD_MAX_RANK):
        raise ValueError(f"quad columns need out_dim divisible by 4 and rank at most "
                         f"{QUAD_MAX_RANK} (four rows of B per thread), got out_dim {out_dim}, "
                         f"rank {rank}; the gemm strategy suits higher ranks")
    if wide and (out_dim % 8 or rank > WIDE_MAX_RANK):
        raise ValueError(f"wide columns need out_dim divisible by 8 and rank at most "
                         f"{WIDE_MAX_RANK} (eight rows of B per thread), got out_dim {out_dim}, "
                         f"rank {rank}; quad columns take up to rank {QUAD_MAX_RANK}")
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    return Bm, output_buffer(m, token_rows(tokens, out_dim), dtype, quad=quad or wide)


def phase_out(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, threads, quad, unroll,
              wide=False, out_block=0):
    """Phase 2 of a tile: output[t0 + k, :] += B @ hw[k] for every token k < n of
    the tile, with ``hw`` (scale * h, in workgroup memory) complete; items of
    ``out_block`` tokens (0: the whole tile) and a group of columns."""
    cols = tile_columns(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, quad, wide, out_block)
    cost = (cols.block * 3 + rank // cols.w) * cols.cols
    unrolled_or_loop(m, m.local_index(), cols.items, threads, cost, cols.column, "i", unroll)


def tile_columns(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, quad, wide, out_block):
    """Phase 2's TileColumns, after checking out_block."""
    if out_block < 0 or out_block and tile_tokens % out_block:
        raise ValueError(f"out_block ({out_block}) must be 0 (the whole tile) or divide "
                         f"tile_tokens ({tile_tokens})")
    return TileColumns(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0,
                       2 if wide else 1 if quad else 0, out_block or tile_tokens)
