"""The causal LM's kernels (lora.kernels.lm, softmax_xent's ignore form and
add_scaled's y_dtype) against float64 numpy references written here from
transformers' modeling_llama.py (LlamaRMSNorm, rotate_half and
apply_rotary_pos_emb, LlamaMLP's act_fn(gate) * up, the causal LM's
cross-entropy with ignore_index -100, torch.argmax), on the GPU device and on
the interpreter (subgroups of 8, races and unwritten reads checked), f32 and
f16 storage, widths that are not multiples of 4 (scalar loads) beside ones
that are (vec4 loads), the token count baked in and read at run time.
The references' gradients are checked against torch autograd of transformers'
own modules in float64 (test_references_match_transformers).

Tolerances: f32 storage, f32 math: 2e-6 of the row's magnitude (a few f32
roundings: these rows sum at most 40 terms). f16 storage: the inputs are f16
values given to the reference as they are, so the only extra error is the
output's rounding to f16, half an f16 ulp (2^-11 relative), and f32 math:
rtol 2^-10 and the f32 bound.
"""
from __future__ import annotations

import numpy as np
import pytest

from lora.kernels.loss import IGNORE
from lora.kernels.registry import KERNELS
from shaderdsl.errors import KernelBuildError
from shaderdsl.interp import Device

F16_RTOL = 2.0 ** -10
F32_TOL = 2e-6


@pytest.fixture(scope="module")
def idev():
    return Device(subgroup_size=8)


@pytest.fixture(params=["gpu", "interp"])
def dev(request, device, idev):
    return device if request.param == "gpu" else idev


def storage(dev, dtype: str):
    """numpy dtype of ``dtype`` storage; a skip where the device lacks f16."""
    if dtype == "f16" and not dev.has_feature("shader-f16"):
        pytest.skip(f"{dev.name} lacks shader-f16")
    return np.float16 if dtype == "f16" else np.float32


def run(dev, name: str, params: dict, tokens: int, buffers: dict, reads: list):
    """Dispatch KERNELS[name] on numpy ``buffers`` (``tokens`` rows; the
    uniform ``tokens`` too where the kernel reads the count at run time); the
    ``reads`` back."""
    spec = KERNELS[name]
    kernel = spec.kernel(**params)
    bound = {k: dev.buffer(np.ascontiguousarray(v)) for k, v in buffers.items()}
    values = {}
    if any(b.name == "tokens" for b in kernel.bindings):  # the count read at run time
        values["tokens"] = np.uint32(tokens)
    grid = spec.grid_rule({**spec.params(**params), "tokens": tokens})
    dev.dispatch(kernel, {**bound, **values}, grid)
    return [dev.read(bound[k]).astype(np.float64) if bound[k].dtype != np.uint32
            else dev.read(bound[k]) for k in reads]


def close(got, want, dtype: str, scale=1.0, what=""):
    """got within the module's tolerance of the float64 ``want``."""
    atol = F32_TOL * scale
    rtol = F16_RTOL if dtype == "f16" else F32_TOL
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


# ------------------------------------------------------------------ references (float64)

def rms_norm_ref(x, w, eps, x_dtype="f32"):
    """LlamaRMSNorm.forward: x in f32, variance = mean(x^2), normalized cast back
    to the input's dtype, times the weight; and rstd for the backward."""
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    normalized = x * rstd
    if x_dtype == "f16":
        normalized = normalized.astype(np.float16).astype(np.float64)
    return w * normalized, rstd[:, 0]


def rms_norm_grad_ref(dy, x, w, rstd):
    """d/dx of sum(dy * w * x * rstd(x)): rstd (w dy - xhat mean(xhat w dy))."""
    r = rstd[:, None]
    xhat = x * r
    return r * (w * dy - xhat * (xhat * w * dy).mean(-1, keepdims=True))


def rotate_half(x):
    """modeling_llama.rotate_half: cat(-x2, x1) on the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def rope_tables(head_dim, positions, theta=10000.0):
    """LlamaRotaryEmbedding's default rope: f32 inv_freq and freqs, then cos and sin
    of the half-row (HF's emb = cat(freqs, freqs) repeats it)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = np.outer(np.arange(positions, dtype=np.float32), inv_freq.astype(np.float32))
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def rope_ref(x, heads, positions, cos, sin, inverse=False):
    """apply_rotary_pos_emb on [T, heads * head_dim]: x cos + rotate_half(x) sin,
    or its transpose: x cos + rotate_half^T(x sin), rotate_half^T(y) = cat(y2, -y1)."""
    t = x.shape[0]
    xh = x.reshape(t, heads, -1)
    c = np.concatenate([cos[positions], cos[positions]], -1)[:, None, :].astype(np.float64)
    s = np.concatenate([sin[positions], sin[positions]], -1)[:, None, :].astype(np.float64)
    if inverse:
        ys = xh * s
        half = ys.shape[-1] // 2
        out = xh * c + np.concatenate([ys[..., half:], -ys[..., :half]], -1)
    else:
        out = xh * c + rotate_half(xh) * s
    return out.reshape(t, -1)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def swiglu_ref(gate, up):
    """LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), act_fn = SiLU."""
    return gate * sigmoid(gate) * up


def swiglu_grad_ref(d_act, gate, up):
    s = sigmoid(gate)
    return d_act * up * s * (1 + gate * (1 - s)), d_act * gate * s


def xent_ref(logits, labels, classes):
    """Cross-entropy with ignore_index (IGNORE here, -100 for transformers):
    per-row losses (0 where ignored), g = (softmax - onehot) / count (0 where
    ignored), count = the rows with a label."""
    keep = labels != IGNORE
    count = keep.sum()
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    rows = np.arange(len(labels))
    safe = np.where(keep, labels, 0).astype(np.int64)
    losses = np.where(keep, -logp[rows, safe], 0.0)
    onehot = np.zeros_like(logits)
    onehot[rows[keep], safe[keep]] = 1.0
    g = np.where(keep[:, None], np.exp(logp) - onehot, 0.0) / max(count, 1)
    return losses, g, count


# ------------------------------------------------------------------ the kernels

@pytest.mark.parametrize("hidden, dtype, out_dtype, tokens", [
    (37, "f32", "f32", 7), (40, "f16", "f32", None), (40, "f32", "f32", None),
    (37, "f16", "f16", 7)])
def test_embed_in_chunks_of_rows(dev, hidden, dtype, out_dtype, tokens):
    """Two chunks of the embedding's rows, a dispatch each: the first writes
    only the tokens of its rows (the others keep their sentinel), both
    together every token; E f16 into an f32 residual stream as well."""
    dt, ot = storage(dev, dtype), storage(dev, out_dtype)
    rng = np.random.default_rng(1)
    vocab, split, t = 29, 11, 7
    E = rng.standard_normal((vocab, hidden)).astype(dt)
    ids = np.array([0, 10, 11, 28, 3, 20, 10], np.uint32)
    x = np.full((t, hidden), -7.0, ot)
    base = dict(hidden=hidden, tokens=tokens, dtype=dtype, out_dtype=out_dtype, threads=16)
    first, = run(dev, "embed", {**base, "rows": split}, t, {"E": E[:split], "ids": ids, "x": x},
                 ["x"])
    mine = ids < split
    np.testing.assert_array_equal(first[mine], E[ids[mine]].astype(np.float64))
    assert (first[~mine] == -7.0).all(), "the first chunk wrote tokens of another chunk"
    both, = run(dev, "embed", {**base, "rows": vocab - split, "first_row": split}, t,
                {"E": E[split:], "ids": ids, "x": first.astype(ot)}, ["x"])
    np.testing.assert_array_equal(both, E[ids].astype(ot).astype(np.float64))


def test_embed_reads_ids_at_an_offset(dev):
    """id_offset: x[t] = E[ids[offset[0] + t]] (decode reads what argmax wrote)."""
    rng = np.random.default_rng(2)
    E = rng.standard_normal((13, 6)).astype(np.float32)
    ids = np.array([5, 5, 5, 12, 0, 7, 5], np.uint32)
    x, = run(dev, "embed", dict(hidden=6, rows=13, tokens=3, id_offset=True, threads=8), 3,
             {"E": E, "ids": ids, "x": np.zeros((3, 6), np.float32),
              "offset": np.array([3], np.uint32)}, ["x"])
    np.testing.assert_array_equal(x, E[[12, 0, 7]])


@pytest.mark.parametrize("hidden, dtype, x_dtype, tokens, subgroups", [
    (37, "f32", "f32", 5, False), (40, "f16", "f32", None, True),
    (40, "f32", "f32", 5, True), (37, "f16", "f16", None, False),
    (40, "f32", "f16", 5, False)])
def test_rms_norm(dev, hidden, dtype, x_dtype, tokens, subgroups):
    """y = w (x rstd) with y stored as dtype (f16 after the f32 residual), the
    normalized row rounded to an f16 input's dtype first; rstd f32."""
    storage(dev, dtype)
    xt = storage(dev, x_dtype)
    if subgroups and not dev.has_feature("subgroup"):
        pytest.skip(f"{dev.name} lacks subgroups")
    rng = np.random.default_rng(3)
    t, eps = 5, 1e-6
    x = (3 * rng.standard_normal((t, hidden))).astype(xt)
    w = (1 + 0.3 * rng.standard_normal(hidden)).astype(np.float32)
    params = dict(hidden=hidden, tokens=tokens, eps=eps, dtype=dtype, x_dtype=x_dtype,
                  threads=16, subgroups=subgroups)
    yt = storage(dev, dtype)
    y, rstd = run(dev, "rms_norm", params, t,
                  {"x": x, "w": w, "y": np.zeros((t, hidden), yt),
                   "rstd": np.zeros(t, np.float32)}, ["y", "rstd"])
    want, want_rstd = rms_norm_ref(x.astype(np.float64), w.astype(np.float64), eps, x_dtype)
    close(rstd, want_rstd, "f32", what="rstd")
    # an f16 input's normalized row is rounded to f16: where the GPU's rsqrt
    # differs from float64's by an f32 ulp, that rounding may land one f16 ulp
    # away (the H100 under Dawn: 4.3e-4 relative), so f16's tolerance then
    close(y, want, "f16" if x_dtype == "f16" else dtype, scale=np.abs(want).max(), what="y")


@pytest.mark.parametrize("hidden, dtype, tokens, subgroups, accumulate", [
    (37, "f32", 5, False, True), (40, "f16", None, True, True), (40, "f32", None, False, False),
    (37, "f16", 5, True, False)])
def test_rms_norm_grad_adds_to_the_residual_gradient(dev, hidden, dtype, tokens, subgroups,
                                                     accumulate):
    """dres += rstd (w dy - xhat mean(xhat w dy)), dy stored as dtype, x f32
    (with accumulate=False, dres = that)."""
    dt = storage(dev, dtype)
    if subgroups and not dev.has_feature("subgroup"):
        pytest.skip(f"{dev.name} lacks subgroups")
    rng = np.random.default_rng(4)
    t = 5
    x = (2 * rng.standard_normal((t, hidden))).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(hidden)).astype(np.float32)
    dy = rng.standard_normal((t, hidden)).astype(dt)
    dres = rng.standard_normal((t, hidden)).astype(np.float32)
    x64 = x.astype(np.float64)
    _, rstd = rms_norm_ref(x64, w.astype(np.float64), 1e-5)
    params = dict(hidden=hidden, tokens=tokens, dtype=dtype, threads=16, subgroups=subgroups,
                  accumulate=accumulate)
    got, = run(dev, "rms_norm_grad", params, t,
               {"dy": dy, "x": x, "w": w, "rstd": rstd.astype(np.float32), "dres": dres},
               ["dres"])
    dx = rms_norm_grad_ref(dy.astype(np.float64), x64, w.astype(np.float64),
                           rstd.astype(np.float32).astype(np.float64))
    close(got, dres + dx if accumulate else dx, "f32", scale=4 * np.abs(dx).max(), what="dres")


@pytest.mark.parametrize("head_dim, dtype, tokens", [
    (6, "f32", 5), (16, "f16", None), (16, "f32", 5), (6, "f16", None)])
def test_rope_and_its_transpose(dev, head_dim, dtype, tokens):
    """q (3 heads) and k (2 kv heads) rotated in one dispatch at positions out
    of order (generate's cumsum(mask) - 1 repeats some), then rotated back by
    inverse=True: each against apply_rotary_pos_emb and its transpose."""
    dt = storage(dev, dtype)
    rng = np.random.default_rng(5)
    t, heads, kv = 5, 3, 2
    cos, sin = rope_tables(head_dim, 40)
    positions = np.array([0, 39, 7, 7, 1], np.uint32)
    q = rng.standard_normal((t, heads * head_dim)).astype(dt)
    k = rng.standard_normal((t, kv * head_dim)).astype(dt)
    tables = {"cosines": cos, "sines": sin, "positions": positions}
    params = dict(heads=heads, head_dim=head_dim, tokens=tokens, dtype=dtype, kv_heads=kv,
                  threads=8)
    for inverse in (False, True):
        gq, gk = run(dev, "rope", {**params, "inverse": inverse}, t,
                     {**tables, "q": q, "k": k}, ["q", "k"])
        for got, x, n in ((gq, q, heads), (gk, k, kv)):
            want = rope_ref(x.astype(np.float64), n, positions, cos, sin, inverse)
            close(got, want, dtype, scale=4, what=f"inverse={inverse}")
    one, = run(dev, "rope", dict(heads=heads, head_dim=head_dim, tokens=tokens, dtype=dtype,
                                 threads=8), t, {**tables, "q": q}, ["q"])
    close(one, rope_ref(q.astype(np.float64), heads, positions, cos, sin), dtype, scale=4,
          what="q alone")


@pytest.mark.parametrize("inter, dtype, tokens", [
    (37, "f32", 4), (40, "f16", None), (40, "f32", None), (37, "f16", 4)])
def test_swiglu_and_its_gradient(dev, inter, dtype, tokens):
    """act = silu(gate) up; d_gate, d_up into their own buffers and in place
    over gate and up; gate spans -12..12 (sigmoid's tails)."""
    dt = storage(dev, dtype)
    rng = np.random.default_rng(6)
    t = 4
    gate = rng.uniform(-12, 12, (t, inter)).astype(dt)
    up, d_act = (rng.standard_normal((t, inter)).astype(dt) for _ in range(2))
    g64, u64, d64 = (a.astype(np.float64) for a in (gate, up, d_act))
    base = dict(inter=inter, tokens=tokens, dtype=dtype, threads=16)
    act, = run(dev, "swiglu", base, t, {"gate": gate, "up": up, "act": np.zeros_like(gate)},
               ["act"])
    close(act, swiglu_ref(g64, u64), dtype, scale=12, what="act")
    want_g, want_u = swiglu_grad_ref(d64, g64, u64)
    zeros = np.zeros_like(gate)
    sep = run(dev, "swiglu_grad", base, t,
              {"d_act": d_act, "gate": gate, "up": up, "d_gate": zeros, "d_up": zeros},
              ["d_gate", "d_up"])
    inplace = run(dev, "swiglu_grad", {**base, "in_place": True}, t,
                  {"d_act": d_act, "gate": gate, "up": up}, ["gate", "up"])
    for (got_g, got_u), how in ((sep, "own buffers"), (inplace, "in place")):
        close(got_g, want_g, dtype, scale=12, what=f"d_gate {how}")
        close(got_u, want_u, dtype, scale=12, what=f"d_up {how}")


@pytest.mark.parametrize("hidden, dtype, tokens", [(37, "f32", 3), (40, "f16", None)])
def test_residual_adds_a_stored_block_output_to_the_f32_stream(dev, hidden, dtype, tokens):
    """out = x + y, x and out f32, y stored as dtype (widened exactly)."""
    dt = storage(dev, dtype)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    y = rng.standard_normal((3, hidden)).astype(dt)
    out, = run(dev, "residual", dict(hidden=hidden, tokens=tokens, dtype=dtype, threads=16), 3,
               {"x": x, "y": y, "out": np.zeros_like(x)}, ["out"])
    close(out, x.astype(np.float64) + y.astype(np.float64), "f32", scale=4, what="out")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_residual_add(dev, dtype):
    """add_scaled with y_dtype: an f32 residual h += y (f16 or f32), 3 x 37
    elements (the run-time token count) and 111 baked."""
    dt = storage(dev, dtype)
    rng = np.random.default_rng(7)
    h = rng.standard_normal((3, 37)).astype(np.float32)
    y = rng.standard_normal((3, 37)).astype(dt)
    want = h.astype(np.float64) + y.astype(np.float64)
    for params in (dict(num_elements=None, columns=37), dict(num_elements=111)):
        got, = run(dev, "add_scaled", dict(params, scale=1.0, y_dtype=dtype, threads=32), 3,
                   {"y": y, "output": h}, ["output"])
        close(got, want, "f32", scale=4, what=str(params))


@pytest.mark.parametrize("classes, dtype, tokens, in_place, subgroups, scale", [
    (37, "f32", 6, False, False, 1.0), (40, "f16", None, True, True, 6.0),
    (40, "f32", 6, True, False, 1.0), (37, "f16", None, False, True, 1.0)])
def test_lm_loss_ignores_labels(dev, classes, dtype, tokens, in_place, subgroups, scale):
    """softmax_xent(ignore=True): rows labelled IGNORE get loss 0 and g 0, the
    others g = (softmax - onehot) / count with count = 4 labelled rows of 6
    (counted in the kernel); sum(losses) / count is transformers' loss. g over
    the logits (in_place) or in its own buffer; times grad_scale (a loss scale)."""
    dt = storage(dev, dtype)
    if subgroups and not dev.has_feature("subgroup"):
        pytest.skip(f"{dev.name} lacks subgroups")
    rng = np.random.default_rng(8)
    t = 6
    logits = (4 * rng.standard_normal((t, classes))).astype(dt)
    labels = np.array([3, IGNORE, classes - 1, 0, IGNORE, 17], np.uint32)
    params = dict(classes=classes, tokens=tokens, dtype=dtype, threads=16, ignore=True,
                  in_place=in_place, subgroups=subgroups, grad_scale=scale)
    buffers = {"logits": logits, "labels": labels, "losses": np.full(t, 9.0, np.float32)}
    if not in_place:
        buffers["g"] = np.zeros_like(logits)
    losses, g = run(dev, "softmax_xent", params, t, buffers,
                    ["losses", "logits" if in_place else "g"])
    want_losses, want_g, count = xent_ref(logits.astype(np.float64), labels, classes)
    assert count == 4
    close(losses, want_losses, "f32", scale=10, what="losses")
    close(g, want_g * scale, dtype, scale=scale / count, what="g")
    assert (g[labels == IGNORE] == 0).all() and (losses[labels == IGNORE] == 0).all()


def test_lm_loss_marks_a_label_past_the_classes(dev):
    """ignore=True keeps softmax_xent's mark of a label outside the classes
    (IGNORE aside): loss -1 - label, g 0, and the row is not counted."""
    logits = np.random.default_rng(13).standard_normal((4, 12)).astype(np.float32)
    labels = np.array([5, 12, IGNORE, 0], np.uint32)
    losses, g = run(dev, "softmax_xent", dict(classes=12, tokens=4, threads=8, ignore=True), 4,
                    {"logits": logits, "labels": labels, "g": np.ones_like(logits),
                     "losses": np.ones(4, np.float32)}, ["losses", "g"])
    kept = np.where(labels == 12, IGNORE, labels)
    want_losses, want_g, count = xent_ref(logits.astype(np.float64), kept, 12)
    assert count == 2 and losses[1] == -13.0 and (g[1] == 0).all()
    close(np.delete(losses, 1), np.delete(want_losses, 1), "f32", scale=10)
    close(g, want_g, "f32", scale=1 / count)


def test_lm_loss_of_an_all_ignored_batch_is_zero(dev):
    """No labelled row: losses 0 and g 0 (transformers gives nan)."""
    logits = np.random.default_rng(9).standard_normal((3, 12)).astype(np.float32)
    labels = np.full(3, IGNORE, np.uint32)
    losses, g = run(dev, "softmax_xent", dict(classes=12, tokens=3, threads=8, ignore=True), 3,
                    {"logits": logits, "labels": labels, "g": np.ones_like(logits),
                     "losses": np.ones(3, np.float32)}, ["losses", "g"])
    assert (losses == 0).all() and (g == 0).all()


@pytest.mark.parametrize("vocab, dtype, tokens, subgroups", [
    (37, "f32", 3, False), (40, "f16", None, True), (40, "f32", 3, True),
    (37, "f16", None, False)])
def test_argmax_takes_the_first_of_ties(dev, vocab, dtype, tokens, subgroups):
    """ids[offset[0] + ahead + r] = torch.argmax of row r: row 0's largest value
    at 3 places (in one vec4, and in other threads' slices), row 1's at its
    last column, row 2 all equal; ids outside 4 .. 6 untouched."""
    dt = storage(dev, dtype)
    if subgroups and not dev.has_feature("subgroup"):
        pytest.skip(f"{dev.name} lacks subgroups")
    rng = np.random.default_rng(10)
    logits = rng.uniform(-5, 5, (3, vocab)).astype(dt)
    logits[0, [9, 10, 30]] = 6.0
    logits[1, -1] = 7.0
    logits[2] = -1.5
    ids = np.full(8, 99, np.uint32)
    got, = run(dev, "argmax", dict(vocab=vocab, tokens=tokens, dtype=dtype, threads=8,
                                   subgroups=subgroups, ahead=3), 3,
               {"logits": logits, "ids": ids, "offset": np.array([1], np.uint32)}, ["ids"])
    want = ids.copy()
    want[4:7] = np.argmax(logits.astype(np.float64), -1)
    assert list(want[4:7]) == [9, vocab - 1, 0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, params, message", [
    ("embed", dict(hidden=0, rows=5, tokens=2), "hidden must be a positive int, got 0"),
    ("embed", dict(hidden=8, rows=5, tokens=2, first_row=-1), "first_row must be an int >= 0"),
    ("rms_norm", dict(hidden=8, tokens=2, eps=-1e-6), r"eps must be a number in \[0, 1\)"),
    ("rms_norm", dict(hidden=8, tokens=2, eps=1e-6, threads=48), "threads must be a power of two"),
    ("rms_norm_grad", dict(hidden=8, tokens=0), "tokens must be a positive int, got 0"),
    ("rope", dict(heads=2, head_dim=7, tokens=2), "head_dim must be even"),
    ("rope", dict(heads=2, head_dim=8, tokens=2, kv_heads=-1), "kv_heads must be an int >= 0"),
    ("swiglu", dict(inter=2.5, tokens=2), "inter must be a positive int, got 2.5"),
    ("argmax", dict(vocab=10, tokens=2, subgroups=1), "subgroups must be a bool"),
    ("softmax_xent", dict(classes=10, tokens=None, seen=True), "seen keeps a .* tokens=None"),
])
def test_bad_parameters_are_refused_by_name(name, params, message):
    with pytest.raises(KernelBuildError, match=message):
        KERNELS[name].kernel(**params)


def numeric_grad(f, x, dy, h=1e-6):
    """d/dx of sum(f(x) * dy) by central differences, float64."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = h
        grad[i] = ((f(x + step) - f(x - step)) * dy).sum() / (2 * h)
    return grad


def test_gradient_references_are_the_forwards_derivatives():
    """rms_norm_grad_ref, rope_ref(inverse=True), swiglu_grad_ref and xent_ref's g
    against central differences of the forward references (float64)."""
    rng = np.random.default_rng(12)
    x, w, dy = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal((3, 5))
    _, rstd = rms_norm_ref(x, w, 1e-6)
    np.testing.assert_allclose(rms_norm_grad_ref(dy, x, w, rstd),
                               numeric_grad(lambda v: rms_norm_ref(v, w, 1e-6)[0], x, dy),
                               rtol=1e-6, atol=1e-8)
    cos, sin = rope_tables(4, 6)
    positions = np.array([5, 0, 2])
    q, dq = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    np.testing.assert_allclose(rope_ref(dq, 2, positions, cos, sin, inverse=True),
                               numeric_grad(lambda v: rope_ref(v, 2, positions, cos, sin), q, dq),
                               rtol=1e-6, atol=1e-8)
    gate, up, d_act = rng.uniform(-6, 6, (3, 3, 4))
    want_g, want_u = swiglu_grad_ref(d_act, gate, up)
    np.testing.assert_allclose(want_g, numeric_grad(lambda v: swiglu_ref(v, up), gate, d_act),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(want_u, numeric_grad(lambda v: swiglu_ref(gate, v), up, d_act),
                               rtol=1e-6, atol=1e-8)
    logits, labels = rng.standard_normal((3, 5)), np.array([4, IGNORE, 0], np.uint32)

    def mean_loss(v):
        losses, _, count = xent_ref(v, labels, 5)
        return losses.sum() / count
    np.testing.assert_allclose(xent_ref(logits, labels, 5)[1],
                               numeric_grad(mean_loss, logits, np.float64(1.0)),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.slow  # importing transformers takes 4 s of the 6
def test_references_match_transformers():
    """The references above against transformers' own LlamaRMSNorm, rotate_half /
    apply_rotary_pos_emb and SiLU, and torch's cross_entropy (ignore_index -100),
    in float64, gradients by autograd: a check of the references themselves."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers.activations import ACT2FN

    rng = np.random.default_rng(11)
    t, hidden, heads, head_dim = 4, 10, 2, 6

    def tensor(a):
        return torch.tensor(a, dtype=torch.float64, requires_grad=True)

    x, w, dy = rng.standard_normal((t, hidden)), rng.standard_normal(hidden), \
        rng.standard_normal((t, hidden))
    norm = llama.LlamaRMSNorm(hidden, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
    xt = tensor(x)
    (norm(xt) * torch.tensor(dy)).sum().backward()
    y, rstd = rms_norm_ref(x, w, 1e-6)  # LlamaRMSNorm computes in f32 whatever its input
    np.testing.assert_allclose(norm(xt).detach().numpy(), y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(xt.grad.numpy(), rms_norm_grad_ref(dy, x, w, rstd), rtol=1e-5,
                               atol=1e-6)

    cos, sin = rope_tables(head_dim, 9)
    positions = np.array([3, 0, 8, 8])
    q = rng.standard_normal((t, heads * head_dim))
    c = torch.tensor(np.concatenate([cos, cos], -1)[positions], dtype=torch.float64)[None]
    s = torch.tensor(np.concatenate([sin, sin], -1)[positions], dtype=torch.float64)[None]
    qt = tensor(q.reshape(t, heads, head_dim).transpose(1, 0, 2)[None])  # [1, heads, T, D]
    rotated, _ = llama.apply_rotary_pos_emb(qt, qt, c, s)
    dq = rng.standard_normal(rotated.shape)
    (rotated * torch.tensor(dq)).sum().backward()

    def flat(a):  # [1, heads, T, D] -> [T, heads * D]
        return a[0].transpose(1, 0, 2).reshape(t, -1)
    np.testing.assert_allclose(flat(rotated.detach().numpy()),
                               rope_ref(q, heads, positions, cos, sin), rtol=1e-12)
    np.testing.assert_allclose(flat(qt.grad.numpy()),
                               rope_ref(flat(dq), heads, positions, cos, sin, inverse=True),
                               rtol=1e-10, atol=1e-12)

    gate, up, d_act = (rng.uniform(-6, 6, (t, hidden)) for _ in range(3))
    gt, ut = tensor(gate), tensor(up)
    act = ACT2FN["silu"](gt) * ut
    (act * torch.tensor(d_act)).sum().backward()
    np.testing.assert_allclose(act.detach().numpy(), swiglu_ref(gate, up), rtol=1e-12)
    want_g, want_u = swiglu_grad_ref(d_act, gate, up)
    np.testing.assert_allclose(gt.grad.numpy(), want_g, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ut.grad.numpy(), want_u, rtol=1e-10, atol=1e-12)

    logits = rng.standard_normal((t, 7))
    labels = np.array([2, IGNORE, 6, 0], np.uint32)
    lt = tensor(logits)
    torch_labels = torch.tensor(np.where(labels == IGNORE, -100, labels.astype(np.int64)))
    loss = torch.nn.functional.cross_entropy(lt, torch_labels, ignore_index=-100)
    loss.backward()
    losses, g, count = xent_ref(logits, labels, 7)
    np.testing.assert_allclose(losses.sum() / count, loss.item(), rtol=1e-12)
    np.testing.assert_allclose(g, lt.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("width, dtype", [(6, "f32"), (8, "f16")])
def test_kv_write_puts_rows_at_past(dev, width, dtype):
    """cache[b, past + i] = src[b, i] for 2 sequences of 3 rows at past 4 of a
    cache of 9 rows each; the other rows untouched."""
    dt = storage(dev, dtype)
    rng = np.random.default_rng(13)
    src = rng.standard_normal((6, width)).astype(dt)
    cache = np.full((18, width), 7.0, dt)
    got, = run(dev, "kv_write", dict(batch=2, rows=3, kv_len=9, width=width, dtype=dtype), 6,
               {"src": src, "past": np.array([4], np.uint32), "cache": cache}, ["cache"])
    want = cache.astype(np.float64)
    want[4:7], want[13:16] = src[:3], src[3:]
    np.testing.assert_array_equal(got, want)


def test_last_rows_and_decode_advance(dev):
    """last_rows: each sequence's last row; decode_advance: past + 1, every
    position + 1 and the ids' offset + batch."""
    x = np.arange(5 * 3 * 4, dtype=np.float32).reshape(15, 4)
    got, = run(dev, "last_rows", dict(batch=3, seq=5, width=4), 3,
               {"src": x, "dst": np.zeros((3, 4), np.float32)}, ["dst"])
    np.testing.assert_array_equal(got, x[[4, 9, 14]])
    past, positions, offset = run(dev, "decode_advance", dict(batch=3), 1, {
        "past": np.array([7], np.uint32), "positions": np.array([2, 5, 9], np.uint32),
        "offset": np.array([6], np.uint32)}, ["past", "positions", "offset"])
    assert list(past) == [8] and list(positions) == [3, 6, 10] and list(offset) == [9]
