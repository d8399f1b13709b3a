"""The LoRA kernels, written in shaderdsl.

Shapes (row-major): A [rank, in_dim], B [out_dim, rank], x [tokens, in_dim],
h [tokens, rank], y and output [tokens, out_dim]. Every kernel is a plain
function of Python parameters; :data:`KERNELS` registers each with the role
of its bindings, its workgroup size and its grid, and ``KERNELS[name].kernel(...)``
compiles (and caches) it. Nothing here needs wgpu.

``dtype`` is the storage type of A, B, x and output: "f32", or "f16" (needs
the adapter's shader-f16). Arithmetic is f32 either way: every f16 load is
widened, and only the final store to output rounds to f16. The scratch
buffers h and y are always f32.

Loops over rank are unrolled in Python, so each accumulator is its own WGSL
variable and stays in a register under both naga and Tint. Rows are read as
vec4 when their length is a multiple of 4.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f16, f32, vec4f, vec4h
from shaderdsl import types as T

SHARED_FLOATS = 4096  # 16 KiB: the WebGPU default maxComputeWorkgroupStorageSize


def _check_threads(threads: int) -> None:
    """The reductions halve the workgroup: its size must be a power of two."""
    if not isinstance(threads, int) or threads < 1 or threads & (threads - 1):
        raise ValueError(f"threads must be a power of two, got {threads!r}")


def _width(n: int) -> int:
    """Vector width for rows of length n: vec4 when it divides, else scalar."""
    return 4 if n % 4 == 0 else 1


DTYPES = ("f32", "f16")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _rows(m, name, n_rows, row_len, dtype="f32"):
    """Declare a read-only row-major matrix; returns (buffer, elements per row)."""
    _check_dtype(dtype)
    w = _width(row_len)
    elem = {("f32", 4): vec4f, ("f32", 1): f32, ("f16", 4): vec4h, ("f16", 1): f16}[dtype, w]
    return m.declare_input_buffer(name, elem, n_rows * row_len // w), row_len // w


def _scalar(dtype: str):
    _check_dtype(dtype)
    return f16 if dtype == "f16" else f32


def _output(m, n, dtype):
    return m.declare_output_buffer("output", _scalar(dtype), n)


def _wide(e):
    """An f16 (or vec4<f16>) value widened to f32; f32 values unchanged."""
    if e.type == f16:
        return f32(e)
    if e.type == vec4h:
        return vec4f(e)
    return e


def _store(out, i, value):
    """out[i] = value (f32), rounded to f16 when out holds f16."""
    out[i] = f16(value) if out.type.elem == f16 else value


def _dot(a, b):
    return B.dot(a, b) if a.type == vec4f else a * b


# ------------------------------------------------------------------ A @ x

def project_a_seed(m, rank, in_dim, tokens=1, dtype="f32"):
    """Hesper's design: one thread per h element, a serial loop over in_dim."""
    A = m.declare_input_buffer("A", _scalar(dtype), rank * in_dim)
    x = m.declare_input_buffer("x", _scalar(dtype), tokens * in_dim)
    h = m.declare_output_buffer("h", f32, tokens * rank)
    gid = m.global_id()
    r, t = gid.x, gid.y
    with m.if_(r < rank):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(in_dim, name="k") as k:
            acc += _wide(A[r * in_dim + k]) * _wide(x[t * in_dim + k])
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


def _partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll=True, rows=None):
    """Each lane's partial sums of A[r] . x[t] over columns lane, lane + lanes, ...
    for r < rank; ``rows``: the start of each row in A (default r * in_n).
    ``t`` is one token (returns one accumulator per rank) or a list of tokens
    (returns a list per token): each load of A then serves every token.

    With few iterations the loop is unrolled in Python, so every load is
    issued before the first multiply waits on memory.
    """
    ts = t if isinstance(t, list) else [t]
    tag = [""] if len(ts) == 1 else [f"{j}_" for j in range(len(ts))]
    accs = [[m.var(f32, 0.0, f"acc{tag[j]}{r}") for r in range(rank)] for j in range(len(ts))]
    rows = rows or [r * in_n for r in range(rank)]

    def step(c):
        xvs = [m.let(_wide(x[tj * in_n + c]), f"xv{tag[j].rstrip('_')}") for j, tj in enumerate(ts)]
        for r in range(rank):
            a = _wide(A[rows[r] + c])
            if len(ts) > 1:
                a = m.let(a, f"a{r}")
            for j, xv in enumerate(xvs):
                accs[j][r] += _dot(a, xv)

    _unrolled_or_loop(m, lane, in_n, lanes, (rank + 1) * len(ts), step, "c", unroll)
    return accs if isinstance(t, list) else accs[0]


def project_a_workgroup(m, rank, in_dim, tokens=1, threads=256, subgroups=False, dtype="f32",
                        rank_group=0):
    """h = A @ x with one workgroup per token (grid (tokens, 1)): every thread
    takes a strided slice of in_dim for all ranks, then the workgroup reduces.

    With ``rank_group`` (0 < rank_group < rank) workgroup (t, g) does ranks
    g * rank_group onwards only (grid (tokens, ceil(rank / rank_group))):
    more workgroups share the rows of A when the rank is high and tokens few.
    """
    A, in_n = _rows(m, "A", rank, in_dim, dtype)
    x, _ = _rows(m, "x", tokens, in_dim, dtype)
    h = m.declare_output_buffer("h", f32, tokens * rank)
    t = m.workgroup_id().x
    if 0 < rank_group < rank:
        # rows r0 .. r0 + rank_group - 1; the last group reads row rank - 1 in
        # place of rows past the end and does not store them
        r0 = m.let(m.workgroup_id().y * rank_group, "r0")
        rows = [m.let(B.min(r0 + q, rank - 1) * in_n, f"row{q}") for q in range(rank_group)]
        accs = _partial_dots(m, A, x, rank_group, in_n, t, m.local_index(), threads, rows=rows)
        hs = _reduce(m, accs, threads, subgroups)
        with m.if_(m.local_index() == 0):
            for q in range(rank_group):
                if (rank % rank_group) and q >= rank % rank_group:
                    with m.if_(r0 + q < rank):
                        h[t * rank + r0 + q] = hs[q]
                else:
                    h[t * rank + r0 + q] = hs[q]
        return
    accs = _partial_dots(m, A, x, rank, in_n, t, m.local_index(), threads)
    hs = _reduce(m, accs, threads, subgroups)
    with m.if_(m.local_index() == 0):
        for r in range(rank):
            h[t * rank + r] = hs[r]


# ------------------------------------------------------------------ B @ h, scaled add

def _b_row(m, Bm, i, rank):
    """Row i of B as lets: vec4 pieces when rank % 4 == 0, else scalars."""
    if _width(rank) == 4:
        return [m.let(_wide(Bm[i * (rank // 4) + q]), f"b{q}") for q in range(rank // 4)]
    return [m.let(_wide(Bm[i * rank + r]), f"b{r}") for r in range(rank)]


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


def project_b(m, out_dim, rank, tokens=1, threads=256, dtype="f32"):
    """y = B @ h: one thread per output element, h in workgroup memory (y is f32)."""
    Bm, _ = _rows(m, "B", out_dim, rank, dtype)
    h = m.declare_input_buffer("h", f32, tokens * rank)
    y = m.declare_output_buffer("y", f32, tokens * out_dim)
    t = m.workgroup_id().y
    hs = _load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        y[t * out_dim + i] = _b_row_dot(m, Bm, i, rank, hs)


def add_scaled(m, num_elements, scale, dtype="f32"):
    """output[i] += scale * y[i] (y is f32, output ``dtype``)."""
    y = m.declare_input_buffer("y", f32, num_elements)
    out = _output(m, num_elements, dtype)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < num_elements):
        if dtype == "f32":
            out[i] += scale * y[i]
        else:
            _store(out, i, _wide(out[i]) + scale * y[i])


def fused_b_add(m, out_dim, rank, scale, tokens=1, threads=256, dtype="f32"):
    """output[i] += scale * sum_r B[i, r] * h[r]: project_b and add_scaled in one."""
    Bm, _ = _rows(m, "B", out_dim, rank, dtype)
    h = m.declare_input_buffer("h", f32, tokens * rank)
    out = _output(m, tokens * out_dim, dtype)
    t = m.workgroup_id().y
    hs = _load_h(m, h, rank, t, threads)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < out_dim):
        if dtype == "f32":
            out[t * out_dim + i] += scale * _b_row_dot(m, Bm, i, rank, hs)
        else:
            j = m.let(t * out_dim + i, "j")
            _store(out, j, _wide(out[j]) + scale * _b_row_dot(m, Bm, i, rank, hs))


# ------------------------------------------------------------------ one dispatch

def fused_forward(m, rank, in_dim, out_dim, scale, tokens=1, threads=256,
                  outputs_per_thread=1, subgroups=False, unroll=True, dtype="f32"):
    """The whole LoRA delta in one dispatch.

    Workgroup (i, t) recomputes h = A @ x[t] (A stays in L2), then adds
    scale * B @ h to its slice of threads * outputs_per_thread outputs of
    token t. WebGPU has no sync between workgroups; recomputing h is cheaper
    than a second dispatch. The B rows and output values this thread will
    need are loaded first, so their latency overlaps the work on h.
    """
    A, in_n = _rows(m, "A", rank, in_dim, dtype)
    x, _ = _rows(m, "x", tokens, in_dim, dtype)
    Bm, _ = _rows(m, "B", out_dim, rank, dtype)
    out = _output(m, tokens * out_dim, dtype)
    wid = m.workgroup_id()
    t = wid.y
    tid = m.local_index()
    base = m.let(wid.x * (threads * outputs_per_thread) + tid, "base")
    mine = []
    for k in range(outputs_per_thread):
        i = m.let(base + k * threads, f"col{k}")
        safe = m.let(B.min(i, out_dim - 1), f"safe{k}")  # in-bounds prefetch
        mine.append((i, _b_row(m, Bm, safe, rank), m.let(_wide(out[t * out_dim + safe]), f"o{k}")))
    accs = _partial_dots(m, A, x, rank, in_n, t, tid, threads, unroll)
    hs = _reduce(m, accs, threads, subgroups)
    for i, row, old in mine:
        with m.if_(i < out_dim):
            _store(out, t * out_dim + i, old + scale * _row_dot(row, hs))


MAX_BLOCK_ACCS = 64  # accumulators per thread in tiled_forward's phase 1 before ranks are split


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
    return tile_tokens // token_block * _rank_split(rank, token_block, _width(rank))[1] <= threads


def _tile_shape(rank, threads, tile_tokens, token_block):
    """(vector width of h, ranks per thread group, rank groups, lanes per group),
    after checking the tile fits the workgroup."""
    _check_threads(threads)
    if tile_tokens > threads or threads % tile_tokens:
        raise ValueError(f"tile_tokens ({tile_tokens}) must divide threads ({threads})")
    if token_block < 1 or tile_tokens % token_block:
        raise ValueError(f"token_block ({token_block}) must divide tile_tokens ({tile_tokens})")
    w = _width(rank)  # scale * h of the tile, as vec4 when rank allows: fewer loads in phase 2
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
        return _partial_dots(m, A, x, rank, in_n, t, lane, lanes, unroll), lane, [tl], 0
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
    accs = [a for block in _partial_dots(m, A, x, per, in_n, ts, lane, lanes, unroll, rows)
            for a in block]
    return accs, lane, [first + j for j in range(token_block)], r0


def _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0, scale):
    """The ``finish`` of phase 1's reduction: lane 0 of each group stores scale * h."""
    tid = m.local_index()

    def finish(red, chunk, g0):
        with m.if_(lane == 0):
            for q in range(len(chunk)):
                j, k = divmod(g0 + q, per)  # token of the block, rank of the group
                value = scale * red[q * threads + tid]
                ragged = rank_groups * per > rank and k >= rank - (rank_groups - 1) * per

                def store():  # r0 is a multiple of 4 when w == 4 (_rank_split)
                    if w == 4:
                        setattr(hw[firsts[j] * (rank // 4) + r0 // 4 + k // 4], "xyzw"[k % 4], value)
                    else:
                        hw[firsts[j] * rank + r0 + k] = value

                if ragged:
                    with m.if_(r0 + k < rank):
                        store()
                else:
                    store()
    return finish


def _tile_columns(m, Bm, out, hw, rank, w, out_dim, tokens, tile_tokens, t0):
    """Phase 2 for output column i: B's row once, then every token of the tile."""
    ragged = tokens % tile_tokens != 0

    def column(i):
        # All loads of this column first (B row, then every token's output),
        # so they are in flight together; then the stores.
        row = _b_row(m, Bm, i, rank)
        dests = [m.let((B.min(t0 + k, tokens - 1) if ragged else t0 + k) * out_dim + i, f"d{k}")
                 for k in range(tile_tokens)]
        olds = [m.let(_wide(out[d]), f"o{k}") for k, d in enumerate(dests)]
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
                    _store(out, dests[k], olds[k] + total)
            else:
                _store(out, dests[k], olds[k] + total)
    return column


def tiled_forward(m, rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                  unroll=True, dtype="f32", token_block=1):
    """The LoRA delta for many tokens in one dispatch, tile_tokens per workgroup.

    Phase 1: h = A @ x for the tile, left as scale * h in workgroup memory.
    Each thread sums a strided slice of in_dim for ``token_block`` tokens at
    once (each load of A serves them all) and for all ranks, or, when that
    would be more than MAX_BLOCK_ACCS accumulators, for a group of ranks; the
    threads sharing (tokens, ranks) then reduce. Phase 2: each thread owns
    output columns; it loads its row of B once and updates that column for
    every token of the tile. A and B are read once per tile (per token block
    in phase 1), not once per token, which is what limits the
    one-token-per-workgroup kernel.
    """
    w, per, rank_groups, lanes = _tile_shape(rank, threads, tile_tokens, token_block)
    A, in_n = _rows(m, "A", rank, in_dim, dtype)
    x, _ = _rows(m, "x", tokens, in_dim, dtype)
    Bm, _ = _rows(m, "B", out_dim, rank, dtype)
    out = _output(m, tokens * out_dim, dtype)
    tid = m.local_index()
    t0 = m.let(m.workgroup_id().x * tile_tokens, "t0")
    accs, lane, firsts, r0 = _tile_partials(m, A, x, rank, in_n, tokens, t0, lanes, per,
                                            rank_groups, token_block, unroll)
    hw = m.shared(vec4f if w == 4 else f32, tile_tokens * rank // w, "hw")
    finish = _tile_h_store(m, hw, rank, w, per, rank_groups, threads, lane, firsts, r0, scale)
    _tree(m, accs, threads, lanes, lane, finish, SHARED_FLOATS - tile_tokens * rank)
    column = _tile_columns(m, Bm, out, hw, rank, w, out_dim, tokens, tile_tokens, t0)
    _unrolled_or_loop(m, tid, out_dim, threads, tile_tokens * 3 + rank // w, column, "i", unroll)


# ------------------------------------------------------------------ the registry

def _ceil(n: int, d: int) -> int:
    return -(-n // d)


@dataclass(frozen=True)
class KernelSpec:
    """One LoRA kernel: its DSL function, the role of each binding, its
    workgroup size and its grid, both computed from the parameters alone.

    ``kernel(**params)`` compiles it (cached by ``shaderdsl.compile``);
    ``grid(**params)`` is the workgroup count a dispatch needs. Parameters
    are the function's keyword parameters (defaults filled in), plus
    ``threads`` wherever the workgroup size is not one of them.
    """

    name: str
    function: Callable
    roles: tuple[str, ...]
    workgroup: Callable[[dict], int]
    grid_rule: Callable[[dict], tuple[int, int, int]]
    doc: str

    @property
    def parameter_names(self) -> set[str]:
        return set(inspect.signature(self.function).parameters) - {"m"} | {"threads"}

    def params(self, **given) -> dict:
        """``given`` over the function's defaults (and threads=256)."""
        sig = inspect.signature(self.function)
        out = {"threads": 256}
        out.update({k: p.default for k, p in sig.parameters.items()
                    if p.default is not inspect.Parameter.empty})
        unknown = set(given) - self.parameter_names
        if unknown:
            raise TypeError(f"kernel {self.name!r} takes no parameter(s) {sorted(unknown)}; "
                            f"it takes {sorted(self.parameter_names)}")
        out.update(given)
        return out

    def kernel(self, **given) -> sd.Kernel:
        p = self.params(**given)
        sig = inspect.signature(self.function).parameters
        name = self.name if p.get("dtype", "f32") == "f32" else f"{self.name}_{p['dtype']}"
        return sd.compile(self.function, self.workgroup(p), name=name,
                          **{k: v for k, v in p.items() if k in sig})

    def grid(self, **given) -> tuple[int, int, int]:
        return self.grid_rule(self.params(**given))


KERNELS = {spec.name: spec for spec in (
    KernelSpec("project_a_seed", project_a_seed, ("A", "x", "h"), lambda p: 64,
               lambda p: (_ceil(p["rank"], 64), p["tokens"], 1),
               "h = A @ x, Hesper's design: one thread per element of h"),
    KernelSpec("project_a", project_a_workgroup, ("A", "x", "h"), lambda p: p["threads"],
               lambda p: (p["tokens"], _ceil(p["rank"], p["rank_group"])
                          if 0 < p["rank_group"] < p["rank"] else 1, 1),
               "h = A @ x: one workgroup per token (and per group of ranks)"),
    KernelSpec("project_b", project_b, ("B", "h", "y"), lambda p: p["threads"],
               lambda p: (_ceil(p["out_dim"], p["threads"]), p["tokens"], 1),
               "y = B @ h: one thread per element of y"),
    KernelSpec("add_scaled", add_scaled, ("y", "output"), lambda p: p["threads"],
               lambda p: (_ceil(p["num_elements"], p["threads"]), 1, 1),
               "output += scale * y"),
    KernelSpec("fused_b_add", fused_b_add, ("B", "h", "output"), lambda p: p["threads"],
               lambda p: (_ceil(p["out_dim"], p["threads"]), p["tokens"], 1),
               "output += scale * B @ h"),
    KernelSpec("fused_forward", fused_forward, ("A", "x", "B", "output"), lambda p: p["threads"],
               lambda p: (_ceil(p["out_dim"], p["threads"] * p["outputs_per_thread"]),
                          p["tokens"], 1),
               "output += scale * B @ (A @ x), one dispatch, h recomputed per workgroup"),
    KernelSpec("tiled_forward", tiled_forward, ("A", "x", "B", "output"), lambda p: p["threads"],
               lambda p: (_ceil(p["tokens"], p["tile_tokens"]), 1, 1),
               "output += scale * B @ (A @ x), one dispatch, a tile of tokens per workgroup"),
)}


def _deprecated(old: str, spec: str, adapt=lambda **kw: kw):
    def fn(*args, **kw):
        params = adapt(**dict(zip(_OLD_ORDER[old], args)), **kw)
        target = KERNELS[params.pop("spec", spec)]
        warnings.warn(f"lora.kernels.{old} is deprecated; use lora.kernels.KERNELS"
                      f"[{target.name!r}].kernel(...)", DeprecationWarning, stacklevel=2)
        return target.kernel(**{k: v for k, v in params.items() if k in target.parameter_names})
    fn.__name__ = old
    return fn


_OLD_ORDER = {
    "project_a_kernel": ("rank", "in_dim", "tokens", "strategy", "threads", "subgroups", "dtype",
                         "rank_group"),
    "project_b_kernel": ("out_dim", "rank", "tokens", "threads", "dtype"),
    "add_scaled_kernel": ("num_elements", "scale", "threads", "dtype"),
    "fused_b_add_kernel": ("out_dim", "rank", "scale", "tokens", "threads", "dtype"),
    "fused_forward_kernel": ("rank", "in_dim", "out_dim", "scale", "tokens", "threads",
                             "outputs_per_thread", "subgroups", "unroll", "dtype"),
    "tiled_forward_kernel": ("rank", "in_dim", "out_dim", "scale", "tokens", "threads",
                             "tile_tokens", "unroll", "dtype", "token_block"),
}


def _project_a_args(strategy="workgroup", rank_group=0, **kw):
    if strategy == "seed":
        return dict(kw, spec="project_a_seed")
    return dict(kw, rank_group=rank_group if 0 < rank_group < kw["rank"] else 0)


# The wrappers of the previous release, kept as aliases that warn.
project_a_kernel = _deprecated("project_a_kernel", "project_a", _project_a_args)
project_b_kernel = _deprecated("project_b_kernel", "project_b")
add_scaled_kernel = _deprecated("add_scaled_kernel", "add_scaled")
fused_b_add_kernel = _deprecated("fused_b_add_kernel", "fused_b_add")
fused_forward_kernel = _deprecated("fused_forward_kernel", "fused_forward")
tiled_forward_kernel = _deprecated("tiled_forward_kernel", "tiled_forward")
