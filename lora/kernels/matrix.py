"""The kernels on matrix units (subgroup matrices): f16 storage, f32 sums.

The forward is two dispatches, each a :func:`shaderdsl.matmul.tiled_product`:

* ``project_a_matrix``: hp = x A^T over ``splits`` slices of in_dim
  (workgroup z is the slice), [splits * tokens, rank] f32;
* ``b_add_matrix``: output += scale * h B^T, with h the slices summed (and,
  with ``save_h``, written out by the workgroups of column block 0), rounded
  to f16 as it is staged, like PyTorch's fp16 h.

Fragments are f16 16x16x16 with f32 results (the H200's; the strategy offers
itself only where the adapter has them); the subgroup size is theirs (32).

``b_add_direct`` replaces b_add_matrix where the adapter also has f16
results: the output's own f16 fragments are the accumulators (loaded from
the output, multiplied into, stored back), so no result passes through
workgroup memory. The sum over the rank then rounds to f16 once per
fragment step of 16 ranks, not once in all.

``grad_outer_matrix`` is the backward's dB = s g^T h and dA = dh^T x on the
same fragments (lora.training's matrix strategy); ``dense_matrix`` and
``dense_grad_input_matrix`` are a network's frozen base products, x W^T and
g W (lora.training.network).
"""
from __future__ import annotations

from shaderdsl import builtins as Bi
from shaderdsl import f16, f32, vec4f, vec4h
from shaderdsl.matmul import MatrixTiling, Operand, tiled_product
from shaderdsl.types import MatrixConfig

from .common import columns_of, token_count, token_rows

FRAGMENT = MatrixConfig("f16", "f32", 16, 16, 16)
DIRECT = MatrixConfig("f16", "f16", 16, 16, 16)  # the output's own fragments as accumulators
DIRECT_SUBGROUPS = 4  # per workgroup of b_add_direct: they share the staged h


def _check(what: str, **dims) -> None:
    bad = {k: v for k, v in dims.items() if v % 4}
    if bad:
        raise ValueError(f"{what} reads four elements at a time: {bad} must be multiples of 4")


def a_tiling(rank: int, fragments: int, depth: int = 32, group: int = 0) -> MatrixTiling:
    """project_a_matrix's tiling: 2 x ``fragments`` fragments of tokens per
    workgroup, the rank's columns (padded to 16) over one or two subgroups,
    ``depth`` columns of x per staged slice; ``group``: MatrixTiling's."""
    cols = -(-rank // FRAGMENT.n)
    across = 2 if cols % 2 == 0 else 1
    return MatrixTiling(FRAGMENT, (2, across), (fragments, cols // across), k_step=depth,
                        group=group)


def b_tiling(rank: int, rows: int, cols: int, group: int = 0) -> MatrixTiling:
    """b_add_matrix's tiling: 2 x 2 subgroups of ``rows`` x ``cols`` fragments,
    the rank (its K) in steps of at most 32; ``group``: MatrixTiling's."""
    return MatrixTiling(FRAGMENT, (2, 2), (rows, cols), k_step=min(32, -(-rank // 16) * 16),
                        group=group)


def project_a_matrix(m, rank, in_dim, tokens, splits=1, fragments=2, depth=32, a_columns=False,
                     scale=1.0, group=0):
    """hp[s * tokens + t, r] = scale * sum over slice s of in_dim of x[t, i] A[r, i],
    or, with ``a_columns``, of x[t, i] A[i, r] (A stored [in_dim, rank]: the
    backward's dh = s g B, with B as A and g as x)."""
    _check("project_a_matrix", rank=rank, in_dim=in_dim, slice=in_dim // splits)
    if in_dim % splits:
        raise ValueError(f"project_a_matrix: splits ({splits}) must divide in_dim ({in_dim})")
    tiling, part = a_tiling(rank, fragments, depth, group), in_dim // splits
    A = m.declare_input_buffer("A", vec4h, rank * in_dim // 4)
    x = m.declare_input_buffer("x", vec4h, token_rows(tokens, in_dim // 4))
    hp = m.declare_output_buffer("hp", vec4f, token_rows(tokens, splits * rank // 4))
    n = token_count(m, tokens)
    # the min changes nothing (z < splits) but bounds every read of x and A for Tint (note 37)
    first = m.let(Bi.min(m.workgroup_id().z, splits - 1) * part, "first")

    def store(t, r, value):
        hp[((m.workgroup_id().z * n + t) * rank + r) / 4] = value if scale == 1.0 else scale * value

    a = Operand(lambda i, r: A[((first + i) * rank + r) / 4]) if a_columns else \
        Operand(lambda i, r: A[(r * in_dim + first + i) / 4], axis=0)
    tiled_product(m, tiling, Operand(lambda t, i: x[(t * in_dim + first + i) / 4]), a,
                  n, rank, part, store)


OUTER = MatrixTiling(FRAGMENT, (2, 2), (2, 2), k_step=32)  # grad_outer_matrix: 64 x 64 blocks


def outer_matrix_grid(n, rank, tokens, chunk, layout) -> tuple:
    rows, cols = (n, rank) if layout == "jr" else (rank, n)
    return OUTER.grid(rows, cols)[:2] + (-(-tokens // chunk),)


def grad_outer_matrix(m, n, rank, scale, tokens, chunk, layout="jr", accumulate=False):
    """grad_outer on matrix units: out[j, r] (layout "jr", dB = s g^T h) or
    out[r, j] ("rj", dA = dh^T x) = scale * sum over tokens of G[t, j] H[t, r],
    G f16 [tokens, n], H f32 [tokens, rank] rounded to f16 as it is staged
    (as PyTorch's fp16 h and dh are), f32 sums. Workgroup z sums ``chunk``
    tokens into its slice of ``partial`` (one chunk: straight into ``out``)."""
    _check("grad_outer_matrix", n=n, rank=rank)
    chunks = -(-tokens // chunk)
    G = m.declare_input_buffer("G", vec4h, tokens * n // 4)
    H = m.declare_input_buffer("H", vec4f, tokens * rank // 4)
    out = m.declare_output_buffer("out" if chunks == 1 else "partial", f32, chunks * n * rank)
    t0 = m.let(m.workgroup_id().z * chunk, "t0")
    span = chunk if chunks == 1 else m.let(Bi.min(t0 + chunk, tokens) - t0, "span")

    def g(t, j):
        return G[((t0 + t) * n + j) / 4]

    def h(t, r):
        return H[((t0 + t) * rank + r) / 4]

    if layout == "jr":  # dB[j, r]: G^T (n x tokens) times H (tokens x rank)
        a, b, rows, cols = Operand(lambda j, t: g(t, j), axis=0), Operand(h), n, rank
    else:               # dA[r, j]: H^T (rank x tokens) times G (tokens x n)
        a, b, rows, cols = Operand(lambda r, t: h(t, r), axis=0), Operand(g), rank, n
    base = m.workgroup_id().z * (n * rank) if chunks > 1 else 0

    def store(row, col, value):
        at = m.let(base + row * cols + col, "at")
        for e, lane in enumerate("xyzw"):
            v = scale * getattr(value, lane)
            out[at + e] = out[at + e] + v if accumulate and chunks == 1 else v

    tiled_product(m, OUTER, a, b, rows, cols, span, store)


def b_add_matrix(m, out_dim, rank, scale, tokens, splits=1, rows=2, cols=4, save_h=False,
                 group=0):
    """output[t, o] += scale * sum_r h[t, r] B[o, r], h the sum of the slices.
    ``group``: MatrixTiling's (the workgroup order)."""
    _check("b_add_matrix", rank=rank, out_dim=out_dim)
    tiling = b_tiling(rank, rows, cols, group)
    n, h_at = _hp_sum(m, rank, tokens, splits)
    Bm = m.declare_input_buffer("B", vec4h, out_dim * rank // 4)
    out = m.declare_output_buffer("output", vec4h, token_rows(tokens, out_dim // 4))
    if save_h:
        row0, col0 = tiling.origin(m)
        _save_h(m, h_at, rank, tokens, n, (row0, col0 == 0), tiling.rows, tiling.threads)

    def add(t, o, value):
        at = m.let((t * out_dim + o) / 4, "at")
        out[at] = vec4h(vec4f(out[at]) + scale * value)

    tiled_product(m, tiling, Operand(h_at), Operand(lambda r, o: Bm[(o * rank + r) / 4], axis=0),
                  n, out_dim, rank, add)


def _save_h(m, h_at, rank, tokens, n, block, rows, threads) -> None:
    """h (the slices summed, f32) for this workgroup's ``rows`` tokens, by the
    workgroups of column block 0; ``block``: (the workgroup's first token,
    whether it is in column block 0)."""
    h = m.declare_output_buffer("h", vec4f, token_rows(tokens, rank // 4))
    quads = rank // 4
    with m.if_(block[1]):
        t0 = m.let(block[0], "t0")
        with m.loop(m.local_index(), rows * quads, threads, name="j") as j:
            t = m.let(t0 + j / quads, "t")
            with m.if_(t < n):
                h[t * quads + j % quads] = h_at(t, j % quads * 4)


def _hp_sum(m, rank, tokens, splits):
    """hp and h_at(t, r): the vec4 of h at (t, r..r+3), the slices summed."""
    hp = m.declare_input_buffer("hp", vec4f, token_rows(tokens, splits * rank // 4))
    n = token_count(m, tokens)

    def h_at(t, r):
        total = hp[(t * rank + r) / 4]
        for s in range(1, splits):
            total = total + hp[((s * n + t) * rank + r) / 4]
        return total
    return n, h_at


def direct_threads() -> int:
    return DIRECT_SUBGROUPS * DIRECT.subgroup_sizes[0]


def direct_grid(out_dim, tokens, rows, cols) -> tuple:
    """b_add_direct's workgroups: blocks of DIRECT_SUBGROUPS x cols fragments of
    columns along x, of ``rows`` fragments of tokens along y."""
    return (-(-out_dim // (DIRECT_SUBGROUPS * cols * DIRECT.n)), -(-tokens // (rows * DIRECT.m)), 1)


def b_add_direct(m, out_dim, rank, scale, tokens, splits=1, rows=2, cols=2, save_h=False):
    """output[t, o] += scale * sum_r h[t, r] B[o, r], accumulated into the
    output's own f16 fragments. Each workgroup stages scale * h for its
    16 * ``rows`` tokens in workgroup memory (f16); each of its subgroups
    owns 16 * ``cols`` columns and, per column fragment, loads the output
    fragment, adds the products over the rank and stores it. A last partial
    fragment of tokens is summed by the lanes one element at a time."""
    if rank % DIRECT.k or out_dim % (DIRECT.n * cols):
        raise ValueError(f"b_add_direct: rank ({rank}) must be a multiple of {DIRECT.k} and "
                         f"out_dim ({out_dim}) of 16 x cols ({16 * cols})")
    n, h_at = _hp_sum(m, rank, tokens, splits)
    Bm = m.declare_input_buffer("B", f16, out_dim * rank)
    out = m.declare_output_buffer("output", f16, token_rows(tokens, out_dim))
    if save_h:
        wg = m.workgroup_id()
        _save_h(m, h_at, rank, tokens, n, (wg.y * (rows * DIRECT.m), wg.x == 0), rows * DIRECT.m,
                direct_threads())
    hs, stride = _stage_scaled_h(m, h_at, rank, scale, n, rows)
    sgs = DIRECT.subgroup_sizes[0]
    c0 = m.let((m.workgroup_id().x * DIRECT_SUBGROUPS + m.local_index() / sgs) * (cols * DIRECT.n),
               "c0")
    left_t, right_t, acc_t = DIRECT.types()
    t0 = m.workgroup_id().y * (rows * DIRECT.m)
    with m.if_(c0 < out_dim):
        for i in range(rows):
            row = m.let(t0 + i * DIRECT.m, f"row{i}")
            lefts = [m.let(Bi.subgroup_matrix_load(left_t, hs, (i * DIRECT.m) * stride + k, stride),
                           f"l{i}_{k // DIRECT.k}") for k in range(0, rank, DIRECT.k)]
            for j in range(cols):
                col = m.let(c0 + j * DIRECT.n, "col")
                with m.if_(row + DIRECT.m <= n):
                    at = m.let(row * out_dim + col, "at")
                    acc = m.var(Bi.subgroup_matrix_load(acc_t, out, at, out_dim), name="acc")
                    for li, k in zip(lefts, range(0, rank, DIRECT.k)):
                        right = Bi.subgroup_matrix_load_col_major(right_t, Bm, col * rank + k, rank)
                        m.assign(acc, Bi.subgroup_matrix_multiply_accumulate(li, right, acc))
                    Bi.subgroup_matrix_store(out, at, acc, out_dim)
                with m.elif_(row < n):
                    _add_partial(m, out, Bm, hs, stride, (row, col), (n, out_dim, rank),
                                 i * DIRECT.m)


def _stage_scaled_h(m, h_at, rank, scale, n, rows):
    """scale * h of this workgroup's tokens in workgroup memory, f16 (zero
    past the last token); returns (the array, its row stride)."""
    stride, quads, threads = rank + 8, rank // 4, direct_threads()
    tile = rows * DIRECT.m
    hs = m.shared(f16, tile * stride, "hs")
    t0 = m.let(m.workgroup_id().y * tile, "t0")
    with m.loop(m.local_index(), tile * quads, threads, name="j") as j:
        # j < tile * quads: the min changes nothing but proves hs's index (note 37)
        t, r = m.let(Bi.min(j / quads, tile - 1), "t"), m.let(j % quads * 4, "r")
        value = m.let(Bi.select(vec4f(0.0), scale * h_at(Bi.min(t0 + t, n - 1), r), t0 + t < n),
                      "hv")
        for e, lane in enumerate("xyzw"):
            hs[t * stride + r + e] = f16(getattr(value, lane))
    m.barrier()
    return hs, stride


def _add_partial(m, out, Bm, hs, stride, origin, extent, local_row) -> None:
    """A fragment whose rows pass the last token: each lane adds the products
    of its elements, one at a time, for the rows before it."""
    (row, col), (n, out_dim, rank) = origin, extent
    sgs, hs_rows = DIRECT.subgroup_sizes[0], hs.type.length // stride
    with m.loop(m.local_index() % sgs, DIRECT.m * DIRECT.n, sgs, name="e") as e:
        t = m.let(row + e / DIRECT.n, "t")
        with m.if_(t < n):
            o = m.let(col + e % DIRECT.n, "o")
            # a row of the staged tile: the min changes nothing but proves hs's index (note 37)
            hrow = m.let(Bi.min(local_row + e / DIRECT.n, hs_rows - 1) * stride, "hrow")
            total = m.var(vec4f(0.0), name="total")
            for r in range(0, rank, 4):
                hv = vec4f(vec4h(*(hs[hrow + r + q] for q in range(4))))
                bv = vec4f(vec4h(*(Bm[o * rank + r + q] for q in range(4))))
                m.assign(total, total + hv * bv)
            at = m.let(t * out_dim + o, "at")
            out[at] = f16(f32(out[at]) + total.x + total.y + total.z + total.w)


def dense_matrix(m, in_dim, out_dim, tokens, bias=True, y_stride=0, y_column=0):
    """lora.kernels.network.dense's y = x W^T (+ b) (a frozen layer of
    lora.training.network) on matrix units, OUTER's 64 x 64 blocks: f16 x, W,
    b and y, f32 sums (in_dim and out_dim multiples of 4; grid
    OUTER.grid(tokens, out_dim))."""
    x = m.declare_input_buffer("x", vec4h, tokens * in_dim // 4)
    W = m.declare_input_buffer("W", vec4h, out_dim * in_dim // 4)
    b = m.declare_input_buffer("bias", f16, out_dim) if bias else None
    stride, first = columns_of(out_dim, y_stride, y_column)
    y = m.declare_output_buffer("y", f16, tokens * stride)

    def store(row, col, value):
        for c in range(4):
            extra = f32(b[col + c]) if b is not None else 0.0
            y[row * stride + first + col + c] = f16(value[c] + extra)

    tiled_product(m, OUTER, Operand(lambda t, i: x[(t * in_dim + i) / 4]),
                  Operand(lambda i, o: W[(o * in_dim + i) / 4], axis=0),
                  tokens, out_dim, in_dim, store)


def dense_grad_input_matrix(m, in_dim, out_dim, tokens, accumulate=False, g_stride=0,
                            g_column=0):
    """dense_grad_input's dx (+)= g W on matrix units: f16 g, W and dx, f32
    sums (in_dim and out_dim multiples of 4; grid OUTER.grid(tokens, in_dim));
    g a block of wider rows with ``g_stride``/``g_column`` (multiples of 4)."""
    stride, first = columns_of(out_dim, g_stride, g_column)
    if stride % 4 or first % 4:
        raise ValueError(f"g_stride and g_column must be multiples of 4, got {stride}, {first}")
    g = m.declare_input_buffer("g", vec4h, tokens * stride // 4)
    W = m.declare_input_buffer("W", vec4h, out_dim * in_dim // 4)
    dx = m.declare_output_buffer("dx", f16, tokens * in_dim)

    def store(row, col, value):
        for c in range(4):
            at = row * in_dim + col + c
            dx[at] = f16(value[c] + f32(dx[at])) if accumulate else f16(value[c])

    tiled_product(m, OUTER, Operand(lambda t, o: g[(t * stride + first + o) / 4]),
                  Operand(lambda o, i: W[(o * in_dim + i) / 4]),
                  tokens, in_dim, out_dim, store)
