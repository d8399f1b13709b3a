"""The LoRA backward kernels.

With s the scale, h = A x saved by the forward and g the upstream gradient
[tokens, out_dim]:

    dh = s g B        [tokens, rank]     grad_dh (a workgroup per token)
    dB = s g^T h      [out_dim, rank]    grad_outer, layout "jr"
    dA = dh^T x       [rank, in_dim]     grad_outer, layout "rj"
    dx = dh A         [tokens, in_dim]   grad_input

Hesper's kernels (kept as the ``seed`` strategy) give every element of a
result to one thread with a serial loop. Here the long sums are spread over a
workgroup (dh: over out_dim) or over workgroups (dA, dB: over token chunks,
summed by grad_outer_reduce), and for a few tokens grad_dh_b reads g once for
both dh and dB and grad_a_input reads x once for both dA and dx. Every write
is guarded: no thread writes out of bounds (Hesper's select-then-write did).
``accumulate`` adds to a gradient (micro-batches) instead of overwriting it.
g, x and dx are stored as ``dtype``; h, dh, dA and dB are f32.
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f32, vec4f

from .common import (
    b_row,
    check_threads,
    hold,
    input_matrix,
    load_h,
    output_buffer,
    reduce_sum,
    row_element,
    stage,
    storage_scalar,
    store_output,
    sum_terms,
    unrolled_or_loop,
    widen,
    width,
)


def _write(buf, i, value, accumulate: bool) -> None:
    """buf[i] = value, or += value: a gradient that accumulates over micro-batches."""
    if accumulate:
        store_output(buf, i, widen(buf[i]) + value)
    else:
        store_output(buf, i, value)


# ------------------------------------------------------------------ dh = s g B

def grad_dh_seed(m, out_dim, rank, scale, tokens=1, dtype="f32"):
    """Hesper's gradDh: one thread per element of dh, a serial loop over out_dim."""
    Bm = m.declare_input_buffer("B", storage_scalar(dtype), out_dim * rank)
    g = m.declare_input_buffer("g", storage_scalar(dtype), tokens * out_dim)
    dh = m.declare_output_buffer("dh", f32, tokens * rank)
    gid = m.global_id()
    r, t = gid.x, gid.y
    with m.if_(r < rank):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(out_dim, name="o") as o:
            acc += widen(Bm[o * rank + r]) * widen(g[t * out_dim + o])
        dh[t * rank + r] = scale * acc


def _dh_partials(m, Bm, g, out_dim, rank, ts, lane, lanes, unroll=True, on_column=None,
                 row_of=None):
    """Each lane's partial sums of g[t] . B[:, r] over columns lane, lane + lanes, ...
    for every token in ``ts``; ``on_column(o, row, gvs)`` runs for each column too.
    ``row_of(o)`` gives the part of B's row o to use (default: all of it)."""
    accs = [[m.var(f32, 0.0, f"acc{j}_{r}" if len(ts) > 1 else f"acc{r}") for r in range(rank)]
            for j in range(len(ts))]

    def column(o):
        row = row_of(o) if row_of else b_row(m, Bm, o, rank)
        gvs = [m.let(widen(g[t * out_dim + o]), f"g{j}" if len(ts) > 1 else "gv")
               for j, t in enumerate(ts)]
        for j, gv in enumerate(gvs):
            for r in range(rank):
                accs[j][r] += gv * row_element(row, r)
        if on_column is not None:
            on_column(o, row, gvs)

    unrolled_or_loop(m, lane, out_dim, lanes, (rank + 2) * len(ts), column, "o", unroll)
    return accs


def grad_dh(m, out_dim, rank, scale, tokens=1, threads=256, subgroups=False, dtype="f32",
            unroll=True, rank_group=0):
    """dh = s g B with one workgroup per token (grid (tokens, 1)): every thread
    sums a strided slice of out_dim for all ranks, then the workgroup reduces.
    With ``rank_group`` (a multiple of 4 dividing rank) workgroup (t, k) does
    ranks k * rank_group onwards (grid (tokens, rank / rank_group)): more
    workgroups for a few tokens at a high rank."""
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    g = m.declare_input_buffer("g", storage_scalar(dtype), tokens * out_dim)
    dh = m.declare_output_buffer("dh", f32, tokens * rank)
    t = m.workgroup_id().x
    tid = m.local_index()
    grouped = 0 < rank_group < rank
    if grouped and (rank % rank_group or rank_group % 4 or width(rank) != 4):
        raise ValueError(f"rank_group ({rank_group}) must be a multiple of 4 dividing rank "
                         f"({rank})")
    span = rank_group if grouped else rank
    q0 = m.let(m.workgroup_id().y * (span // 4), "q0") if grouped else 0
    row_of = (lambda o: [m.let(widen(Bm[o * (rank // 4) + q0 + q]), f"b{q}")
                         for q in range(span // 4)]) if grouped else None
    (accs,) = _dh_partials(m, Bm, g, out_dim, span, [t], tid, threads, unroll, row_of=row_of)
    sums = reduce_sum(m, accs, threads, subgroups)
    with m.if_(tid == 0):
        for r in range(span):
            dh[t * rank + (q0 * 4 + r)] = scale * sums[r]


def grad_dh_tiled(m, out_dim, rank, scale, tokens, threads=256, dtype="f32"):
    """dh = s g B for many tokens: thread (token, q) of a workgroup accumulates
    dh[t, 4q..4q+3] as a vec4 over all of out_dim (grid ceil(tokens / tile),
    tile = threads / (rank / 4) tokens), reading g[t] four columns at a time.
    No reduction between threads, so no barrier: the per-token grad_dh spends
    most of its time reducing when the rank is high."""
    if rank % 4 or out_dim % 4:
        raise ValueError(f"grad_dh_tiled needs rank and out_dim multiples of 4, got {rank}, "
                         f"{out_dim}")
    quads, cols = rank // 4, out_dim // 4
    if threads % quads:
        raise ValueError(f"threads ({threads}) must be a multiple of rank / 4 ({quads})")
    tile = threads // quads
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    g, _ = input_matrix(m, "g", tokens, out_dim, dtype)
    dh = m.declare_output_buffer("dh", vec4f, tokens * quads)
    tid = m.local_index()
    q = m.let(tid % quads, "q")
    t = m.let(m.workgroup_id().x * tile + tid / quads, "t")
    row = m.let(B.min(t, tokens - 1) * cols, "row")  # a thread past the end reads a real row
    acc = m.var(vec4f, vec4f(0.0), "acc")
    with m.loop(cols, name="c") as c:
        gv = m.let(widen(g[row + c]), "gv")
        for k in range(4):
            acc += getattr(gv, "xyzw"[k]) * widen(Bm[(c * 4 + k) * quads + q])
    with m.if_(t < tokens):
        dh[t * quads + q] = scale * acc


def grad_dh_b(m, out_dim, rank, scale, tokens=1, threads=256, accumulate=False, dtype="f32"):
    """dh and dB from one read of g, for a few tokens (one workgroup, grid 1):
    the thread that owns column o adds g[t, o] * B[o, :] into dh's partial sums
    (reduced over the workgroup afterwards) and writes dB[o, :] = s sum_t g[t, o] h[t, :]."""
    check_threads(threads)
    Bm, _ = input_matrix(m, "B", out_dim, rank, dtype)
    g = m.declare_input_buffer("g", storage_scalar(dtype), tokens * out_dim)
    h = m.declare_input_buffer("h", f32, tokens * rank)
    dh = m.declare_output_buffer("dh", f32, tokens * rank)
    dB = m.declare_output_buffer("dB", f32, out_dim * rank)
    tid = m.local_index()
    hs = [[m.let(h[t * rank + r], f"h{t}_{r}") for r in range(rank)] for t in range(tokens)]

    def grad_b_column(o, row, gvs):
        for r in range(rank):
            total = gvs[0] * hs[0][r]
            for j in range(1, tokens):
                total = total + gvs[j] * hs[j][r]
            _write(dB, o * rank + r, scale * total, accumulate)

    accs = _dh_partials(m, Bm, g, out_dim, rank, list(range(tokens)), tid, threads,
                        on_column=grad_b_column)
    sums = reduce_sum(m, [a for per_token in accs for a in per_token], threads, False)
    with m.if_(tid == 0):
        for k, total in enumerate(sums):
            dh[k] = scale * total


# ------------------------------------------------------------------ dA = dh^T x, dB = s g^T h

def _outer_index(j, r, n, rank, layout):
    return j * rank + r if layout == "jr" else r * n + j


def grad_outer_seed(m, n, rank, scale, tokens=1, layout="jr", accumulate=False, dtype="f32"):
    """Hesper's gradB / gradA: one thread per element of the result, a serial loop
    over tokens: out[j, r] (layout "jr") or out[r, j] ("rj") = s sum_t G[t, j] H[t, r]."""
    G = m.declare_input_buffer("G", storage_scalar(dtype), tokens * n)
    H = m.declare_input_buffer("H", f32, tokens * rank)
    out = m.declare_output_buffer("out", f32, n * rank)
    idx = m.let(m.global_id().x, "idx")
    with m.if_(idx < n * rank):
        j, r = (idx / rank, idx % rank) if layout == "jr" else (idx % n, idx / n)
        acc = m.var(f32, 0.0, "acc")
        with m.loop(tokens, name="t") as t:
            acc += widen(G[t * n + j]) * H[t * rank + r]
        _write(out, idx, scale * acc, accumulate)


def grad_outer(m, n, rank, scale, tokens, threads=256, chunk=0, layout="jr", accumulate=False,
               dtype="f32"):
    """s G^T H over a chunk of tokens per workgroup (grid (ceil(n / threads),
    ceil(tokens / chunk))): the thread of column j sums G[t, j] H[t, :] over its
    chunk. One chunk (chunk = 0 or >= tokens) writes the result; several write
    partial results, ``partial[c]`` laid out like the result, for grad_outer_reduce."""
    chunk = tokens if chunk <= 0 or chunk >= tokens else chunk
    G, H = _outer_inputs(m, "G", "H", n, rank, tokens, dtype)
    chunks = -(-tokens // chunk)
    out = m.declare_output_buffer("out" if chunks == 1 else "partial", f32, chunks * n * rank)
    j = m.let(m.global_id().x, "j")
    c = m.workgroup_id().y
    t0 = m.let(c * chunk, "t0")
    with m.if_(j < n):
        last = tokens if chunks == 1 else m.let(B.min(t0 + chunk, tokens), "t1")
        accs = _outer_sums(m, G, H, j, n, rank, t0, last)
        base = c * (n * rank) if chunks > 1 else 0
        for r in range(rank):
            k = _outer_index(j, r, n, rank, layout)
            _write(out, base + k if chunks > 1 else k, scale * accs[r],
                   accumulate and chunks == 1)


def _outer_inputs(m, g_name, h_name, n, rank, tokens, dtype):
    """G [tokens, n] stored as ``dtype``, H [tokens, rank] f32 (vec4 rows when
    the rank allows: a quarter of the loads)."""
    w = width(rank)
    return (m.declare_input_buffer(g_name, storage_scalar(dtype), tokens * n),
            m.declare_input_buffer(h_name, vec4f if w == 4 else f32, tokens * rank // w))


def _outer_sums(m, G, H, j, n, rank, t_from, t_to) -> list:
    """sum over t in [t_from, t_to) of G[t, j] H[t, r], for every r (H as
    _outer_inputs declares it)."""
    accs = [m.var(f32, 0.0, f"acc{r}") for r in range(rank)]
    vec = width(rank) == 4
    with m.loop(t_from, t_to, name="t") as t:
        gv = m.let(widen(G[t * n + j]), "gv")
        hs = [m.let(H[t * (rank // 4) + q], f"h{q}") for q in range(rank // 4)] if vec else None
        for r in range(rank):
            accs[r] += gv * (row_element(hs, r) if vec else H[t * rank + r])
    return accs


def grad_outer_pair(m, in_dim, out_dim, rank, scale, tokens, accumulate=False, dtype="f32",
                    dh_parts=0):
    """dB = s g^T h and dA = dh^T x in one dispatch, one thread per column of
    either (grid ceil((out_dim + in_dim) / threads)), every token each: for a
    few tokens, where two grad_outer dispatches cost more than their work.
    ``dh_parts`` (one token; 0: none): dh comes in that many parts [parts,
    rank] (the mse kernel's), summed here."""
    g, h = _outer_inputs(m, "g", "h", out_dim, rank, tokens, dtype)
    if dh_parts:
        x = m.declare_input_buffer("x", storage_scalar(dtype), in_dim)
        dh = m.declare_input_buffer("dh", f32, dh_parts * rank)
    else:
        x, dh = _outer_inputs(m, "x", "dh", in_dim, rank, tokens, dtype)
    dB = m.declare_output_buffer("dB", f32, out_dim * rank)
    dA = m.declare_output_buffer("dA", f32, rank * in_dim)
    j = m.let(m.global_id().x, "j")
    with m.if_(j < out_dim):
        accs = _outer_sums(m, g, h, j, out_dim, rank, 0, tokens)
        for r in range(rank):
            _write(dB, j * rank + r, scale * accs[r], accumulate)
    with m.elif_(j < out_dim + in_dim):
        i = m.let(j - out_dim, "i")
        if dh_parts:
            xv = m.let(widen(x[i]), "xv")
            accs = [xv * _sum_parts(dh, dh_parts, rank, r) for r in range(rank)]
        else:
            accs = _outer_sums(m, x, dh, i, in_dim, rank, 0, tokens)
        for r in range(rank):
            _write(dA, r * in_dim + i, accs[r], accumulate)


def _sum_parts(parts, count: int, size: int, k):
    """parts[k] + parts[size + k] + ...: element k of ``count`` parts of ``size``."""
    total = parts[k]
    for p in range(1, count):
        total = total + parts[p * size + k]
    return total


OUTER_THREADS = 256  # grad_outer_tiled's workgroup, at most


def outer_tile(n_rank: int) -> tuple[int, int, int]:
    """(threads, columns, tokens per step) of grad_outer_tiled at this rank: a
    thread per 4 columns x 4 ranks, as many column quads as fill
    OUTER_THREADS, and as many tokens per step as keep both staged tiles
    within 16 KiB."""
    quads = n_rank // 4
    groups = max(1, OUTER_THREADS // quads)
    columns = 4 * groups
    return groups * quads, columns, max(1, min(16, 2048 // max(columns, n_rank)))


def outer_tiled_fits(n: int, rank: int) -> bool:
    """Shapes grad_outer_tiled takes: n and rank multiples of 4, rank up to 1024."""
    return n % 4 == 0 and rank % 4 == 0 and 0 < rank <= 1024


def outer_chunk(chunk: int, tokens: int, rank: int) -> int:
    """grad_outer_tiled's tokens per workgroup row: ``chunk`` (0: all) rounded
    up to whole steps."""
    steps = outer_tile(rank)[2]
    chunk = tokens if chunk <= 0 or chunk >= tokens else chunk
    return -(-chunk // steps) * steps


def grad_outer_tiled(m, n, rank, scale, tokens, chunk=0, layout="jr", accumulate=False,
                     dtype="f32"):
    """grad_outer as a tiled matrix product: a workgroup takes ``columns``
    columns (outer_tile) and every rank over a chunk of tokens; each step
    stages a few tokens' rows of G and H in workgroup memory (coalesced vec4
    loads, the next step's in flight during this one's arithmetic), and each
    thread does 16 multiply-adds per two vec4 reads there, for its 4 columns
    x 4 ranks. Grid (ceil(n / columns), chunks); n and rank multiples of 4."""
    if not outer_tiled_fits(n, rank):
        raise ValueError(f"grad_outer_tiled needs n and rank multiples of 4 and rank at most "
                         f"1024, got n={n}, rank={rank}")
    quads, (threads, columns, kt) = rank // 4, outer_tile(rank)
    groups = columns // 4
    chunk = outer_chunk(chunk, tokens, rank)
    chunks = -(-tokens // chunk)
    G, gn = input_matrix(m, "G", tokens, n, dtype)
    H = m.declare_input_buffer("H", vec4f, tokens * quads)
    out = m.declare_output_buffer("out" if chunks == 1 else "partial", f32, chunks * n * rank)
    gs, hs = m.shared(vec4f, kt * groups, "gs"), m.shared(vec4f, kt * quads, "hs")
    tid = m.local_index()
    tx, ty = m.let(tid % quads, "tx"), m.let(tid / quads, "ty")
    q0 = m.let(m.workgroup_id().x * groups, "q0")  # this workgroup's first column quad
    c = m.workgroup_id().y
    t0 = m.let(c * chunk, "t0")
    end = tokens if chunks == 1 else m.let(B.min(t0 + chunk, tokens), "t_end")

    def tiles(step, into=None):
        """This thread's items of both tiles at ``step`` (zero past the chunk)."""
        def item(j, per_row, name):  # name: gv (a vec4 of G's columns) or hv (of H's ranks)
            t = m.let(t0 + step * kt + j / per_row, "t")
            tc, q = B.min(t, tokens - 1), j % per_row
            value = widen(G[tc * gn + B.min(q0 + q, gn - 1)]) if name == "gv" else H[tc * quads + q]
            return B.select(vec4f(0.0), value, t < end)

        return [hold(m, kt * per_row, threads, lambda j, p=per_row, v=name: item(j, p, v),
                     name, part) for (per_row, name), part in
                zip(((groups, "gv"), (quads, "hv")), into or (None, None))]

    accs = [m.var(vec4f, vec4f(0.0), f"acc{k}") for k in range(4)]
    held = tiles(0)
    with m.loop(0, chunk // kt, name="step") as step:
        m.barrier()  # the previous step's reads of the tiles are done
        for shared, items, part in zip((gs, hs), (kt * groups, kt * quads), held):
            stage(m, shared, items, part, threads)
        m.barrier()
        with m.if_(step + 1 < chunk // kt):
            tiles(step + 1, held)
        for k in range(kt):
            gv, hv = m.let(gs[k * groups + ty], "g4"), m.let(hs[k * quads + tx], "h4")
            for i in range(4):
                accs[i] += getattr(gv, "xyzw"[i]) * hv
    base = c * (n * rank) if chunks > 1 else 0
    for i in range(4):
        j = m.let((q0 + ty) * 4 + i, f"j{i}")
        with m.if_(j < n):
            for r in range(4):
                k = _outer_index(j, tx * 4 + r, n, rank, layout)
                _write(out, base + k if chunks > 1 else k, scale * getattr(accs[i], "xyzw"[r]),
                       accumulate and chunks == 1)


def grad_outer_reduce(m, size, chunks, accumulate=False):
    """out[k] (+)= sum_c partial[c, k]: the last step of a chunked grad_outer."""
    partial = m.declare_input_buffer("partial", f32, chunks * size)
    out = m.declare_output_buffer("out", f32, size)
    k = m.let(m.global_id().x, "k")
    with m.if_(k < size):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(chunks, name="c") as c:
            acc += partial[c * size + k]
        _write(out, k, acc, accumulate)


# ------------------------------------------------------------------ dx = dh A

def grad_input_seed(m, in_dim, rank, tokens=1, accumulate=False, dtype="f32"):
    """Hesper's inputGrad: one thread per element of dx, a loop over rank."""
    A = m.declare_input_buffer("A", storage_scalar(dtype), rank * in_dim)
    dh = m.declare_input_buffer("dh", f32, tokens * rank)
    dx = output_buffer(m, tokens * in_dim, dtype, "dx")
    gid = m.global_id()
    i, t = gid.x, gid.y
    with m.if_(i < in_dim):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(rank, name="r") as r:
            acc += widen(A[r * in_dim + i]) * dh[t * rank + r]
        _write(dx, t * in_dim + i, acc, accumulate)


def grad_input(m, in_dim, rank, tokens=1, threads=256, accumulate=False, dtype="f32"):
    """dx = dh A: one thread per element (grid (ceil(in_dim / threads), tokens)),
    the token's dh in workgroup memory, the loop over rank unrolled."""
    A = m.declare_input_buffer("A", storage_scalar(dtype), rank * in_dim)
    dh = m.declare_input_buffer("dh", f32, tokens * rank)
    dx = output_buffer(m, tokens * in_dim, dtype, "dx")
    t = m.workgroup_id().y
    hs = load_h(m, dh, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < in_dim):
        total = sum_terms([widen(A[r * in_dim + i]) * hs[r] for r in range(rank)])
        _write(dx, t * in_dim + i, total, accumulate)


def grad_a_input(m, in_dim, rank, tokens=1, threads=256, accumulate=False, with_dx=True,
                 dtype="f32"):
    """dA = dh^T x and dx = dh A from one read of x and A, for a few tokens: the
    thread of column i (grid ceil(in_dim / threads)) loops over the tokens."""
    A = m.declare_input_buffer("A", storage_scalar(dtype), rank * in_dim)
    x = m.declare_input_buffer("x", storage_scalar(dtype), tokens * in_dim)
    dh = m.declare_input_buffer("dh", f32, tokens * rank)
    dA = m.declare_output_buffer("dA", f32, rank * in_dim)
    dx = output_buffer(m, tokens * in_dim, dtype, "dx") if with_dx else None
    hs = [[m.let(dh[t * rank + r], f"dh{t}_{r}") for r in range(rank)] for t in range(tokens)]
    i = m.let(m.global_id().x, "i")
    with m.if_(i < in_dim):
        xs = [m.let(widen(x[t * in_dim + i]), f"x{t}") for t in range(tokens)]
        a = [m.let(widen(A[r * in_dim + i]), f"a{r}") for r in range(rank)] if with_dx else []
        for r in range(rank):
            total = hs[0][r] * xs[0]
            for t in range(1, tokens):
                total = total + hs[t][r] * xs[t]
            _write(dA, r * in_dim + i, total, accumulate)
        for t in range(tokens if with_dx else 0):
            total = sum_terms([hs[t][r] * a[r] for r in range(rank)])
            _write(dx, t * in_dim + i, total, accumulate)
