"""Training on the GPU: every backward kernel and strategy against float64
numpy (and the reference against central finite differences), accumulation,
the optimizers against a numpy transcription of their formula, the losses,
a training step that stays on the GPU, bad input, and the train command."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lora_errors import NoDispatch

import lora
from lora import SGD, AdamW, Backward, LayerTrainer, backward_plan
from lora import reference as R
from lora.core import tuning
from lora.training import strategy
from lora.training.strategy import Split
from shaderdsl.errors import AliasingError, BindingError

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BACKWARD_TEXTS = ["seed", "paired:64", "paired:256", "split:64", "split:128:16", "split:64:3",
                  "split:64:0:sg", "split:64:0:8", "split:64:5:4:sg", "gemm:64", "gemm:256:16"]


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def grad_tolerance(x, a, b, g, scale):
    """|gpu - ref| bound per gradient: 1e-5 of the sums of absolute products."""
    m = R.backward(np.abs(x), np.abs(a), np.abs(b), np.abs(g), abs(scale))
    return {k: 1e-5 * m[k] + 1e-30 for k in ("dh", "grad_a", "grad_b", "grad_x")}


def run_backward(device, x, a, b, g, scale, strategy, accumulate=False, start=None):
    """lora.backward_plan on fresh buffers (h from the float64 reference); the gradients."""
    w = lora.Weight.from_numpy(device, a, b)
    tokens = 1 if x.ndim == 1 else x.shape[0]
    h = (np.atleast_2d(x).astype(np.float64) @ a.T).astype(np.float32)
    plan = backward_plan(device, w, scale, tokens, strategy, accumulate=accumulate)
    start = start or {}
    bufs = {"g": device.buffer(g), "x": device.buffer(x), "h": device.buffer(h),
            "dA": device.buffer(start.get("dA", np.full(a.shape, np.nan, np.float32))),
            "dB": device.buffer(start.get("dB", np.full(b.shape, np.nan, np.float32))),
            "dx": device.buffer(start.get("dx", np.full(x.shape, np.nan, np.float32)))}
    plan(bufs["g"], bufs["x"], bufs["h"], bufs["dA"], bufs["dB"], bufs["dx"])
    return {"grad_a": device.read(bufs["dA"]), "grad_b": device.read(bufs["dB"]),
            "grad_x": device.read(bufs["dx"]), "dh": device.read(plan.scratch["dh"])}


def fitted(strategy, *dims) -> tuple:
    """The dims rounded up to multiples of 4 for gemm (its tiles are vec4s)."""
    return tuple(-(-d // 4) * 4 for d in dims) if strategy.name == "gemm" else dims


def assert_within(got, want, tol, what):
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    bad = np.argwhere(~(np.abs(got - want) <= tol))
    assert bad.size == 0, f"{what}: {len(bad)} out of tolerance, first {bad[0].tolist()}"


# ---------------------------------------------------------------- backward

@pytest.mark.examples(quick=4)
@SETTINGS
@given(strategy=st.sampled_from(BACKWARD_TEXTS), rank=st.integers(1, 20),
       in_dim=st.integers(1, 300), out_dim=st.integers(1, 300), tokens=st.integers(1, 140),
       scale=st.floats(-4, 4, allow_nan=False, width=32), seed=st.integers(0, 2**32 - 1))
def test_backward_matches_numpy(device, strategy, rank, in_dim, out_dim, tokens, scale, seed):
    s = Backward.parse(strategy)
    if s.subgroups and not device.has_feature("subgroup"):
        return
    if s.name == "paired":
        tokens = min(tokens, 4)
    rank, in_dim, out_dim = fitted(s, rank, in_dim, out_dim)
    rng = np.random.default_rng(seed)
    x, g = normal(rng, (tokens, in_dim)), normal(rng, (tokens, out_dim))
    a, b = normal(rng, (rank, in_dim)), normal(rng, (out_dim, rank))
    got = run_backward(device, x, a, b, g, scale, s)
    want, tol = R.backward(x, a, b, g, scale), grad_tolerance(x, a, b, g, scale)
    for key in ("grad_a", "grad_b", "grad_x"):
        assert_within(got[key], want[key], tol[key], f"{strategy} {key}")


@pytest.mark.parametrize("strategy", BACKWARD_TEXTS)
def test_backward_of_one_token_and_accumulation(device, strategy):
    """One 1-D token; then accumulate=True adds to what the gradients held."""
    s = Backward.parse(strategy)
    if s.subgroups and not device.has_feature("subgroup"):
        pytest.skip("adapter lacks 'subgroup'")
    rng = np.random.default_rng(7)
    rank, in_dim, out_dim = fitted(s, 3, 37, 29)
    x, g = normal(rng, in_dim), normal(rng, out_dim)
    a, b = normal(rng, (rank, in_dim)), normal(rng, (out_dim, rank))
    want, tol = R.backward(x, a, b, g, 0.5), grad_tolerance(x, a, b, g, 0.5)
    start = {"dA": normal(rng, a.shape), "dB": normal(rng, b.shape), "dx": normal(rng, x.shape)}
    got = run_backward(device, x, a, b, g, 0.5, s, accumulate=True, start=start)
    for key, role in (("grad_a", "dA"), ("grad_b", "dB"), ("grad_x", "dx")):
        assert_within(got[key], want[key] + start[role], tol[key] + 1e-6, f"{strategy} {key}")


def test_reference_backward_against_finite_differences():
    rng = np.random.default_rng(8)
    x, a, b, g = (rng.standard_normal(s) for s in ((3, 5), (2, 5), (4, 2), (3, 4)))
    d = R.backward(x, a, b, g, 1.5)
    def loss(xx, aa, bb):
        return float(np.sum(g * R.forward(xx, aa, bb, 1.5)))
    for key, arr, which in (("grad_a", a, 1), ("grad_b", b, 2), ("grad_x", x, 0)):
        numeric = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            args_p, args_m = [x.copy(), a.copy(), b.copy()], [x.copy(), a.copy(), b.copy()]
            args_p[which][i] += 1e-6
            args_m[which][i] -= 1e-6
            numeric[i] = (loss(*args_p) - loss(*args_m)) / 2e-6
        np.testing.assert_allclose(d[key], numeric, rtol=1e-6, atol=1e-8, err_msg=key)


def test_gpu_gradients_against_finite_differences(device):
    """The GPU's gradients of sum(g * out) agree with central differences of the
    float64 forward (small shape, float32 tolerance)."""
    rng = np.random.default_rng(9)
    x, g = normal(rng, (2, 6)), normal(rng, (2, 5))
    a, b = normal(rng, (3, 6)), normal(rng, (5, 3))
    got = run_backward(device, x, a, b, g, 2.0, "split:64")
    def loss(aa, bb):
        return float(np.sum(g * R.forward(x, aa, bb, 2.0)))
    for key, arr in (("grad_a", a), ("grad_b", b)):
        numeric = np.zeros(arr.shape)
        for i in np.ndindex(arr.shape):
            plus, minus = arr.astype(np.float64), arr.astype(np.float64)
            plus[i] += 1e-5
            minus[i] -= 1e-5
            args = (plus, b) if key == "grad_a" else (a, plus)
            margs = (minus, b) if key == "grad_a" else (a, minus)
            numeric[i] = (loss(*args) - loss(*margs)) / 2e-5
        np.testing.assert_allclose(got[key], numeric, rtol=1e-4, atol=1e-4, err_msg=key)


@pytest.mark.parametrize("strategy", ["seed", "split"])
def test_execute_functions_one_kernel_each(device, strategy):
    rng = np.random.default_rng(10)
    x, g = normal(rng, (70, 40)), normal(rng, (70, 24))
    a, b = normal(rng, (4, 40)), normal(rng, (24, 4))
    w = lora.Weight.from_numpy(device, a, b)
    ref = R.backward(x, a, b, g, 1.5)
    tol = grad_tolerance(x, a, b, g, 1.5)
    xb, gb, hb = device.buffer(x), device.buffer(g), device.buffer(ref["h"].astype(np.float32))
    dh, dA = device.empty((70, 4), np.float32), device.empty((4, 40), np.float32)
    dB, dx = device.empty((24, 4), np.float32), device.empty((70, 40), np.float32)
    lora.execute_grad_b(device, w, 1.5, gb, hb, dB, strategy=strategy)
    lora.execute_grad_dh(device, w, 1.5, gb, dh, strategy=strategy)
    lora.execute_grad_a(device, w, dh, xb, dA, strategy=strategy)
    lora.execute_grad_input(device, w, dh, dx, strategy=strategy)
    for buf, key in ((dh, "dh"), (dA, "grad_a"), (dB, "grad_b"), (dx, "grad_x")):
        assert_within(device.read(buf), ref[key], 4 * tol[key] + 1e-6, f"{strategy} {key}")


@pytest.mark.parametrize("forward", ["single:64:1", "tiled:64:8", "split:64", "three:64", "seed"])
def test_forward_train_saves_h(device, forward):
    rng = np.random.default_rng(11)
    tokens = 1 if forward.startswith("single") else 13
    x, base = normal(rng, (tokens, 40)), normal(rng, (tokens, 24))
    a, b = normal(rng, (3, 40)), normal(rng, (24, 3))
    w = lora.Weight.from_numpy(device, a, b)
    xb, ob, hb = device.buffer(x), device.buffer(base), device.empty((tokens, 3), np.float32)
    lora.execute_lora_forward_train(device, w, 0.5, xb, ob, hb, strategy=forward)
    assert_within(device.read(hb), R.project_a(a, x), R.h_tolerance(x, a), "h")
    assert_within(device.read(ob), R.forward(x, a, b, 0.5, base), R.tolerance(x, a, b, 0.5, base),
                  "out")


def test_numpy_backward(device):
    rng = np.random.default_rng(12)
    x, g = normal(rng, (5, 33)), normal(rng, (5, 21))
    a, b = normal(rng, (4, 33)), normal(rng, (21, 4))
    gx, ga, gb = lora.backward(x, a, b, g, alpha=8.0, device=device)
    want, tol = R.backward(x, a, b, g, 2.0), grad_tolerance(x, a, b, g, 2.0)
    assert_within(gx, want["grad_x"], tol["grad_x"], "grad_x")
    assert_within(ga, want["grad_a"], tol["grad_a"], "grad_a")
    assert_within(gb, want["grad_b"], tol["grad_b"], "grad_b")


# ---------------------------------------------------------------- bad input

def test_backward_refuses_bad_buffers_before_dispatch(device):
    rng = np.random.default_rng(13)
    w = lora.Weight.from_numpy(device, normal(rng, (3, 16)), normal(rng, (8, 3)))
    bufs = {"g": device.buffer(normal(rng, (2, 8))), "x": device.buffer(normal(rng, (2, 16))),
            "h": device.buffer(normal(rng, (2, 3))), "dA": device.empty((3, 16), np.float32),
            "dB": device.empty((8, 3), np.float32)}
    def call(**kw):
        lora.execute_lora_backward(
            device, w, 1.0, *(kw.get(k, bufs[k]) for k in ("g", "x", "h", "dA", "dB")))
    with NoDispatch(device, BindingError,
                    r"grad_b_buf must be float32 \(8, 3\), got float32 \(3, 8\)"):
        call(dB=device.empty((3, 8), np.float32))
    with NoDispatch(device, BindingError,
                    r"x_buf must be float32 \(2, 16\) \(the weight's dtype\), got int32"):
        call(x=device.buffer(np.ones((2, 16), np.int32)))
    with NoDispatch(device, AliasingError, r"x_buf and grad_x_buf are the same buffer"):
        lora.execute_lora_backward(device, w, 1.0, bufs["g"], bufs["x"], bufs["h"], bufs["dA"],
                                   bufs["dB"], bufs["x"])
    with NoDispatch(device, BindingError, r"grad_out_buf: expected shape \(out_dim,\) = \(8,\)"):
        call(g=device.buffer(normal(rng, (2, 9))))
    with pytest.raises(ValueError, match="the paired backward takes at most 4 tokens"):
        backward_plan(device, w, 1.0, 5, "paired")
    with pytest.raises(ValueError, match="cannot parse backward strategy 'split:x'"):
        Backward.parse("split:x")
    if device.has_feature("shader-f16"):
        w16 = lora.Weight.from_numpy(device, np.ones((3, 16)), np.ones((8, 3)), dtype=np.float16)
        trainer = LayerTrainer(device, w16, 1.0, 2, AdamW())
        with NoDispatch(device, BindingError, r"input buffer must be float16 \(2, 16\) \(the "
                                              r"weight's dtype\), got float32"):
            trainer.record(bufs["x"], device.empty((2, 8), np.float16),
                           device.empty((2, 8), np.float16), device.empty((2, 8), np.float16))


# ---------------------------------------------------------------- optimizers

def transcription(kind, steps, grads, p0, **kw):
    """The documented update in float32 numpy, step by step (lora.reference)."""
    p, state = p0.astype(np.float32), [np.zeros_like(p0, np.float32)] * 2
    for step, g in enumerate(grads, 1):
        if kind == "adamw":
            p, m, v = R.adamw_step(p, g, state[0], state[1], step, kw["lr"], dtype=np.float32,
                                   weight_decay=kw["weight_decay"])
            state = [m, v]
        else:
            p, buf = R.sgd_step(p, g, state[0], step, kw["lr"], kw["momentum"], kw["weight_decay"],
                                dtype=np.float32)
            state = [buf, None]
    return p


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_against_the_formula(device, kind):
    """40 steps with ordinary, zero, tiny and huge gradients: no NaN, and the
    float32 transcription of the documented formula agrees to a few ulp."""
    rng = np.random.default_rng(14)
    p0 = [normal(rng, (3, 50)), normal(rng, (50, 3))]
    grads = []
    for step in range(40):
        big = 1e30 if kind == "adamw" else 1e3
        scale = [1.0, 0.0, 1e-30, big][step % 4]
        grads.append([normal(rng, p.shape) * np.float32(scale) for p in p0])
    kw = dict(lr=1e-2, weight_decay=0.1) | ({} if kind == "adamw" else {"momentum": 0.9})
    opt = AdamW(**kw, device=device) if kind == "adamw" else SGD(**kw, device=device)
    params = p0
    with np.errstate(over="ignore"):
        for g in grads:
            params = opt.step(params, g)
        for k in range(2):
            want = transcription(kind, 40, [g[k] for g in grads], p0[k], **kw)
            assert np.isfinite(params[k]).all()
            # FMA contraction on the GPU rounds differently: relative to the
            # tensor's scale, where cancellation leaves a small element
            np.testing.assert_allclose(params[k], want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    assert opt.step_count == 40


def test_adamw_schedule_clip_and_settings_without_recompiling(device):
    rng = np.random.default_rng(15)
    p = [normal(rng, (4, 8))]
    opt = AdamW(lr=1e-2, max_grad_norm=0.5, schedule="cosine", warmup=3, total=12, device=device)
    pr = p[0].astype(np.float64)
    m = v = np.zeros_like(pr)
    for step in range(1, 13):
        g = normal(rng, (4, 8)) * 4
        if step == 7:
            before = dict(device.stats)
            opt.set(weight_decay=0.05)
            assert device.stats["pipelines"] == before["pipelines"]
        p = opt.step(p, [g])
        lr = R.learning_rate(step, 1e-2, "cosine", 3, 12)
        c = R.clip_scale([g], 0.5)
        pr, m, v = R.adamw_step(pr, c * g.astype(np.float64), m, v, step, lr,
                                weight_decay=0.05 if step >= 7 else 0.01)
        norm = opt.last_norm()
        assert norm is not None  # clipping keeps the norm
        np.testing.assert_allclose(norm, np.sqrt(np.sum(g.astype(np.float64) ** 2)), rtol=1e-5)
    np.testing.assert_allclose(p[0], pr, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_grad_scale_undoes_a_loss_scale(device, kind):
    """Gradients given 1024 times too large with scale_gradients(1/1024) (a
    loss scale undone) step as the true gradients do, clipping included: the
    params equal those of an optimizer given the true gradients, and the
    norm reported is the true one."""
    rng = np.random.default_rng(16)
    p = [normal(rng, (4, 8))]
    grads = [normal(rng, (4, 8)) * 3 for _ in range(3)]
    make = AdamW if kind == "adamw" else SGD
    plain, scaled = (make(lr=1e-2, max_grad_norm=0.5, device=device) for _ in range(2))
    scaled.scale_gradients(1 / 1024)
    a, b = p, p
    for g in grads:
        a = plain.step(a, [g])
        b = scaled.step(b, [g * np.float32(1024)])
        assert np.isclose(scaled.last_norm() or 0.0, plain.last_norm() or 1.0, rtol=1e-6)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tensors", [6, 7, 15])
def test_clipping_any_number_of_tensors(device, tensors):
    """clip_grad_norm_ over every tensor however many: norm_partials first,
    up to 7 tensors a dispatch (6, 7: one; 15: 7 + 7 + 1).
    3 AdamW steps, clipped at each, and the norm, against float64."""
    rng = np.random.default_rng(tensors)
    shapes = [(int(rng.integers(1, 40)), 3) for _ in range(tensors)]
    ps = [normal(rng, s) for s in shapes]
    opt = AdamW(lr=1e-2, max_grad_norm=0.5, device=device)
    ref = [(p.astype(np.float64), 0.0, 0.0) for p in ps]
    for step in range(1, 4):
        gs = [normal(rng, s) for s in shapes]
        ps = opt.step(ps, gs)
        c = R.clip_scale(gs, 0.5)
        assert c < 0.5   # it clipped
        ref = [R.adamw_step(p, c * g.astype(np.float64), m, v, step, 1e-2)
               for (p, m, v), g in zip(ref, gs)]
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gs))
        got_norm = opt.last_norm()
        assert got_norm is not None and abs(got_norm - norm) <= 1e-6 * norm, (got_norm, norm)
    names = [st.kernel.name for plan in opt.plans() for st in plan.steps]
    assert names.count("norm_partials") == -(-tensors // 7)
    for got, (want, _, _) in zip(ps, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_norm_partials_sums_each_chunk(device):
    """norm_partials: one workgroup per ``chunk`` values of each gradient
    (ragged last chunks, a gradient smaller than one), every sum of squares
    in its slot after ``first``, against float64."""
    from lora.kernels.registry import KERNELS
    rng = np.random.default_rng(5)
    sizes, chunk, first = (300, 64, 5, 129), 64, 2
    grads = [normal(rng, (n,)) for n in sizes]
    spec = KERNELS["norm_partials"]
    params = dict(grad_sizes=sizes, chunk=chunk, first=first, slots=first + 5 + 1 + 1 + 3 + 1)
    out = device.buffer(np.full(params["slots"], -1.0, np.float32))
    device.dispatch(spec.kernel(**params), {**{f"g{k}": device.buffer(g)
                                               for k, g in enumerate(grads)}, "partials": out},
                    spec.grid(**params))
    want = [np.sum(g[i:i + chunk].astype(np.float64) ** 2)
            for g in grads for i in range(0, g.size, chunk)]
    got = device.read(out)
    assert spec.grid(**params) == (len(want), 1, 1)
    np.testing.assert_array_equal(got[:first], -1.0)   # slots before ``first`` untouched
    np.testing.assert_allclose(got[first:first + len(want)], want, rtol=1e-6)


def test_clipping_a_gradient_of_many_chunks(device):
    """A gradient of 3 x NORM_CHUNK + 5 values (four norm_partials
    workgroups) and a small one: the norm and the clipped AdamW step against
    float64."""
    from lora.kernels.optimizer import NORM_CHUNK
    rng = np.random.default_rng(9)
    shapes = [(3 * NORM_CHUNK + 5,), (7, 3)]
    ps, gs = [normal(rng, s) for s in shapes], [normal(rng, s) for s in shapes]
    opt = AdamW(lr=1e-2, max_grad_norm=1.0, device=device)
    got = opt.step(ps, gs)
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gs))
    got_norm = opt.last_norm()
    assert got_norm is not None and abs(got_norm - norm) <= 1e-6 * norm, (got_norm, norm)
    assert opt.partials.size == 4 + 1
    c = R.clip_scale(gs, 1.0)
    for p, g, new in zip(ps, gs, got):
        want, _, _ = R.adamw_step(p.astype(np.float64), c * g.astype(np.float64), 0.0, 0.0, 1,
                                  1e-2)
        np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-6)


def test_optimizer_refusals(device):
    with pytest.raises(ValueError, match="lr: expected a finite number"):
        AdamW(lr=float("nan"))
    with pytest.raises(ValueError, match="schedule: expected one of"):
        AdamW(schedule="step")
    with pytest.raises(ValueError, match="schedule 'cosine' needs total > warmup"):
        AdamW(schedule="cosine", warmup=10, total=5)
    opt = SGD(lr=0.1, device=device)
    opt.step([np.ones(3)], [np.ones(3)])
    with pytest.raises(ValueError,
                       match=r"shapes \[\(4,\)\] differ from the first call's \[\(3,\)\]"):
        opt.step([np.ones(4)], [np.ones(4)])
    with pytest.raises(ValueError, match="unknown setting 'beta3'"):
        opt.set(beta3=0.5)


# ---------------------------------------------------------------- losses and training steps

@pytest.mark.parametrize("loss", ["mse", "xent"])
def test_layer_trainer_matches_float64(device, loss):
    """30 steps of forward, loss, backward and AdamW, one submit each, against
    the same training in float64 numpy."""
    rng = np.random.default_rng(16)
    T, n_in, n_out, r, s = 6, 48, 10, 4, 2.0
    a, b = R.init_lora(n_in, n_out, r, seed=1)
    b = normal(rng, b.shape) * np.float32(0.1)
    x, base = normal(rng, (T, n_in)), normal(rng, (T, n_out))
    target = (normal(rng, (T, n_out)) if loss == "mse"
              else rng.integers(0, n_out, T).astype(np.uint32))
    w = lora.Weight.from_numpy(device, a, b)
    trainer = LayerTrainer(device, w, s, T, AdamW(lr=1e-2), loss=loss)
    xb, ob, tb, bb = (device.buffer(v) for v in (x, np.zeros_like(base), target, base))
    ar, br = a.astype(np.float64), b.astype(np.float64)
    moments = [np.zeros_like(ar)] * 2 + [np.zeros_like(br)] * 2
    for step in range(1, 31):
        before = device.stats["submits"]
        trainer.record(xb, ob, tb, bb)
        assert device.stats["submits"] - before == 1
        out = R.forward(x, ar, br, s, base)
        want, g = R.mse(out, target) if loss == "mse" else R.softmax_cross_entropy(out, target)
        d = R.backward(x, ar, br, g, s)
        ar, moments[0], moments[1] = R.adamw_step(ar, d["grad_a"], moments[0], moments[1],
                                                  step, 1e-2)
        br, moments[2], moments[3] = R.adamw_step(br, d["grad_b"], moments[2], moments[3],
                                                  step, 1e-2)
        assert abs(trainer.loss() - want) <= 1e-4 * abs(want), (step, trainer.loss(), want)


@pytest.mark.parametrize("forward", [None, "tiled:64:8"])
def test_f16_layer_trainer_is_mixed_precision(device, forward):
    """An f16 weight trains as torch.autocast does: f16 x, outputs, target and
    g, f32 masters updated by the optimizer, the weight their f16 rounding
    after each step. Against float64 of the same rounding of the stored
    values, 8 SGD steps."""
    if not device.has_feature("shader-f16"):
        pytest.skip(f"{device.name} lacks shader-f16")
    rng = np.random.default_rng(21)
    T, n_in, n_out, r, s, lr = 24, 64, 40, 8, 2.0, 0.5
    a, b = R.init_lora(n_in, n_out, r, seed=3)
    b = (normal(rng, b.shape) * np.float32(0.1)).astype(np.float16)
    a = a.astype(np.float16)
    x, base, target = (normal(rng, shape).astype(np.float16)
                       for shape in ((T, n_in), (T, n_out), (T, n_out)))
    w = lora.Weight.from_numpy(device, a, b, dtype=np.float16)
    trainer = LayerTrainer(device, w, s, T, SGD(lr=lr), loss="mse", forward=forward)
    xb, ob, tb, bb = (device.buffer(v) for v in (x, np.zeros_like(base), target, base))
    ar, br = a.astype(np.float64), b.astype(np.float64)
    first = 0.0
    for _ in range(8):
        trainer.record(xb, ob, tb, bb)
        out = R.forward(x, ar.astype(np.float16), br.astype(np.float16), s, base)
        loss, g = R.mse(out.astype(np.float16), target)
        d = R.backward(x, ar.astype(np.float16), br.astype(np.float16), g.astype(np.float16), s)
        ar, br = ar - lr * d["grad_a"], br - lr * d["grad_b"]
        first = first or loss
        assert abs(trainer.loss() - loss) <= 2e-3 * loss, (trainer.loss(), loss)
    got_a, got_b = (device.read(m) for m in trainer.masters)
    for got, want, start in ((got_a, ar, a), (got_b, br, b)):
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want - start).max()
    assert np.array_equal(device.read(w.a), got_a.astype(np.float16))
    assert np.array_equal(device.read(w.b), got_b.astype(np.float16))
    assert trainer.loss() < 0.9 * first
    # a weight written after the trainer was made: the masters follow (the next step
    # would otherwise write the old values back into it)
    old_a, new_a = got_a, normal(rng, a.shape) * np.float32(0.01)
    w.write(a=new_a)
    assert np.array_equal(device.read(trainer.masters[0]), new_a)
    trainer.record(xb, ob, tb, bb)
    stepped = device.read(trainer.masters[0])
    assert np.abs(stepped - new_a).max() < np.abs(stepped - old_a).max()
    assert np.array_equal(device.read(w.a), stepped.astype(np.float16))


# ---------------------------------------------------------------- LoRA dropout

def _dropout_trainer(device, p, seed=0, dtype=np.float32, tokens=64, in_dim=40, loss="mse"):
    """A trainer with lora_dropout=p on a fixed weight and batch; (trainer, x, buffers)."""
    rng = np.random.default_rng(30)
    a, b = R.init_lora(in_dim, 6, 4, seed=1)
    b = normal(rng, b.shape) * np.float32(0.1)
    w = lora.Weight.from_numpy(device, a, b, dtype=dtype)
    trainer = LayerTrainer(device, w, 2.0, tokens, AdamW(lr=1e-2), loss=loss, lora_dropout=p,
                           dropout_seed=seed)
    x = normal(rng, (tokens, in_dim)).astype(dtype)
    target = (normal(rng, (tokens, 6)) if loss == "mse"
              else rng.integers(0, 6, tokens).astype(np.uint32))
    bufs = [device.buffer(v) for v in (x, np.zeros((tokens, 6), dtype),
                                       target.astype(dtype) if loss == "mse" else target,
                                       normal(rng, (tokens, 6)).astype(dtype))]
    return trainer, x, bufs


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dropout_draws_the_hash_of_seed_step_and_index(device, dtype):
    """The mask is the numpy hash's (lora.kernels.dropout.keep_mask), the kept
    values x / (1 - p) within one rounding; about 1 - p of them are kept, a
    new mask each step, the same one for the same seed."""
    if dtype == np.float16 and not device.has_feature("shader-f16"):
        pytest.skip(f"{device.name} lacks shader-f16")
    from lora.kernels.dropout import keep_mask
    p, tokens, in_dim = 0.3, 256, 64
    trainer, x, bufs = _dropout_trainer(device, p, seed=11, dtype=dtype, tokens=tokens,
                                        in_dim=in_dim)
    masks = []
    for step in range(3):
        trainer.record(*bufs)
        got = device.read(trainer.x_dropped).astype(np.float64)
        mask = keep_mask(11, step, x.shape, p)
        want = np.where(mask, x.astype(np.float64) / (1 - p), 0.0)
        eps = 2.0 ** -10 if dtype == np.float16 else 2.0 ** -23
        assert np.all(np.abs(got - want) <= eps * np.abs(want))
        assert np.array_equal(got != 0, mask & (x != 0))
        kept, sigma = mask.mean(), np.sqrt(p * (1 - p) / mask.size)
        assert abs(kept - (1 - p)) <= 5 * sigma, (step, kept)
        masks.append(mask)
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    assert abs((masks[0] == masks[1]).mean() - (p * p + (1 - p) ** 2)) <= 0.02  # independent
    again, _, bufs2 = _dropout_trainer(device, p, seed=11, dtype=dtype, tokens=tokens,
                                       in_dim=in_dim)
    again.record(*bufs2)
    assert np.array_equal(device.read(again.x_dropped) != 0, masks[0] & (x != 0))
    assert not np.array_equal(keep_mask(12, 0, x.shape, p), masks[0])


@pytest.mark.parametrize("loss", ["mse", "xent"])
def test_layer_trainer_with_dropout_matches_float64(device, loss):
    """peft's lora_B(lora_A(dropout(x))) * scaling, base undropped: 12 AdamW
    steps against float64 numpy given the same masks."""
    from lora.kernels.dropout import keep_mask
    p, s = 0.2, 2.0
    trainer, x, bufs = _dropout_trainer(device, p, seed=3, loss=loss)
    w = trainer.weight
    (a, b), target, base = w.numpy(), device.read(bufs[2]), device.read(bufs[3])
    ar, br = a.astype(np.float64), b.astype(np.float64)
    moments = [np.zeros_like(ar)] * 2 + [np.zeros_like(br)] * 2
    for step in range(12):
        trainer.record(*bufs)
        xd = np.where(keep_mask(3, step, x.shape, p), x / (1 - p), 0.0)
        out = R.forward(xd, ar, br, s, base)
        want, g = R.mse(out, target) if loss == "mse" else R.softmax_cross_entropy(out, target)
        d = R.backward(xd, ar, br, g, s)
        ar, moments[0], moments[1] = R.adamw_step(ar, d["grad_a"], moments[0], moments[1],
                                                  step + 1, 1e-2)
        br, moments[2], moments[3] = R.adamw_step(br, d["grad_b"], moments[2], moments[3],
                                                  step + 1, 1e-2)
        assert abs(trainer.loss() - want) <= 1e-4 * abs(want), (step, trainer.loss(), want)
    got_a, got_b = w.numpy()
    assert np.abs(got_a - ar).max() <= 1e-4 * np.abs(ar).max()
    assert np.abs(got_b - br).max() <= 1e-4 * np.abs(br).max()


def test_no_dropout_is_the_step_without_it(device):
    """lora_dropout=0: no dispatch more, and A and B bit for bit those of a
    trainer made without the option; p > 0 adds one dispatch."""
    plain, _, bufs = _dropout_trainer(device, 0.0)
    names = [st.kernel.name for plan in plain.plans() for st in plan.steps]
    assert plain.dropout is None and "dropout" not in names
    rng = np.random.default_rng(30)
    a, b = R.init_lora(40, 6, 4, seed=1)
    w = lora.Weight.from_numpy(device, a, normal(rng, b.shape) * np.float32(0.1))
    today = LayerTrainer(device, w, 2.0, 64, AdamW(lr=1e-2))
    assert [st.kernel.name for plan in today.plans() for st in plan.steps] == names
    for _ in range(3):
        plain.record(*bufs)
        today.record(*bufs)
    for got, want in zip(plain.weight.numpy(), w.numpy()):
        assert np.array_equal(got, want)
    dropped, _, _ = _dropout_trainer(device, 0.1)
    assert [st.kernel.name for plan in dropped.plans() for st in plan.steps] == ["dropout", *names]


def test_the_exported_step_carries_the_dropout():
    """The web export records LayerTrainer's step: replayed as the JS trainer
    replays it (the recorded dispatches in order, twice), its dropout draws
    keep_mask's masks, a new one each step (the optimizer's state advances)."""
    from lora.apps.web_export import InterpDevice
    from lora.apps.web_train import TrainSetup, record_layer
    from lora.core.shape import LayerShape
    from lora.kernels.dropout import keep_mask
    rec = record_layer(TrainSetup(LayerShape(4, 24, 8, 16, "f32", 2.0), lora_dropout=0.4,
                                  seed=5))
    dev, x = rec.device, normal(np.random.default_rng(2), (16, 24))
    dev.write(rec.named["x"], x)
    dropped = next(op[2][1] for op in dev.ops if op[0] == "dispatch" and
                   op[1].name == "dropout")
    for step in range(2):
        for op in dev.ops:
            if op[0] == "dispatch":
                InterpDevice.dispatch(dev, op[1], op[2], op[3])
            else:
                InterpDevice._copy(dev, *op[1:])
        assert np.array_equal(dev.read(dropped) != 0, keep_mask(5, step, x.shape, 0.4))


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan"), "0.1", True])
def test_a_dropout_outside_zero_to_one_is_refused(device, p):
    with pytest.raises(ValueError, match=r"lora_dropout: expected a probability in \[0, 1\)"):
        _dropout_trainer(device, p)
    with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\^32\), got -1"):
        _dropout_trainer(device, 0.5, seed=-1)


def test_init_is_peft_like_and_seeded():
    a, b = R.init_lora(2560, 64, 8, seed=3)
    assert a.shape == (8, 2560) and not b.any() and np.abs(a).max() <= 1 / np.sqrt(2560)
    assert np.array_equal(a, R.init_lora(2560, 64, 8, seed=3)[0])
    assert not np.array_equal(a, R.init_lora(2560, 64, 8, seed=4)[0])
    g, _ = R.init_lora(1000, 10, 4, seed=0, kind="gaussian")
    assert abs(g.std() - 0.25) < 0.01  # N(0, 1/rank)


@pytest.mark.slow  # trains on digits end to end
def test_train_command(tmp_path, capsys):
    """python -m lora train --quick --check: trains, matches float64, writes a peft adapter."""
    from lora.apps.cli import main

    assert main(["train", "--quick", "--check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "check: the GPU loss trajectory is within" in out and ": ok" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.05
    assert summary["max_relative_difference"] <= 1e-4
    layers = lora.load_adapter(tmp_path / "adapter")
    assert set(layers) == {"fc1", "fc2"} and layers["fc1"].rank == 8 and layers["fc1"].scale == 2.0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["target_modules"] == ["fc1", "fc2"]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_train_command_with_dropout(tmp_path, capsys):
    """python -m lora train --lora-dropout 0.2 --check: the GPU's losses follow
    the float64 reference drawing the same masks (digits.dropout_multipliers),
    differ from a run without dropout, and the summary says what p was."""
    from lora.apps.cli import main

    args = ["train", "--steps", "12", "--batch", "32", "--check", "--no-plot"]
    assert main([*args, "--lora-dropout", "0.2", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "dropout 0.2 on fc1 and fc2" in out and ": ok" in out
    dropped = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert dropped["lora_dropout"] == 0.2 and dropped["max_relative_difference"] <= 1e-4
    assert main([*args, "--out", str(tmp_path / "p")]) == 0
    plain = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert plain["lora_dropout"] == 0.0 and plain["loss"][0] == dropped["loss"][0]  # B = 0
    assert plain["loss"][1:] != dropped["loss"][1:]


@pytest.mark.parametrize("argv, message", [
    (["--lora-dropout", "1"], "error: --lora-dropout must be in [0, 1) (a probability), got 1"),
    (["--lora-dropout", "-0.5"], "must be in [0, 1) (a probability), got -0.5"),
    (["--lora-dropout", "nan"], "must be in [0, 1) (a probability), got nan"),
    (["--lora-dropout", "0.1", "--seed", "-1"],
     "error: --seed must be in [0, 2^32) to seed --lora-dropout's masks, got -1"),
])
def test_train_command_refuses_a_bad_dropout(argv, message, tmp_path, capsys):
    from lora.apps.cli import main

    assert main(["train", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("rank", [4, 8, 64])
@pytest.mark.parametrize("tiled_dh", [False, True])
def test_split_backward_of_many_tokens(device, rank, tiled_dh, monkeypatch):
    """Split sums dA and dB over chunks (a ragged last chunk) and, from
    TILED_DH_ELEMENTS tokens x ranks, computes dh with grad_dh_tiled (one vec4
    of dh per thread; a ragged last tile)."""
    if tiled_dh:
        monkeypatch.setattr(strategy, "TILED_DH_ELEMENTS", 197 * rank)
    rng = np.random.default_rng(17 + rank)
    x, g = normal(rng, (197, 36)), normal(rng, (197, 44))
    a, b = normal(rng, (rank, 36)), normal(rng, (44, rank))
    plan_kernels = [k[0] for k in Backward.parse("split:64").kernels(
        lora.LayerShape(rank, 36, 44, tokens=197))]
    assert ("grad_dh_tiled" in plan_kernels) == (tiled_dh and rank % 4 == 0)
    got = run_backward(device, x, a, b, g, -1.25, "split:64")
    want, tol = R.backward(x, a, b, g, -1.25), grad_tolerance(x, a, b, g, -1.25)
    for key in ("dh", "grad_a", "grad_b", "grad_x"):
        assert_within(got[key], want[key], tol[key], key)


def test_the_training_forward_is_the_forward_models(device, cache_dir):
    """Nothing timed: the strategy the forward's model gives (gemm here, the
    H200's fastest), leaving h for the backward."""
    rng = np.random.default_rng()
    tokens, rank, in_dim, out_dim = 128, 32, 128, 32
    x, base = normal(rng, (tokens, in_dim)), normal(rng, (tokens, out_dim))
    a, b = normal(rng, (rank, in_dim)), normal(rng, (out_dim, rank))
    w = lora.Weight.from_numpy(device, a, b)
    plan = lora.train_forward_plan(device, w, 0.5, tokens, given=())
    assert str(plan.strategy) == "gemm(splits=4)" == str(tuning.model(device, w, tokens)[0])
    ob = device.buffer(base)
    plan(device.buffer(x), ob)
    assert_within(device.read(plan.h), R.project_a(a, x), R.h_tolerance(x, a), "h")
    assert_within(device.read(ob), R.forward(x, a, b, 0.5, base), R.tolerance(x, a, b, 0.5, base),
                  "out")


def _trainer(device, loss="mse", tokens=4, classes=3):
    rng = np.random.default_rng()
    a, b = normal(rng, (2, 8)), normal(rng, (classes, 2))
    return LayerTrainer(device, lora.Weight.from_numpy(device, a, b), 1.0, tokens, AdamW(),
                        loss=loss), rng, (a, b)


def test_a_step_needs_the_base_output(device):
    """out holds the last prediction after a step: training on it as the base
    diverged silently. base_buf is required; base_buf=out_buf says out holds it."""
    trainer, rng, (a, b) = _trainer(device)
    xs, target = normal(rng, (4, 8)), normal(rng, (4, 3))
    x, out, target_buf = device.buffer(xs), device.empty((4, 3), np.float32), device.buffer(target)
    with pytest.raises(ValueError, match=r"LayerTrainer.record: base_buf is required: the frozen "
                                         r"base layer's output for this batch"):
        trainer.record(x, out, target_buf)
    with pytest.raises(RuntimeError, match=r"LayerTrainer.loss: no step recorded yet"):
        trainer.loss()
    base = normal(rng, (4, 3))
    device.write(out, base)
    trainer.record(x, out, target_buf, base_buf=out)   # out holds this batch's base output
    want, _ = R.mse(R.forward(xs, a, b, 1.0, base), target)
    assert abs(trainer.loss() - want) <= 1e-5 * want


@pytest.mark.parametrize("clip", [None, 1.0])
def test_one_token_steps_fold_dispatches(device, clip):
    """At one token (rank 8: single forward, split backward) a step is 4
    dispatches: the forward adds to the base buffer itself (no copy), the
    loss's dispatch also advances the optimizer's step (without clipping,
    which needs the gradients) and writes dh in parts, dB and dA share one.
    12 AdamW steps against float64, with base_buf given and with out
    holding the base; out_dim 2100 makes three parts of dh."""
    rng = np.random.default_rng(8)
    n_in, n_out, r, s = 40, 2100, 8, 2.0
    a, b = R.init_lora(n_in, n_out, r, seed=2)
    b = normal(rng, b.shape) * np.float32(0.1)
    w = lora.Weight.from_numpy(device, a, b)
    trainer = LayerTrainer(device, w, s, 1, AdamW(lr=1e-2, max_grad_norm=clip),
                           forward="single:64:1")
    names = [st.kernel.name for plan in trainer.plans() for st in plan.steps]
    folded = ["fused_forward", "mse", "grad_outer_pair", "adamw_update"]
    clipped = folded[:3] + ["norm_partials", "optim_begin", "adamw_update"]
    assert names == (folded if clip is None else clipped)
    assert trainer.backward.scratch["dh"].shape == (3, r)
    x, base, target = normal(rng, (1, n_in)), normal(rng, (1, n_out)), normal(rng, (1, n_out))
    xb, ob, tb, bb = (device.buffer(v) for v in (x, np.zeros_like(base), target, base))
    ar, br = a.astype(np.float64), b.astype(np.float64)
    moments = [np.zeros_like(ar)] * 2 + [np.zeros_like(br)] * 2
    for step in range(1, 13):
        before = device.stats["dispatches"]
        if step % 2:
            trainer.record(xb, ob, tb, bb)
        else:
            device.write(ob, base)
            trainer.record(xb, ob, tb, base_buf=ob)
        assert device.stats["dispatches"] - before == len(names)
        out = R.forward(x, ar, br, s, base)
        want, g = R.mse(out, target)
        d = R.backward(x, ar, br, g, s)
        ga, gb = d["grad_a"], d["grad_b"]
        if clip is not None:
            norm = np.sqrt((ga ** 2).sum() + (gb ** 2).sum())
            ga, gb = ga * min(1.0, clip / (norm + 1e-6)), gb * min(1.0, clip / (norm + 1e-6))
        ar, moments[0], moments[1] = R.adamw_step(ar, ga, moments[0], moments[1], step, 1e-2)
        br, moments[2], moments[3] = R.adamw_step(br, gb, moments[2], moments[3], step, 1e-2)
        assert abs(trainer.loss() - want) <= 1e-4 * abs(want), (step, trainer.loss(), want)
    assert np.array_equal(device.read(bb), base), "the base buffer is only read"
    assert trainer.optimizer.step_count == 12


def test_dh_in_parts_is_refused_where_it_cannot_be(device):
    from lora.training.losses import loss_plan
    w = lora.Weight.from_numpy(device, np.ones((8, 64), np.float32), np.ones((64, 8), np.float32))
    with pytest.raises(ValueError, match="the gemm backward computes dh itself: only split at "
                                         "one token, without dx, takes dh in parts"):
        backward_plan(device, w, 1.0, 1, "gemm", with_dx=False, dh_parts=1)
    with pytest.raises(ValueError, match="the split backward computes dh itself"):
        backward_plan(device, w, 1.0, 1, "split", dh_parts=1)  # with dx
    dh = device.empty((1, 8), np.float32)
    with pytest.raises(ValueError, match="loss_plan: dh in parts needs mse at one token, got "
                                         "xent at 1"):
        loss_plan(device, "xent", 1, 64, dh=(w.b, 1.0, dh))


def test_clipping_cannot_be_turned_on_after_attach(device):
    """The begin kernel was built without the gradients' norm: clipping turned
    on later would be silently ignored, so set() refuses it."""
    opt = AdamW(lr=1e-3)
    opt.step([np.ones(4, np.float32)], [np.ones(4, np.float32)])
    with pytest.raises(ValueError, match=r"AdamW.set: max_norm: clipping was off when the "
                                         r"optimizer was attached"):
        opt.set(max_norm=1.0)
    opt.set(lr=1e-2)  # other settings change freely


def _xent_steps(device, labels_per_step, tokens=4, classes=3, trainer=None):
    """A xent trainer (``trainer`` or a new one) after one record per labels array."""
    rng = np.random.default_rng(1)
    if trainer is None:
        weight = lora.Weight.from_numpy(device, normal(rng, (2, 8)), normal(rng, (classes, 2)))
        trainer = LayerTrainer(device, weight, 1.0, tokens, AdamW(), loss="xent")
    x, base = device.buffer(normal(rng, (tokens, 8))), device.buffer(normal(rng, (tokens, 3)))
    out = device.empty((tokens, classes), np.float32)
    for labels in labels_per_step:
        trainer.record(x, out, device.buffer(np.array(labels, np.uint32)), base)
    return trainer


LABEL_7 = (r"labels: label 7 at token 2 of step 1 \(counting this trainer's steps from 1\) is "
           r"outside 0..2 \(the output has 3 classes\); that step trained without the token")


def test_a_label_outside_the_classes_is_reported(device):
    trainer = _xent_steps(device, [[0, 2, 7, 1]])
    with pytest.raises(ValueError, match=LABEL_7 + r".*1 token\(s\) had a label out of range"):
        trainer.loss()
    assert not device.read(trainer.g)[2].any()
    assert np.isfinite(trainer.loss())  # reported once: the mean over the tokens in range


def test_a_bad_label_in_a_step_whose_loss_is_not_read_is_reported(device):
    """The user's case: bad labels, then good ones, then loss(). It returned
    1.2989 and raised nothing; the sticky record on the GPU names step 1."""
    trainer = _xent_steps(device, [[0, 2, 7, 1], [0, 1, 2, 1]])
    with pytest.raises(ValueError, match=LABEL_7):
        trainer.loss()
    assert np.isfinite(trainer.loss())  # cleared when reported


@pytest.mark.parametrize("read", ["weight", "gradients", "save"])
def test_a_bad_label_is_reported_at_the_next_read_of_a_result(device, tmp_path, read):
    trainer = _xent_steps(device, [[0, 1, 2, 1], [5, 2, 9, 1], [0, 8, 2, 1]])
    weight = trainer.weight
    first = r"labels: label 5 at token 0 of step 2 .* 3 token\(s\) had a label out of range"
    with pytest.raises(ValueError, match=first):
        if read == "weight":
            weight.numpy()
        elif read == "gradients":
            trainer.gradients()
        else:
            lora.save_adapter(tmp_path / "a", {"m": weight.numpy()}, alpha=2)
    assert not (tmp_path / "a").exists()
    weight.numpy()  # cleared: nothing more to report
    trainer.gradients()
    assert np.isfinite(trainer.loss())


def test_the_label_record_is_read_only_with_a_result(device, monkeypatch):
    """Steps read nothing back: the record rides on the reads the user makes."""
    trainer, reads = _xent_steps(device, []), []
    real = device.read
    monkeypatch.setattr(device, "read", lambda buf: reads.append(buf) or real(buf))
    _xent_steps(device, [[0, 1, 2, 1]] * 3, trainer=trainer)
    assert reads == []
    trainer.loss()
    assert any(buf is trainer.loss_plan.scratch["seen"] for buf in reads)


@pytest.mark.parametrize("make", [lambda: AdamW(betas=(0.9, 1.0)), lambda: AdamW(betas=(1.0, 0.9)),
                                  lambda: AdamW().set(beta2=1.0), lambda: SGD(momentum=-0.1)])
def test_hyper_parameters_are_checked_as_torch_checks_them(make):
    with pytest.raises(ValueError, match=r"(betas\[\d\]|beta2|momentum): expected a finite number "
                                         r"in \[0.0, 1.0[)\]]"):
        make()


def test_a_smaller_last_batch_is_named(device):
    trainer, rng, _ = _trainer(device, tokens=4)
    x, out = device.buffer(normal(rng, (3, 8))), device.buffer(normal(rng, (3, 3)))
    with pytest.raises(BindingError, match=r"LayerTrainer.record: this trainer takes batches of 4 "
                                           r"token\(s\), x_buf has 3 .*make a trainer for 3 "
                                           r"tokens for a smaller last batch, or drop it"):
        trainer.record(x, out, device.buffer(normal(rng, (3, 3))), out)
    with pytest.raises(BindingError, match=r"output buffer must be float32 \(4, 3\)"):
        trainer.record(device.buffer(normal(rng, (4, 8))), out, out, out)


@pytest.mark.parametrize("rank, in_dim, out_dim, tokens, chunk", [
    (4, 8, 12, 3, 0), (16, 260, 64, 70, 16), (64, 36, 520, 20, 7), (32, 40, 44, 9, 0),
    (12, 24, 200, 130, 0)])
def test_gemm_backward_matches_numpy(device, rank, in_dim, out_dim, tokens, chunk):
    """gemm: dh from B as stored (in slices when tokens are few), dA and dB as
    tiled products over one or several chunks of tokens, overwritten and
    accumulated; dx as split's."""
    strategy = Backward.parse(f"gemm(threads=64, chunk_tokens={chunk})")
    assert strategy == Backward.parse(f"gemm:64:{chunk}")
    kernels = [k[0] for k in strategy.kernels(lora.LayerShape(rank, in_dim, out_dim, tokens))]
    assert kernels.count("grad_outer_tiled") == 2 and "project_a_tiled" in kernels
    rng = np.random.default_rng()
    x, g = normal(rng, (tokens, in_dim)), normal(rng, (tokens, out_dim))
    a, b = normal(rng, (rank, in_dim)), normal(rng, (out_dim, rank))
    want, tol = R.backward(x, a, b, g, -1.5), grad_tolerance(x, a, b, g, -1.5)
    got = run_backward(device, x, a, b, g, -1.5, strategy)
    for key in ("grad_a", "grad_b", "grad_x"):
        assert_within(got[key], want[key], tol[key], f"gemm {key}")
    start = {"dA": normal(rng, a.shape), "dB": normal(rng, b.shape), "dx": normal(rng, x.shape)}
    got = run_backward(device, x, a, b, g, -1.5, strategy, accumulate=True, start=start)
    assert_within(got["grad_a"], start["dA"] + want["grad_a"], 2 * tol["grad_a"] + 1e-6, "acc dA")
    assert_within(got["grad_b"], start["dB"] + want["grad_b"], 2 * tol["grad_b"] + 1e-6, "acc dB")


def test_default_backward_by_shape():
    """gemm from rank 32 (and rank 16 from 128 tokens) where dims and rank are
    multiples of 4; split elsewhere (measured faster at rank 8 on the H200)."""
    def pick(tokens, rank, in_dim, out_dim):
        return Backward.for_shape(lora.LayerShape(rank, in_dim, out_dim, tokens)).name

    assert pick(1, 64, 2560, 2560) == pick(4096, 32, 64, 64) == pick(128, 16, 64, 64) == "gemm"
    assert pick(64, 16, 64, 64) == pick(4096, 8, 2560, 2560) == "split"
    assert pick(4096, 64, 2561, 2560) == pick(4096, 66, 64, 64) == "split"  # gemm needs 4 | dims
    assert Backward.for_shape(lora.LayerShape(64, 63, 64, 16), subgroups=True) == \
        Split(subgroups=True, rank_group=8)


def test_a_trainer_given_arrays_says_how_to_make_buffers(device):
    """LayerTrainer.record takes device buffers; numpy arrays (what a torch
    user passes first) are refused naming device.buffer, before any dispatch."""
    weight = lora.Weight.init(device, rank=2, in_dim=8, out_dim=6, seed=0)
    trainer = lora.LayerTrainer(device, weight, 2.0, 5, lora.AdamW(lr=1e-2))
    arrays = [np.zeros((5, 8), np.float32)] + [np.zeros((5, 6), np.float32)] * 3
    with pytest.raises(BindingError, match=r"must be a live Buffer on .*, got ndarray \(device"
                                           r".buffer\(values\) puts values on the device\)"):
        trainer.record(*arrays)
