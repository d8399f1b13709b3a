"""The attention backward on matrix units: f16 storage, f16 16x16x16
subgroup matrices into f32 (FlashAttention-2's backward), split as the SIMT
kernels of lora.kernels.attention split it (same bindings, layout and masks):

* ``attention_matrix_grad_kv``: a workgroup owns 16 keys per subgroup of one
  kv head (each subgroup its own 16: K and V as left fragments in registers,
  dK and dV accumulated in fragments) and steps over the group's query heads
  and the blocks of ``step`` queries that see its keys. Per step each
  subgroup computes S^T = K Q^T and dP^T = V dO^T into workgroup memory (f32),
  its lanes P^T = exp(scale S^T - lse) and dS^T = P^T (dP^T - delta) in f32
  (written as f16), then dV += P^T dO and dK += dS^T Q on fragments.
* ``attention_matrix_grad_q``: a workgroup owns 16 query rows per subgroup
  (block_q queries x the group's heads sharing a kv head, as the forward
  packs them; Q and dO as left fragments) and steps over blocks of ``step``
  keys: S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.

The stepped rows (Q and dO, or K and V) are staged as f16 in two copies: a
step's global reads are issued before its products and land in the other
copy while the lanes compute P and dS, so a step has two barriers (after
the first products, after the element-wise phase), and the reads' latency
hides behind the products. Every staged row is padded by 8 f16 (16 bytes)
and every f32 row by 4 f32, so that a fragment's rows start in different
banks. P and dS are rounded to f16 for the products (as FlashAttention's
fp16 kernels do); every exp, sum and the accumulators stay f32.

Workgroup memory (shared_bytes) is chosen within the device's limit (16 KiB,
WebGPU's default, unless the device grants more): ``grad_tiling`` picks the
most subgroups and the longest step that fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from shaderdsl import builtins as B
from shaderdsl import f16, f32, u32, vec2f, vec4f, vec4h

from .attention import NO_KEY_LSE, QueryRows, check_shape, storage_matrix
from .common import ceil_div
from .matrix import FRAGMENT

F = FRAGMENT.m                          # 16: the fragments' M, N and K
SUBGROUP = FRAGMENT.subgroup_sizes[0]   # 32
PAD16 = 8   # f16 elements after each staged row (16 bytes)
PAD32 = 4   # f32 elements after each row of S and dP (16 bytes)
KINDS = ("grad_kv", "grad_q")
DEFAULT_LIMIT = 16384   # WebGPU's default maxComputeWorkgroupStorageSize
SUBGROUP_CHOICES = (4, 2, 1)
STEP_CHOICES = (32, 16)


@dataclass(frozen=True)
class GradTiling:
    """``subgroups`` of SUBGROUP threads, each owning F rows (grad_kv: keys;
    grad_q: query rows); ``step`` rows of the other side staged per step."""

    kind: str
    subgroups: int
    step: int
    group: int
    head_dim: int

    @property
    def threads(self) -> int:
        return self.subgroups * SUBGROUP

    @property
    def owned(self) -> int:
        return self.subgroups * F

    @property
    def block_q(self) -> int:
        return self.step if self.kind == "grad_kv" else self.owned // self.group

    @property
    def block_k(self) -> int:
        return self.owned if self.kind == "grad_kv" else self.step

    @property
    def rows(self) -> int:
        """Owned rows in use (grad_q: block_q queries x the group's heads)."""
        return self.owned if self.kind == "grad_kv" else self.block_q * self.group

    @property
    def stride(self) -> int:
        """Elements per staged f16 row."""
        return self.head_dim + PAD16

    def shared_bytes(self) -> int:
        """Two copies of the stepped rows (two tensors, f16); per subgroup S and
        dP (f32) and P^T and dS^T (grad_kv) or dS (f16); lse and delta (f32)."""
        staged = 2 * 2 * self.step * self.stride * 2
        scores = 2 * F * (self.step + PAD32) * 4
        halves = (2 if self.kind == "grad_kv" else 1) * F * (self.step + PAD16) * 2
        values = 2 * 2 * self.step * 4 if self.kind == "grad_kv" else 2 * self.owned * 4
        return staged + self.subgroups * (scores + halves) + values

    def grid(self, batch: int, kv_heads: int, seq: int) -> tuple[int, int, int]:
        owned = self.block_k if self.kind == "grad_kv" else self.block_q
        return ceil_div(seq, owned), kv_heads, batch


def grad_tiling(kind, heads, kv_heads, head_dim, seq, limit=DEFAULT_LIMIT, subgroups=0,
                step=0) -> GradTiling:
    """The tiling of ``kind`` (grad_kv or grad_q): ``subgroups`` and ``step``
    where given (nonzero), else the most subgroups (up to 4), then the
    longest step (32 or 16), whose workgroup memory fits ``limit`` bytes.
    Raises ValueError where none fits or the shape cannot run on fragments."""
    check_shape(heads, kv_heads, head_dim, seq, seq)
    if kind not in KINDS:
        raise ValueError(f"attention matrix backward: kind must be one of {KINDS}, got {kind!r}")
    group = heads // kv_heads
    if head_dim % F:
        raise ValueError(f"attention matrix backward: head_dim ({head_dim}) must be a multiple "
                         f"of {F}, the fragments' size")
    if step and step not in STEP_CHOICES:
        raise ValueError(f"attention matrix backward: step must be one of {STEP_CHOICES} (a "
                         f"multiple of {F} dividing the subgroup's {SUBGROUP} lanes), got {step}")
    options = [GradTiling(kind, s, k, group, head_dim)
               for s in ((subgroups,) if subgroups else SUBGROUP_CHOICES)
               for k in ((step,) if step else STEP_CHOICES)]
    # the owned rows are staged once through the two copies of the stepped rows
    fitting = [t for t in options if t.shared_bytes() <= limit and t.owned <= 2 * t.step
               and (kind == "grad_kv" or group <= t.owned)]
    if not fitting:
        raise ValueError(f"attention matrix backward ({kind}): no tiling of head_dim "
                         f"{head_dim}, group {group} with subgroups={subgroups or 'any'}, "
                         f"step={step or 'any'} fits {limit} bytes of workgroup memory (the "
                         f"owned rows, 16 a subgroup, must be at most twice the step)")
    return fitting[0]


# ------------------------------------------------------------------ shared pieces

class Staged:
    """Two tensors' rows staged as f16 in two copies of ``step`` rows each
    (the first 2 * step rows also stage the owned rows once, before the loop)."""

    def __init__(self, m, t: GradTiling, names):
        self.t, self.vecs = t, t.head_dim // 4
        self.tiles = [m.shared(f16, 2 * t.step * t.stride, name) for name in names]

    def fetch(self, m, bufs, count, row_of):
        """This lane's share of ``count`` rows of each of ``bufs``, read now into
        registers: per buffer [(row, column, vec4h, inside)]; row_of(r) gives
        (the index of the row's first vec4 in the buffer, whether it exists:
        zeros where not). ``inside`` is None where every lane has an item."""
        lid, items, threads = m.local_index(), count * self.vecs, self.t.threads
        out = []
        for buf in bufs:
            held = []
            for k in range(ceil_div(items, threads)):
                raw = m.let(lid + k * threads, "fe")
                inside = raw < items if (k + 1) * threads > items else None
                e = m.let(B.min(raw, items - 1), "fc") if inside is not None else raw
                r, c = m.let(e / self.vecs, "fr"), m.let(e % self.vecs, "fq")
                first, valid = row_of(r)
                held.append((r, c, m.let(B.select(vec4h(0.0), buf[first + c], valid), "fv"),
                             inside))
            out.append(held)
        return out

    def store(self, m, fetched, copy) -> None:
        """What fetch read, into rows copy * step + r of each tile."""
        for tile, held in zip(self.tiles, fetched):
            for r, c, value, inside in held:
                at = m.let((copy * self.t.step + r) * self.t.stride + c * 4, "sa")
                if inside is None:
                    _store_halves(tile, at, value)
                else:
                    with m.if_(inside):
                        _store_halves(tile, at, value)

    def owned_fragments(self, m, sg, name):
        """Each tile's F rows of subgroup sg (staged at rows sg * F) as left
        fragments, one per F columns of head_dim."""
        left = FRAGMENT.types()[0]
        return [[m.let(B.subgroup_matrix_load(left, tile, sg * F * self.t.stride + d,
                                              self.t.stride), f"{name}{i}_{d // F}")
                 for d in range(0, self.t.head_dim, F)] for i, tile in enumerate(self.tiles)]


def _store_halves(tile, at, value) -> None:
    for i, lane in enumerate("xyzw"):
        tile[at + i] = getattr(value, lane)


class Values:
    """lse and delta of ``count`` query rows (stats' two halves), staged as f32
    (NO_KEY_LSE and 0 where a row does not exist), in ``copies`` copies."""

    def __init__(self, m, t: GradTiling, count: int, copies: int):
        self.t, self.count = t, count
        self.lse = m.shared(f32, copies * count, "lses")
        self.delta = m.shared(f32, copies * count, "deltas")

    def fetch(self, m, stats, index_of):
        """[(row, vec2f (lse, delta), inside)] for this lane; index_of(i) gives
        (the row's element of stats, whether it exists)."""
        lid, threads, held = m.local_index(), self.t.threads, []
        for k in range(ceil_div(self.count, threads)):
            raw = m.let(lid + k * threads, "ve")
            i = m.let(B.min(raw, self.count - 1), "vi")
            at, valid = index_of(i)
            value = m.let(B.select(vec2f(NO_KEY_LSE, 0.0), stats[at], valid), "vv")
            held.append((i, value, raw < self.count if (k + 1) * threads > self.count else None))
        return held

    def store(self, m, held, copy) -> None:
        for i, value, inside in held:
            def put(i=i, value=value):
                at = m.let(copy * self.count + i, "va")
                self.lse[at] = value.x
                self.delta[at] = value.y
            if inside is None:
                put()
            else:
                with m.if_(inside):
                    put()


def _products_t(m, t, sg, lefts, tile, copy, out) -> None:
    """out[sg] = L R^T, F x step: L the subgroup's left fragments (one per F
    columns of head_dim), R the ``step`` rows of ``copy`` of the staged
    ``tile``, read column-major (as its transpose); out f32, row stride
    step + PAD32."""
    _, right, result = FRAGMENT.types()
    base, stride = m.let(copy * t.step * t.stride, "rb"), t.step + PAD32
    for f in range(t.step // F):
        acc = m.var(result, name="st_acc")
        for i, lf in enumerate(lefts):
            rf = B.subgroup_matrix_load_col_major(right, tile, base + f * F * t.stride + i * F,
                                                  t.stride)
            m.assign(acc, B.subgroup_matrix_multiply_accumulate(lf, rf, acc))
        B.subgroup_matrix_store(out, sg * F * stride + f * F, acc, stride)


def _accumulate(m, t, sg, pairs, copy) -> None:
    """For each (halves, tile, accs) of ``pairs``: accs[d] += H R[:, dF..],
    H the subgroup's F x step block of ``halves`` (f16), R the step rows of
    ``copy`` of the staged ``tile``."""
    left, right, _ = FRAGMENT.types()
    base, hstride = m.let(copy * t.step * t.stride, "ab"), t.step + PAD16
    for f in range(t.step // F):
        for halves, tile, accs in pairs:
            hf = m.let(B.subgroup_matrix_load(left, halves, sg * F * hstride + f * F, hstride),
                       "hf")
            for d, acc in enumerate(accs):
                rf = B.subgroup_matrix_load(right, tile, base + f * F * t.stride + d * F,
                                            t.stride)
                m.assign(acc, B.subgroup_matrix_multiply_accumulate(hf, rf, acc))


class Elements:
    """This lane's elements (r, c) of its subgroup's F x step block:
    consecutive lanes take consecutive columns, so with a step dividing
    SUBGROUP a lane keeps one column c (its query in grad_kv, its key in
    grad_q: one lse or keep read a step) and the rows r = lane / step + k
    SUBGROUP / step, the same at every step (what depends on them alone is
    read once, before the loop)."""

    def __init__(self, m, t, sg):
        lane = m.let(m.local_index() % SUBGROUP, "lane")
        self.c = m.let(lane % t.step, "ec")
        self.rows = [m.let(lane / t.step + k * (SUBGROUP // t.step), f"er{k}")
                     for k in range(F * t.step // SUBGROUP)]
        self.at32 = [m.let((sg * F + r) * (t.step + PAD32) + self.c, f"e32_{k}")
                     for k, r in enumerate(self.rows)]
        self.at16 = [m.let((sg * F + r) * (t.step + PAD16) + self.c, f"e16_{k}")
                     for k, r in enumerate(self.rows)]
        self.keys: list = []   # grad_kv: the rows' keys (_real_keys)


def _write_out(m, t, sg, outputs, scratch, write) -> None:
    """Each accumulator of ``outputs`` [(fragments, scale, out)] through an f32
    array of ``scratch`` (one each) to write(out, r, q, vec4f): row r of the
    subgroup's F, vec4 q of head_dim's."""
    stride = t.step + PAD32
    lane = m.let(m.local_index() % SUBGROUP, "wl")
    for d in range(t.head_dim // F):
        for (accs, _, _), tile in zip(outputs, scratch):
            B.subgroup_matrix_store(tile, sg * F * stride, accs[d], stride)
        m.barrier()
        for (_, scale, out), tile in zip(outputs, scratch):
            for k in range(F * F // 4 // SUBGROUP):
                e = m.let(lane + k * SUBGROUP, "we")
                r, q = m.let(e / 4, "wr"), m.let(e % 4, "wq")
                at = m.let((sg * F + r) * stride + q * 4, "wa")
                value = vec4f(tile[at], tile[at + 1], tile[at + 2], tile[at + 3])
                write(out, r, d * (F // 4) + q, value * scale)
        m.barrier()


def _grad_inputs(m, batch, heads, kv_heads, head_dim, seq):
    """The backward's bindings (as the SIMT kernels'): q, k, v, dout, stats, keep."""
    q = storage_matrix(m, "q", batch * seq, heads, head_dim, "f16")
    k = storage_matrix(m, "k", batch * seq, kv_heads, head_dim, "f16")
    v = storage_matrix(m, "v", batch * seq, kv_heads, head_dim, "f16")
    do = storage_matrix(m, "dout", batch * seq, heads, head_dim, "f16")
    stats = m.declare_input_buffer("stats", vec2f, batch * heads * seq)
    keep = m.declare_input_buffer("keep", u32, batch * seq)
    return q, k, v, do, stats, keep


def _score_arrays(m, t, names):
    """Per subgroup F x step f32 arrays (S, dP) and f16 ones (P, dS)."""
    f32s = [m.shared(f32, t.subgroups * F * (t.step + PAD32), n) for n in names[0]]
    f16s = [m.shared(f16, t.subgroups * F * (t.step + PAD16), n) for n in names[1]]
    return f32s, f16s


# ------------------------------------------------------------------ dK and dV

def attention_matrix_grad_kv(m, batch, heads, kv_heads, head_dim, seq, limit=DEFAULT_LIMIT,
                             subgroups=0, step=0):
    """dk and dv (as attention_grad_kv, f16) on matrix units. Grid
    (ceil(seq / (16 subgroups)), kv_heads, batch); bindings q, k, v, dout,
    stats, keep -> dk, dv. ``limit``: the device's workgroup memory in bytes."""
    t = grad_tiling("grad_kv", heads, kv_heads, head_dim, seq, limit, subgroups, step)
    vecs, result = head_dim // 4, FRAGMENT.types()[2]
    q, k, v, do, stats, keep = _grad_inputs(m, batch, heads, kv_heads, head_dim, seq)
    dk = storage_matrix(m, "dk", batch * seq, kv_heads, head_dim, "f16", output=True)
    dv = storage_matrix(m, "dv", batch * seq, kv_heads, head_dim, "f16", output=True)
    staged, values = Staged(m, t, ("qs", "dos")), Values(m, t, t.step, 2)
    (st, dpt), (pt, dst) = _score_arrays(m, t, (("st", "dpt"), ("pt", "dst")))
    wid = m.workgroup_id()
    j0, kvh, b = m.let(wid.x * t.block_k, "j0"), m.let(wid.y, "kvh"), m.let(wid.z, "b")
    sg = m.let(m.local_index() / SUBGROUP, "sg")
    staged.store(m, staged.fetch(m, (k, v), t.owned, lambda r: (
        ((b * seq + B.min(j0 + r, seq - 1)) * kv_heads + kvh) * vecs, j0 + r < seq)), 0)
    m.barrier()
    kf, vf = staged.owned_fragments(m, sg, "kv")
    m.barrier()
    first = m.let(j0 / t.step * t.step, "first")   # the queries from the block of key j0 on
    blocks = m.let((seq - first + t.step - 1) / t.step, "blocks")
    total = m.let(blocks * t.group, "total")

    def fetch(n):
        """Step n's query rows (head g = n / blocks of the group), read now."""
        h = m.let(kvh * t.group + n / blocks, "h")
        i0 = m.let(first + n % blocks * t.step, "i0")
        rows = staged.fetch(m, (q, do), t.step, lambda r: (
            ((b * seq + B.min(i0 + r, seq - 1)) * heads + h) * vecs, i0 + r < seq))
        return rows, values.fetch(m, stats, lambda i: (
            (b * heads + h) * seq + B.min(i0 + i, seq - 1), i0 + i < seq))

    _store_step(m, staged, values, fetch(m.let(u32(0), "n0")), 0)
    m.barrier()
    elements = Elements(m, t, sg)
    real = _real_keys(m, elements, keep, b, seq, j0, sg)
    dk_acc = [m.var(result, name=f"dk{d}") for d in range(head_dim // F)]
    dv_acc = [m.var(result, name=f"dv{d}") for d in range(head_dim // F)]
    with m.loop(total, name="n") as n:
        cur = m.let(n % 2, "cur")
        following = fetch(m.let(B.min(n + 1, total - 1), "nn"))
        _products_t(m, t, sg, kf, staged.tiles[0], cur, st)     # S^T = K Q^T
        _products_t(m, t, sg, vf, staged.tiles[1], cur, dpt)    # dP^T = V dO^T
        m.barrier()
        i0 = m.let(first + n % blocks * t.step, "qi0")
        _kv_elements(m, t, (st, dpt, pt, dst), values, cur, elements, real, seq, i0,
                     head_dim ** -0.5)
        _store_step(m, staged, values, following, 1 - cur)
        m.barrier()
        _accumulate(m, t, sg, ((pt, staged.tiles[1], dv_acc), (dst, staged.tiles[0], dk_acc)),
                    cur)

    def write(out, r, c, value):
        key = m.let(j0 + sg * F + r, "key")
        with m.if_(key < seq):
            out[((b * seq + key) * kv_heads + kvh) * vecs + c] = vec4h(value)
    _write_out(m, t, sg, ((dk_acc, head_dim ** -0.5, dk), (dv_acc, 1.0, dv)), (st, dpt), write)


def _store_step(m, staged, values, fetched, copy) -> None:
    """A step's fetched rows and values (grad_kv's fetch) into ``copy``."""
    rows, held = fetched
    staged.store(m, rows, copy)
    values.store(m, held, copy)


def _kv_elements(m, t, arrays, values, cur, e, real, seq, i0, scale) -> None:
    """P^T = exp(scale S^T - lse) where key row r (real[k]: it exists and is
    kept; its key e.keys[k]) is seen by query i0 + c (else 0), and dS^T = P^T
    (dP^T - delta), from f32 into f16."""
    st, dpt, pt, dst = arrays
    query = m.let(i0 + e.c, "query")
    inside = m.let(query < seq, "inside")
    vi = m.let(cur * t.step + e.c, "vi")
    lse, delta = m.let(values.lse[vi], "lse"), m.let(values.delta[vi], "delta")
    for k, (at32, at16) in enumerate(zip(e.at32, e.at16)):
        seen = inside & real[k] & (e.keys[k] <= query)
        p = m.let(B.select(0.0, B.exp(st[at32] * scale - lse), seen), "p")
        pt[at16] = f16(p)
        dst[at16] = f16(p * (dpt[at32] - delta))


def _real_keys(m, e, keep, b, seq, j0, sg):
    """Each of the lane's rows' key (e.keys) and whether it exists and is kept."""
    e.keys = [m.let(j0 + sg * F + r, f"key{k}") for k, r in enumerate(e.rows)]
    return [m.let((key < seq) & (keep[b * seq + B.min(key, seq - 1)] != 0), f"real{k}")
            for k, key in enumerate(e.keys)]


# ------------------------------------------------------------------ dQ

def attention_matrix_grad_q(m, batch, heads, kv_heads, head_dim, seq, limit=DEFAULT_LIMIT,
                            subgroups=0, step=0):
    """dq (as attention_grad_q, f16) on matrix units. Grid (ceil(seq /
    block_q), kv_heads, batch); bindings q, k, v, dout, stats, keep -> dq."""
    t = grad_tiling("grad_q", heads, kv_heads, head_dim, seq, limit, subgroups, step)
    vecs, result = head_dim // 4, FRAGMENT.types()[2]
    q, k, v, do, stats, keep = _grad_inputs(m, batch, heads, kv_heads, head_dim, seq)
    dq = storage_matrix(m, "dq", batch * seq, heads, head_dim, "f16", output=True)
    staged, values = Staged(m, t, ("ks", "vs")), Values(m, t, t.owned, 1)
    (st, dpt), (dss,) = _score_arrays(m, t, (("st", "dpt"), ("dss",)))
    rows = QueryRows(m, t, heads, seq, capacity=t.owned)
    sg = m.let(m.local_index() / SUBGROUP, "sg")
    staged.store(m, staged.fetch(m, (q, do), t.owned, lambda r: (
        (rows.token(r) * heads + rows.head(r)) * vecs, rows.valid(r))), 0)
    values.store(m, values.fetch(m, stats, lambda r: (rows.value_index(r), rows.valid(r))), 0)
    m.barrier()
    qf, dof = staged.owned_fragments(m, sg, "qo")
    m.barrier()
    blocks = m.let((rows.last + t.step) / t.step, "blocks")   # the keys up to the last query

    def fetch(n):
        j = m.let(n * t.step, "kj0")
        return staged.fetch(m, (k, v), t.step, lambda r: (
            ((rows.b * seq + B.min(j + r, seq - 1)) * kv_heads + rows.kvh) * vecs, j + r < seq))

    staged.store(m, fetch(m.let(u32(0), "n0")), 0)
    m.barrier()
    elements = Elements(m, t, sg)
    dq_acc = [m.var(result, name=f"dq{d}") for d in range(head_dim // F)]
    with m.loop(blocks, name="n") as n:
        cur = m.let(n % 2, "cur")
        following = fetch(m.let(B.min(n + 1, blocks - 1), "nn"))
        _products_t(m, t, sg, qf, staged.tiles[0], cur, st)     # S = Q K^T
        _products_t(m, t, sg, dof, staged.tiles[1], cur, dpt)   # dP = dO V^T
        m.barrier()
        _q_elements(m, t, sg, (st, dpt, dss), values, rows, elements, keep, seq,
                    m.let(n * t.step, "j0"), head_dim ** -0.5)
        staged.store(m, following, 1 - cur)
        m.barrier()
        _accumulate(m, t, sg, ((dss, staged.tiles[0], dq_acc),), cur)

    def write(out, r, c, value):
        row = m.let(sg * F + r, "row")
        with m.if_(rows.valid(row)):
            out[(rows.token(row) * heads + rows.head(row)) * vecs + c] = vec4h(value)
    _write_out(m, t, sg, ((dq_acc, head_dim ** -0.5, dq),), (st,), write)


def _q_elements(m, t, sg, arrays, values, rows, e, keep, seq, j0, scale) -> None:
    """dS = P (dP - delta) with P = exp(scale S - lse) where query row sg F + r
    sees key j0 + c (else 0), from f32 into f16."""
    st, dpt, dss = arrays
    key = m.let(j0 + e.c, "key")
    real = m.let((key < seq) & (keep[rows.b * seq + B.min(key, seq - 1)] != 0), "real")
    for r, at32, at16 in zip(e.rows, e.at32, e.at16):
        row = m.let(sg * F + r, "row")
        seen = real & rows.valid(row) & (key <= rows.query(row))
        p = m.let(B.select(0.0, B.exp(st[at32] * scale - values.lse[row]), seen), "p")
        dss[at16] = f16(p * (dpt[at32] - values.delta[row]))
