"""Causal self-attention of the language model, in the flash-attention form.

Layout (the LM contract): q [batch * q_len, heads * head_dim]; k and v
[batch * kv_len, kv_heads * head_dim], the step's own or a KV cache whose rows
hold kv_len positions per sequence; keep u32 [batch * kv_len] (1: a real
token, 0: padding); past u32 [1]. Query i of a sequence sits at position
past + i and sees key j iff j <= past + i and keep[j] = 1; query head h reads
kv head h // (heads // kv_heads) (transformers' repeat_kv). A score is
scale * q . k with scale = head_dim ** -0.5 (transformers' ``scaling``).
lse is f32 [batch * heads * q_len], element (b * heads + h) * q_len + i; the
backward's stats are vec2<f32> of the same count, (lse, delta) of each row.

No [q_len, kv_len] matrix exists anywhere: a workgroup owns a few rows (it
accumulates them in registers) and steps over blocks of the other side staged
in workgroup memory, within WebGPU's defaults (16 KiB, 256 invocations), so
the kernels run in a browser too. Each step has three phases between
barriers: every (row, staged row) pair's score by any thread (a dot product
of two staged rows), then per-row work, then each row's ``lanes`` threads
accumulate their vec4s of it. Softmax and every sum are f32; q, k, v, o and
the gradients are stored as ``dtype``.

* ``attention``: o and lse by the online softmax over blocks of keys (one
  kernel for training, prefill and decode: past is read at run time).
* ``attention_delta``: delta = rowsum(do * o), written beside a copy of lse
  as the backward's stats (one binding for both: grad_kv then binds 8
  storage buffers, WebGPU's default maxStorageBuffersPerShaderStage).
* ``attention_grad_kv``: dk and dv, a workgroup per block of keys of a kv
  head, stepping over the group's query heads and blocks of queries (so each
  kv head's gradient sums its query heads without atomics).
* ``attention_grad_q``: dq, a workgroup per block of queries, stepping over keys.

The backward recomputes the probabilities p = exp(s - lse) (training: past =
0, q_len = kv_len = seq).

Staged rows are padded to an odd length (``padded``) so that the threads of
a dot product, which read one column of different rows, meet different
banks; ``pad=False`` (each kernel's parameter) stages them unpadded, as
before, for ``bench --attention`` to time beside.
"""
from __future__ import annotations

from dataclasses import dataclass

from shaderdsl import builtins as B
from shaderdsl import f16, f32, u32, vec2f, vec4f, vec4h

from .common import (
    SHARED_FLOATS,
    ceil_div,
    check_dtype,
    dot_or_mul,
    store_output,
    sum_terms,
    unrolled_or_loop,
    widen,
    width,
)

MASKED = -1.0e30      # a hidden key's score: finite (WGSL may assume no infinities), below any
NO_KEY_LSE = 1.0e30   # the lse of a query that sees no key: exp(s - lse) = 0 for every score
MAX_THREADS = 256     # WebGPU's default maxComputeInvocationsPerWorkgroup
STEPS = (32, 16, 8, 4, 2, 1)   # staged rows per step, largest first
ROW_TARGETS = (16, 8, 4, 2, 1)  # owned rows per workgroup, largest first
KINDS = ("forward", "grad_q", "grad_kv")


@dataclass(frozen=True)
class Tiling:
    """A workgroup's split of its work. It owns ``rows`` rows, accumulated in
    registers by ``lanes`` threads each (a thread every lanes-th vec4 of its
    row), and stages ``step`` rows of the other side per step. The forward and
    grad_q own query rows, block_q queries x the ``group`` query heads of one
    kv head (row r: query r // group, head r % group of the group), so each
    staged key serves every head that reads it; grad_kv owns block_k keys and
    steps over block_q queries of one head at a time."""

    kind: str
    block_q: int
    block_k: int
    group: int
    lanes: int
    pad: bool = True   # staged rows padded (padded()); False: as before, for bench --attention

    @property
    def rows(self) -> int:
        return self.block_k if self.kind == "grad_kv" else self.block_q * self.group

    @property
    def step(self) -> int:
        return self.block_q if self.kind == "grad_kv" else self.block_k

    @property
    def threads(self) -> int:
        return self.rows * self.lanes

    def shared_floats(self, head_dim: int) -> int:
        """Workgroup memory the kernel declares, in f32s (rows padded: padded())."""
        r, s = self.rows, self.step
        d = padded(head_dim // width(head_dim), self.pad) * width(head_dim)
        if self.kind == "forward":  # q rows, k and v steps, scores, a value per row
            return (r + 2 * s) * d + r * padded(s, self.pad) + r
        if self.kind == "grad_q":   # q and do rows, k and v steps, dS, lse and delta per row
            return 2 * (r + s) * d + r * s + 2 * r
        return 2 * (r + s) * d + 2 * r * s + 2 * s  # grad_kv: k, v rows; q, do; P, dS; lse, delta

    def fits(self, head_dim: int) -> bool:
        return 0 < self.threads <= MAX_THREADS and self.shared_floats(head_dim) <= SHARED_FLOATS

    def grid(self, batch: int, kv_heads: int, q_len: int, kv_len: int) -> tuple[int, int, int]:
        """(blocks of owned rows, kv heads, sequences)."""
        owned = ceil_div(kv_len, self.block_k) if self.kind == "grad_kv" else \
            ceil_div(q_len, self.block_q)
        return owned, kv_heads, batch


def check_shape(heads, kv_heads, head_dim, q_len, kv_len) -> None:
    """Positive ints, and whole groups of query heads per kv head."""
    dims = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_len=q_len, kv_len=kv_len)
    bad = {k: v for k, v in dims.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"attention: expected positive ints, got {bad}")
    if heads % kv_heads:
        raise ValueError(f"attention: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")


def tiling(kind, heads, kv_heads, head_dim, q_len, kv_len, block_q=0, block_k=0,
           threads=0, pad=True) -> Tiling:
    """The tiling of ``kind`` (one of KINDS): block_q, block_k and threads
    where given (nonzero), the rest the largest that fit WebGPU's defaults:
    staged steps of at least 8 rows first, then the most owned rows (up to
    16), then the longest step; blocks no longer than q_len and kv_len, and
    at most one thread per vec4 of a row."""
    check_shape(heads, kv_heads, head_dim, q_len, kv_len)
    if kind not in KINDS:
        raise ValueError(f"attention tiling: kind must be one of {KINDS}, got {kind!r}")
    group, vecs = heads // kv_heads, head_dim // width(head_dim)
    options = []
    for target in ROW_TARGETS:
        for step in STEPS:
            bq, bk = (step, target) if kind == "grad_kv" else (max(1, target // group), step)
            t = Tiling(kind, block_q or min(bq, q_len), block_k or min(bk, kv_len), group, 1,
                       pad)
            lanes = threads // t.rows if threads else max(1, min(vecs, MAX_THREADS // t.rows))
            if not threads or threads == t.rows * lanes:
                options.append(Tiling(kind, t.block_q, t.block_k, group, lanes, pad))
    fitting = [t for t in options if t.fits(head_dim)]
    if not fitting:
        raise ValueError(f"attention ({kind}): no tiling of head_dim {head_dim} with "
                         f"block_q={block_q or 'any'}, block_k={block_k or 'any'}, "
                         f"threads={threads or 'any'} fits {SHARED_FLOATS * 4} bytes of workgroup "
                         f"memory and {MAX_THREADS} threads (threads must be a multiple of the "
                         f"owned rows)")
    return max(fitting, key=lambda t: (min(t.step, 8), t.rows, t.step))


# ------------------------------------------------------------------ shared pieces

def padded(n: int, pad: bool = True) -> int:
    """A staged row's length: n, or n + 1 where n is even. Threads that read
    one column of consecutive rows (a dot product's k_j, a row owner's
    scores) then meet rows that start in different banks: at head_dim 64 a
    row of 16 vec4s put every row of a warp's reads in the same four banks,
    an 8-way conflict on each of the dot products' loads."""
    return n + 1 if pad and n % 2 == 0 else n


def row_tile(m, t, rows: int, head_dim: int, name: str):
    """A workgroup array of ``rows`` staged rows (row_type), padded where t.pad."""
    vecs = head_dim // width(head_dim)
    return m.shared(row_type(head_dim), (rows, padded(vecs, t.pad)), name)


def row_type(head_dim: int):
    """What a row is staged and accumulated in: vec4s where head_dim allows, else f32s."""
    return vec4f if width(head_dim) == 4 else f32


def zero_row(head_dim: int):
    return vec4f(0.0) if width(head_dim) == 4 else f32(0.0)


def storage_matrix(m, name, rows, heads, head_dim, dtype, output=False):
    """A [rows, heads * head_dim] matrix stored as ``dtype``, in vec4s where head_dim allows."""
    check_dtype(dtype)
    w = width(head_dim)
    elem = {("f32", 4): vec4f, ("f32", 1): f32, ("f16", 4): vec4h, ("f16", 1): f16}[dtype, w]
    declare = m.declare_output_buffer if output else m.declare_input_buffer
    return declare(name, elem, rows * heads * head_dim // w)


def _each(m, count, threads, body, name, cost=4):
    """body(e) for this thread's items e = local_index + k * threads < count."""
    unrolled_or_loop(m, m.local_index(), count, threads, cost, body, name)


def _stage(m, tile, count, vecs, threads, load):
    """tile[r, c] = load(r, c) for r < count, c < vecs (each a row's vec4 or f32)."""
    def body(e):
        r, c = m.let(e / vecs, "sr"), m.let(e % vecs, "sc")
        tile[r, c] = load(r, c)
    _each(m, count * vecs, threads, body, "se")


def _stage_values(m, tile, count, threads, load):
    """tile[i] = load(i) for i < count (one f32 per row: lse, delta)."""
    def body(i):
        tile[i] = load(i)
    _each(m, count, threads, body, "sv")


def _row_of(buf, token, heads, head, vecs, c, valid, head_dim):
    """Element c of one head's row of ``buf`` (widened), zero where not ``valid``
    (``token`` is clamped inside the buffer by the caller)."""
    return B.select(zero_row(head_dim), widen(buf[(token * heads + head) * vecs + c]), valid)


def _dot(m, a, i, b, j, vecs, name):
    """sum_c a[i, c] . b[j, c] over the vec4s of two staged rows, in f32."""
    return m.let(sum_terms([dot_or_mul(a[i, c], b[j, c]) for c in range(vecs)]), name)


class Lanes:
    """This thread's share of an owned row: row = local_index / lanes, and the
    vec4s lane, lane + lanes, ... of it (``cols``: their indices, clamped for
    reads where lanes does not divide the row; ``store`` writes only those
    inside it)."""

    def __init__(self, m, t, vecs: int):  # t: any tiling with lanes
        lid = m.local_index()
        self.row = m.let(lid / t.lanes, "row")
        lane = m.let(lid % t.lanes, "lane")
        self.count, self.vecs, self.lanes = ceil_div(vecs, t.lanes), vecs, t.lanes
        self.unclamped = [lane + k * t.lanes for k in range(self.count)]
        self.cols = [m.let(B.min(c, vecs - 1) if self.partial(k) else c, f"col{k}")
                     for k, c in enumerate(self.unclamped)]

    def partial(self, k: int) -> bool:
        return (k + 1) * self.lanes > self.vecs

    def accumulators(self, m, head_dim, name):
        return [m.var(row_type(head_dim), zero_row(head_dim), f"{name}{k}")
                for k in range(self.count)]

    def store(self, m, k, write) -> None:
        """write() for the k-th vec4 where it is inside the row."""
        if self.partial(k):
            with m.if_(self.unclamped[k] < self.vecs):
                write()
        else:
            write()


class QueryRows:
    """The owned query rows of a workgroup (x: block of queries, y: kv head,
    z: sequence): row r is query q0 + r // group of head kvh * group + r % group,
    for r < t.rows; ``capacity`` rows are computed (more where a matrix
    fragment holds them: those past t.rows are not valid)."""

    def __init__(self, m, t, heads: int, q_len: int, capacity: int = 0):
        wid = m.workgroup_id()
        self.t, self.heads, self.q_len = t, heads, q_len
        self.capacity = capacity or t.rows
        self.q0 = m.let(wid.x * t.block_q, "q0")
        self.kvh, self.b = m.let(wid.y, "kvh"), m.let(wid.z, "b")
        self.last = m.let(B.min(self.q0 + t.block_q, q_len) - 1, "last")  # the block's last query

    def query(self, r):
        return self.q0 + r / self.t.group

    def head(self, r):
        return self.kvh * self.t.group + r % self.t.group

    def token(self, r):
        """The row's token, clamped inside the batch (rows past q_len read the last)."""
        return self.b * self.q_len + B.min(self.query(r), self.q_len - 1)

    def valid(self, r):
        inside = self.query(r) < self.q_len
        return inside if self.capacity == self.t.rows else inside & (r < self.t.rows)

    def value_index(self, r):
        """Its element of lse and stats."""
        return (self.b * self.heads + self.head(r)) * self.q_len + B.min(self.query(r),
                                                                         self.q_len - 1)

    def stage(self, m, tile, buf, head_dim):
        vecs = head_dim // width(head_dim)
        _stage(m, tile, self.t.rows, vecs, self.t.threads,
               lambda r, c: _row_of(buf, self.token(r), self.heads, self.head(r), vecs, c,
                                    self.valid(r), head_dim))


def visible(keep, b, kv_len, key, position):
    """Whether ``key`` exists, is real and is at most ``position`` (the query's)."""
    real = keep[b * kv_len + B.min(key, kv_len - 1)] != 0
    return (key <= position) & (key < kv_len) & real


def _stage_keys(m, tiles, bufs, b, kvh, kv_heads, kv_len, j0, count, threads, head_dim):
    """tiles[k][r] = key row j0 + r of kv head kvh of each buffer (zero past kv_len)."""
    vecs = head_dim // width(head_dim)
    for tile, buf in zip(tiles, bufs):
        _stage(m, tile, count, vecs, threads,
               lambda r, c, buf=buf: _row_of(buf, b * kv_len + B.min(j0 + r, kv_len - 1),
                                             kv_heads, kvh, vecs, c, j0 + r < kv_len, head_dim))


# ------------------------------------------------------------------ the forward

def attention(m, batch, heads, kv_heads, head_dim, q_len, kv_len, dtype="f32", block_q=0,
              block_k=0, threads=0, pad=True):
    """o = softmax(scale q k^T, masked) v and lse per query row, by the online
    softmax over blocks of block_k keys (FlashAttention).

    Grid (ceil(q_len / block_q), kv_heads, batch); bindings q, k, v, keep,
    past (u32 [1], read at run time: decode advances it without a new
    pipeline) -> o, lse. A workgroup owns block_q queries of the group's heads
    that share one kv head, so each staged key block serves all of them; it
    steps only over the keys its last query sees. Per step: scores into
    workgroup memory; each row's owner takes their max, rescales its running
    sum and turns them into probabilities; the row's lanes rescale and add p v.
    A query that sees no key gets o = 0 and lse = NO_KEY_LSE.

    Decode (q_len = 1) runs batch * kv_heads workgroups, each looping over
    all past + 1 keys. Splitting the keys over workgroups (flash-decoding:
    each split writes its (max, sum, o) and a second pass merges them) would
    multiply that parallelism by the number of splits where batch * kv_heads
    workgroups leave most of a GPU idle, and shorten the serial chain per
    token from past / block_k steps to past / (block_k * splits).
    """
    t = tiling("forward", heads, kv_heads, head_dim, q_len, kv_len, block_q, block_k, threads,
               pad)
    vecs = head_dim // width(head_dim)
    q = storage_matrix(m, "q", batch * q_len, heads, head_dim, dtype)
    k = storage_matrix(m, "k", batch * kv_len, kv_heads, head_dim, dtype)
    v = storage_matrix(m, "v", batch * kv_len, kv_heads, head_dim, dtype)
    keep = m.declare_input_buffer("keep", u32, batch * kv_len)
    past = m.declare_input_buffer("past", u32, 1)
    o = storage_matrix(m, "o", batch * q_len, heads, head_dim, dtype, output=True)
    lse = m.declare_output_buffer("lse", f32, batch * heads * q_len)
    qs, ks = row_tile(m, t, t.rows, head_dim, "qs"), row_tile(m, t, t.block_k, head_dim, "ks")
    vs = row_tile(m, t, t.block_k, head_dim, "vs")
    scores = m.shared(f32, (t.rows, padded(t.block_k, t.pad)), "scores")
    per_row = m.shared(f32, t.rows, "per_row")  # each step's rescale, then 1 / the row's sum
    rows, lanes = QueryRows(m, t, heads, q_len), Lanes(m, t, vecs)
    rows.stage(m, qs, q, head_dim)
    p0 = m.let(past[0], "p0")
    key_end = m.let(B.min(p0 + rows.last + 1, kv_len), "key_end")
    top = m.var(f32, MASKED, "top")     # the owner's running max and sum of its row
    total = m.var(f32, 0.0, "total")
    acc = lanes.accumulators(m, head_dim, "acc")
    with m.loop((key_end + t.block_k - 1) / t.block_k, name="kb") as kb:
        j0 = m.let(kb * t.block_k, "j0")
        _stage_keys(m, (ks, vs), (k, v), rows.b, rows.kvh, kv_heads, kv_len, j0, t.block_k,
                    t.threads, head_dim)
        m.barrier()
        _scores(m, t, qs, ks, scores, vecs, rows, keep, kv_len, j0, p0, head_dim)
        m.barrier()
        with m.if_(m.local_index() < t.rows):
            _online_softmax(m, t, scores, per_row, top, total)
        m.barrier()
        _add_pv(m, t, lanes, acc, scores, vs, per_row)
        m.barrier()
    finish_forward(m, rows, lanes, acc, lse, o, per_row, top, total, vecs)


def _scores(m, t, qs, ks, scores, vecs, rows, keep, kv_len, j0, p0, head_dim):
    """scores[r, j] = scale q_r . k_j where visible, else MASKED."""
    def body(e):
        r, j = m.let(e / t.block_k, "r"), m.let(e % t.block_k, "j")
        s = _dot(m, qs, r, ks, j, vecs, "s")
        seen = visible(keep, rows.b, kv_len, j0 + j, p0 + rows.query(r))
        scores[r, j] = B.select(f32(MASKED), s * head_dim ** -0.5, seen)
    _each(m, t.rows * t.block_k, t.threads, body, "e", vecs + 4)


def _online_softmax(m, t, scores, per_row, top, total):
    """The row owner's step: the new max over its row's scores, the rescale
    of what came before (per_row), the scores turned into probabilities."""
    r = m.let(m.local_index(), "r")
    block_max = m.var(f32, MASKED, "block_max")
    with m.loop(t.block_k, name="j") as j:
        m.assign(block_max, B.max(block_max, scores[r, j]))
    new_top = m.let(B.max(top, block_max), "new_top")
    rescale = m.let(B.exp(top - new_top), "rescale")
    added = m.var(f32, 0.0, "added")
    with m.loop(t.block_k, name="j") as j:
        s = m.let(scores[r, j], "s")
        p = m.let(B.select(0.0, B.exp(s - new_top), s > MASKED), "p")
        scores[r, j] = p
        added += p
    m.assign(total, total * rescale + added)
    m.assign(top, new_top)
    per_row[r] = rescale


def _add_pv(m, t, lanes, acc, probs, vs, per_row):
    """acc = acc * rescale + sum_j p[row, j] v_j over this thread's vec4s."""
    rescale = m.let(per_row[lanes.row], "rescale")
    for a in acc:
        m.assign(a, a * rescale)
    with m.loop(t.block_k, name="j") as j:
        p = m.let(probs[lanes.row, j], "p")
        for a, c in zip(acc, lanes.cols):
            a += p * vs[j, c]


def finish_forward(m, rows, lanes, acc, lse, o, per_row, top, total, vecs):
    """lse = max + log(sum) and o = acc / sum; NO_KEY_LSE and 0 where no key
    was seen (a seen row's sum is at least 1: its max's own term). The
    owners are threads 0.. of the rows' capacity."""
    with m.if_(m.local_index() < rows.capacity):
        r = m.let(m.local_index(), "r")
        seen = m.let(total > 0.0, "seen")
        with m.if_(rows.valid(r)):
            lse[rows.value_index(r)] = B.select(f32(NO_KEY_LSE), top + B.log(B.max(total, 1.0)),
                                                seen)
        per_row[r] = B.select(0.0, 1.0 / B.max(total, 1.0), seen)
    m.barrier()
    inverse = m.let(per_row[lanes.row], "inverse")
    row = lanes.row
    with m.if_(rows.valid(row)):
        base = m.let((rows.token(row) * rows.heads + rows.head(row)) * vecs, "base")
        for k, a in enumerate(acc):
            lanes.store(m, k, lambda a=a, k=k: store_output(o, base + lanes.cols[k], a * inverse))


# ------------------------------------------------------------------ the backward

def attention_delta(m, batch, heads, head_dim, seq, dtype="f32"):
    """stats[e] = (lse[e], delta) with delta = sum_d do[t, h, d] o[t, h, d] for
    e = (b * heads + h) * seq + i, t = b * seq + i: the backward's D =
    rowsum(dO o) in f32, beside the row's lse. Grid ceil(batch * heads * seq
    / threads); bindings dout, o, lse -> stats (vec2<f32>). A thread per
    (row, head), consecutive threads on consecutive heads of a token, so that
    a warp's reads of do and o are one stretch of memory (threads taken in
    stats' order were a row of heads * head_dim apart); the sum is one
    head's head_dim values, too short to share."""
    vecs = head_dim // width(head_dim)
    do = storage_matrix(m, "dout", batch * seq, heads, head_dim, dtype)
    o = storage_matrix(m, "o", batch * seq, heads, head_dim, dtype)
    lse = m.declare_input_buffer("lse", f32, batch * heads * seq)
    stats = m.declare_output_buffer("stats", vec2f, batch * heads * seq)
    e = m.let(m.global_id().x, "e")   # token * heads + head
    with m.if_(e < batch * heads * seq):
        token, h = m.let(e / heads, "token"), m.let(e % heads, "h")
        at = m.let((token / seq * heads + h) * seq + token % seq, "at")
        base = m.let(e * vecs, "base")
        acc = m.var(f32, 0.0, "acc")
        with m.loop(vecs, name="c") as c:
            acc += dot_or_mul(widen(do[base + c]), widen(o[base + c]))
        stats[at] = vec2f(lse[at], acc)


def _grad_inputs(m, batch, heads, kv_heads, head_dim, seq, dtype):
    """The backward's bindings: q, k, v, dout (the gradient of o), stats, keep."""
    q = storage_matrix(m, "q", batch * seq, heads, head_dim, dtype)
    k = storage_matrix(m, "k", batch * seq, kv_heads, head_dim, dtype)
    v = storage_matrix(m, "v", batch * seq, kv_heads, head_dim, dtype)
    do = storage_matrix(m, "dout", batch * seq, heads, head_dim, dtype)
    stats = m.declare_input_buffer("stats", vec2f, batch * heads * seq)
    keep = m.declare_input_buffer("keep", u32, batch * seq)
    return q, k, v, do, stats, keep


def _probability_and_grad(m, qs, ks, dos, vs, i, j, vecs, lse_i, delta_i, seen, head_dim):
    """(p, dS) of one (query, key) pair: p = exp(scale q.k - lse) where
    visible (else 0), dS = p (do . v - delta)."""
    s = _dot(m, qs, i, ks, j, vecs, "s")
    p = m.let(B.select(0.0, B.exp(s * head_dim ** -0.5 - lse_i), seen), "p")
    dp = _dot(m, dos, i, vs, j, vecs, "dp")
    return p, p * (dp - delta_i)


def attention_grad_kv(m, batch, heads, kv_heads, head_dim, seq, dtype="f32", block_q=0,
                      block_k=0, threads=0, pad=True):
    """dk = scale sum dS^T q and dv = sum P^T do, summed over the query heads
    that share each kv head (training: past = 0, q_len = kv_len = seq).

    Grid (ceil(seq / block_k), kv_heads, batch); bindings q, k, v, dout,
    stats, keep -> dk, dv. A workgroup owns block_k keys of one kv head (its
    k and v rows staged once, its dk and dv in registers) and steps over the
    group's query heads and the blocks of block_q queries that see its keys
    (those from its first key on): no float atomics, each gradient written once.
    """
    t = tiling("grad_kv", heads, kv_heads, head_dim, seq, seq, block_q, block_k, threads, pad)
    vecs = head_dim // width(head_dim)
    q, k, v, do, stats, keep = _grad_inputs(m, batch, heads, kv_heads, head_dim, seq, dtype)
    dk = storage_matrix(m, "dk", batch * seq, kv_heads, head_dim, dtype, output=True)
    dv = storage_matrix(m, "dv", batch * seq, kv_heads, head_dim, dtype, output=True)
    ks, vs = row_tile(m, t, t.block_k, head_dim, "ks"), row_tile(m, t, t.block_k, head_dim, "vs")
    qs, dos = row_tile(m, t, t.block_q, head_dim, "qs"), row_tile(m, t, t.block_q, head_dim, "dos")
    probs = m.shared(f32, (t.block_q, t.block_k), "probs")
    grads = m.shared(f32, (t.block_q, t.block_k), "grads")
    lses, deltas = m.shared(f32, t.block_q, "lses"), m.shared(f32, t.block_q, "deltas")
    wid = m.workgroup_id()
    j0, kvh, b = m.let(wid.x * t.block_k, "j0"), m.let(wid.y, "kvh"), m.let(wid.z, "b")
    _stage_keys(m, (ks, vs), (k, v), b, kvh, kv_heads, seq, j0, t.block_k, t.threads, head_dim)
    lanes = Lanes(m, t, vecs)
    dk_acc, dv_acc = lanes.accumulators(m, head_dim, "dk"), lanes.accumulators(m, head_dim, "dv")
    with m.loop(t.group, name="g") as g:
        h = m.let(kvh * t.group + g, "h")
        with m.loop(j0 / t.block_q, ceil_div(seq, t.block_q), name="qb") as qb:
            i0 = m.let(qb * t.block_q, "i0")
            _stage_queries(m, t, (qs, dos), (q, do), (lses, deltas), stats, b, h, heads, seq,
                           i0, head_dim)
            m.barrier()

            def pair(e):
                i, j = m.let(e / t.block_k, "i"), m.let(e % t.block_k, "j")
                seen = (i0 + i < seq) & visible(keep, b, seq, j0 + j, i0 + i)
                p, ds = _probability_and_grad(m, qs, ks, dos, vs, i, j, vecs, lses[i],
                                              deltas[i], seen, head_dim)
                probs[i, j] = p
                grads[i, j] = ds
            _each(m, t.block_q * t.block_k, t.threads, pair, "e", 2 * vecs + 6)
            m.barrier()
            with m.loop(t.block_q, name="i") as i:
                p, ds = m.let(probs[i, lanes.row], "p"), m.let(grads[i, lanes.row], "ds")
                for k_, c in enumerate(lanes.cols):
                    dv_acc[k_] += p * dos[i, c]
                    dk_acc[k_] += ds * qs[i, c]
            m.barrier()
    key = lanes.row
    with m.if_(j0 + key < seq):
        base = m.let(((b * seq + j0 + key) * kv_heads + kvh) * vecs, "base")
        for k_ in range(lanes.count):
            def write(k_=k_):
                store_output(dk, base + lanes.cols[k_], dk_acc[k_] * head_dim ** -0.5)
                store_output(dv, base + lanes.cols[k_], dv_acc[k_])
            lanes.store(m, k_, write)


def _stage_queries(m, t, tiles, bufs, value_tiles, stats, b, h, heads, seq, i0, head_dim):
    """Query rows i0.. of head h: q and do rows into ``tiles``, lse and delta
    (stats) into ``value_tiles`` (zeros past seq, and lse NO_KEY_LSE there)."""
    vecs = head_dim // width(head_dim)
    for tile, buf in zip(tiles, bufs):
        _stage(m, tile, t.block_q, vecs, t.threads,
               lambda r, c, buf=buf: _row_of(buf, b * seq + B.min(i0 + r, seq - 1), heads, h,
                                             vecs, c, i0 + r < seq, head_dim))
    for tile, part, outside in zip(value_tiles, "xy", (NO_KEY_LSE, 0.0)):
        _stage_values(m, tile, t.block_q, t.threads,
                      lambda i, part=part, outside=outside: B.select(
                          f32(outside),
                          getattr(stats[(b * heads + h) * seq + B.min(i0 + i, seq - 1)], part),
                          i0 + i < seq))


def attention_grad_q(m, batch, heads, kv_heads, head_dim, seq, dtype="f32", block_q=0,
                     block_k=0, threads=0, pad=True):
    """dq = scale sum_j dS_ij k_j (training: past = 0, q_len = kv_len = seq).

    Grid (ceil(seq / block_q), kv_heads, batch); bindings q, k, v, dout,
    stats, keep -> dq. A workgroup owns block_q queries of the group's heads
    that share a kv head (q, do, lse and delta staged once, dq in registers)
    and steps over the blocks of block_k keys its last query sees,
    recomputing p and dS there (the grad_kv kernel has them too; sharing
    them would take a [seq, seq] buffer or float atomics)."""
    t = tiling("grad_q", heads, kv_heads, head_dim, seq, seq, block_q, block_k, threads, pad)
    vecs = head_dim // width(head_dim)
    q, k, v, do, stats, keep = _grad_inputs(m, batch, heads, kv_heads, head_dim, seq, dtype)
    dq = storage_matrix(m, "dq", batch * seq, heads, head_dim, dtype, output=True)
    qs, dos = row_tile(m, t, t.rows, head_dim, "qs"), row_tile(m, t, t.rows, head_dim, "dos")
    ks, vs = row_tile(m, t, t.block_k, head_dim, "ks"), row_tile(m, t, t.block_k, head_dim, "vs")
    grads = m.shared(f32, (t.rows, t.block_k), "grads")
    lses, deltas = m.shared(f32, t.rows, "lses"), m.shared(f32, t.rows, "deltas")
    rows, lanes = QueryRows(m, t, heads, seq), Lanes(m, t, vecs)
    rows.stage(m, qs, q, head_dim)
    rows.stage(m, dos, do, head_dim)
    for tile, part, outside in ((lses, "x", NO_KEY_LSE), (deltas, "y", 0.0)):
        _stage_values(m, tile, t.rows, t.threads, lambda r, part=part, outside=outside: B.select(
            f32(outside), getattr(stats[rows.value_index(r)], part), rows.valid(r)))
    acc = lanes.accumulators(m, head_dim, "acc")
    with m.loop((rows.last + t.block_k) / t.block_k, name="kb") as kb:
        j0 = m.let(kb * t.block_k, "j0")
        _stage_keys(m, (ks, vs), (k, v), rows.b, rows.kvh, kv_heads, seq, j0, t.block_k,
                    t.threads, head_dim)
        m.barrier()

        def pair(e):
            r, j = m.let(e / t.block_k, "r"), m.let(e % t.block_k, "j")
            seen = rows.valid(r) & visible(keep, rows.b, seq, j0 + j, rows.query(r))
            grads[r, j] = _probability_and_grad(m, qs, ks, dos, vs, r, j, vecs, lses[r],
                                                deltas[r], seen, head_dim)[1]
        _each(m, t.rows * t.block_k, t.threads, pair, "e", 2 * vecs + 6)
        m.barrier()
        with m.loop(t.block_k, name="j") as j:
            ds = m.let(grads[lanes.row, j], "ds")
            for a, c in zip(acc, lanes.cols):
                a += ds * ks[j, c]
        m.barrier()
    row = lanes.row
    with m.if_(rows.valid(row)):
        base = m.let((rows.token(row) * heads + rows.head(row)) * vecs, "base")
        for k_, a in enumerate(acc):
            lanes.store(m, k_, lambda a=a, k_=k_: store_output(dq, base + lanes.cols[k_],
                                                                a * head_dim ** -0.5))
