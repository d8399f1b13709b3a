"""The attention forward on matrix units: f16 storage, f16 16x16x16 subgroup
matrices with f32 results (the H200's), the online softmax in f32. The
language model does not run it: on the H100 under Dawn it took 561 / 826 us
at SmolLM2's / Qwen2.5's 8 x 512 where the padded SIMT forward took 403 / 544
(docs/benchmarks.md, round 5; its four barriers a step and the row owners'
softmax between the products are the suspects, note 54). Benched by
``python -m lora bench --attention``.

``attention_matrix`` computes what lora.kernels.attention's ``attention``
computes (same bindings, layout, masks, o and lse) for f16 storage, with its
two products on fragments. A workgroup owns one fragment of 16 rows (block_q
queries x the group's heads sharing a kv head: decode fills group of them)
and steps over blocks of block_k keys:

* Q's fragments are loaded once (staged through workgroup memory) and held
  in registers for every step;
* S = Q K^T: each subgroup multiplies its fragments of the block's keys
  (K staged row-major, read as column-major right fragments), into f32;
* the row owners scale and mask S, take the online softmax step and write
  P rounded to f16 (as FlashAttention's fp16 kernels do; the row sum stays
  f32), and each row's rescale;
* P V: each subgroup multiplies its fragments of head_dim into f32, which
  leave through workgroup memory: an accumulator fragment cannot be scaled
  row by row, so each row's lanes keep o in f32 registers and add
  rescale * o + (P V) per step, as the SIMT kernel does.

Four barriers per step; no barrier after the last phase, since what the next
step writes first (K and V) was last read before the barrier after P V.
Workgroup memory stays within WebGPU's default 16 KiB (head_dim up to 64 at
block_k 32, up to 112 at 16); where a shape does not fit, or head_dim or
block_k is not a multiple of 16, the SIMT kernel is the one to use.
"""
from __future__ import annotations

from dataclasses import dataclass

from shaderdsl import builtins as B
from shaderdsl import f16, f32, u32, vec4f, vec4h

from .attention import (
    MASKED,
    Lanes,
    QueryRows,
    check_shape,
    finish_forward,
    storage_matrix,
    visible,
)
from .common import SHARED_FLOATS, ceil_div
from .matrix import FRAGMENT

F = FRAGMENT.m  # 16: the fragments' M, N and K
SUBGROUP = FRAGMENT.subgroup_sizes[0]  # 32


@dataclass(frozen=True)
class MatrixTiling:
    """One fragment of F owned rows, ``rows`` = block_q * group of them used;
    block_k keys per step; ``subgroups`` of SUBGROUP threads, each taking
    every subgroups-th fragment of S and of P V; ``lanes`` threads per row
    accumulate o."""

    block_q: int
    block_k: int
    group: int
    head_dim: int
    subgroups: int

    @property
    def rows(self) -> int:
        return self.block_q * self.group

    @property
    def threads(self) -> int:
        return self.subgroups * SUBGROUP

    @property
    def lanes(self) -> int:
        return self.threads // F

    def shared_bytes(self) -> int:
        """K, V (Q staged there first) and P in f16; S, P V and a value per row in f32."""
        halves = 2 * self.block_k * self.head_dim + F * self.block_k
        return 2 * halves + 4 * (F * self.block_k + F * self.head_dim + F)

    def grid(self, batch: int, kv_heads: int, q_len: int) -> tuple[int, int, int]:
        return ceil_div(q_len, self.block_q), kv_heads, batch


def matrix_tiling(heads, kv_heads, head_dim, q_len, kv_len, block_k=32) -> MatrixTiling:
    """The tiling: as many queries as fill a fragment with the group's heads
    (fewer where q_len is shorter), two subgroups where both products split
    evenly between them. Raises ValueError where it cannot run."""
    check_shape(heads, kv_heads, head_dim, q_len, kv_len)
    group = heads // kv_heads
    if head_dim % F or block_k % F or block_k < F:
        raise ValueError(f"attention_matrix: head_dim ({head_dim}) and block_k ({block_k}) must "
                         f"be multiples of {F}, the fragments' size")
    if group > F:
        raise ValueError(f"attention_matrix: a group of {group} query heads per kv head does "
                         f"not fit a fragment of {F} rows")
    even = (block_k // F) % 2 == 0 and (head_dim // F) % 2 == 0
    t = MatrixTiling(min(q_len, F // group), block_k, group, head_dim, 2 if even else 1)
    if t.shared_bytes() > 4 * SHARED_FLOATS:
        raise ValueError(f"attention_matrix: head_dim {head_dim} with block_k {block_k} takes "
                         f"{t.shared_bytes()} bytes of workgroup memory, over "
                         f"{4 * SHARED_FLOATS}; give a smaller block_k, or use the SIMT kernel")
    return t


def _stage_halves(m, tile, count, head_dim, threads, load):
    """tile[r * head_dim + d] = the f16s of load(r, c) (a vec4<f16>: d = 4c .. 4c + 3)."""
    vecs = head_dim // 4

    def body(e):
        r, c = m.let(e / vecs, "sr"), m.let(e % vecs, "sc")
        value = m.let(load(r, c), "sv")
        for i, lane in enumerate("xyzw"):
            tile[r * head_dim + c * 4 + i] = getattr(value, lane)
    with m.loop(m.local_index(), count * vecs, threads, name="se") as e:
        body(e)


def _row(buf, token, heads, head, vecs, c, valid):
    return B.select(vec4h(0.0), buf[(token * heads + head) * vecs + c], valid)


def attention_matrix(m, batch, heads, kv_heads, head_dim, q_len, kv_len, block_k=32):
    """``attention`` (f16) on matrix units. Grid (ceil(q_len / block_q),
    kv_heads, batch); bindings q, k, v, keep, past -> o, lse, as attention's."""
    t = matrix_tiling(heads, kv_heads, head_dim, q_len, kv_len, block_k)
    vecs = head_dim // 4
    q = storage_matrix(m, "q", batch * q_len, heads, head_dim, "f16")
    k = storage_matrix(m, "k", batch * kv_len, kv_heads, head_dim, "f16")
    v = storage_matrix(m, "v", batch * kv_len, kv_heads, head_dim, "f16")
    keep = m.declare_input_buffer("keep", u32, batch * kv_len)
    past = m.declare_input_buffer("past", u32, 1)
    o = storage_matrix(m, "o", batch * q_len, heads, head_dim, "f16", output=True)
    lse = m.declare_output_buffer("lse", f32, batch * heads * q_len)
    ks, vs = m.shared(f16, block_k * head_dim, "ks"), m.shared(f16, block_k * head_dim, "vs")
    probs, scores = m.shared(f16, F * block_k, "probs"), m.shared(f32, F * block_k, "scores")
    pv, per_row = m.shared(f32, F * head_dim, "pv"), m.shared(f32, F, "per_row")
    rows, lanes = QueryRows(m, t, heads, q_len, capacity=F), Lanes(m, t, vecs)
    sg = m.let(m.local_index() / SUBGROUP, "sg")
    q_frags = _load_queries(m, t, rows, q, vs, vecs)
    p0 = m.let(past[0], "p0")
    key_end = m.let(B.min(p0 + rows.last + 1, kv_len), "key_end")
    top, total = m.var(f32, MASKED, "top"), m.var(f32, 0.0, "total")
    acc = lanes.accumulators(m, head_dim, "acc")
    with m.loop((key_end + block_k - 1) / block_k, name="kb") as kb:
        j0 = m.let(kb * block_k, "j0")
        for tile, buf in ((ks, k), (vs, v)):
            _stage_halves(m, tile, block_k, head_dim, t.threads, lambda r, c, buf=buf: _row(
                buf, rows.b * kv_len + B.min(j0 + r, kv_len - 1), kv_heads, rows.kvh, vecs, c,
                j0 + r < kv_len))
        m.barrier()
        _scores(m, t, sg, q_frags, ks, scores)
        m.barrier()
        with m.if_(m.local_index() < F):
            seen = _owner_visibility(m, rows, keep, kv_len, j0, p0)
            _softmax_step(m, t, scores, probs, per_row, top, total, seen)
        m.barrier()
        _products(m, t, sg, probs, vs, pv)
        m.barrier()
        rescale = m.let(per_row[lanes.row], "rescale")
        for a, c in zip(acc, lanes.cols):
            at = m.let(lanes.row * head_dim + c * 4, "at")
            m.assign(a, a * rescale + vec4f(pv[at], pv[at + 1], pv[at + 2], pv[at + 3]))
    m.barrier()  # every lane has read per_row before the owners write 1 / sum there
    finish_forward(m, rows, lanes, acc, lse, o, per_row, top, total, vecs)


def _load_queries(m, t, rows, q, staging, vecs):
    """Q's F x head_dim rows staged (zero past the used rows) and loaded as
    left fragments, one per F columns, held for the whole loop."""
    left = FRAGMENT.types()[0]
    _stage_halves(m, staging, F, t.head_dim, t.threads,
                  lambda r, c: _row(q, rows.token(r), rows.heads, rows.head(r), vecs, c,
                                    rows.valid(r)))
    m.barrier()
    frags = [m.let(B.subgroup_matrix_load(left, staging, d, t.head_dim), f"qf{d // F}")
             for d in range(0, t.head_dim, F)]
    m.barrier()  # every subgroup has its fragments before K and V overwrite the staging
    return frags


def _scores(m, t, sg, q_frags, ks, scores):
    """scores[r, j] = q_r . k_j (unscaled, unmasked): subgroup sg takes key
    fragments sg, sg + subgroups, ..."""
    _, right, result = FRAGMENT.types()
    for f in range(0, t.block_k // F, t.subgroups):
        key0 = m.let((sg + f) * F, "key0")
        s = m.var(result, name="s")
        for i, qf in enumerate(q_frags):
            kf = B.subgroup_matrix_load_col_major(right, ks, key0 * t.head_dim + i * F,
                                                  t.head_dim)
            m.assign(s, B.subgroup_matrix_multiply_accumulate(qf, kf, s))
        B.subgroup_matrix_store(scores, key0, s, t.block_k)


def _owner_visibility(m, rows, keep, kv_len, j0, p0):
    """visible(j) for the owner's row r = local_index: key j0 + j seen by its query."""
    r = m.let(m.local_index(), "r")
    valid = m.let(rows.valid(r), "valid")
    position = m.let(p0 + rows.query(r), "position")
    return lambda j: valid & visible(keep, rows.b, kv_len, j0 + j, position)


def _softmax_step(m, t, scores, probs, per_row, top, total, seen):
    """The row owner's online softmax step: its scores scaled and masked,
    the new max, the rescale of what came before, P in f16. Owner r walks
    its row from column r on (j = (i + r) mod block_k at step i): the 16
    owners read 16 different banks at once, where a walk from column 0 put
    them all in one (rows of block_k = 32 f32s: a 16-way conflict)."""
    r = m.local_index()
    block_max = m.var(f32, MASKED, "block_max")
    with m.loop(t.block_k, name="i") as i:
        j = m.let((i + r) % t.block_k, "j")
        s = m.let(B.select(f32(MASKED), scores[r * t.block_k + j] * t.head_dim ** -0.5,
                           seen(j)), "s")
        scores[r * t.block_k + j] = s
        m.assign(block_max, B.max(block_max, s))
    new_top = m.let(B.max(top, block_max), "new_top")
    rescale = m.let(B.exp(top - new_top), "rescale")
    added = m.var(f32, 0.0, "added")
    with m.loop(t.block_k, name="i") as i:
        j = m.let((i + r) % t.block_k, "j")
        s = m.let(scores[r * t.block_k + j], "s")
        p = m.let(B.select(0.0, B.exp(s - new_top), s > MASKED), "p")
        probs[r * t.block_k + j] = f16(p)
        added += p
    m.assign(total, total * rescale + added)
    m.assign(top, new_top)
    per_row[r] = rescale


def _products(m, t, sg, probs, vs, pv):
    """pv = P V: subgroup sg takes column fragments sg, sg + subgroups, ... of head_dim."""
    left, right, result = FRAGMENT.types()
    for f in range(0, t.head_dim // F, t.subgroups):
        col0 = m.let((sg + f) * F, "col0")
        acc = m.var(result, name="pv_acc")
        for kk in range(0, t.block_k, F):
            pf = B.subgroup_matrix_load(left, probs, kk, t.block_k)
            vf = B.subgroup_matrix_load(right, vs, kk * t.head_dim + col0, t.head_dim)
            m.assign(acc, B.subgroup_matrix_multiply_accumulate(pf, vf, acc))
        B.subgroup_matrix_store(pv, col0, acc, t.head_dim)
