"""The frozen base layers LoRA adapts, for training a network on the GPU
(lora.training.network): a dense layer ``y = x W^T (+ b)`` (W [out, in]), its
input gradient ``dx = g W``, and the elementwise activations (ReLU, GELU,
SiLU, tanh) with their gradients. One thread per element of the result; the
base weights get no gradient (they are frozen).
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f16, f32, vec4f, vec4h

from .common import columns_of, storage_scalar, store_output, widen

ACTIVATIONS = ("relu", "gelu", "silu", "tanh")
# erfc(z) for z >= 0 as t exp(-z^2 + P(t)), t = 1 / (1 + z / 2): P's coefficients,
# lowest first (a Chebyshev fit, relative error under 1.2e-7 for every z >= 0)
ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
        -1.13520398, 1.48851587, -0.82215223, 0.17087277)
TANH_CLAMP = 15.0  # tanh(15) is 1 in f32; past it exp overflows in some tanh implementations


def dense(m, in_dim, out_dim, tokens, dtype="f32", bias=True, y_stride=0, y_column=0):
    """y[t, o] = b[o] + sum_i x[t, i] W[o, i], without b where ``bias`` is False
    (grid (ceil(out_dim / threads), tokens)); ``y_stride``/``y_column``: y is
    columns y_column.. of rows of y_stride values (columns_of)."""
    stride, col = columns_of(out_dim, y_stride, y_column)
    x = m.declare_input_buffer("x", storage_scalar(dtype), tokens * in_dim)
    W = m.declare_input_buffer("W", storage_scalar(dtype), out_dim * in_dim)
    b = m.declare_input_buffer("bias", storage_scalar(dtype), out_dim) if bias else None
    y = m.declare_output_buffer("y", storage_scalar(dtype), tokens * stride)
    o, t = m.global_id().x, m.workgroup_id().y
    with m.if_(o < out_dim):
        acc = m.var(f32, widen(b[o]) if b is not None else 0.0, "acc")
        with m.loop(in_dim, name="i") as i:
            acc += widen(x[t * in_dim + i]) * widen(W[o * in_dim + i])
        store_output(y, t * stride + col + o, acc)


def dense_grad_input(m, in_dim, out_dim, tokens, accumulate=False, dtype="f32", g_stride=0,
                     g_column=0):
    """dx[t, i] (+)= sum_o g[t, o] W[o, i] (grid (ceil(in_dim / threads), tokens));
    ``g_stride``/``g_column``: g is a block of wider rows (columns_of)."""
    stride, col = columns_of(out_dim, g_stride, g_column)
    g = m.declare_input_buffer("g", storage_scalar(dtype), tokens * stride)
    W = m.declare_input_buffer("W", storage_scalar(dtype), out_dim * in_dim)
    dx = m.declare_output_buffer("dx", storage_scalar(dtype), tokens * in_dim)
    i, t = m.global_id().x, m.workgroup_id().y
    with m.if_(i < in_dim):
        acc = m.var(f32, widen(dx[t * in_dim + i]) if accumulate else 0.0, "acc")
        with m.loop(out_dim, name="o") as o:
            acc += widen(g[t * stride + col + o]) * widen(W[o * in_dim + i])
        store_output(dx, t * in_dim + i, acc)


def _normal_cdf(m, z):
    """Phi(z) = erfc(-z / sqrt 2) / 2, from ERFC (f32 expressions)."""
    a = m.let(B.abs(z) * 0.7071067811865476, "a")
    t = m.let(1.0 / (1.0 + 0.5 * a), "t")
    poly = ERFC[-1] * t
    for c in reversed(ERFC[1:-1]):
        poly = (poly + c) * t
    tail = m.let(0.5 * t * B.exp(poly + ERFC[0] - a * a), "tail")  # erfc(|z| / sqrt 2) / 2
    return B.select(tail, 1.0 - tail, z > 0.0)


def _activate(m, kind: str, z):
    """(the activation of z, its derivative at z), f32; the derivative only where needed."""
    if kind == "relu":
        return B.max(z, 0.0), B.select(0.0, 1.0, z > 0.0)
    if kind == "gelu":  # torch's exact GELU: z Phi(z)
        cdf = m.let(_normal_cdf(m, z), "cdf")
        pdf = B.exp(-0.5 * z * z) * 0.3989422804014327
        return z * cdf, cdf + z * pdf
    if kind == "silu":
        sig = m.let(1.0 / (1.0 + B.exp(-z)), "sig")
        return z * sig, sig * (1.0 + z * (1.0 - sig))
    if kind == "tanh":
        th = m.let(B.tanh(B.min(B.max(z, -TANH_CLAMP), TANH_CLAMP)), "th")
        return th, 1.0 - th * th
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {kind!r}")


def activation(m, n, kind="relu", dtype="f32"):
    """y = act(z) for ``kind`` in ACTIVATIONS (grid ceil(n / threads))."""
    z = m.declare_input_buffer("z", storage_scalar(dtype), n)
    y = m.declare_output_buffer("y", storage_scalar(dtype), n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        store_output(y, i, _activate(m, kind, m.let(widen(z[i]), "zi"))[0])


def activation_grad(m, n, kind="relu", dtype="f32"):
    """dz = dy act'(z) (ReLU: dy where z > 0, else 0) (grid ceil(n / threads))."""
    z = m.declare_input_buffer("z", storage_scalar(dtype), n)
    dy = m.declare_input_buffer("dy", storage_scalar(dtype), n)
    dz = m.declare_output_buffer("dz", storage_scalar(dtype), n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        zi = m.let(widen(z[i]), "zi")
        if kind == "relu":  # a select, so an infinite dy where z <= 0 gives 0, not NaN
            store_output(dz, i, B.select(0.0, widen(dy[i]), zi > 0.0))
        else:
            store_output(dz, i, widen(dy[i]) * _activate(m, kind, zi)[1])


def copy(m, n4, dtype="f32"):
    """dst = src, a vec4 at a time (grid ceil(n4 / threads)): a copy inside a
    compute pass, at the kernels' bandwidth."""
    elem = vec4h if dtype == "f16" else vec4f
    src = m.declare_input_buffer("src", elem, n4)
    dst = m.declare_output_buffer("dst", elem, n4)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n4):
        dst[i] = src[i]


def to_f16(m, sizes):
    """h{k} = f16(p{k}) for one or two f32 tensors (grid ceil(sum(sizes) /
    threads)): the f16 copies that kernels read of parameters trained in f32."""
    k, start = m.let(m.global_id().x, "k"), 0
    for i, n in enumerate(sizes):
        p = m.declare_input_buffer(f"p{i}", f32, n)
        h = m.declare_output_buffer(f"h{i}", f16, n)
        with m.if_((k >= start) & (k < start + n)):
            h[k - start] = f16(p[k - start])
        start += n


TILE = 64     # rows and columns of the result per workgroup of the tiled products
TILE_K = 16   # the shared dimension staged per step
TILED_THREADS = 256  # each thread owns a 4 x 4 block of the result


def _tiled_product(m, x, w_at, rows, k_dim, n_dim, init, out, x_cols=(0, 0), out_cols=(0, 0)):
    """out[t, n] = init(t, n) + sum_k x[t * k_dim + k] w_at(k, n), summed in k's
    order from init, as the plain kernels sum (so the result is theirs): a
    TILE x TILE block per workgroup, TILE_K columns of x and rows of w staged
    in workgroup memory per step (0 outside the matrices). ``x_cols`` and
    ``out_cols``: (stride, column) where x or out is a block of wider rows."""
    xs_stride, x_col = columns_of(k_dim, *x_cols)
    out_stride, out_col = columns_of(n_dim, *out_cols)
    xs = m.shared(f32, TILE * TILE_K, "xs")   # xs[r * TILE_K + k]
    ws = m.shared(f32, TILE_K * TILE, "ws")   # ws[k * TILE + n]
    li = m.let(m.local_index(), "li")
    tr, tc = m.let(li // (TILE // 4), "tr"), m.let(li % (TILE // 4), "tc")
    row0 = m.let(m.workgroup_id().y * TILE, "row0")
    col0 = m.let(m.workgroup_id().x * TILE, "col0")
    acc = [[m.var(f32, init(B.min(row0 + tr * 4 + i, rows - 1),
                            B.min(col0 + tc * 4 + j, n_dim - 1)), f"acc{i}{j}")
            for j in range(4)] for i in range(4)]
    with m.loop(-(-k_dim // TILE_K), name="step") as step:
        k0 = m.let(step * TILE_K, "k0")
        for q in range(TILE * TILE_K // TILED_THREADS):
            e = m.let(li + q * TILED_THREADS, f"e{q}")
            r, k = e // TILE_K, e % TILE_K
            inside = (row0 + r < rows) & (k0 + k < k_dim)
            at = B.min((row0 + r) * xs_stride + x_col + k0 + k, rows * xs_stride - 1)
            xs[e] = B.select(0.0, widen(x[at]), inside)
            ws_index, value, w_inside = w_at(e, k0, col0)
            ws[ws_index] = B.select(0.0, value, w_inside)
        m.barrier()
        with m.loop(TILE_K, name="k") as k:
            a = [m.let(xs[(tr * 4 + i) * TILE_K + k], f"a{i}") for i in range(4)]
            b = [m.let(ws[k * TILE + tc * 4 + j], f"b{j}") for j in range(4)]
            for i in range(4):
                for j in range(4):
                    acc[i][j] += a[i] * b[j]
        m.barrier()
    for i in range(4):
        for j in range(4):
            t, n = row0 + tr * 4 + i, col0 + tc * 4 + j
            with m.if_((t < rows) & (n < n_dim)):
                store_output(out, t * out_stride + out_col + n, acc[i][j])


def dense_tiled(m, in_dim, out_dim, tokens, dtype="f32", bias=True, y_stride=0, y_column=0):
    """dense's result (y = x W^T (+ b)), tiled: for layers too wide for a thread
    per output to read all of W (grid (ceil(out_dim / TILE), ceil(tokens / TILE)))."""
    stride, _ = columns_of(out_dim, y_stride, y_column)
    x = m.declare_input_buffer("x", storage_scalar(dtype), tokens * in_dim)
    W = m.declare_input_buffer("W", storage_scalar(dtype), out_dim * in_dim)
    b = m.declare_input_buffer("bias", storage_scalar(dtype), out_dim) if bias else None
    y = m.declare_output_buffer("y", storage_scalar(dtype), tokens * stride)

    def w_at(e, k0, col0):  # W[n, k], read along k
        n, k = e // TILE_K, e % TILE_K
        inside = (col0 + n < out_dim) & (k0 + k < in_dim)
        index = B.min((col0 + n) * in_dim + k0 + k, out_dim * in_dim - 1)
        return k * TILE + n, widen(W[index]), inside

    def init(t, n):
        return widen(b[n]) if b is not None else 0.0
    _tiled_product(m, x, w_at, tokens, in_dim, out_dim, init, y, out_cols=(y_stride, y_column))


def dense_grad_input_tiled(m, in_dim, out_dim, tokens, accumulate=False, dtype="f32", g_stride=0,
                           g_column=0):
    """dense_grad_input's result (dx (+)= g W), tiled (grid (ceil(in_dim / TILE),
    ceil(tokens / TILE)))."""
    stride, _ = columns_of(out_dim, g_stride, g_column)
    g = m.declare_input_buffer("g", storage_scalar(dtype), tokens * stride)
    W = m.declare_input_buffer("W", storage_scalar(dtype), out_dim * in_dim)
    dx = m.declare_output_buffer("dx", storage_scalar(dtype), tokens * in_dim)

    def w_at(e, k0, col0):  # W[k, n], read along n
        k, n = e // TILE, e % TILE
        inside = (k0 + k < out_dim) & (col0 + n < in_dim)
        index = B.min((k0 + k) * in_dim + col0 + n, out_dim * in_dim - 1)
        return k * TILE + n, widen(W[index]), inside

    def init(t, n):
        return widen(dx[t * in_dim + n]) if accumulate else 0.0
    _tiled_product(m, g, w_at, tokens, out_dim, in_dim, init, dx, x_cols=(g_stride, g_column))

