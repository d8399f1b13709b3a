"""The LoRA forward in two dispatches shaped like matrix products (the gemm
strategy): ``project_a_tiled`` writes h (in slices of in_dim) from tiles of x
and A staged in workgroup memory, ``tiled_b_add`` sums the slices and adds
scale * B @ h to the output. The backward's dh = s g B is project_a_tiled
too (``a_columns``)."""
from __future__ import annotations

from contextlib import contextmanager

from shaderdsl import builtins as B
from shaderdsl import vec4f

from .common import (
    SHARED_FLOATS,
    DirectTile,
    TransposedTile,
    input_matrix,
    output_buffer,
    store_output,
    tile_origin,
    token_rows,
    widen,
)

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
    n, t0 = tile_origin(m, tokens, tm)
    xs, at = m.shared(vec4f, chunk * tm // 4, "xs"), m.shared(vec4f, chunk * quads, "at")
    def token_row(t):  # a partial last tile recomputes a real token
        return B.min(t0 + t, n - 1)

    tiles = [TransposedTile(m, xs, x, tm, chunk, in_n, token_row, threads),
             DirectTile(m, at, A, chunk * quads, threads) if a_columns
             else TransposedTile(m, at, A, rank, chunk, in_n, None, threads)]
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
    with _staged_steps(m, tiles, ("x_", "a_"), first, last):
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


@contextmanager
def _staged_steps(m, tiles, names, first, last):
    """``for step in range(first, last)``: every tile's step staged in workgroup
    memory, then the body; the next step's loads are issued before the body's
    arithmetic, so their latency overlaps it."""
    held = [tile.load(first, name) for tile, name in zip(tiles, names)]
    with m.loop(first, last, name="step") as step:
        m.barrier()  # the previous step's reads of the tiles are done
        for tile, items in zip(tiles, held):
            tile.store(items)
        m.barrier()
        with m.if_(step + 1 < last):  # the next step's loads, in flight during the arithmetic
            for tile, items in zip(tiles, held):
                tile.load(step + 1, into=items)
        yield step


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
    n, t0 = tile_origin(m, tokens, tile_tokens)
    hw = m.shared(vec4f, tile_tokens * quads, "hw")
    with m.loop(m.local_index(), tile_tokens * quads, threads, name="j") as j:
        t = m.let(B.min(t0 + j / quads, n - 1), "t")
        q = m.let(j % quads, "q")
        total = hp[t * quads + q]
        for s in range(1, splits):
            total = total + hp[(s * n + t) * quads + q]
        total = m.let(total, "hsum")
        hw[j] = scale * total
        if h is not None:
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
