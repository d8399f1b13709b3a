"""The LoRA forward kernels: h = A @ x, y = B @ h, the scaled add, and fused forms.

Shapes (row-major): A [rank, in_dim], B [out_dim, rank], x [tokens, in_dim],
h [tokens, rank], y and output [tokens, out_dim]. The scratch buffers h and
y are always f32 (see ``common`` for dtypes).

``tokens=None`` (every kernel that takes ``tokens``; add_scaled with
``num_elements=None``) reads the token count at run time from the u32
uniform ``tokens``: the token-sized buffers are runtime-sized, rows past the
count are guarded, and the grid axis that counts tokens may be split over z
(``common.split_index``), so one pipeline serves every token count.
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f32, vec4f

from .common import (
    SHARED_FLOATS,
    b_row,
    b_row_dot,
    check_threads,
    hold,
    input_matrix,
    load_h,
    output_buffer,
    partial_dots,
    past_the_end,
    reduce_sum,
    row_dot,
    split_index,
    stage,
    storage_scalar,
    store_output,
    token_count,
    token_rows,
    tree_sum,
    unrolled_or_loop,
    widen,
    width,
)

# ------------------------------------------------------------------ A @ x

def project_a_seed(m, rank, in_dim, tokens=1, dtype="f32"):
    """Hesper's design: one thread per h element, a serial loop over in_dim."""
    A = m.declare_input_buffer("A", storage_scalar(dtype), rank * in_dim)
    x = m.declare_input_buffer("x", storage_scalar(dtype), token_rows(tokens, in_dim))
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank))
    gid = m.global_id()
    if tokens is None:  # grid (ceil(rank / 64), T) with T possibly split over z
        n = token_count(m, tokens)
        r, t = gid.x, split_index(m, "y", "t")
        inside = (r < rank) & (t < n)
    else:
        r, t = gid.x, gid.y
        inside = r < rank
    with m.if_(inside):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(in_dim, name="k") as k:
            acc += widen(A[r * in_dim + k]) * widen(x[t * in_dim + k])
        h[t * rank + r] = acc



def project_a_workgroup(m, rank, in_dim, tokens=1, threads=256, subgroups=False, dtype="f32",
                        rank_group=0):
    """h = A @ x with one workgroup per token (grid (tokens, 1)): every thread
    takes a strided slice of in_dim for all ranks, then the workgroup reduces.

    With ``rank_group`` (0 < rank_group < rank) workgroup (t, g) does ranks
    g * rank_group onwards only (grid (tokens, ceil(rank / rank_group))):
    more workgroups share the rows of A when the rank is high and tokens few.
    """
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank))
    t = _token(m, tokens, "x")
    if 0 < rank_group < rank:
        # rows r0 .. r0 + rank_group - 1; the last group reads row rank - 1 in
        # place of rows past the end and does not store them
        r0 = m.let(m.workgroup_id().y * rank_group, "r0")
        rows = [m.let(B.min(r0 + q, rank - 1) * in_n, f"row{q}") for q in range(rank_group)]
        accs = partial_dots(m, A, x, rank_group, in_n, t, m.local_index(), threads, rows=rows)
        hs = reduce_sum(m, accs, threads, subgroups)
        with m.if_(m.local_index() == 0):
            for q in range(rank_group):
                if (rank % rank_group) and q >= rank % rank_group:
                    with m.if_(r0 + q < rank):
                        h[t * rank + r0 + q] = hs[q]
                else:
                    h[t * rank + r0 + q] = hs[q]
        return
    accs = partial_dots(m, A, x, rank, in_n, t, m.local_index(), threads)
    hs = reduce_sum(m, accs, threads, subgroups)
    with m.if_(m.local_index() == 0):
        for r in range(rank):
            h[t * rank + r] = hs[r]


def _token(m, tokens, axis):
    """The token of this workgroup, ``workgroup_id.axis``; at run time (tokens
    None) also over z, and the workgroups past the last token return."""
    if tokens is not None:
        return getattr(m.workgroup_id(), axis)
    t = split_index(m, axis, "t")
    past_the_end(m, t, token_count(m, tokens))
    return t


# ------------------------------------------------------------------ B @ h, scaled add


def project_b(m, out_dim, rank, tokens=1, threads=256, dtype="f32"):
    """y = B @ h: one thread per output element, h in workgroup memory (y is f32)."""
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    h = m.declare_input_buffer("h", f32, token_rows(tokens, rank))
    y = m.declare_output_buffer("y", f32, token_rows(tokens, out_dim))
    t = _token(m, tokens, "y")
    hs = load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        y[t * out_dim + i] = b_row_dot(m, Bm, i, rank, hs)


def add_scaled(m, num_elements, scale, dtype="f32", columns=1):
    """output[i] += scale * y[i] (y is f32, output ``dtype``). ``num_elements``
    None: the first ``tokens * columns`` elements, ``tokens`` read at run time
    (the grid's x may then be split over z)."""
    y = m.declare_input_buffer("y", f32, num_elements)
    out = output_buffer(m, num_elements, dtype)
    if num_elements is None:
        n = m.let(token_count(m, None) * columns, "n")
        wid = m.workgroup_id()
        i = m.let(m.global_id().x + wid.z * m.num_workgroups().x * m.workgroup_size[0], "i")
    else:
        n = num_elements
        i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        if dtype == "f32":
            out[i] += scale * y[i]
        else:
            store_output(out, i, widen(out[i]) + scale * y[i])


def fused_b_add(m, out_dim, rank, scale, tokens=1, threads=256, dtype="f32"):
    """output[i] += scale * sum_r B[i, r] * h[r]: project_b and add_scaled in one."""
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    h = m.declare_input_buffer("h", f32, token_rows(tokens, rank))
    out = output_buffer(m, token_rows(tokens, out_dim), dtype)
    t = _token(m, tokens, "y")
    hs = load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        if dtype == "f32":
            out[t * out_dim + i] += scale * b_row_dot(m, Bm, i, rank, hs)
        else:
            j = m.let(t * out_dim + i, "j")
            store_output(out, j, widen(out[j]) + scale * b_row_dot(m, Bm, i, rank, hs))


# ------------------------------------------------------------------ one dispatch

def fused_forward(m, rank, in_dim, out_dim, scale, tokens=1, threads=256,
                  outputs_per_thread=1, subgroups=False, unroll=True, dtype="f32", save_h=False,
                  from_base=False):
    """The whole LoRA delta in one dispatch.

    Workgroup (i, t) recomputes h = A @ x[t] (A stays in L2), then adds
    scale * B @ h to its slice of threads * outputs_per_thread outputs of
    token t. WebGPU has no sync between workgroups; recomputing h is cheaper
    than a second dispatch. The B rows and output values this thread will
    need are loaded first, so their latency overlaps the work on h. With
    ``save_h`` the workgroups of column 0 also write h (f32) for the backward.
    With ``from_base`` it adds to ``base`` and writes the sum to the output
    (a training step's base output, without a copy into the output first).
    """
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    out = output_buffer(m, token_rows(tokens, out_dim), dtype)
    old_values = m.declare_input_buffer("base", storage_scalar(dtype), token_rows(
        tokens, out_dim)) if from_base else out
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank)) if save_h else None
    wid = m.workgroup_id()
    t = _token(m, tokens, "y")
    tid = m.local_index()
    base = m.let(wid.x * (threads * outputs_per_thread) + tid, "base")
    mine = []
    for k in range(outputs_per_thread):
        i = m.let(base + k * threads, f"col{k}")
        safe = m.let(B.min(i, out_dim - 1), f"safe{k}")  # in-bounds prefetch
        mine.append((i, b_row(m, Bm, safe, rank),
                     m.let(widen(old_values[t * out_dim + safe]), f"o{k}")))
    accs = partial_dots(m, A, x, rank, in_n, t, tid, threads, unroll)
    hs = reduce_sum(m, accs, threads, subgroups)
    for i, row, old in mine:
        with m.if_(i < out_dim):
            store_output(out, t * out_dim + i, old + scale * row_dot(row, hs))
    if save_h:
        with m.if_((wid.x == 0) & (tid == 0)):
            for r in range(rank):
                h[t * rank + r] = hs[r]


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


def _tile_shape(rank, threads, tile_tokens, token_block):
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


def _tile_partials(m, A, x, rank, in_n, tokens, t0, lanes, per, rank_groups, token_block, unroll):
    """Phase 1's partial sums: (accumulators, lane, first token of each block
    row within the tile, first rank r0 of the thread's group)."""
    tid = m.local_index()
    if token_block == 1 and rank_groups == 1:
        tl = m.let(tid / lanes, "tl")
        lane = m.let(tid % lanes, "lane")
        t = m.let(B.min(t0 + tl, tokens - 1), "t")  # a partial last tile recomputes a real token
        return partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll), lane, [tl], 0
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
    accs = [a for block in partial_dots(m, A, x, per, in_n, ts, lane, lanes, unroll, rows)
            for a in block]
    return accs, lane, [first + j for j in range(token_block)], r0


def _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0, scale, saved=None):
    """The ``finish`` of phase 1's reduction: lane 0 of each group stores scale * h
    (and, with ``saved`` = (h buffer, t0, tokens), h itself for the backward)."""
    tid = m.local_index()

    def finish(red, chunk, g0):
        with m.if_(lane == 0):
            for q in range(len(chunk)):
                j, k = divmod(g0 + q, per)  # token of the block, rank of the group
                value = scale * red[q * threads + tid]
                ragged = rank_groups * per > rank and k >= rank - (rank_groups - 1) * per

                def store_h():  # r0 is a multiple of 4 when w == 4 (_rank_split)
                    if w == 4:
                        setattr(hw[firsts[j] * (rank // 4) + r0 // 4 + k // 4], "xyzw"[k % 4], value)
                    else:
                        hw[firsts[j] * rank + r0 + k] = value
                    if saved is not None:
                        h, t0, tokens = saved
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
        total = B.dot(row[0], hs[0])
        for v, h in zip(row[1:], hs[1:]):
            total = total + B.dot(v, h)
        return total

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
                  unroll=True, dtype="f32", token_block=1, save_h=False, quad=False,
                  phases="both"):
    """The LoRA delta for many tokens in one dispatch, tile_tokens per workgroup.

    Phase 1: h = A @ x for the tile, left as scale * h in workgroup memory.
    Each thread sums a strided slice of in_dim for ``token_block`` tokens at
    once (each load of A serves them all) and for all ranks, or, when that
    would be more than MAX_BLOCK_ACCS accumulators, for a group of ranks; the
    threads sharing (tokens, ranks) then reduce. Phase 2 (``_phase_out``):
    each thread owns output columns (``quad``: four adjacent ones, read and
    written as vec4); it loads their rows of B once and updates them for
    every token of the tile. A and B are read once per tile (per token block
    in phase 1), not once per token, which is what limits the
    one-token-per-workgroup kernel. With ``save_h`` phase 1 also writes h (f32)
    for the backward. ``phases`` "h" or "out" builds one phase alone (the other
    replaced by a store of h or a constant h), for ``lora.bench_profile``.
    """
    if phases not in ("both", "h", "out"):
        raise ValueError(f"phases must be 'both', 'h' or 'out', got {phases!r}")
    w, per, rank_groups, lanes = _tile_shape(rank, threads, tile_tokens, token_block)
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x = input_matrix(m, "x", tokens, in_dim, dtype)[0] if phases != "out" else None
    Bm, out = (None, None) if phases == "h" else \
        _tile_outputs(m, rank, out_dim, tokens, dtype, quad)
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank)) \
        if save_h or phases == "h" else None
    n, t0 = _tile_origin(m, tokens, tile_tokens)
    hw = m.shared(vec4f if w == 4 else f32, tile_tokens * rank // w, "hw")
    if phases == "out":  # h of the tile: scale * A's first elements
        with m.loop(m.local_index(), tile_tokens * rank // w, threads, name="j") as j:
            hw[j] = scale * widen(A[j % (rank * in_n // w)])
        m.barrier()
    else:
        accs, lane, firsts, r0 = _tile_partials(m, A, x, rank, in_n, n, t0, lanes, per,
                                                rank_groups, token_block, unroll)
        finish = _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0,
                               scale, (h, t0, n) if h is not None else None)
        tree_sum(m, accs, threads, lanes, lane, finish, SHARED_FLOATS - tile_tokens * rank)
    if phases != "h":
        _phase_out(m, Bm, out, hw, rank, w, out_dim, n, tile_tokens, t0, threads, quad, unroll)


def _tile_origin(m, tokens, tile_tokens):
    """(token count, first token t0 of this workgroup's tile); at run time the
    tiles come from workgroup_id.x and .z, and those past the last token return."""
    if tokens is None:
        n = token_count(m, tokens)
        t0 = m.let(split_index(m, "x", "tile") * tile_tokens, "t0")
        past_the_end(m, t0, n)
        return n, t0
    return tokens, m.let(m.workgroup_id().x * tile_tokens, "t0")


def _tile_outputs(m, rank, out_dim, tokens, dtype, quad):
    """B and the output buffer of phase 2 (``quad``: the output as vec4)."""
    if quad and (out_dim % 4 or rank > QUAD_MAX_RANK):
        raise ValueError(f"quad columns need out_dim divisible by 4 and rank at most "
                         f"{QUAD_MAX_RANK} (four rows of B per thread), got out_dim {out_dim}, "
                         f"rank {rank}; the gemm strategy suits higher ranks")
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    return Bm, output_buffer(m, token_rows(tokens, out_dim), dtype, quad=quad)


def _phase_out(m, Bm, out, hw, rank, w, out_dim, n, tile_tokens, t0, threads, quad, unroll):
    """Phase 2 of a tile: output[t0 + k, :] += B @ hw[k] for every token k < n of
    the tile, with ``hw`` (scale * h, in workgroup memory) complete."""
    column = _tile_columns(m, Bm, out, hw, rank, w, out_dim, n, tile_tokens, t0, quad)
    columns = out_dim // 4 if quad else out_dim
    cost = (tile_tokens * 3 + rank // w) * (4 if quad else 1)
    unrolled_or_loop(m, m.local_index(), columns, threads, cost, column, "i", unroll)


# ------------------------------------------------------------------ two dispatches, GEMM-shaped

B_ADD_THREADS = 64  # tiled_b_add's workgroup: 64 threads, a vec4 of output columns each


GEMM_BLOCKS = (4, 8)  # tokens per thread of project_a_tiled


def gemm_tile_tokens(rank: int, threads: int, block: int = 4) -> int:
    """Tokens per workgroup of project_a_tiled: each thread owns a block x 4
    block (``block`` tokens, a vec4 of ranks), so threads // (rank / 4) groups
    of ``block`` tokens, at most 512 tokens (the threads left over only stage
    tiles)."""
    return block * min(threads // (rank // 4), 512 // block)


def gemm_chunk(rank: int, in_dim: int, threads: int, block: int = 4) -> int:
    """Columns of x and A staged per step: the most of 32, 16, 8, 4 that divides
    in_dim and fits both tiles in workgroup memory."""
    tile_rows = gemm_tile_tokens(rank, threads, block) + rank
    for chunk in (32, 16, 8, 4):
        if in_dim % chunk == 0 and chunk * tile_rows <= SHARED_FLOATS:
            return chunk
    raise ValueError(f"project_a_tiled: in_dim ({in_dim}) must be a multiple of 4 and "
                     f"{threads} threads at rank {rank} must fit {SHARED_FLOATS} floats")


def project_a_tiled(m, rank, in_dim, tokens, threads=256, splits=1, dtype="f32",
                    a_columns=False, scale=1.0, block=4):
    """Partial sums of h = scale A @ x, shaped like a matrix product: a workgroup
    takes ``gemm_tile_tokens`` tokens and every rank, over slice
    ``workgroup_id.y`` of ``splits`` slices of in_dim (more workgroups when
    tokens are few).

    Each step stages ``chunk`` columns of x and A in workgroup memory,
    transposed so that a vec4 holds 4 tokens (x) or 4 ranks (A); each thread
    then does 4 ``block`` multiply-adds per block / 4 + 1 vec4 loads (``block``
    tokens per thread: 4 or 8), and no thread reduces with another. The next
    step's loads are issued before this step's arithmetic, so their latency
    overlaps it. hp[s, t] holds slice s's sums for token t (hp is h when splits
    is 1); ``tiled_b_add`` adds the slices. ``a_columns``: A is given as its
    transpose [in_dim, rank] (B's layout: the backward's dh = s g B is this
    kernel with x = g and A = B), staged as is."""
    if rank % 4 or in_dim % 4 or rank > 4 * threads:
        raise ValueError(f"project_a_tiled: rank ({rank}) and in_dim ({in_dim}) must be "
                         f"multiples of 4, and rank at most 4 x threads ({threads})")
    if block not in GEMM_BLOCKS:
        raise ValueError(f"project_a_tiled: block must be one of {GEMM_BLOCKS}, got {block}")
    quads, tm = rank // 4, gemm_tile_tokens(rank, threads, block)
    chunk = gemm_chunk(rank, in_dim, threads, block)
    A, in_n = input_matrix(m, "A", *((in_dim, rank) if a_columns else (rank, in_dim)), dtype)
    x, in_n = input_matrix(m, "x", tokens, in_dim, dtype)
    hp = m.declare_output_buffer("hp", vec4f, None if tokens is None else splits * tokens * quads)
    n, t0 = _tile_origin(m, tokens, tm)
    xs, at = m.shared(vec4f, chunk * tm // 4, "xs"), m.shared(vec4f, chunk * quads, "at")
    tiles = [_transposed_tile(m, xs, x, tm, chunk, in_n, lambda t: B.min(t0 + t, n - 1), threads),
             _direct_tile(m, at, A, chunk * quads, threads) if a_columns
             else _transposed_tile(m, at, A, rank, chunk, in_n, lambda r: r, threads)]
    tid = m.local_index()
    tx, ty = m.let(tid % quads, "tx"), m.let(tid / quads, "ty")
    groups = tm // block  # of block tokens, one per thread of a rank quad
    spare = groups * quads < threads  # threads past the last group: staging only
    tr = m.let(ty % groups, "tr") if spare else ty
    accs = [m.var(vec4f, vec4f(0.0), f"acc{i}") for i in range(block)]
    s = m.workgroup_id().y
    steps = in_dim // chunk
    first = m.let(s * steps / splits, "first")
    last = m.let((s + 1) * steps / splits, "last")
    held = [load(first, name) for (load, _), name in zip(tiles, ("x_", "a_"))]
    with m.loop(first, last, name="step") as step:
        m.barrier()  # the previous step's reads of the tiles are done
        for (_, store), items in zip(tiles, held):
            store(items)
        m.barrier()
        with m.if_(step + 1 < last):  # the next step's loads, in flight during the arithmetic
            for (load, _), items in zip(tiles, held):
                load(step + 1, into=items)
        for k in range(chunk):
            xvs = [m.let(xs[k * (tm // 4) + tr * (block // 4) + b], "xv")
                   for b in range(block // 4)]
            av = m.let(at[k * quads + tx], "av")
            for i in range(block):
                accs[i] += getattr(xvs[i // 4], "xyzw"[i % 4]) * av
    for i in range(block):
        t = m.let(t0 + ty * block + i, f"t{i}")
        with m.if_((t < n) & (ty < groups) if spare else t < n):
            hp[(s * n + t) * quads + tx] = accs[i] if scale == 1.0 else scale * accs[i]


def _transposed_tile(m, shared, src, rows, chunk, in_n, row_of, threads):
    """(load(step, name or into), store(held)) of a rows x chunk tile of src
    staged transposed: _stage_load and _stage_store."""
    return (lambda step, name="", into=None: _stage_load(m, src, rows, chunk, in_n, step, row_of,
                                                         threads, name, into),
            lambda held: _stage_store(m, shared, rows, chunk, held, threads))


def _direct_tile(m, shared, src, items, threads):
    """(load, store) of a tile that is ``items`` consecutive vec4s of src per
    step, staged as it is stored."""
    return (lambda step, name="", into=None: hold(m, items, threads,
                                                  lambda j: widen(src[step * items + j]), name,
                                                  into),
            lambda held: stage(m, shared, items, held, threads))


def _stage_items(rows, chunk, threads):
    """(work items, per thread) of staging a rows x chunk tile: an item is one
    vec4 of 4 consecutive rows."""
    items = rows // 4 * (chunk // 4)
    return items, -(-items // threads)


def _stage_load(m, src, rows, chunk, in_n, step, row_of, threads, name="", into=None):
    """Load this thread's items of step ``step`` of a tile (4 vec4 each) into
    vars (new ones named ``name``, or ``into``); returns them."""
    items, per_thread = _stage_items(rows, chunk, threads)
    out = into or []
    for it in range(per_thread):
        j = B.min(m.local_index() + it * threads, items - 1)
        rq, kq = j / (chunk // 4), j % (chunk // 4)
        vals = [widen(src[row_of(rq * 4 + c) * in_n + step * (chunk // 4) + kq]) for c in range(4)]
        if into is None:
            out.append([m.var(vec4f, v, f"{name}{it}_{c}") for c, v in enumerate(vals)])
        else:
            for var, v in zip(into[it], vals):
                m.assign(var, v)
    return out


def _stage_store(m, shared, rows, chunk, held, threads):
    """shared[k, r / 4] = (row r + c's column k, for c < 4): the 4 x 4 transpose
    of each item this thread holds."""
    items, per_thread = _stage_items(rows, chunk, threads)
    for it in range(per_thread):
        j = m.let(m.local_index() + it * threads, "j")

        def store():
            rq, kq = j / (chunk // 4), j % (chunk // 4)
            for c in range(4):
                shared[(kq * 4 + c) * (rows // 4) + rq] = vec4f(
                    *[getattr(v, "xyzw"[c]) for v in held[it]])
        if (it + 1) * threads > items:
            with m.if_(j < items):
                store()
        else:
            store()


def tiled_b_add(m, out_dim, rank, scale, tokens, tile_tokens=16, splits=1, dtype="f32",
                save_h=False):
    """output += scale * B @ h for tile_tokens tokens and 4 * B_ADD_THREADS output
    columns per workgroup (grid: token tiles x column blocks).

    h (the sum of project_a_tiled's ``splits`` slices, times scale) is staged
    in workgroup memory; each thread keeps a vec4 of outputs per token of the
    tile in registers and walks the ranks four at a time: four vec4 loads of
    B (transposed in registers; the next four are loaded before this step's
    arithmetic), then per token one vec4 of h (the same address for every
    thread) and four vec4 multiply-adds. ``save_h``: the workgroups of column
    block 0 write h.
    """
    if rank % 4 or out_dim % 4:
        raise ValueError(f"tiled_b_add: rank ({rank}) and out_dim ({out_dim}) must be "
                         f"multiples of 4")
    quads, threads = rank // 4, B_ADD_THREADS
    hp = m.declare_input_buffer("hp", vec4f, None if tokens is None else splits * tokens * quads)
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    out = output_buffer(m, token_rows(tokens, out_dim), dtype, quad=True)
    h = m.declare_output_buffer("h", vec4f, None if tokens is None else tokens * quads) \
        if save_h else None
    n, t0 = _tile_origin(m, tokens, tile_tokens)
    hw = m.shared(vec4f, tile_tokens * quads, "hw")
    with m.loop(m.local_index(), tile_tokens * quads, threads, name="j") as j:
        t = m.let(B.min(t0 + j / quads, n - 1), "t")
        q = m.let(j % quads, "q")
        total = hp[t * quads + q]
        for s in range(1, splits):
            total = total + hp[(s * n + t) * quads + q]
        total = m.let(total, "hsum")
        hw[j] = scale * total
        if save_h:
            with m.if_((t0 + j / quads < n) & (m.workgroup_id().y == 0)):
                h[t * quads + q] = total
    m.barrier()
    c4 = m.let(m.workgroup_id().y * threads + m.local_index(), "c4")  # columns 4 c4 .. 4 c4 + 3
    with m.if_(c4 < out_dim // 4):
        accs = [m.var(vec4f, vec4f(0.0), f"acc{k}") for k in range(tile_tokens)]
        ahead = [m.var(vec4f, widen(Bm[(c4 * 4 + c) * quads]), f"next{c}") for c in range(4)]
        with m.loop(0, quads, name="q") as q:
            bs = [m.let(b, f"b{c}") for c, b in enumerate(ahead)]
            with m.if_(q + 1 < quads):  # the next rank quad's B in flight during this one's work
                for c in range(4):
                    m.assign(ahead[c], widen(Bm[(c4 * 4 + c) * quads + q + 1]))
            # bt[j] = B[4 c4 .. 4 c4 + 3, 4 q + j]: then each token is 4 vec4 multiply-adds
            bt = [m.let(vec4f(*[getattr(b, "xyzw"[j]) for b in bs]), f"bt{j}") for j in range(4)]
            for k in range(tile_tokens):
                hv = m.let(hw[k * quads + q], "hv")
                for j in range(4):
                    accs[k] += getattr(hv, "xyzw"[j]) * bt[j]
        ragged = not isinstance(n, int) or n % tile_tokens
        for k in range(tile_tokens):
            d = m.let((B.min(t0 + k, n - 1) if ragged else t0 + k) * (out_dim // 4) + c4, f"d{k}")
            if ragged:
                with m.if_(t0 + k < n):
                    store_output(out, d, widen(out[d]) + accs[k])
            else:
                store_output(out, d, widen(out[d]) + accs[k])
