"""Losses on the GPU: each writes the gradient of the loss with respect to its
input and partial sums of the loss value, which the host adds up (in float64)
only when the value is asked for.

    mse:          L = mean((out - want)^2) over all N elements; g = 2 (out - want) / N
    softmax_xent: L = mean over tokens of -log softmax(logits)[label];
                  g = (softmax(logits) - onehot(label)) / tokens; a label
                  outside the classes gets g = 0 and -1 - label as its loss,
                  which the host reports when it reads the value; with
                  ``seen``, also kept per token until the host clears it
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import f16, f32, u32, vec4f, vec4h

from .common import (
    b_row,
    check_threads,
    input_matrix,
    output_buffer,
    reduce_sum,
    row_element,
    storage_scalar,
    store_output,
    widen,
    width,
)
from .optimizer import advance, state_buffers


def _begin(m, schedule) -> None:
    """With ``schedule`` (not None): the optimizer's begin (optimizer.advance,
    no clipping) by the dispatch's first thread, one dispatch fewer a step."""
    if schedule is not None:
        state, hyper = state_buffers(m)
        with m.if_(m.global_id().x == 0):
            advance(m, state, hyper, schedule)


def mse(m, n, threads=256, dtype="f32", begin=None, dh_rank=0, dh_scale=1.0, subgroups=False):
    """g = 2 (out - want) / n, a vec4 per thread where n is a multiple of 4,
    else one element (grid ceil(n / (w threads))); each workgroup writes the
    sum of its squared errors to ``partial``. ``begin``: see _begin. With
    ``dh_rank`` (one token: n is out_dim), each workgroup also writes its
    part of the backward's dh = dh_scale g B (B [n, dh_rank], g as stored)
    to ``dh`` [workgroups, dh_rank]: one dispatch fewer a step. ``subgroups``:
    the workgroup sums by subgroup operations (one barrier, not a tree)."""
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
    sums = [B.dot(d, d) if w == 4 else d * d]
    if dh_rank:
        sums += _dh_terms(m, n, w, dh_rank, dtype, (2.0 / n) * d)
        dh = m.declare_output_buffer("dh", f32, -(-n // (w * threads)) * dh_rank)
    total, *dh_sums = reduce_sum(m, sums, threads, subgroups)
    with m.if_(m.local_index() == 0):
        partial[m.workgroup_id().x] = total
        for r, value in enumerate(dh_sums):
            dh[m.workgroup_id().x * dh_rank + r] = dh_scale * value


def _dh_terms(m, n, w, rank, dtype, grad) -> list:
    """This thread's terms of sum_o g[o] B[o, r] for every r: its ``w`` values
    of g (``grad``, rounded as g is stored; zero past the end) times their
    rows of B."""
    Bm, _ = input_matrix(m, "B", n, rank, dtype)
    stored = widen((vec4h if w == 4 else f16)(grad)) if dtype == "f16" else grad
    i = m.global_id().x
    terms = [0.0] * rank
    for q in range(w):
        gq = m.let(getattr(stored, "xyzw"[q]) if w == 4 else stored, f"g{q}")
        row = b_row(m, Bm, B.min(i * w + q, n - 1), rank)
        for r in range(rank):
            terms[r] = terms[r] + gq * row_element(row, r)
    return terms


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


def softmax_xent(m, classes, tokens, threads=64, dtype="f32", begin=None, seen=False):
    """Softmax cross-entropy, one workgroup per token (grid tokens): the row's
    max and sum of exponentials by workgroup reductions, then every thread
    writes its columns of g; thread 0 writes the token's loss to ``losses``.
    ``begin``: see _begin. ``seen``: labels outside the classes are also kept
    in a sticky record (see _record_label)."""
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
        if seen:
            _record_label(m, tokens, t, label, valid)


def _record_label(m, tokens, t, label, valid) -> None:
    """``seen`` u32 [3, tokens], column t written only by token t's thread 0
    (no atomics): row 0 counts the steps this token has seen, rows 1 and 2
    hold its first bad step since the host last cleared them (counted from
    1; 0: none) and that step's label. One dispatch a step, so the count is
    the step number without a host write."""
    seen = m.declare_output_buffer("seen", u32, 3 * tokens)
    step = m.let(seen[t] + 1, "step")
    seen[t] = step
    with m.if_(~valid & (seen[tokens + t] == 0)):
        seen[tokens + t] = step
        seen[2 * tokens + t] = label
