"""The LoRA kernels, written in shaderdsl.

Shapes (row-major f32): A [rank, in_dim], B [out_dim, rank], x [tokens, in_dim],
h [tokens, rank], y and output [tokens, out_dim]. Every kernel is a plain
function of Python parameters; ``kernel(...)`` below compiles (and caches) it.

Loops over rank are unrolled in Python, so each accumulator is its own WGSL
variable and stays in a register under both naga and Tint. Rows are read as
vec4 when their length is a multiple of 4.
"""
from __future__ import annotations

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32, vec4f
from shaderdsl import types as T

SHARED_FLOATS = 4096  # 16 KiB: the WebGPU default maxComputeWorkgroupStorageSize


def _check_threads(threads: int) -> None:
    """The reductions halve the workgroup: its size must be a power of two."""
    if not isinstance(threads, int) or threads < 1 or threads & (threads - 1):
        raise ValueError(f"threads must be a power of two, got {threads!r}")


def _width(n: int) -> int:
    """Vector width for rows of length n: vec4 when it divides, else scalar."""
    return 4 if n % 4 == 0 else 1


def _rows(m, name, n_rows, row_len):
    """Declare a read-only row-major matrix; returns (buffer, elements per row)."""
    w = _width(row_len)
    return m.declare_input_buffer(name, vec4f if w == 4 else f32, n_rows * row_len // w), row_len // w


def _dot(a, b):
    return B.dot(a, b) if a.type == vec4f else a * b


# ------------------------------------------------------------------ A @ x

def project_a_seed(m, rank, in_dim, tokens=1):
    """Hesper's design: one thread per h element, a serial loop over in_dim."""
    A = m.declare_input_buffer("A", f32, rank * in_dim)
    x = m.declare_input_buffer("x", f32, tokens * in_dim)
    h = m.declare_output_buffer("h", f32, tokens * rank)
    gid = m.global_id()
    r, t = gid.x, gid.y
    with m.if_(r < rank):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(in_dim, name="k") as k:
            acc += A[r * in_dim + k] * x[t * in_dim + k]
        h[t * rank + r] = acc


def _reduce(m, accs, threads, subgroups):
    """Sum each accumulator over the workgroup; returns lets holding the sums.

    With subgroups: one subgroupAdd per value, one slot per subgroup in
    workgroup memory, then each subgroup adds the slots (1 barrier). Without: a tree in
    workgroup memory, in groups of values that fit 16 KiB (log2(threads) + 2
    barriers per group).
    """
    _check_threads(threads)
    tid = m.local_index()
    rank = len(accs)
    if subgroups:
        slots = threads // 4  # subgroups are at least 4 wide
        part = m.shared(f32, rank * slots, "partial")
        lane = m.subgroup_invocation_id()
        sg = m.let(tid / m.subgroup_size(), "sg")
        sums = [m.let(B.subgroup_add(a)) for a in accs]
        with m.if_(lane == 0):
            for r, s in enumerate(sums):
                part[r * slots + sg] = s
        m.barrier()
        # Every subgroup adds all the per-subgroup partials itself (one per lane
        # on wide subgroups): no second barrier, and the subgroupAdd stays in
        # uniform control flow, as Tint requires.
        count = m.let((threads + m.subgroup_size() - 1) / m.subgroup_size(), "nsg")
        vs = [m.var(f32, 0.0, f"v{r}") for r in range(rank)]
        with m.loop(lane, count, m.subgroup_size(), name="j") as j:
            for r in range(rank):
                vs[r] += part[r * slots + j]
        return [m.let(B.subgroup_add(v), f"h{r}") for r, v in enumerate(vs)]
    out = []

    def finish(red, chunk, g0):
        out.extend(m.let(red[q * threads], f"h{g0 + q}") for q in range(len(chunk)))

    _tree(m, accs, threads, threads, tid, finish)
    return out


def _tree(m, accs, threads, lanes, lane, finish, floats=SHARED_FLOATS):
    """Sum each accumulator over groups of ``lanes`` consecutive threads in
    workgroup memory, a group of ranks at a time so the array fits ``floats``;
    ``lane`` is the thread's index within its group; ``finish(red, chunk, g0)``
    reads the sums (at red[q * threads + group start]).

    Few levels are unrolled in Python (constant offsets); many ranks make the
    halving a runtime loop, which keeps compile times short on software drivers.
    """
    tid = m.local_index()
    rank = len(accs)
    group = max(1, min(rank, floats // threads))
    red = m.shared(f32, group * threads, "red")
    levels = lanes.bit_length() - 1
    for g0 in range(0, rank, group):
        chunk = accs[g0:g0 + group]
        for q, a in enumerate(chunk):
            red[q * threads + tid] = a
        m.barrier()

        def level(s):
            with m.if_(lane < s):
                for q in range(len(chunk)):
                    red[q * threads + tid] += red[q * threads + tid + s]
            m.barrier()

        if len(chunk) * levels <= 64:
            s = lanes // 2
            while s > 0:
                level(s)
                s //= 2
        else:
            s = m.var(T.u32, lanes // 2, "s")
            with m.while_(s > 0):
                level(s)
                s >>= 1
        finish(red, chunk, g0)
        m.barrier()  # the next group reuses `red`


UNROLL_BUDGET = 256  # statements a loop may unroll into in Python; beyond, a runtime loop


def _unrolled_or_loop(m, start, stop, stride, per_iteration, body, name, unroll=True):
    """``for c in range(start, stop, stride): body(c)``: unrolled in Python while
    it stays under UNROLL_BUDGET statements (every load issued up front), else
    (or with ``unroll=False``) a runtime loop. ``start`` is a shader
    expression, ``stop`` and ``stride`` ints. Tint profits from unrolling;
    naga's output can run slower unrolled, so the autotuner tries both."""
    iterations = -(-stop // stride)
    if unroll and iterations * per_iteration <= UNROLL_BUDGET:
        for j in range(iterations):
            c = m.let(start + j * stride, f"{name}{j}")
            if (j + 1) * stride > stop:
                with m.if_(c < stop):
                    body(c)
            else:
                body(c)
    else:
        with m.loop(start, stop, stride, name=name) as c:
            body(c)


def _partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll=True):
    """Each lane's partial sums of A[r] . x[t] over columns lane, lane + lanes, ...

    With few iterations the loop is unrolled in Python, so every load is
    issued before the first multiply waits on memory.
    """
    accs = [m.var(f32, 0.0, f"acc{r}") for r in range(rank)]

    def step(c):
        xv = m.let(x[t * in_n + c], "xv")
        for r in range(rank):
            accs[r] += _dot(A[r * in_n + c], xv)

    _unrolled_or_loop(m, lane, in_n, lanes, rank + 1, step, "c", unroll)
    return accs


def project_a_workgroup(m, rank, in_dim, tokens=1, threads=256, subgroups=False):
    """h = A @ x with one workgroup per token: every thread takes a strided
    slice of in_dim for all ranks, then the workgroup reduces."""
    A, in_n = _rows(m, "A", rank, in_dim)
    x, _ = _rows(m, "x", tokens, in_dim)
    h = m.declare_output_buffer("h", f32, tokens * rank)
    t = m.workgroup_id().x
    accs = _partial_dots(m, A, x, rank, in_n, t, m.local_index(), threads)
    hs = _reduce(m, accs, threads, subgroups)
    with m.if_(m.local_index() == 0):
        for r in range(rank):
            h[t * rank + r] = hs[r]


# ------------------------------------------------------------------ B @ h, scaled add

def _b_row(m, Bm, i, rank):
    """Row i of B as lets: vec4 pieces when rank % 4 == 0, else scalars."""
    if _width(rank) == 4:
        return [m.let(Bm[i * (rank // 4) + q], f"b{q}") for q in range(rank // 4)]
    return [m.let(Bm[i * rank + r], f"b{r}") for r in range(rank)]


def _row_dot(row, hs):
    """sum_r row[r] * h[r] for a row from _b_row (vec4 pieces or scalars)."""
    if row[0].type == vec4f:
        terms = [B.dot(v, vec4f(*hs[4 * q:4 * q + 4])) for q, v in enumerate(row)]
    else:
        terms = [v * h for v, h in zip(row, hs)]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _b_row_dot(m, Bm, i, rank, hs):
    """sum_r B[i, r] * h[r], with vec4 loads of the row when rank % 4 == 0."""
    return _row_dot(_b_row(m, Bm, i, rank), hs)


def _load_h(m, h, rank, t, threads):
    """Copy h[t] into workgroup memory once; each thread reads it from there."""
    tid = m.local_index()
    hw = m.shared(f32, rank, "hw")
    with m.loop(tid, rank, threads, name="r") as r:
        hw[r] = h[t * rank + r]
    m.barrier()
    return [m.let(hw[r], f"h{r}") for r in range(rank)]


def project_b(m, out_dim, rank, tokens=1, threads=256):
    """y = B @ h: one thread per output element, h in workgroup memory."""
    Bm, _ = _rows(m, "B", out_dim, rank)
    h = m.declare_input_buffer("h", f32, tokens * rank)
    y = m.declare_output_buffer("y", f32, tokens * out_dim)
    t = m.workgroup_id().y
    hs = _load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        y[t * out_dim + i] = _b_row_dot(m, Bm, i, rank, hs)


def add_scaled(m, num_elements, scale):
    """output[i] += scale * y[i]."""
    y = m.declare_input_buffer("y", f32, num_elements)
    out = m.declare_output_buffer("output", f32, num_elements)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < num_elements):
        out[i] += scale * y[i]


def fused_b_add(m, out_dim, rank, scale, tokens=1, threads=256):
    """output[i] += scale * sum_r B[i, r] * h[r]: project_b and add_scaled in one."""
    Bm, _ = _rows(m, "B", out_dim, rank)
    h = m.declare_input_buffer("h", f32, tokens * rank)
    out = m.declare_output_buffer("output", f32, tokens * out_dim)
    t = m.workgroup_id().y
    hs = _load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        out[t * out_dim + i] += scale * _b_row_dot(m, Bm, i, rank, hs)


# ------------------------------------------------------------------ one dispatch

def fused_forward(m, rank, in_dim, out_dim, scale, tokens=1, threads=256,
                  outputs_per_thread=1, subgroups=False, unroll=True):
    """The whole LoRA delta in one dispatch.

    Workgroup (i, t) recomputes h = A @ x[t] (A stays in L2), then adds
    scale * B @ h to its slice of threads * outputs_per_thread outputs of
    token t. WebGPU has no sync between workgroups; recomputing h is cheaper
    than a second dispatch. The B rows and output values this thread will
    need are loaded first, so their latency overlaps the work on h.
    """
    A, in_n = _rows(m, "A", rank, in_dim)
    x, _ = _rows(m, "x", tokens, in_dim)
    Bm, _ = _rows(m, "B", out_dim, rank)
    out = m.declare_output_buffer("output", f32, tokens * out_dim)
    wid = m.workgroup_id()
    t = wid.y
    tid = m.local_index()
    base = m.let(wid.x * (threads * outputs_per_thread) + tid, "base")
    mine = []
    for k in range(outputs_per_thread):
        i = m.let(base + k * threads, f"col{k}")
        safe = m.let(B.min(i, out_dim - 1), f"safe{k}")  # in-bounds prefetch
        mine.append((i, _b_row(m, Bm, safe, rank), m.let(out[t * out_dim + safe], f"o{k}")))
    accs = _partial_dots(m, A, x, rank, in_n, t, tid, threads, unroll)
    hs = _reduce(m, accs, threads, subgroups)
    for i, row, old in mine:
        with m.if_(i < out_dim):
            out[t * out_dim + i] = old + scale * _row_dot(row, hs)


def tiled_forward(m, rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                  unroll=True):
    """The LoRA delta for many tokens in one dispatch, tile_tokens per workgroup.

    Phase 1: threads // tile_tokens lanes per token reduce h = A @ x[t] and
    leave scale * h for the whole tile in workgroup memory. Phase 2: each
    thread owns output columns; it loads its row of B once and updates that
    column for every token of the tile. A and B are read once per tile, not
    once per token, which is what limits the one-token-per-workgroup kernel.
    """
    _check_threads(threads)
    if tile_tokens > threads or threads % tile_tokens:
        raise ValueError(f"tile_tokens ({tile_tokens}) must divide threads ({threads})")
    lanes = threads // tile_tokens
    A, in_n = _rows(m, "A", rank, in_dim)
    x, _ = _rows(m, "x", tokens, in_dim)
    Bm, _ = _rows(m, "B", out_dim, rank)
    out = m.declare_output_buffer("output", f32, tokens * out_dim)
    tid = m.local_index()
    t0 = m.let(m.workgroup_id().x * tile_tokens, "t0")
    tl = m.let(tid / lanes, "tl")
    lane = m.let(tid % lanes, "lane")
    t = m.let(B.min(t0 + tl, tokens - 1), "t")  # a partial last tile recomputes a real token

    accs = _partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll)
    w = _width(rank)  # scale * h of the tile, as vec4 when rank allows: fewer loads in phase 2
    hw = m.shared(vec4f if w == 4 else f32, tile_tokens * rank // w, "hw")

    def finish(red, chunk, g0):
        with m.if_(lane == 0):
            for q in range(len(chunk)):
                r = g0 + q
                target = hw[tl * (rank // w) + r // w]
                if w == 4:
                    setattr(target, "xyzw"[r % 4], scale * red[q * threads + tid])
                else:
                    hw[tl * rank + r] = scale * red[q * threads + tid]

    _tree(m, accs, threads, lanes, lane, finish, SHARED_FLOATS - tile_tokens * rank)

    ragged = tokens % tile_tokens != 0

    def column(i):
        # All loads of this column first (B row, then every token's output),
        # so they are in flight together; then the stores.
        row = _b_row(m, Bm, i, rank)
        dests = [m.let((B.min(t0 + k, tokens - 1) if ragged else t0 + k) * out_dim + i, f"d{k}")
                 for k in range(tile_tokens)]
        olds = [m.let(out[d], f"o{k}") for k, d in enumerate(dests)]
        for k in range(tile_tokens):
            hs = [hw[k * (rank // w) + q] for q in range(rank // w)]
            if w == 4:
                total = B.dot(row[0], hs[0])
                for v, h in zip(row[1:], hs[1:]):
                    total = total + B.dot(v, h)
            else:
                total = _row_dot(row, hs)
            if ragged:
                with m.if_(t0 + k < tokens):
                    out[dests[k]] = olds[k] + total
            else:
                out[dests[k]] = olds[k] + total

    _unrolled_or_loop(m, tid, out_dim, threads, tile_tokens * 3 + rank // w, column, "i", unroll)


# ------------------------------------------------------------------ compiled kernels

def project_a_kernel(rank, in_dim, tokens=1, strategy="workgroup", threads=256, subgroups=False):
    """Kernel for h = A @ x (bindings A, x, h)."""
    if strategy == "seed":
        return sd.compile(project_a_seed, 64, name="project_a_seed", rank=rank, in_dim=in_dim, tokens=tokens)
    return sd.compile(project_a_workgroup, threads, name="project_a", rank=rank, in_dim=in_dim,
                      tokens=tokens, threads=threads, subgroups=subgroups)


def project_b_kernel(out_dim, rank, tokens=1, threads=256):
    """Kernel for y = B @ h (bindings B, h, y)."""
    return sd.compile(project_b, threads, name="project_b", out_dim=out_dim, rank=rank,
                      tokens=tokens, threads=threads)


def add_scaled_kernel(num_elements, scale, threads=256):
    """Kernel for output[i] += scale * y[i] (bindings y, output)."""
    return sd.compile(add_scaled, threads, name="add_scaled", num_elements=num_elements,
                      scale=float(scale))


def fused_b_add_kernel(out_dim, rank, scale, tokens=1, threads=256):
    """Kernel for output += scale * B @ h (bindings B, h, output)."""
    return sd.compile(fused_b_add, threads, name="fused_b_add", out_dim=out_dim, rank=rank,
                      scale=float(scale), tokens=tokens, threads=threads)


def fused_forward_kernel(rank, in_dim, out_dim, scale, tokens=1, threads=256,
                         outputs_per_thread=1, subgroups=False, unroll=True):
    """Kernel for output += scale * B @ (A @ x) in one dispatch (bindings A, x, B, output)."""
    return sd.compile(fused_forward, threads, name="fused_forward", rank=rank, in_dim=in_dim,
                      out_dim=out_dim, scale=float(scale), tokens=tokens, threads=threads,
                      outputs_per_thread=outputs_per_thread, subgroups=subgroups, unroll=unroll)


def tiled_forward_kernel(rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                         unroll=True):
    """Kernel for output += scale * B @ (A @ x) over tiles of tokens (bindings A, x, B, output)."""
    return sd.compile(tiled_forward, threads, name="tiled_forward", rank=rank, in_dim=in_dim,
                      out_dim=out_dim, scale=float(scale), tokens=tokens, threads=threads,
                      tile_tokens=tile_tokens, unroll=unroll)
