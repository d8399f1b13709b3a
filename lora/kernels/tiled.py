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
                   half=False):
    """Phase 1's partial sums: (accumulators, lane, first token of each block
    row within the tile, first rank r0 of the thread's group)."""
    tid = m.local_index()
    if token_block == 1 and rank_groups == 1:
        tl = m.let(tid / lanes, "tl")
        lane = m.let(tid % lanes, "lane")
        t = m.let(B.min(t0 + tl, tokens - 1), "t")  # a partial last tile recomputes a real token
        accs = partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll, half=half)
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
    accs = [a for block in partial_dots(m, A, x, per, in_n, ts, lane, lanes, unroll, rows, half)
            for a in block]
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


def _tile_columns(m, Bm, out, hw, rank, w, out_dim, tokens, tile_tokens, t0, quad=False):
    """Phase 2 for output column i (``quad``: columns 4i .. 4i + 3, out read and
    written as vec4): B's row(s) once, then every token of the tile.
    ``tokens``: an int, or the run-time count (then any tile may be the last)."""
    ragged = not isinstance(tokens, int) or tokens % tile_tokens != 0
    row_len = out_dim // 4 if quad else out_dim

    def dot_h(row, k):
        hs = [hw[k * (rank // w) + q] for q in range(rank // w)]
        if w != 4:
            return row_dot(row, hs)
        return sum_terms([B.dot(v, h) for v, h in zip(row, hs)])

    def column(i):
        # All loads of this column first (B row(s), then every token's output),
        # so they are in flight together; then the stores.
        rows = [b_row(m, Bm, i * 4 + c, rank) for c in range(4)] if quad else \
            [b_row(m, Bm, i, rank)]
        dests = [m.let((B.min(t0 + k, tokens - 1) if ragged else t0 + k) * row_len + i, f"d{k}")
                 for k in range(tile_tokens)]
        olds = [m.let(widen(out[d]), f"o{k}") for k, d in enumerate(dests)]
        for k in range(tile_tokens):
            total = vec4f(*[dot_h(row, k) for row in rows]) if quad else dot_h(rows[0], k)
            if ragged:
                with m.if_(t0 + k < tokens):
                    store_output(out, dests[k], olds[k] + total)
            else:
                store_output(out, dests[k], olds[k] + total)
    return column


def tiled_forward(m, rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                  unroll=True, dtype="f32", token_block=1, save_h=False, quad=False, half=False):
    """The LoRA delta for many tokens in one dispatch, tile_tokens per workgroup.

    Phase 1 (``phase_h``): h = A @ x for the tile, left as scale * h in
    workgroup memory. Each thread sums a strided slice of in_dim for
    ``token_block`` tokens at once (each load of A serves them all) and for
    all ranks, or, when that would be more than MAX_BLOCK_ACCS accumulators,
    for a group of ranks; the threads sharing (tokens, ranks) then reduce.
    Phase 2 (``phase_out``): each thread owns output columns (``quad``: four
    adjacent ones, read and written as vec4); it loads their rows of B once
    and updates them for every token of the tile. A and B are read once per
    tile (per token block in phase 1), not once per token, which is what
    limits the one-token-per-workgroup kernel. ``half`` (f16 only): phase
    1's products of A and x summed in f16 four at a time
    (lora.kernels.common.half_dot), so A is never converted to f32. With
    ``save_h`` phase 1 also writes h (f32) for the backward.
    """
    tile_layout(rank, threads, tile_tokens, token_block)
    check_half(half, dtype)
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    Bm, out = tile_outputs(m, rank, out_dim, tokens, dtype, quad)
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank)) if save_h else None
    n, t0 = tile_origin(m, tokens, tile_tokens)
    hw = tile_memory(m, rank, tile_tokens)
    phase_h(m, hw, A, x, in_n, n, t0, rank, scale, threads, tile_tokens, token_block, unroll, h,
            half)
    phase_out(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, threads, quad, unroll)


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
            h=None, half=False):
    """Phase 1 of a tile: hw = scale * A @ x for its tokens (and h = A @ x where
    ``h``, the f32 buffer, is given); ``half``: products summed in f16 four at
    a time."""
    w, per, rank_groups, lanes = tile_layout(rank, threads, tile_tokens, token_block)
    accs, lane, firsts, r0 = _tile_partials(m, A, x, rank, in_n, n, t0, lanes, per,
                                            rank_groups, token_block, unroll, half)
    finish = _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0,
                           scale, (h, t0, n))
    tree_sum(m, accs, threads, lanes, lane, finish, SHARED_FLOATS - tile_tokens * rank)


def tile_outputs(m, rank, out_dim, tokens, dtype, quad):
    """B and the output buffer of phase 2 (``quad``: the output as vec4)."""
    if quad and (out_dim % 4 or rank > QUAD_MAX_RANK):
        raise ValueError(f"quad columns need out_dim divisible by 4 and rank at most "
                         f"{QUAD_MAX_RANK} (four rows of B per thread), got out_dim {out_dim}, "
                         f"rank {rank}; the gemm strategy suits higher ranks")
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    return Bm, output_buffer(m, token_rows(tokens, out_dim), dtype, quad=quad)


def phase_out(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, threads, quad, unroll):
    """Phase 2 of a tile: output[t0 + k, :] += B @ hw[k] for every token k < n of
    the tile, with ``hw`` (scale * h, in workgroup memory) complete."""
    w = width(rank)
    column = _tile_columns(m, Bm, out, hw, rank, w, out_dim, n, tile_tokens, t0, quad)
    columns = out_dim // 4 if quad else out_dim
    cost = (tile_tokens * 3 + rank // w) * (4 if quad else 1)
    unrolled_or_loop(m, m.local_index(), columns, threads, cost, column, "i", unroll)
