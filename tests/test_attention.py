"""The causal LM's attention kernels (lora.kernels.attention) against a float64
numpy reference written out here: the forward (o, lse) and the backward (delta,
dq, dk, dv) on the interpreter and on the wgpu device, with grouped-query
heads, left and right padding, a query with no visible key, decode and
prefill with past > 0, head_dims that are and are not multiples of 4, and
tilings with several blocks and partial lanes; and the forward's matrix form
(attention_matrix) on the interpreter's subgroup matrices (lavapipe has
none). The reference's gradient is derived by hand and checked once against
torch.autograd in float64.

Tolerances, relative to the largest value of each result: f32 2e-6 (f32 dot
products of head_dim terms and sums over the keys; measured on lavapipe at
most 6.0e-7, in dv at seq 130, head_dim 64). f16 storage: the kernels widen
f16 inputs exactly and compute in f32, so against the reference computed from
the same f16 values the only new error is each output's rounding to f16, at
most 2^-11 of its own size (half an ulp), on top of the f32 term (measured:
o equal to the reference rounded to f16 but for one ulp at seq 130). The
backward's delta is rowsum(do * o) of the o it is given (the stored f16 o, as
FlashAttention's backward uses), so the reference takes that o too; against
the exact o's gradient the f16 dk differed by up to 6.8e-4 of its largest
value in these shapes. The matrix form also rounds P to f16 for P V, which
moves o by at most 2^-11 sum_j p_j |v_j| <= 2^-11 max|v| (measured: o within
4.2e-4 of its largest value).
"""
from __future__ import annotations

import numpy as np
import pytest

from lora.kernels import KERNELS
from lora.kernels.attention import MASKED, NO_KEY_LSE, Tiling, tiling
from lora.kernels.attention_matrix import matrix_tiling
from shaderdsl import interp

F32_TOL = 2e-6
F16_ROUNDING = 2.0 ** -11  # half an f16 ulp, relative


# ------------------------------------------------------------------ the float64 reference

def visible(keep, past, q_len):
    """[batch, q_len, kv_len]: query i sees key j iff j <= past + i and keep[j]."""
    kv_len = keep.shape[1]
    causal = np.arange(kv_len)[None, :] <= past + np.arange(q_len)[:, None]
    return causal[None] & (keep[:, None, :] != 0)


def _heads(x, batch, heads):
    """[batch * len, heads * d] -> [batch, heads, len, d] float64."""
    rows, width = x.shape
    return x.astype(np.float64).reshape(batch, rows // batch, heads, width // heads) \
        .transpose(0, 2, 1, 3)


def _rows(x):
    """[batch, heads, len, d] -> [batch * len, heads * d]."""
    batch, heads, length, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch * length, heads * d)


def probabilities(q, k, keep, past, heads, kv_heads):
    """P [batch, heads, q_len, kv_len] (rows with no visible key all 0), the
    scaled scores S, and the visibility; k repeated over its query heads."""
    batch = keep.shape[0]
    Q, K = _heads(q, batch, heads), _heads(k, batch, kv_heads).repeat(heads // kv_heads, axis=1)
    S = Q @ K.transpose(0, 1, 3, 2) * Q.shape[-1] ** -0.5
    vis = visible(keep, past, Q.shape[2])[:, None]
    top = np.where(vis, S, -np.inf).max(-1, keepdims=True)
    E = np.where(vis, np.exp(S - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = E.sum(-1, keepdims=True)
    return E / np.where(total > 0, total, 1.0), S, vis


def reference_forward(q, k, v, keep, past, heads, kv_heads):
    """(o [batch * q_len, heads * d], lse [batch * heads * q_len]; NaN where no key is seen)."""
    batch = keep.shape[0]
    P, S, vis = probabilities(q, k, keep, past, heads, kv_heads)
    V = _heads(v, batch, kv_heads).repeat(heads // kv_heads, axis=1)
    with np.errstate(divide="ignore"):
        lse = np.log(np.where(vis, np.exp(S), 0.0).sum(-1))
    return _rows(P @ V), np.where(np.isfinite(lse), lse, np.nan).ravel()


def _group_sum(x, kv_heads):
    """[batch, heads, ...] -> [batch, kv_heads, ...]: each kv head's query heads summed."""
    batch, heads = x.shape[:2]
    return x.reshape(batch, kv_heads, heads // kv_heads, *x.shape[2:]).sum(2)


def reference_backward(q, k, v, do, keep, heads, kv_heads, o=None):
    """(dq, dk, dv) of sum(o * do), by hand (past = 0): dV = P^T dO, dP = dO V^T,
    dS = P (dP - delta) with delta = rowsum(dO o), dQ = scale dS K, dK =
    scale dS^T Q, each kv head's dK and dV summed over its query heads.
    ``o``: the stored output delta is taken from (default: the exact one)."""
    batch = keep.shape[0]
    P, _, _ = probabilities(q, k, keep, 0, heads, kv_heads)
    group = heads // kv_heads
    Q, dO = _heads(q, batch, heads), _heads(do, batch, heads)
    K = _heads(k, batch, kv_heads).repeat(group, axis=1)
    V = _heads(v, batch, kv_heads).repeat(group, axis=1)
    out = P @ V if o is None else _heads(o, batch, heads)
    delta = (dO * out).sum(-1, keepdims=True)
    dS = P * (dO @ V.transpose(0, 1, 3, 2) - delta)
    scale = Q.shape[-1] ** -0.5
    dq = scale * dS @ K
    dk = scale * _group_sum(dS.transpose(0, 1, 3, 2) @ Q, kv_heads)
    dv = _group_sum(P.transpose(0, 1, 3, 2) @ dO, kv_heads)
    return _rows(dq), _rows(dk), _rows(dv), delta.ravel()


def rounding_magnitudes(q, k, v, do, keep, heads, kv_heads, o):
    """(|dS| |K| scale, scale |dS|^T |Q|, |P|^T |dO|) (the last two summed over
    each kv head's query heads): what rounding P and dS to f16 before the
    products can move dq, dk and dv by, times 2^-11 (each a sum of |terms|)."""
    batch, group = keep.shape[0], heads // kv_heads
    P, _, _ = probabilities(q, k, keep, 0, heads, kv_heads)
    Q, dO = _heads(q, batch, heads), _heads(do, batch, heads)
    K = _heads(k, batch, kv_heads).repeat(group, axis=1)
    V = _heads(v, batch, kv_heads).repeat(group, axis=1)
    delta = (dO * _heads(o, batch, heads)).sum(-1, keepdims=True)
    dS = np.abs(P * (dO @ V.transpose(0, 1, 3, 2) - delta))
    scale = Q.shape[-1] ** -0.5
    return (_rows(scale * dS @ np.abs(K)),
            _rows(scale * _group_sum(dS.transpose(0, 1, 3, 2) @ np.abs(Q), kv_heads)),
            _rows(_group_sum(P.transpose(0, 1, 3, 2) @ np.abs(dO), kv_heads)))


def test_reference_gradient_matches_torch_autograd():
    """The hand-derived backward equals torch.autograd's in float64 (grouped
    heads, padding inside and at the right; every query sees key 0)."""
    torch = pytest.importorskip("torch", reason="the check against autograd needs torch")
    rng = np.random.default_rng(1)
    batch, seq, heads, kv_heads, d = 2, 6, 4, 2, 3
    q, do = (rng.standard_normal((batch * seq, heads * d)) for _ in range(2))
    k, v = (rng.standard_normal((batch * seq, kv_heads * d)) for _ in range(2))
    keep = np.ones((batch, seq), np.uint32)
    keep[0, 2], keep[1, 4:] = 0, 0
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))

    def split(x, h):
        return x.reshape(batch, seq, h, d).transpose(1, 2)
    K = split(tk, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    V = split(tv, kv_heads).repeat_interleave(heads // kv_heads, dim=1)
    S = split(tq, heads) @ K.transpose(-1, -2) * d ** -0.5
    mask = torch.tensor(visible(keep, 0, seq))[:, None]
    out = torch.softmax(S.masked_fill(~mask, float("-inf")), dim=-1) @ V
    (out.transpose(1, 2).reshape(batch * seq, heads * d) * torch.tensor(do)).sum().backward()
    want = [t.grad.numpy() for t in (tq, tk, tv)]
    got = reference_backward(q, k, v, do, keep, heads, kv_heads)[:3]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    o, _ = reference_forward(q, k, v, keep, 0, heads, kv_heads)
    np.testing.assert_allclose(o, out.detach().transpose(1, 2).reshape(batch * seq, -1).numpy(),
                               rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ running the kernels

def _storage(dtype):
    return np.float16 if dtype == "f16" else np.float32


def _dispatch(device, name, params, inputs, outputs):
    """Run KERNELS[name] once; ``outputs``: name -> (shape, dtype), NaN-filled
    first. Returns the outputs read back."""
    spec = KERNELS[name]
    bufs = {key: device.buffer(np.ascontiguousarray(x)) for key, x in inputs.items()}
    for key, (shape, dt) in outputs.items():
        bufs[key] = device.buffer(np.full(shape, np.nan, dt))
    device.dispatch(spec.kernel(**params), bufs, spec.grid(**params))
    return {key: device.read(bufs[key]) for key in outputs}


def run_forward(device, q, k, v, keep, past, heads, kv_heads, dtype="f32", kernel="attention",
                **tiles):
    """(o, lse) of KERNELS[kernel] for q, k, v stored as ``dtype`` (attention_matrix: f16)."""
    batch, kv_len = keep.shape
    st = _storage(dtype)
    params = dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=q.shape[1] // heads,
                  q_len=q.shape[0] // batch, kv_len=kv_len, **tiles)
    if kernel == "attention":
        params["dtype"] = dtype
    out = _dispatch(device, kernel, params,
                    dict(q=q.astype(st), k=k.astype(st), v=v.astype(st),
                         keep=keep.ravel().astype(np.uint32), past=np.array([past], np.uint32)),
                    dict(o=(q.shape, st), lse=((batch * heads * q.shape[0] // batch,), np.float32)))
    return out["o"], out["lse"]


def run_backward(device, q, k, v, o, do, lse, keep, heads, kv_heads, dtype="f32", tiles=None,
                 matrix=None):
    """(delta, dq, dk, dv) of the three backward kernels; ``tiles``: per kernel name;
    ``matrix``: the parameters of the matrix kernels (f16) to run instead of the SIMT ones."""
    batch, seq = keep.shape
    st, tiles = _storage(dtype), tiles or {}
    shape = dict(batch=batch, heads=heads, head_dim=q.shape[1] // heads, seq=seq, dtype=dtype)
    lse = lse.astype(np.float32)
    stats = _dispatch(device, "attention_delta", shape,
                      dict(dout=do.astype(st), o=o.astype(st), lse=lse),
                      dict(stats=((batch * heads * seq, 2), np.float32)))["stats"]
    np.testing.assert_array_equal(stats[:, 0], lse)   # lse passes through unchanged
    inputs = dict(q=q.astype(st), k=k.astype(st), v=v.astype(st), dout=do.astype(st),
                  stats=stats, keep=keep.ravel().astype(np.uint32))
    grads, prefix = dict(shape, kv_heads=kv_heads), "attention_"
    if matrix is not None:
        del grads["dtype"]
        grads, prefix = dict(grads, **matrix), "attention_matrix_"
    dkv = _dispatch(device, f"{prefix}grad_kv", dict(grads, **tiles.get("grad_kv", {})), inputs,
                    dict(dk=(k.shape, st), dv=(v.shape, st)))
    dq = _dispatch(device, f"{prefix}grad_q", dict(grads, **tiles.get("grad_q", {})), inputs,
                   dict(dq=(q.shape, st)))["dq"]
    return stats[:, 1], dq, dkv["dk"], dkv["dv"]


def assert_close(got, want, rel_max=F32_TOL, rel_each=0.0, what="",
                 atol: float | np.ndarray = 0.0):
    """|got - want| <= rel_each |want| + rel_max max|want| + atol everywhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bound = rel_each * np.abs(want) + rel_max * max(np.abs(want).max(), 1e-30) + atol
    err = np.abs(got - want)
    assert np.all(err <= bound), \
        f"{what}: worst {err.max():.3g} at {np.unravel_index(np.argmax(err - bound), err.shape)}"\
        f", bound there {bound.ravel()[np.argmax(err - bound)]:.3g}"


def _inputs(rng, batch, q_len, kv_len, heads, kv_heads, d, spread=1.5):
    q = rng.normal(0, spread, (batch * q_len, heads * d))
    k, v = (rng.normal(0, spread, (batch * kv_len, kv_heads * d)) for _ in range(2))
    return q, k, v


def _padded(batch, kv_len, left=3, right=4):
    """keep: sequence 0 left-padded (its first queries see no key), 1 right-padded,
    others with a hole in the middle."""
    keep = np.ones((batch, kv_len), np.uint32)
    keep[0, :left] = 0
    if batch > 1:
        keep[1, kv_len - right:] = 0
    for b in range(2, batch):
        keep[b, kv_len // 2] = 0
    return keep


def check_forward(device, q, k, v, keep, past, heads, kv_heads, dtype="f32",
                  kernel="attention", **tiles):
    """The kernel's o and lse against the reference from the values it sees.
    The matrix form rounds P to f16 for P V: at most 2^-11 sum_j p_j |v_j|,
    so 2^-11 max|v| more."""
    st = _storage(dtype)
    q, k, v = (x.astype(st).astype(np.float64) for x in (q, k, v))  # what the kernel sees
    o, lse = run_forward(device, q, k, v, keep, past, heads, kv_heads, dtype, kernel, **tiles)
    want_o, want_lse = reference_forward(q, k, v, keep, past, heads, kv_heads)
    rel_each = F16_ROUNDING if dtype == "f16" else 0.0
    p_rounding = F16_ROUNDING * np.abs(v).max() if kernel == "attention_matrix" else 0.0
    assert_close(o, want_o, rel_each=rel_each, what="o", atol=p_rounding)
    seen = ~np.isnan(want_lse)
    assert_close(lse[seen], want_lse[seen], what="lse")
    assert np.all(lse[~seen] == np.float32(NO_KEY_LSE))
    return o, lse


def check_backward(device, q, k, v, do, keep, heads, kv_heads, dtype="f32", tiles=None,
                   matrix=None):
    """The backward's delta, dq, dk and dv against the reference from the
    values the kernels see. The matrix kernels (``matrix``: their parameters)
    round P and dS to f16 before the products: each gradient moves by at most
    2^-11 of the sum of its terms' sizes (rounding_magnitudes)."""
    st = _storage(dtype)
    q, k, v, do = (x.astype(st).astype(np.float64) for x in (q, k, v, do))
    want_o, want_lse = reference_forward(q, k, v, keep, 0, heads, kv_heads)
    o = want_o.astype(st)   # the stored o, as the forward would leave it
    lse = np.where(np.isnan(want_lse), NO_KEY_LSE, want_lse)
    got = run_backward(device, q, k, v, o, do, lse, keep, heads, kv_heads, dtype, tiles, matrix)
    want = reference_backward(q, k, v, do, keep, heads, kv_heads, o=o.astype(np.float64))
    rel_each = F16_ROUNDING if dtype == "f16" else 0.0
    rounding = rounding_magnitudes(q, k, v, do, keep, heads, kv_heads, o.astype(np.float64)) \
        if matrix is not None else (0.0, 0.0, 0.0)
    assert_close(got[0], want[3], what="delta")   # delta is f32 in either storage
    for g, w, what, mag in zip(got[1:], want[:3], ("dq", "dk", "dv"), rounding):
        assert_close(g, w, rel_each=rel_each, what=what, atol=F16_ROUNDING * np.asarray(mag))


# ------------------------------------------------------------------ on the interpreter

@pytest.fixture(scope="module")
def interp_dev():
    return interp.Device(subgroup_size=8)


TRAINING_SHAPES = [  # (batch, seq, heads, kv_heads, head_dim, tiles)
    (2, 13, 4, 2, 16, {}),
    (2, 11, 4, 2, 12, dict(block_q=2, block_k=4)),        # several blocks, 3 vec4s per row
    (1, 9, 2, 2, 10, dict(block_q=3, block_k=5)),         # head_dim 10: scalar rows, no GQA
    (3, 7, 4, 1, 8, dict(block_q=1, block_k=3, threads=12)),  # 3 lanes over 2 vec4s: partial
]


@pytest.mark.parametrize("batch, seq, heads, kv_heads, d, tiles", TRAINING_SHAPES)
def test_forward_on_the_interpreter(interp_dev, batch, seq, heads, kv_heads, d, tiles):
    rng = np.random.default_rng(seq)
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d)
    check_forward(interp_dev, q, k, v, _padded(batch, seq), 0, heads, kv_heads, **tiles)


@pytest.mark.parametrize("q_len, past, tiles", [(1, 6, {}), (1, 7, dict(block_k=3)),
                                                 (3, 4, {}), (3, 4, dict(block_k=2))])
def test_decode_and_prefill_with_past_on_the_interpreter(interp_dev, q_len, past, tiles):
    """Queries at past.. of a cache of kv_len positions (those past the last
    query unused), padding on the left of sequence 0; in blocks of 2 and 3
    keys, the loop must run up to the last query's position past + q_len - 1."""
    rng = np.random.default_rng(q_len)
    batch, kv_len, heads, kv_heads, d = 2, 10, 4, 2, 8
    q, k, v = _inputs(rng, batch, q_len, kv_len, heads, kv_heads, d)
    check_forward(interp_dev, q, k, v, _padded(batch, kv_len, left=2, right=0), past, heads,
                  kv_heads, **tiles)


@pytest.mark.parametrize("batch, seq, heads, kv_heads, d, tiles", TRAINING_SHAPES[:3])
def test_backward_on_the_interpreter(interp_dev, batch, seq, heads, kv_heads, d, tiles):
    rng = np.random.default_rng(seq + 1)
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d)
    do = rng.standard_normal(q.shape)
    both = dict(grad_kv=tiles, grad_q=tiles)
    check_backward(interp_dev, q, k, v, do, _padded(batch, seq), heads, kv_heads, tiles=both)


MATRIX_CASES = [  # (batch, q_len, kv_len, past, heads, kv_heads, head_dim, block_k)
    (2, 13, 13, 0, 4, 2, 32, 32),   # training's shape: padding, rows with no key; 2 subgroups
    (2, 1, 40, 20, 6, 2, 16, 16),   # decode over 3 blocks of keys, a group of 3; 1 subgroup
    (1, 5, 37, 30, 4, 4, 64, 16),   # prefill after a cache, head_dim 64, no GQA
    (1, 7, 7, 0, 6, 2, 16, 16),     # 5 queries x 3 heads: 15 of a fragment's 16 rows used
]


@pytest.mark.parametrize("batch, q_len, kv_len, past, heads, kv_heads, d, block_k", MATRIX_CASES)
def test_matrix_forward_on_the_interpreter(batch, q_len, kv_len, past, heads, kv_heads, d,
                                           block_k):
    """attention_matrix on the interpreter's H200 fragments (f16 16x16x16 -> f32,
    subgroups of 32), against the float64 reference."""
    rng = np.random.default_rng(kv_len)
    q, k, v = _inputs(rng, batch, q_len, kv_len, heads, kv_heads, d)
    check_forward(interp.Device(subgroup_size=32), q, k, v, _padded(batch, kv_len), past, heads,
                  kv_heads, "f16", "attention_matrix", block_k=block_k)


@pytest.mark.parametrize("batch, q_len, kv_len, past, heads, kv_heads, d, block_k", MATRIX_CASES)
def test_matrix_forward_on_the_device(device, batch, q_len, kv_len, past, heads, kv_heads, d,
                                      block_k):
    """attention_matrix on the device's own subgroup matrices (the H200's under
    Dawn; skipped where the device has no f16 16x16x16 fragments), against the
    float64 reference: what the interpreter's run does not show (Tint's
    lowering, the hardware's fragment layout)."""
    from lora.kernels.matrix import FRAGMENT
    if FRAGMENT not in getattr(device, "subgroup_matrix_configs", ()):
        pytest.skip(f"{device.name} has no {FRAGMENT} subgroup matrices")
    rng = np.random.default_rng(kv_len + 1)
    q, k, v = _inputs(rng, batch, q_len, kv_len, heads, kv_heads, d)
    check_forward(device, q, k, v, _padded(batch, kv_len), past, heads, kv_heads, "f16",
                  "attention_matrix", block_k=block_k)


MATRIX_GRAD_CASES = [  # (batch, seq, heads, kv_heads, head_dim, limit, subgroups, step)
    (2, 19, 2, 1, 16, 16384, 1, 16),    # padding left (rows with no key) and right, 2 steps
    (1, 35, 3, 1, 16, 32768, 2, 16),    # 2 subgroups, a group of 3 (30 of 32 rows), 3 steps
]


@pytest.mark.parametrize("batch, seq, heads, kv_heads, d, limit, subgroups, step",
                         MATRIX_GRAD_CASES)
def test_matrix_backward_on_the_interpreter(batch, seq, heads, kv_heads, d, limit, subgroups,
                                            step):
    """attention_matrix_grad_kv and _q on the interpreter's H200 fragments (f16
    16x16x16 -> f32, subgroups of 32), against the float64 reference."""
    rng = np.random.default_rng(seq + 3)
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d)
    device = interp.Device(subgroup_size=32,
                           limits={"max-compute-workgroup-storage-size": limit})
    check_backward(device, q, k, v, rng.standard_normal(q.shape), _padded(batch, seq), heads,
                   kv_heads, "f16", matrix=dict(limit=limit, subgroups=subgroups, step=step))


@pytest.mark.parametrize("batch, seq, heads, kv_heads, d, limit, subgroups, step",
                         MATRIX_GRAD_CASES + [(2, 130, 9, 3, 64, 16384, 0, 0),
                                              (1, 100, 14, 2, 64, 49152, 0, 0)])
def test_matrix_backward_on_the_device(device, batch, seq, heads, kv_heads, d, limit,
                                       subgroups, step):
    """The matrix backward on the device's own subgroup matrices (skipped where
    it has no f16 16x16x16 fragments), at the interpreter's shapes and at the
    LM's head_dim 64 with its default tilings (SmolLM2's and Qwen2.5's groups)."""
    from lora.kernels.matrix import FRAGMENT
    if FRAGMENT not in getattr(device, "subgroup_matrix_configs", ()):
        pytest.skip(f"{device.name} has no {FRAGMENT} subgroup matrices")
    if limit > device.limits["max-compute-workgroup-storage-size"]:
        pytest.skip(f"{device.name} has less than {limit} bytes of workgroup memory")
    rng = np.random.default_rng(seq + 4)
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d, spread=1.0)
    check_backward(device, q, k, v, rng.standard_normal(q.shape), _padded(batch, seq), heads,
                   kv_heads, "f16", matrix=dict(limit=limit, subgroups=subgroups, step=step))


# ------------------------------------------------------------------ on the device

@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("batch, seq, heads, kv_heads, d, tiles", TRAINING_SHAPES[:2])
def test_forward_and_backward_on_the_device(device, dtype, batch, seq, heads, kv_heads, d, tiles):
    if dtype == "f16" and not device.has_feature("shader-f16"):
        pytest.skip("the device has no shader-f16")
    rng = np.random.default_rng(seq + 2)
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d)
    keep = _padded(batch, seq)
    check_forward(device, q, k, v, keep, 0, heads, kv_heads, dtype, **tiles)
    check_backward(device, q, k, v, rng.standard_normal(q.shape), keep, heads, kv_heads, dtype,
                   dict(grad_kv=tiles, grad_q=tiles))


def test_unpadded_rows_on_the_device(device):
    """pad=False (the staged rows as they were before padding, which bench
    --attention times beside) computes the same forward and backward."""
    rng = np.random.default_rng(5)
    batch, seq, heads, kv_heads, d = TRAINING_SHAPES[0][:5]
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d)
    keep = _padded(batch, seq)
    check_forward(device, q, k, v, keep, 0, heads, kv_heads, pad=False)
    check_backward(device, q, k, v, rng.standard_normal(q.shape), keep, heads, kv_heads,
                   tiles=dict(grad_kv=dict(pad=False), grad_q=dict(pad=False)))


def test_decode_reads_past_at_run_time(device):
    """One pipeline for every past: decode steps at past 0, 5 and 9 of one
    cache in blocks of 4 keys (keys after past hold values the queries must
    not see)."""
    rng = np.random.default_rng(3)
    batch, kv_len, heads, kv_heads, d = 2, 10, 4, 2, 16
    q, k, v = _inputs(rng, batch, 1, kv_len, heads, kv_heads, d)
    keep = _padded(batch, kv_len, left=2, right=0)
    pipelines = []
    for past in (0, 5, 9):
        check_forward(device, q, k, v, keep, past, heads, kv_heads, block_k=4)
        pipelines.append(KERNELS["attention"].kernel(batch=batch, heads=heads, kv_heads=kv_heads,
                                                     head_dim=d, q_len=1, kv_len=kv_len,
                                                     block_k=4))
    assert pipelines[0] is pipelines[1] is pipelines[2]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_longer_sequence_on_the_device(device, dtype):
    """seq 130 (several blocks of keys and queries), head_dim 64, default tilings."""
    if dtype == "f16" and not device.has_feature("shader-f16"):
        pytest.skip("the device has no shader-f16")
    rng = np.random.default_rng(130)
    batch, seq, heads, kv_heads, d = 2, 130, 4, 2, 64
    q, k, v = _inputs(rng, batch, seq, seq, heads, kv_heads, d, spread=1.0)
    keep = _padded(batch, seq, left=5, right=20)
    check_forward(device, q, k, v, keep, 0, heads, kv_heads, dtype)
    check_backward(device, q, k, v, rng.standard_normal(q.shape), keep, heads, kv_heads, dtype)


# ------------------------------------------------------------------ tilings and refusals

@pytest.mark.parametrize("kind, shape", [
    ("forward", (9, 3, 64, 512, 512)), ("forward", (9, 3, 64, 1, 2048)),
    ("forward", (32, 8, 128, 512, 512)), ("grad_kv", (14, 2, 64, 512, 512)),
    ("grad_q", (4, 4, 128, 512, 512)), ("grad_q", (4, 2, 10, 9, 9)),
])
def test_default_tilings_fit_webgpu_defaults(kind, shape):
    """The chosen tiling's workgroup memory (as the kernel declares it) fits
    16 KiB and its threads 256; its formula is the kernel's own count."""
    heads, kv_heads, d, q_len, kv_len = shape
    t = tiling(kind, heads, kv_heads, d, q_len, kv_len)
    assert t.threads <= 256 and t.shared_floats(d) * 4 <= 16384
    if kind == "forward":
        kernel = KERNELS["attention"].kernel(batch=2, heads=heads, kv_heads=kv_heads, head_dim=d,
                                             q_len=q_len, kv_len=kv_len)
    else:
        kernel = KERNELS[f"attention_{kind}"].kernel(batch=2, heads=heads, kv_heads=kv_heads,
                                                     head_dim=d, seq=q_len)
    assert kernel.workgroup_bytes == 4 * t.shared_floats(d)
    assert kernel.workgroup_size[0] == t.threads


@pytest.mark.parametrize("head_dim, block_k", [(16, 16), (64, 32), (112, 16)])
def test_matrix_tiling_fits_webgpu_defaults(head_dim, block_k):
    t = matrix_tiling(6, 2, head_dim, 300, 300, block_k)
    kernel = KERNELS["attention_matrix"].kernel(batch=1, heads=6, kv_heads=2, head_dim=head_dim,
                                                q_len=300, kv_len=300, block_k=block_k)
    assert kernel.workgroup_bytes == t.shared_bytes() <= 16384
    assert (t.block_q, t.rows, kernel.workgroup_size[0]) == (5, 15, t.threads)


@pytest.mark.parametrize("args, message", [
    ((4, 2, 24, 32), r"head_dim \(24\) and block_k \(32\) must be multiples of 16"),
    ((64, 2, 16, 32), r"a group of 32 query heads per kv head does not fit"),
    ((4, 2, 128, 32), r"head_dim 128 with block_k 32 takes 27712 bytes"),
])
def test_matrix_form_refuses_what_it_cannot_run(args, message):
    heads, kv_heads, head_dim, block_k = args
    with pytest.raises(ValueError, match=message):
        matrix_tiling(heads, kv_heads, head_dim, 8, 8, block_k)


def test_decode_tiling_owns_the_group():
    """Decode (q_len 1): a workgroup owns the group's query heads of one kv head."""
    t = tiling("forward", 14, 2, 64, 1, 4096)
    assert (t.block_q, t.rows) == (1, 7) and isinstance(t, Tiling)


@pytest.mark.parametrize("args, message", [
    ((6, 4, 16, 8, 8), r"heads \(6\) must be a multiple of kv_heads \(4\)"),
    ((4, 2, 0, 8, 8), r"expected positive ints, got \{'head_dim': 0\}"),
    ((4, 2, 4096, 8, 8), r"no tiling of head_dim 4096"),
])
def test_bad_shapes_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        KERNELS["attention"].kernel(batch=1, heads=args[0], kv_heads=args[1], head_dim=args[2],
                                    q_len=args[3], kv_len=args[4])


def test_threads_must_be_whole_rows():
    with pytest.raises(ValueError, match=r"threads=100 fits .* multiple of the owned rows"):
        tiling("forward", 4, 2, 16, 8, 8, block_q=8, threads=100)


def test_masked_scores_stay_finite():
    """The placeholders are finite f32 values (WGSL may assume no infinities)."""
    assert np.isfinite(np.float32(MASKED)) and np.isfinite(np.float32(NO_KEY_LSE))
    assert np.exp(np.float32(MASKED) - np.float32(MASKED)) == 1.0
