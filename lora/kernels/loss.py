"""Losses on the GPU: each writes the gradient of the loss with respect to its
input and partial sums of the loss value, which the host adds up (in float64)
only when the value is asked for.

    mse:          L = mean((out - want)^2) over all N elements; g = 2 (out - want) / N
    softmax_xent: L = mean over tokens of -log softmax(logits)[label];
                  g = (softmax(logits) - onehot(label)) / tokens; a label
                  outside the classes gets g = 0 and -1 - label as its loss,
                  which the host reports when it reads the value
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f32, u32, vec4f

from .common import (check_threads, input_matrix, output_buffer, reduce_sum, storage_scalar,
                     store_output, widen, width)
from .optimizer import advance, state_buffers


def _begin(m, schedule) -> None:
    """With ``schedule`` (not None): the optimizer's begin (optimizer.advance,
    no clipping) by the dispatch's first thread, one dispatch fewer a step."""
    if schedule is not None:
        state, hyper = state_buffers(m)
        with m.if_(m.global_id().x == 0):
            advance(m, state, hyper, schedule)


def mse(m, n, threads=256, dtype="f32", begin=None):
    """g = 2 (out - want) / n, a vec4 per thread where n is a multiple of 4,
    else one element (grid ceil(n / (w threads))); each workgroup writes the
    sum of its squared errors to ``partial``. ``begin``: see _begin."""
    check_threads(threads)
    _begin(m, begin)
    w = width(n)
    out, _ = input_matrix(m, "out", 1, n, dtype)
    want, _ = input_matrix(m, "want", 1, n, dtype)
    g = output_buffer(m, n, dtype, "g", quad=w == 4)
    partial = m.declare_output_buffer("partial", f32, -(-n // (w * threads)))
    i = m.let(m.global_id().x, "i")
    d = m.var(vec4f, vec4f(0.0), "d") if w == 4 else m.var(f32, 0.0, "d")
    with m.if_(i < n // w):
        m.assign(d, widen(out[i]) - widen(want[i]))
        store_output(g, i, (2.0 / n) * d)
    (total,) = reduce_sum(m, [B.dot(d, d) if w == 4 else d * d], threads, False)
    with m.if_(m.local_index() == 0):
        partial[m.workgroup_id().x] = total


def _workgroup_fold(m, value, threads, combine, name):
    """Every thread's ``value`` folded over the workgroup with ``combine``; the
    result, in a let every thread sees."""
    tid = m.local_index()
    red = m.shared(f32, threads, name)
    red[tid] = value
    m.barrier()
    s = threads // 2
    while s > 0:
        with m.if_(tid < s):
            red[tid] = combine(red[tid], red[tid + s])
        m.barrier()
        s //= 2
    result = m.let(red[0], f"{name}_all")
    m.barrier()
    return result


def softmax_xent(m, classes, tokens, threads=64, dtype="f32", begin=None):
    """Softmax cross-entropy, one workgroup per token (grid tokens): the row's
    max and sum of exponentials by workgroup reductions, then every thread
    writes its columns of g; thread 0 writes the token's loss to ``losses``.
    ``begin``: see _begin."""
    check_threads(threads)
    _begin(m, begin)
    logits = m.declare_input_buffer("logits", storage_scalar(dtype), tokens * classes)
    labels = m.declare_input_buffer("labels", u32, tokens)
    g = m.declare_output_buffer("g", storage_scalar(dtype), tokens * classes)
    losses = m.declare_output_buffer("losses", f32, tokens)
    t = m.workgroup_id().x
    tid = m.local_index()
    row = m.let(t * classes, "row")
    best = m.var(f32, -3.4028234663852886e38, "best")
    with m.loop(tid, classes, threads, name="c") as c:
        m.assign(best, B.max(best, widen(logits[row + c])))
    top = _workgroup_fold(m, best, threads, B.max, "mx")
    total = m.var(f32, 0.0, "total")
    with m.loop(tid, classes, threads, name="c") as c:
        total += B.exp(widen(logits[row + c]) - top)
    norm = _workgroup_fold(m, total, threads, lambda a, b: a + b, "sum")
    label = m.let(labels[t], "label")
    valid = m.let(label < classes, "valid")  # else: g 0, and -1 - label as its loss
    with m.loop(tid, classes, threads, name="c") as c:
        p = m.let(B.exp(widen(logits[row + c]) - top) / norm, "p")
        hit = m.let(B.select(0.0, 1.0, c == label), "hit")
        store_output(g, row + c, B.select(0.0, (p - hit) * (1.0 / tokens), valid))
    with m.if_(tid == 0):
        loss = m.let(B.log(norm) - (widen(logits[row + B.min(label, classes - 1)]) - top), "loss")
        losses[t] = B.select(-1.0 - f32(label), loss, valid)
