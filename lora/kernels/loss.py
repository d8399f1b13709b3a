"""Losses on the GPU: each writes the gradient of the loss with respect to its
input and partial sums of the loss value, which the host adds up (in float64)
only when the value is asked for.

    mse:          L = mean((out - want)^2) over all N elements; g = 2 (out - want) / N
    softmax_xent: L = mean over tokens of -log softmax(logits)[label];
                  g = (softmax(logits) - onehot(label)) / tokens; a label
                  outside the classes gets g = 0 and -1 - label as its loss,
                  which the host reports when it reads the value; with
                  ``seen``, also kept per token until the host clears it;
                  with ``ignore`` (the causal LM), labels of IGNORE are
                  left out and the mean is over the labels counted
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import collectives, f16, f32, u32, vec4f, vec4h, vec4u

from .common import (
    b_row,
    check_threads,
    input_matrix,
    output_buffer,
    reduce_sum,
    row_element,
    store_output,
    token_count,
    token_rows,
    widen,
    width,
    workgroup_token,
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


IGNORE = 0xFFFFFFFF  # softmax_xent(ignore=True): a row without a label (the host's -100)


def softmax_xent(m, classes, tokens, threads=64, dtype="f32", begin=None, seen=False,
                 ignore=False, in_place=False, subgroups=False, grad_scale=1.0):
    """Softmax cross-entropy, one workgroup per token (grid (tokens, 1, 1)):
    each thread keeps a running max and sum of exponentials over its slice
    of the row (one read of it), the workgroup combines them (a max, then a
    sum of the rescaled sums), and every thread writes its columns of
    g = (softmax - onehot) / count; the thread holding the label's column
    writes the token's loss -log softmax[label] to ``losses``. Rows are read
    as vec4 where classes is a multiple of 4. ``begin``: see _begin.
    ``seen``: labels outside the classes are also kept in a sticky record
    (see _record_label). ``subgroups``: the reductions by subgroup operations.

    count is the token count, or with ``ignore`` (the causal LM's loss) the
    number of labels in the batch inside the classes, which each workgroup
    counts itself (no host write or read-back a step): a label of IGNORE
    (0xFFFFFFFF, the host's -100) gets g = 0 and loss 0, and the loss is
    sum(losses) / count. An all-ignored batch gives loss 0 and g = 0, where
    transformers gives nan. ``in_place``: g is written over the logits (the
    binding ``g`` goes), saving tokens x classes of memory. ``grad_scale``:
    g times it (a loss scale: f16's g of a large vocabulary, about
    1 / (vocab * count), is below f16's least value; the optimizer's
    scale_gradients undoes it)."""
    check_threads(threads)
    if seen and tokens is None:
        raise ValueError("softmax_xent: seen keeps a [3, tokens] record, so it needs the token "
                         "count baked in (tokens an int), got tokens=None")
    _begin(m, begin)
    w = width(classes)
    size = token_rows(tokens, classes)
    if in_place:
        logits = output_buffer(m, size, dtype, "logits", quad=w == 4)
        cn = classes // w
    else:
        logits, cn = input_matrix(m, "logits", tokens, classes, dtype)
    labels = m.declare_input_buffer("labels", u32, tokens)
    g = logits if in_place else output_buffer(m, size, dtype, "g", quad=w == 4)
    losses = m.declare_output_buffer("losses", f32, tokens)
    t = workgroup_token(m, tokens, "x")
    tid = m.local_index()
    row = m.let(t * cn, "row")
    top, norm, inv = _row_statistics(m, logits, row, cn, w, labels, classes, tokens, ignore,
                                     subgroups)
    if grad_scale != 1.0:
        inv = m.let(inv * float(grad_scale), "scaled")
    label = m.let(labels[t], "label")
    valid = m.let(label < classes, "valid")  # else: g 0, and -1 - label as its loss
    zero = vec4f(0.0) if w == 4 else 0.0
    with m.loop(tid, cn, threads, name="c") as c:
        v = m.let(widen(logits[row + c]), "v")
        p = m.let(B.exp(v - top) / norm, "p")
        store_output(g, row + c, B.select(zero, (p - _onehot(c, w, label)) * inv, valid))
        with m.if_(label / w == c):  # this thread holds the label's column (so it is valid)
            mine = v[label % w] if w == 4 else v
            losses[t] = B.log(norm) - (mine - top)
    with m.if_((tid == 0) & ~valid):
        bad = -1.0 - f32(label)
        losses[t] = B.select(bad, 0.0, label == IGNORE) if ignore else bad
    if seen:
        with m.if_(tid == 0):
            _record_label(m, tokens, t, label, (valid | (label == IGNORE)) if ignore else valid)


def _row_statistics(m, logits, row, cn, w, labels, classes, tokens, ignore, subgroups):
    """(the row's max, its sum of exp(logit - max), 1 / count) as lets every
    thread sees, from one read of the row: each thread rescales its running
    sum when its max grows; with ``ignore``, count is the labels inside the
    classes, counted with the sum's reduction."""
    threads = m.workgroup_size[0]
    tid = m.local_index()
    mx = m.var(f32, -3.4028234663852886e38, "mx")
    s = m.var(f32, 0.0, "s")
    with m.loop(tid, cn, threads, name="c") as c:
        v = m.let(widen(logits[row + c]), "v")
        most = B.max(B.max(v.x, v.y), B.max(v.z, v.w)) if w == 4 else v
        new = m.let(B.max(mx, most), "new")
        e = B.exp(v - new)
        m.assign(s, s * B.exp(mx - new) + (B.dot(e, vec4f(1.0)) if w == 4 else e))
        m.assign(mx, new)
    top = collectives.reduce(m, mx, "max", subgroups=subgroups, names="top")
    sums = [m.let(s * B.exp(mx - top), "mine")]
    n = token_count(m, tokens)
    if ignore:
        counted = m.var(f32, 0.0, "counted")
        with m.loop(tid, n, threads, name="u") as u:
            counted += B.select(0.0, 1.0, labels[u] < classes)
        sums.append(counted)
    norm, *count = collectives.reduce(m, sums, "sum", subgroups=subgroups,
                                      names=["norm", "count"][:len(sums)])
    if ignore:
        inv = m.let(B.select(0.0, 1.0 / count[0], count[0] > 0.0), "inv")
    else:
        inv = m.let(1.0 / f32(n), "inv") if tokens is None else 1.0 / tokens
    return top, norm, inv


def _onehot(c, w: int, label):
    """1.0 where element c (vec4 rows: elements 4c .. 4c + 3) is ``label``, else 0."""
    if w == 1:
        return B.select(0.0, 1.0, c == label)
    index = vec4u(c * 4, c * 4 + 1, c * 4 + 2, c * 4 + 3)
    return B.select(vec4f(0.0), vec4f(1.0), index == vec4u(label))


def _record_label(m, tokens, t, label, ok) -> None:
    """``seen`` u32 [3, tokens], column t written only by token t's thread 0
    (no atomics): row 0 counts the steps this token has seen, rows 1 and 2
    hold its first step with a label not ``ok`` since the host last cleared them (counted from
    1; 0: none) and that step's label. One dispatch a step, so the count is
    the step number without a host write."""
    seen = m.declare_output_buffer("seen", u32, 3 * tokens)
    step = m.let(seen[t] + 1, "step")
    seen[t] = step
    with m.if_(~ok & (seen[tokens + t] == 0)):
        seen[tokens + t] = step
        seen[2 * tokens + t] = label
