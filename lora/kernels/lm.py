"""The causal language model's kernels other than attention and the Linear
products (issue 42; the layout and numerics of docs/lm-contract): the token
embedding, RMSNorm and its gradient, rotary embeddings (and their transpose,
the backward), the SwiGLU product and its gradient, and the greedy argmax. The
loss is ``loss.softmax_xent`` with ``ignore=True``; the residual add is
``projections.add_scaled`` with ``y_dtype``.

Activations are row-major [tokens, width]; ``dtype`` is the storage type of a
kernel's activations ("f32" or "f16"), every sum and every transcendental is
f32. Rows are read and written as vec4 where their width is a multiple of 4.
``tokens=None`` reads the token count from the u32 uniform ``tokens`` at run
time (one pipeline for every count, the token axis of the grid split over z
past max-compute-workgroups-per-dimension: ``common.workgroup_token``).

Grids: ``embed``, ``rope``, ``swiglu`` and ``swiglu_grad`` run a thread per
element (a vec4 of them, a rotated pair of them for ``rope``) in workgroup
rows of ``threads`` along x and one workgroup row per token along y;
``rms_norm``, ``rms_norm_grad`` and ``argmax`` run one workgroup per token
(a row needs a reduction over its whole width).
"""
from __future__ import annotations

from shaderdsl import builtins as B
from shaderdsl import collectives, f16, f32, u32, vec4f, vec4h

from .common import (
    check_dtype,
    check_threads,
    dot_or_mul,
    input_matrix,
    output_buffer,
    store_output,
    token_rows,
    widen,
    width,
    workgroup_token,
)

NO_INDEX = 0xFFFFFFFF  # argmax: a thread that has seen no element yet
LEAST_F32 = -3.4028234663852886e38


def _row_threads(threads: int, subgroups: bool) -> None:
    """The row kernels reduce over the workgroup: a power of two (the trees halve it)."""
    check_threads(threads)
    if not isinstance(subgroups, bool):
        raise ValueError(f"subgroups must be a bool, got {subgroups!r}")


def _reduce(m, value, op: str, subgroups: bool, name: str):
    """``value`` combined by ``op`` over the workgroup: a let every thread reads."""
    return collectives.reduce(m, [value], op, subgroups=subgroups, names=[name])[0]


def _sizes(tokens, **sizes) -> None:
    """ValueError naming a size that is not a positive int (``tokens`` may be
    None: read at run time), before anything is built."""
    if tokens is not None:
        sizes["tokens"] = tokens
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _rounded(value, dtype: str):
    """``value`` (f32 or vec4<f32>) rounded to ``dtype`` and widened again: the
    value an f16 tensor would hold."""
    if dtype == "f32":
        return value
    return widen((vec4h if value.type == vec4f else f16)(value))


# ------------------------------------------------------------------ embedding

def embed(m, hidden, rows, tokens, dtype="f32", out_dtype="f32", first_row=0, id_offset=False):
    """x[t] = E[ids[offset + t] - first_row] for each token whose id falls in
    [first_row, first_row + rows) (grid (ceil(hidden / (w threads)), tokens)).

    ``E`` holds rows [first_row, first_row + rows) of the embedding, stored as
    ``dtype``; ``x`` [tokens, hidden] is stored as ``out_dtype`` (f32 for the
    residual stream even where E is f16). An embedding larger than the
    device's max-storage-buffer-binding-size is split by rows into chunks, one
    binding and one dispatch each: every dispatch writes only its own tokens,
    so together they write every token whose id is below the vocabulary
    (ids are checked on the host). ``id_offset``: ids are read from
    ``ids[offset[0] + t]``, ``offset`` a u32 storage buffer of one value (a
    decode step reads the ids the previous step's argmax wrote into a longer
    buffer, no read-back; decode_advance moves it on the GPU).
    """
    check_dtype(out_dtype)
    _sizes(tokens, hidden=hidden, rows=rows)
    if isinstance(first_row, bool) or not isinstance(first_row, int) or first_row < 0:
        raise ValueError(f"first_row must be an int >= 0, got {first_row!r}")
    w = width(hidden)
    E, hn = input_matrix(m, "E", None, hidden, dtype)  # runtime-sized: rows may be 10^5
    ids = m.declare_input_buffer("ids", u32, None if id_offset else tokens)
    x = output_buffer(m, token_rows(tokens, hidden), out_dtype, "x", quad=w == 4)
    offset = m.declare_input_buffer("offset", u32, 1)[0] if id_offset else 0
    t = workgroup_token(m, tokens, "y")
    c = m.let(m.global_id().x, "c")
    row = m.let(ids[offset + t] - first_row, "row")  # ids below first_row wrap past rows
    with m.if_((c < hn) & (row < rows)):
        store_output(x, t * hn + c, widen(E[row * hn + c]))


# ------------------------------------------------------------------ RMSNorm

def rms_norm(m, hidden, tokens, eps, dtype="f32", x_dtype="f32", w_dtype="f32", threads=64,
             subgroups=False):
    """LlamaRMSNorm, one workgroup per token (grid (tokens, 1, 1)):
    rstd[t] = 1 / sqrt(mean(x[t]^2) + eps) in f32, and y[t] = w * (x[t] rstd[t]),
    the normalized row rounded to ``x_dtype`` first as transformers casts it
    back to the input's dtype (a no-op for the f32 residual stream), y stored
    as ``dtype`` (f16 for the Linear that follows in f16 mode). ``rstd`` f32
    [tokens] is kept for the backward (rms_norm_grad). The workgroup reads
    its row twice (the second read from cache): once for the sum of
    squares, once to scale it."""
    _row_threads(threads, subgroups)
    check_dtype(dtype)
    _sizes(tokens, hidden=hidden)
    if not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        raise ValueError(f"eps must be a number in [0, 1), got {eps!r}")
    x, hn = input_matrix(m, "x", tokens, hidden, x_dtype)
    w, _ = input_matrix(m, "w", 1, hidden, w_dtype)
    y = output_buffer(m, token_rows(tokens, hidden), dtype, "y", quad=width(hidden) == 4)
    rstd = m.declare_output_buffer("rstd", f32, tokens)
    t = workgroup_token(m, tokens, "x")
    tid = m.local_index()
    row = m.let(t * hn, "row")
    acc = m.var(f32, 0.0, "acc")
    with m.loop(tid, hn, threads, name="c") as c:
        v = m.let(widen(x[row + c]), "v")
        acc += dot_or_mul(v, v)
    total = _reduce(m, acc, "sum", subgroups, "total")
    r = m.let(B.inverse_sqrt(total / float(hidden) + eps), "r")
    with m.if_(tid == 0):
        rstd[t] = r
    with m.loop(tid, hn, threads, name="c") as c:
        store_output(y, row + c, widen(w[c]) * _rounded(widen(x[row + c]) * r, x_dtype))


def rms_norm_grad(m, hidden, tokens, dtype="f32", x_dtype="f32", w_dtype="f32", threads=64,
                  subgroups=False, accumulate=True):
    """RMSNorm's input gradient ADDED to the residual stream's f32 gradient,
    one workgroup per token (grid (tokens, 1, 1)):
    dres[t] += rstd (w dy - xhat mean(xhat w dy)), xhat = x rstd, from dy
    (the gradient of y, stored as ``dtype``), x, w and the forward's rstd.
    The residual's gradient also flows straight past the norm, so the
    norm's part is added, not stored; ``accumulate=False`` stores it (the
    final norm's, where the residual's gradient starts). The weight is
    frozen: no dw."""
    _row_threads(threads, subgroups)
    _sizes(tokens, hidden=hidden)
    dy, hn = input_matrix(m, "dy", tokens, hidden, dtype)
    x, _ = input_matrix(m, "x", tokens, hidden, x_dtype)
    w, _ = input_matrix(m, "w", 1, hidden, w_dtype)
    rstd = m.declare_input_buffer("rstd", f32, tokens)
    dres = m.declare_output_buffer("dres", vec4f if width(hidden) == 4 else f32,
                                   token_rows(tokens, hn))
    t = workgroup_token(m, tokens, "x")
    tid = m.local_index()
    row = m.let(t * hn, "row")
    acc = m.var(f32, 0.0, "acc")
    with m.loop(tid, hn, threads, name="c") as c:
        acc += dot_or_mul(widen(x[row + c]), widen(w[c]) * widen(dy[row + c]))
    total = _reduce(m, acc, "sum", subgroups, "total")
    r = m.let(rstd[t], "r")
    k = m.let(r * total / float(hidden), "k")  # mean(xhat w dy) = rstd mean(x w dy)
    with m.loop(tid, hn, threads, name="c") as c:
        wdy = widen(w[c]) * widen(dy[row + c])
        part = r * (wdy - widen(x[row + c]) * r * k)
        if accumulate:
            dres[row + c] += part
        else:
            dres[row + c] = part


# ------------------------------------------------------------------ rotary embeddings

def rope(m, heads, head_dim, tokens, dtype="f32", inverse=False, kv_heads=0):
    """Rotary embeddings in place, transformers' apply_rotary_pos_emb:
    x' = x cos + rotate_half(x) sin per head, rotate_half(x) = cat(-x2, x1), at
    each token's position (u32 ``positions`` [tokens]); ``inverse``: the
    transpose (rotation by -angle), which is the backward: dx = dy cos +
    rotate_half^T(dy sin). ``q`` [tokens, heads * head_dim] (and with
    ``kv_heads`` also ``k`` [tokens, kv_heads * head_dim], in the same
    dispatch) stored as ``dtype``, rotated in f32. ``cosines``, ``sines``
    (cos and sin are WGSL's names): f32 [max_positions, head_dim / 2] (HF's
    cos is cat(freqs, freqs).cos(): one half-row serves both halves). A
    thread per pair (x1[j], x2[j]), a vec4 of pairs where head_dim / 2 is a
    multiple of 4 (grid (ceil((heads + kv_heads) head_dim / 2 / (w threads)),
    tokens))."""
    check_dtype(dtype)
    _sizes(tokens, heads=heads, head_dim=head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotate_half splits it), got {head_dim!r}")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 0:
        raise ValueError(f"kv_heads must be an int >= 0, got {kv_heads!r}")
    half = head_dim // 2
    w = width(half)
    hq = half // w  # items per half-head
    table = vec4f if w == 4 else f32
    cos = m.declare_input_buffer("cosines", table)
    sin = m.declare_input_buffer("sines", table)
    positions = m.declare_input_buffer("positions", u32, tokens)
    q = output_buffer(m, token_rows(tokens, heads * head_dim), dtype, "q", quad=w == 4)
    k = output_buffer(m, token_rows(tokens, kv_heads * head_dim), dtype, "k", quad=w == 4) \
        if kv_heads else None
    t = workgroup_token(m, tokens, "y")
    i = m.let(m.global_id().x, "i")
    p = m.let(positions[t] * hq, "p")

    def rotate(buf, n_heads, item):
        j = m.let(item % hq, "j")
        at = m.let(t * (n_heads * 2 * hq) + item / hq * (2 * hq) + j, "at")
        c, s = m.let(cos[p + j], "cs"), m.let(sin[p + j], "sn")
        x1, x2 = m.let(widen(buf[at]), "x1"), m.let(widen(buf[at + hq]), "x2")
        if inverse:
            y1, y2 = m.let(x1 * c + x2 * s, "y1"), m.let(x2 * c - x1 * s, "y2")
        else:
            y1, y2 = m.let(x1 * c - x2 * s, "y1"), m.let(x2 * c + x1 * s, "y2")
        store_output(buf, at, y1)
        store_output(buf, at + hq, y2)

    with m.if_(i < heads * hq):
        rotate(q, heads, i)
    if k is not None:
        with m.elif_(i < (heads + kv_heads) * hq):
            rotate(k, kv_heads, m.let(i - heads * hq, "ik"))


# ------------------------------------------------------------------ SwiGLU

def _sigmoid(m, z):
    return m.let(1.0 / (1.0 + B.exp(-z)), "sig")


def _elements(m, n, tokens):
    """(token, item index in its row, whether the thread has an item) of a
    thread-per-item kernel over rows of ``n`` items."""
    t = workgroup_token(m, tokens, "y")
    c = m.let(m.global_id().x, "c")
    return t, c, c < n


def residual(m, hidden, tokens, dtype="f32"):
    """out = x + y: the residual stream (x and out f32 [tokens, hidden]) past a
    block whose output y is stored as ``dtype`` (grid (ceil(hidden / (w
    threads)), tokens)); out is a buffer of its own, as the backward reads x."""
    _sizes(tokens, hidden=hidden)
    w = width(hidden)
    x, n = input_matrix(m, "x", tokens, hidden, "f32")
    y, _ = input_matrix(m, "y", tokens, hidden, dtype)
    out = output_buffer(m, token_rows(tokens, hidden), "f32", "out", quad=w == 4)
    t, c, inside = _elements(m, n, tokens)
    with m.if_(inside):
        j = m.let(t * n + c, "j")
        out[j] = x[j] + widen(y[j])


def swiglu(m, inter, tokens, dtype="f32"):
    """act = silu(gate) up (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)), f32
    math, gate, up and act [tokens, inter] stored as ``dtype`` (grid
    (ceil(inter / (w threads)), tokens))."""
    _sizes(tokens, inter=inter)
    w = width(inter)
    gate, n = input_matrix(m, "gate", tokens, inter, dtype)
    up, _ = input_matrix(m, "up", tokens, inter, dtype)
    act = output_buffer(m, token_rows(tokens, inter), dtype, "act", quad=w == 4)
    t, c, inside = _elements(m, n, tokens)
    with m.if_(inside):
        j = m.let(t * n + c, "j")
        z = m.let(widen(gate[j]), "z")
        store_output(act, j, z * _sigmoid(m, z) * widen(up[j]))


def swiglu_grad(m, inter, tokens, dtype="f32", in_place=False):
    """SwiGLU's gradients from d_act (the down_proj input gradient, read as
    stored): d_gate = d_act up silu'(gate), d_up = d_act silu(gate), with
    silu'(z) = s (1 + z (1 - s)), s = sigmoid(z); all [tokens, inter] stored
    as ``dtype``, f32 math (grid (ceil(inter / (w threads)), tokens)).
    ``in_place``: d_gate over gate and d_up over up (neither is needed after:
    the bindings ``d_gate`` and ``d_up`` go), saving two [tokens, inter]."""
    _sizes(tokens, inter=inter)
    w = width(inter)
    d_act, n = input_matrix(m, "d_act", tokens, inter, dtype)
    size = token_rows(tokens, inter)
    if in_place:
        gate = output_buffer(m, size, dtype, "gate", quad=w == 4)
        up = output_buffer(m, size, dtype, "up", quad=w == 4)
        d_gate, d_up = gate, up
    else:
        gate, _ = input_matrix(m, "gate", tokens, inter, dtype)
        up, _ = input_matrix(m, "up", tokens, inter, dtype)
        d_gate = output_buffer(m, size, dtype, "d_gate", quad=w == 4)
        d_up = output_buffer(m, size, dtype, "d_up", quad=w == 4)
    t, c, inside = _elements(m, n, tokens)
    with m.if_(inside):
        j = m.let(t * n + c, "j")
        z, u = m.let(widen(gate[j]), "z"), m.let(widen(up[j]), "u")
        da = m.let(widen(d_act[j]), "da")
        s = _sigmoid(m, z)
        store_output(d_gate, j, da * u * (s * (1.0 + z * (1.0 - s))))
        store_output(d_up, j, da * (z * s))


# ------------------------------------------------------------------ greedy decoding

def argmax(m, vocab, tokens, dtype="f32", threads=64, subgroups=False, ahead=0):
    """ids[offset + ahead + r] = the index of row r's largest logit, the FIRST index on
    ties (torch.argmax), one workgroup per row (grid (tokens, 1, 1)): each
    thread keeps its first largest element of a strided slice, then the
    workgroup takes the largest value (a max reduction) and the least index
    holding it (a min reduction). ``logits`` [tokens, vocab] stored as
    ``dtype``; ``ids`` u32 (runtime-sized) at ``offset`` (a u32 storage buffer of
    one value, which decode_advance moves on the GPU) plus ``ahead``, so
    decode writes the next step's ids where its embedding reads them, with no
    read-back. NaN logits are not ranked as torch ranks them; a row of -inf
    gives 0, as torch does."""
    _row_threads(threads, subgroups)
    _sizes(tokens, vocab=vocab)
    logits, vn = input_matrix(m, "logits", tokens, vocab, dtype)
    ids = m.declare_output_buffer("ids", u32)
    offset = m.let(m.declare_input_buffer("offset", u32, 1)[0] + ahead, "offset")
    t = workgroup_token(m, tokens, "x")
    tid = m.local_index()
    w = vocab // vn
    row = m.let(t * vn, "row")
    best = m.var(f32, LEAST_F32, "best")
    at = m.var(u32, NO_INDEX, "at")
    with m.loop(tid, vn, threads, name="c") as c:
        v = m.let(widen(logits[row + c]), "v")
        for q in range(w):
            vq = getattr(v, "xyzw"[q]) if w == 4 else v
            with m.if_((vq > best) | (at == NO_INDEX)):  # a later equal value keeps the first
                m.assign(best, vq)
                m.assign(at, c * w + q)
    top = _reduce(m, best, "max", subgroups, "top")
    mine = m.let(B.select(NO_INDEX, at, (best == top) & (at != NO_INDEX)), "mine")
    first = _reduce(m, mine, "min", subgroups, "first")
    with m.if_(tid == 0):
        ids[offset + t] = B.select(first, u32(0), first == NO_INDEX)



# ------------------------------------------------------------------ the KV cache

def kv_write(m, batch, rows, kv_len, width, dtype="f32"):
    """cache[b, past + i] = src[b, i] for i < rows: a step's keys or values (rows
    per sequence, RoPE already applied to keys) written into a KV cache of
    kv_len rows per sequence at the run-time position ``past`` (u32 [1], the
    attention kernel's), grid (ceil(width / threads), batch * rows). Rows past
    kv_len are not written (the host checks past + rows <= kv_len)."""
    _sizes(None, batch=batch, rows=rows, kv_len=kv_len, width=width)
    src, wn = input_matrix(m, "src", batch * rows, width, dtype)
    past = m.declare_input_buffer("past", u32, 1)
    cache = output_buffer(m, batch * kv_len * width, dtype, "cache", quad=wn != width)
    r, c = m.let(m.workgroup_id().y, "r"), m.let(m.global_id().x, "c")
    at = m.let(past[0] + r % rows, "at")
    with m.if_((c < wn) & (at < kv_len)):
        cache[((r / rows) * kv_len + at) * wn + c] = src[r * wn + c]


def last_rows(m, batch, seq, width):
    """dst[b] = src[b, seq - 1]: each sequence's last row of an f32 [batch * seq,
    width] matrix (the hidden states the LM head needs after a prefill), grid
    (ceil(width / threads), batch)."""
    _sizes(None, batch=batch, seq=seq, width=width)
    src, wn = input_matrix(m, "src", batch * seq, width, "f32")
    dst = output_buffer(m, batch * width, "f32", "dst", quad=wn != width)
    b, c = m.let(m.workgroup_id().y, "b"), m.let(m.global_id().x, "c")
    with m.if_(c < wn):
        dst[b * wn + c] = src[(b * seq + seq - 1) * wn + c]


def decode_advance(m, batch):
    """past += 1, positions[b] += 1 and offset += batch (one workgroup, a thread
    per sequence): the next decode step's place in the KV cache, its tokens'
    RoPE positions and where its ids are read, advanced on the GPU, so the
    steps are all alike (several in one submit, or one captured graph replayed)."""
    _sizes(None, batch=batch)
    past = m.declare_output_buffer("past", u32, 1)
    positions = m.declare_output_buffer("positions", u32, batch)
    offset = m.declare_output_buffer("offset", u32, 1)
    i = m.let(m.local_index(), "i")
    with m.if_(i < batch):
        positions[i] += 1
    with m.if_(i == 0):
        past[0] += 1
        offset[0] += batch
