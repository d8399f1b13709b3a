"""The frozen base layers LoRA adapts, for training a small network on the GPU:
a dense layer ``y = x W^T + b`` (W [out, in]), its input gradient ``dx = g W``,
and ReLU with its gradient. One thread per element of the result; the base
weights get no gradient (they are frozen).
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f16, f32, vec4f, vec4h

from .common import storage_scalar, store_output, widen


def dense(m, in_dim, out_dim, tokens, dtype="f32"):
    """y[t, o] = b[o] + sum_i x[t, i] W[o, i] (grid (ceil(out_dim / threads), tokens))."""
    x = m.declare_input_buffer("x", storage_scalar(dtype), tokens * in_dim)
    W = m.declare_input_buffer("W", storage_scalar(dtype), out_dim * in_dim)
    bias = m.declare_input_buffer("bias", storage_scalar(dtype), out_dim)
    y = m.declare_output_buffer("y", storage_scalar(dtype), tokens * out_dim)
    o, t = m.global_id().x, m.workgroup_id().y
    with m.if_(o < out_dim):
        acc = m.var(f32, widen(bias[o]), "acc")
        with m.loop(in_dim, name="i") as i:
            acc += widen(x[t * in_dim + i]) * widen(W[o * in_dim + i])
        store_output(y, t * out_dim + o, acc)


def dense_grad_input(m, in_dim, out_dim, tokens, accumulate=False, dtype="f32"):
    """dx[t, i] (+)= sum_o g[t, o] W[o, i] (grid (ceil(in_dim / threads), tokens))."""
    g = m.declare_input_buffer("g", storage_scalar(dtype), tokens * out_dim)
    W = m.declare_input_buffer("W", storage_scalar(dtype), out_dim * in_dim)
    dx = m.declare_output_buffer("dx", storage_scalar(dtype), tokens * in_dim)
    i, t = m.global_id().x, m.workgroup_id().y
    with m.if_(i < in_dim):
        acc = m.var(f32, widen(dx[t * in_dim + i]) if accumulate else 0.0, "acc")
        with m.loop(out_dim, name="o") as o:
            acc += widen(g[t * out_dim + o]) * widen(W[o * in_dim + i])
        store_output(dx, t * in_dim + i, acc)


def relu(m, n, dtype="f32"):
    """y = max(z, 0) (grid ceil(n / threads))."""
    z = m.declare_input_buffer("z", storage_scalar(dtype), n)
    y = m.declare_output_buffer("y", storage_scalar(dtype), n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        store_output(y, i, B.max(widen(z[i]), 0.0))


def relu_grad(m, n, dtype="f32"):
    """dz = dy where z > 0, else 0 (grid ceil(n / threads))."""
    z = m.declare_input_buffer("z", storage_scalar(dtype), n)
    dy = m.declare_input_buffer("dy", storage_scalar(dtype), n)
    dz = m.declare_output_buffer("dz", storage_scalar(dtype), n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        store_output(dz, i, B.select(0.0, widen(dy[i]), widen(z[i]) > 0.0))


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
