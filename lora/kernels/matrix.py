"""The LoRA and base-layer products on matrix units: each one product of
:mod:`shaderdsl.matmul`'s engine (f16 storage, f16 16x16x16 fragments, f32
sums; the H200's under Dawn), declared as its factors' layouts
(``Operand``) and its epilogue (``Epilogue``).

The forward is two dispatches:

* ``project_a_matrix``: hp = x A^T over ``splits`` slices of in_dim
  (workgroup z is the slice: a batch of the engine), [splits * tokens, rank] f32;
* ``b_add_matrix``: output += scale * h B^T, with h the slices summed as
  they are staged (the engine's ``parts``; with ``save_h``, written out by
  the workgroups of column block 0), rounded to f16 as it is staged, like
  PyTorch's fp16 h. With ``direct`` (where the adapter also has f16 results)
  the output's own f16 fragments are the accumulators (the engine's
  in-place epilogue: no workgroup round trip; the sum over the rank then
  rounds to f16 once per fragment step of 16 ranks, not once in all).

``grad_outer_matrix`` is the backward's dB = s g^T h and dA = dh^T x (chunks
of tokens as the engine's batches), ``grad_input_matrix`` its dx = dh A; ``dense_matrix`` and
``dense_grad_input_matrix`` are a network's and a language model's frozen
base products, x W^T (+ b) and g W, on the tiling ``lora.core.tilings``
picks per shape.
"""
from __future__ import annotations

from shaderdsl import builtins as Bi
from shaderdsl import f16, vec4f, vec4h
from shaderdsl.matmul import Epilogue, MatrixTiling, Operand, f16_factor, tiled_product
from shaderdsl.types import MatrixConfig

from .common import columns_of, token_count, token_rows

FRAGMENT = MatrixConfig("f16", "f32", 16, 16, 16)
DIRECT = MatrixConfig("f16", "f16", 16, 16, 16)  # the output's own fragments as accumulators


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


def b_tiling(rank: int, rows: int, cols: int, group: int = 0,
             direct: bool = False) -> MatrixTiling:
    """b_add_matrix's tiling: 2 x 2 subgroups of ``rows`` x ``cols`` fragments,
    the rank (its K) in steps of at most 32; ``group``: MatrixTiling's;
    ``direct``: f16 results (the output's own fragments)."""
    return MatrixTiling(DIRECT if direct else FRAGMENT, (2, 2), (rows, cols),
                        k_step=min(32, -(-rank // 16) * 16), group=group)


def project_a_matrix(m, rank, in_dim, tokens, splits=1, fragments=2, depth=32, a_columns=False,
                     scale=1.0, group=0):
    """hp[s * tokens + t, r] = scale * sum over slice s of in_dim of x[t, i] A[r, i],
    or, with ``a_columns``, of x[t, i] A[i, r] (A stored [in_dim, rank]: the
    backward's dh = s g B, with B as A and g as x). The slices are the
    engine's batches (workgroup z)."""
    _check("project_a_matrix", rank=rank, in_dim=in_dim, slice=in_dim // splits)
    if in_dim % splits:
        raise ValueError(f"project_a_matrix: splits ({splits}) must divide in_dim ({in_dim})")
    tiling, part = a_tiling(rank, fragments, depth, group), in_dim // splits
    A = m.declare_input_buffer("A", vec4h, rank * in_dim // 4)
    x = m.declare_input_buffer("x", vec4h, token_rows(tokens, in_dim // 4))
    hp = m.declare_output_buffer("hp", vec4f, token_rows(tokens, splits * rank // 4))
    n = token_count(m, tokens)
    a = Operand(A, "row", stride=rank, batch=part * rank) if a_columns else \
        Operand(A, "col", stride=in_dim, batch=part)
    tiled_product(m, tiling, Operand(x, stride=in_dim, batch=part), a, n, rank, part,
                  Epilogue(hp, batch=n * rank, scale=scale), batches=splits)


OUTER = MatrixTiling(FRAGMENT, (2, 2), (2, 2), k_step=32)  # grad_outer_matrix: 64 x 64 blocks


def outer_matrix_grid(n, rank, tokens, chunk, layout) -> tuple:
    rows, cols = (n, rank) if layout == "jr" else (rank, n)
    return OUTER.grid(rows, cols, -(-tokens // chunk))


def grad_outer_matrix(m, n, rank, scale, tokens, chunk, layout="jr", accumulate=False):
    """grad_outer on matrix units: out[j, r] (layout "jr", dB = s g^T h) or
    out[r, j] ("rj", dA = dh^T x) = scale * sum over tokens of G[t, j] H[t, r],
    G f16 [tokens, n], H f32 [tokens, rank] rounded to f16 as it is staged
    (as PyTorch's fp16 h and dh are), f32 sums. Workgroup z (the engine's
    batch) sums ``chunk`` tokens into its slice of ``partial`` (one chunk:
    straight into ``out``)."""
    _check("grad_outer_matrix", n=n, rank=rank)
    chunks = -(-tokens // chunk)
    G = m.declare_input_buffer("G", vec4h, tokens * n // 4)
    H = m.declare_input_buffer("H", vec4f, tokens * rank // 4)
    out = m.declare_output_buffer("out" if chunks == 1 else "partial", vec4f,
                                  chunks * n * rank // 4)
    span = chunk
    if chunks > 1:  # the last chunk's tokens may be fewer
        t0 = m.let(Bi.min(m.workgroup_id().z, chunks - 1) * chunk, "t0")
        span = m.let(Bi.min(t0 + chunk, tokens) - t0, "span")
    g = dict(stride=n, batch=chunk * n)
    h = dict(stride=rank, batch=chunk * rank)
    if layout == "jr":  # dB[j, r]: G^T (n x tokens) times H (tokens x rank)
        a, b, rows, cols = Operand(G, "col", **g), Operand(H, **h), n, rank
    else:               # dA[r, j]: H^T (rank x tokens) times G (tokens x n)
        a, b, rows, cols = Operand(H, "col", **h), Operand(G, **g), rank, n
    tiled_product(m, OUTER, a, b, rows, cols, span,
                  Epilogue(out, batch=n * rank, scale=scale,
                           accumulate=accumulate and chunks == 1), batches=chunks)


def grad_input_matrix(m, in_dim, rank, tokens, accumulate=False):
    """The backward's dx (+)= dh A on matrix units: dh f32 [tokens, rank]
    rounded to f16 as it is staged (as grad_outer_matrix stages it), A f16
    [rank, in_dim], dx f16; b_add's tiling (2 x 2 subgroups of 2 x 2
    fragments, the rank as K); grid ``b_tiling(rank, 2, 2).grid(tokens, in_dim)``."""
    _check("grad_input_matrix", rank=rank, in_dim=in_dim)
    A = m.declare_input_buffer("A", vec4h, rank * in_dim // 4)
    dh = m.declare_input_buffer("dh", vec4f, tokens * rank // 4)
    dx = m.declare_output_buffer("dx", vec4h, tokens * in_dim // 4)
    tiled_product(m, b_tiling(rank, 2, 2), Operand(dh), Operand(A), tokens, in_dim, rank,
                  Epilogue(dx, accumulate=accumulate))


def b_add_matrix(m, out_dim, rank, scale, tokens, splits=1, rows=2, cols=4, save_h=False,
                 group=0, direct=False):
    """output[t, o] += scale * sum_r h[t, r] B[o, r], h the sum of the slices
    (staged as their sum, rounded to f16). ``group``: MatrixTiling's (the
    workgroup order); ``direct``: the output's own f16 fragments are the
    accumulators where a block lies inside it (scale * h staged; the engine's
    in-place epilogue; the adapter must have f16 16x16x16 results)."""
    _check("b_add_matrix", rank=rank, out_dim=out_dim)
    tiling = b_tiling(rank, rows, cols, group, direct)
    hp = m.declare_input_buffer("hp", vec4f, token_rows(tokens, splits * rank // 4))
    n = token_count(m, tokens)
    Bm = m.declare_input_buffer("B", vec4h, out_dim * rank // 4)
    out = m.declare_output_buffer("output", f16, token_rows(tokens, out_dim)) if direct else \
        m.declare_output_buffer("output", vec4h, token_rows(tokens, out_dim // 4))
    h = Operand(hp, stride=rank, parts=splits, part_stride=n * rank,
                scale=scale if direct else 1.0)
    if save_h:
        row0, col0 = tiling.origin(m)
        _save_h(m, hp, (rank, splits), tokens, n, (row0, col0 == 0), tiling)
    epilogue = Epilogue(out, accumulate=True, in_place=True) if direct else \
        Epilogue(out, scale=scale, accumulate=True)
    tiled_product(m, tiling, h, Operand(Bm, "col", stride=rank), n, out_dim, rank, epilogue)


def _save_h(m, hp, dims, tokens, n, block, tiling) -> None:
    """h (the slices of hp summed, f32) for this workgroup's rows of tokens,
    by the workgroups of column block 0; ``dims``: (rank, splits); ``block``:
    (the workgroup's first token, whether it is in column block 0)."""
    rank, splits = dims
    h = m.declare_output_buffer("h", vec4f, token_rows(tokens, rank // 4))
    quads = rank // 4
    with m.if_(block[1]):
        t0 = m.let(block[0], "t0")
        with m.loop(m.local_index(), tiling.rows * quads, tiling.threads, name="j") as j:
            t = m.let(t0 + j / quads, "t")
            with m.if_(t < n):
                r4 = m.let(t * quads + j % quads, "r4")
                total = hp[r4]
                for s in range(1, splits):
                    total = total + hp[s * n * quads + r4]
                h[r4] = total


def _f16_rows(m, name, count, stride, column):
    """An f16 output of ``count`` rows of ``stride`` values: vec4s where every
    row's block from ``column`` starts at a multiple of 4, else scalars."""
    if stride % 4 == 0 and column % 4 == 0:
        return m.declare_output_buffer(name, vec4h, count * stride // 4)
    return m.declare_output_buffer(name, f16, count * stride)


def dense_matrix(m, in_dim, out_dim, tokens, bias=True, y_stride=0, y_column=0, tiling=None):
    """lora.kernels.network.dense's y = x W^T (+ b) (a frozen layer of
    lora.training.network, a language model's projection or head) on the
    engine: f16 x, W, b and y, f32 sums (in_dim and out_dim multiples of the
    tiling's read width, 4 or 8; grid ``tiling.grid(tokens, out_dim)``;
    ``tiling`` None: OUTER's 64 x 64 blocks); y a block of wider rows with
    ``y_stride``/``y_column``."""
    tiling = tiling or OUTER
    stride, first = columns_of(out_dim, y_stride, y_column)
    x = f16_factor(m, "x", tokens * in_dim, tiling)
    W = f16_factor(m, "W", out_dim * in_dim, tiling)
    b = m.declare_input_buffer("bias", f16, out_dim) if bias else None
    y = _f16_rows(m, "y", tokens, stride, first)
    tiled_product(m, tiling, Operand(x), Operand(W, "col"), tokens, out_dim, in_dim,
                  Epilogue(y, stride, first, bias=b))


def dense_grad_input_matrix(m, in_dim, out_dim, tokens, accumulate=False, g_stride=0,
                            g_column=0, tiling=None):
    """dense_grad_input's dx (+)= g W on the engine: f16 g, W and dx, f32
    sums (in_dim and out_dim multiples of the tiling's read width; grid
    ``tiling.grid(tokens, in_dim)``, ``tiling`` None: OUTER's); g a block of
    wider rows with ``g_stride``/``g_column`` (multiples of the read width)."""
    tiling = tiling or OUTER
    stride, first = columns_of(out_dim, g_stride, g_column)
    w = tiling.read_width
    if stride % w or first % w:
        raise ValueError(f"g_stride and g_column must be multiples of {w} (the tiling's "
                         f"read width), got {stride}, {first}")
    g = f16_factor(m, "g", tokens * stride, tiling)
    W = f16_factor(m, "W", out_dim * in_dim, tiling)
    dx = m.declare_output_buffer("dx", vec4h, tokens * in_dim // 4)
    tiled_product(m, tiling, Operand(g, stride=stride, offset=first), Operand(W), tokens,
                  in_dim, out_dim, Epilogue(dx, accumulate=accumulate))
