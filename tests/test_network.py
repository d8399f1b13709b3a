"""lora.Network: a stack of frozen layers with LoRA trained together on the GPU,
checked against a float64 numpy autograd written out here, against torch+peft
where torch is installed, and the digits app (lora.apps.finetune) built on it."""
import json
import math

import numpy as np
import pytest

import lora
from lora.apps import digits as D
from lora.apps.finetune import DigitsTrainer
from lora.kernels.dropout import keep_mask
from lora.training.network import Linear, Network

NO_TORCH = "torch is not installed (the torch extra: pip install -e '.[torch]')"

ACTS = {"relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float)),
        "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
        "silu": (lambda z: z / (1 + np.exp(-z)),
                 lambda z: (s := 1 / (1 + np.exp(-z))) * (1 + z * (1 - s)))}
ERF = np.vectorize(math.erf)
ACTS["gelu"] = (lambda z: z * 0.5 * (1 + ERF(z / math.sqrt(2))),
                lambda z: 0.5 * (1 + ERF(z / math.sqrt(2)))
                + z * np.exp(-z * z / 2) / math.sqrt(2 * math.pi))
# relative (largest difference over the largest value): measured on lavapipe at most 2.7e-7
# after 4 steps (losses 2.9e-7), and 6.5e-7 after 20 steps of the torch test's model
TOL = 5e-6


def _mlp(rng, dims, acts, *, frozen=(), bias=(0, 1, 2), rank=3):
    """[Linear, act, Linear, act, Linear] with random weights and nonzero
    adapters (B != 0, so every gradient is live at the first step)."""
    layers = []
    for k, (i, o) in enumerate(zip(dims, dims[1:])):
        w = rng.normal(0, 1 / math.sqrt(i), (o, i))
        b = rng.normal(0, 0.1, o) if k in bias else None
        ad = None if k in frozen else (rng.normal(0, 0.3, (rank, i)), rng.normal(0, 0.3, (o, rank)))
        layers.append(dict(w=w, b=b, ad=ad, alpha=2.0 * rank))
        if k < len(acts):
            layers.append(acts[k])
    return layers


def _network(spec, **kw):
    return Network([s if isinstance(s, str) else
                    Linear(s["w"], s["b"], adapter=s["ad"], alpha=s["alpha"]) for s in spec],
                   **kw)


def _reference_step(spec, x, y, kind, state, step, lr, wd=0.01, sgd=False, drop=None,
                    clip=None):
    """One step in float64, by hand: forward, loss, backward, torch's AdamW
    (or plain SGD); updates the adapters in ``spec``, returns the loss before.
    ``drop``: {layer position: the dropout's multiplier (mask / (1 - p)) of
    its adapter's input}, as peft: lora_B(lora_A(dropout(x))) * scaling.
    ``clip``: torch's clip_grad_norm_(every A and B, clip) first; the norm
    before clipping is kept in ``state["norm"]``."""
    zs, v, drop = [], x, drop or {}
    for k, s in enumerate(spec):
        zs.append(v)
        if isinstance(s, str):
            v = ACTS[s][0](v)
        else:
            v = v @ s["w"].T + (0 if s["b"] is None else s["b"])
            if s["ad"] is not None:
                a, b = s["ad"]
                v = v + s["alpha"] / len(a) * (zs[-1] * drop.get(k, 1.0) @ a.T) @ b.T
    if kind == "mse":
        loss, g = np.mean((v - y) ** 2), 2 * (v - y) / v.size
    else:
        p = np.exp(v - v.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(len(y)), y]))
        g = p.copy()
        g[np.arange(len(y)), y] -= 1
        g /= len(y)
    grads = {}
    for k in reversed(range(len(spec))):
        s, xin = spec[k], zs[k]
        if isinstance(s, str):
            g = g * ACTS[s][1](xin)
            continue
        dx = g @ s["w"]
        if s["ad"] is not None:
            a, b = s["ad"]
            sc, m = s["alpha"] / len(a), drop.get(k, 1.0)
            dh = sc * g @ b
            grads[k] = (dh.T @ (xin * m), sc * g.T @ (xin * m @ a.T))
            dx = dx + (dh @ a) * m
        g = dx
    if clip is not None:
        state["norm"] = math.sqrt(sum(np.sum(gr * gr) for pair in grads.values() for gr in pair))
        factor = min(1.0, clip / (state["norm"] + 1e-6))
        grads = {k: tuple(gr * factor for gr in pair) for k, pair in grads.items()}
    for k, pair in grads.items():
        new = []
        for j, (p, gr) in enumerate(zip(spec[k]["ad"], pair)):
            if sgd:
                new.append(p - lr * gr)
                continue
            m, vv = state.get((k, j), (0.0, 0.0))
            m, vv = 0.9 * m + 0.1 * gr, 0.999 * vv + 0.001 * gr * gr
            state[(k, j)] = (m, vv)
            p = p * (1 - lr * wd)
            m_hat, v_hat = m / (1 - 0.9 ** step), vv / (1 - 0.999 ** step)
            new.append(p - lr * m_hat / (np.sqrt(v_hat) + 1e-8))
        spec[k]["ad"] = tuple(new)
    return loss


def _reference_forward(spec, v):
    for s in spec:
        if isinstance(s, str):
            v = ACTS[s][0](v)
        else:
            base = v @ s["w"].T + (0 if s["b"] is None else s["b"])
            if s["ad"] is not None:
                a, b = s["ad"]
                base = base + s["alpha"] / len(a) * (v @ a.T) @ b.T
            v = base
    return v


def _rel(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _as32(spec):
    """The spec with every array rounded to float32 (the GPU's values), in float64."""
    out = []
    for s in spec:
        if isinstance(s, str):
            out.append(s)
            continue
        r: dict = {k: (None if v is None else np.float32(v).astype(np.float64))
                   for k, v in s.items() if k in ("w", "b")}
        r["ad"] = None if s["ad"] is None else tuple(np.float32(m).astype(np.float64)
                                                     for m in s["ad"])
        out.append(dict(r, alpha=s["alpha"]))
    return out


@pytest.mark.parametrize("acts, kind, frozen, dims", [
    (("gelu", "silu"), "mse", (), (12, 16, 8, 5)),
    (("relu", "tanh"), "xent", (0,), (12, 16, 8, 5)),  # a frozen first layer: no gradient into it
    (("tanh", "gelu"), "mse", (1,), (12, 16, 8, 5)),   # a frozen middle layer: W^T g passes
    (("silu", "relu"), "mse", (), (12, 130, 128, 5)),  # the middle layer's products tiled
], ids=["gelu-silu-mse", "relu-tanh-xent-frozen-first", "tanh-gelu-mse-frozen-middle",
        "wide-middle-tiled"])
def test_three_layers_match_float64_autograd(acts, kind, frozen, dims):
    """Every adapter, the losses and forward() after 4 AdamW steps, against
    the float64 autograd above (inputs rounded to float32 as the GPU holds them)."""
    rng = np.random.default_rng(0)
    batch, lr = 6, 2e-2
    spec = _as32(_mlp(rng, dims, acts, frozen=frozen))
    net = _network(spec, loss=kind, optimizer=lora.AdamW(lr=lr))
    tiled = [p.label for s in net.build(batch).forwards for p, _ in s
             if p.steps[0].kernel.name.endswith("_tiled")]
    assert len(tiled) == (dims[1] * dims[2] >= 128 * 128), tiled
    state = {}
    for step in range(1, 5):
        x = rng.normal(0, 1, (batch, dims[0]))
        y = rng.integers(0, dims[-1], batch) if kind == "xent" else rng.normal(0, 1, (batch, 5))
        net.step(x, y)
        want = _reference_step(spec, np.float32(x).astype(np.float64),
                               np.float32(y).astype(np.float64) if kind == "mse" else y, kind,
                               state, step, lr)
        assert abs(net.loss() - want) <= TOL * abs(want), (step, net.loss(), want)
    names = [s for s in net.adapters()]
    trained = [s for s in spec if not isinstance(s, str) and s["ad"] is not None]
    assert len(names) == len(trained) == 3 - len(frozen)
    for name, s in zip(names, trained):
        for got, want in zip(net.adapters()[name], s["ad"]):
            assert _rel(got, want) < TOL, (name, _rel(got, want))
    x = rng.normal(0, 1, (batch + 2, dims[0]))   # two batches, the second padded
    assert _rel(net.forward(x), _reference_forward(spec, np.float32(x).astype(np.float64))) < TOL


def _dropout_run(p, seed, steps, kind="mse", frozen=(1,)):
    """(network, spec, losses) after ``steps`` AdamW steps with lora_dropout=p
    on a 3-layer MLP, the reference stepped beside it in ``spec``."""
    rng = np.random.default_rng(7)
    dims, batch = (12, 16, 8, 5), 6
    spec = _as32(_mlp(rng, dims, ("gelu", "relu"), frozen=frozen))
    net = _network(spec, loss=kind, optimizer=lora.AdamW(lr=2e-2), lora_dropout=p,
                   dropout_seed=seed)
    state, losses = {}, []
    for step in range(1, steps + 1):
        x = np.float32(rng.normal(0, 1, (batch, dims[0]))).astype(np.float64)
        y = rng.integers(0, 5, batch) if kind == "xent" else \
            np.float32(rng.normal(0, 1, (batch, 5))).astype(np.float64)
        drop = {k: keep_mask(seed + k, step - 1, (batch, spec[k]["w"].shape[1]), p) / (1 - p)
                for k in range(0, len(spec), 2) if spec[k]["ad"] is not None}
        net.step(x, y)
        want = _reference_step(spec, x, y, kind, state, step, 2e-2, drop=drop)
        losses.append(net.loss())
        assert abs(losses[-1] - want) <= TOL * abs(want), (step, losses[-1], want)
    return net, spec, losses


@pytest.mark.parametrize("kind, frozen", [("mse", (1,)), ("xent", ())])
def test_dropout_matches_float64_with_the_same_masks(kind, frozen):
    """peft's lora_B(lora_A(dropout(x))) * scaling, base undropped, the input
    gradient through the adapter masked alike: every loss and adapter after 4
    AdamW steps against float64 with keep_mask's masks (seed + the layer's
    position), and forward() drops nothing."""
    net, spec, _ = _dropout_run(0.3, 5, 4, kind, frozen)
    trained = [s for s in spec if not isinstance(s, str) and s["ad"] is not None]
    for (name, pair), s in zip(net.adapters().items(), trained):
        for got, want in zip(pair, s["ad"]):
            assert _rel(got, want) < TOL, (name, _rel(got, want))
    x = np.float32(np.random.default_rng(2).normal(0, 1, (6, 12)))
    assert _rel(net.forward(x), _reference_forward(spec, x.astype(np.float64))) < TOL


def test_dropout_is_reproducible_and_its_masks_differ_by_seed_and_layer():
    """The same seed gives the same adapters bit for bit; another seed others;
    the layers' masks are not one mask."""
    first, _, losses = _dropout_run(0.5, 9, 3)
    again, _, losses2 = _dropout_run(0.5, 9, 3)
    other, _, losses3 = _dropout_run(0.5, 10, 3)
    assert losses == losses2 and losses != losses3
    for name, pair in first.adapters().items():
        assert all(np.array_equal(a, b) for a, b in zip(pair, again.adapters()[name]))
    assert not np.array_equal(keep_mask(9, 0, (6, 16), 0.5)[:, :12], keep_mask(11, 0, (6, 12), 0.5))


def test_no_dropout_is_the_step_without_it():
    """lora_dropout=0: the dispatches and the adapters of a network without the
    option, bit for bit; 0.1: one dropout dispatch per adapted layer forward
    and one per adapted layer with an input gradient backward."""
    def run(**kw):
        rng = np.random.default_rng(3)
        spec = _as32(_mlp(rng, (12, 16, 8, 5), ("gelu", "relu")))
        net = _network(spec, optimizer=lora.AdamW(lr=2e-2), **kw)
        for _ in range(3):
            net.step(rng.normal(0, 1, (6, 12)), rng.normal(0, 1, (6, 5)))
        gpu = net.build(6)
        names = [st.kernel.name for s in gpu.forwards + gpu.backwards for p, _ in s
                 for st in p.steps]
        return net.adapters(), names
    plain, names = run()
    zero, zero_names = run(lora_dropout=0.0, dropout_seed=4)
    assert zero_names == names and "dropout" not in names
    for name, pair in plain.items():
        assert all(np.array_equal(a, b) for a, b in zip(pair, zero[name]))
    _, dropped = run(lora_dropout=0.1)
    assert dropped.count("dropout") == 3 + 2 and len(dropped) == len(names) + 5


@pytest.mark.parametrize("kw, match", [
    (dict(lora_dropout=1.0), r"lora_dropout: expected a probability in \[0, 1\)"),
    (dict(lora_dropout=-0.1), r"lora_dropout: expected a probability in \[0, 1\)"),
    (dict(lora_dropout="0.1"), r"lora_dropout: expected a probability"),
    (dict(lora_dropout=0.1, dropout_seed=-1), r"dropout_seed: expected an int in \[0, 2\^32\)"),
    (dict(lora_dropout=0.1, dropout_seed=1.5), r"dropout_seed: expected an int"),
])
def test_bad_dropout_is_refused_when_the_network_is_made(kw, match):
    spec = _mlp(np.random.default_rng(0), (4, 4, 3), ("relu",))
    with pytest.raises(ValueError, match=match):
        _network(spec, device=NoDevice(), **kw)


def test_digits_trainer_is_unchanged():
    """The digits app on the general network: 5 steps of python -m lora train's
    recipe match its float64 reference as before (the same kernels, in order)."""
    data = D.load(0)
    base = D.train_base(data, 0, steps=30)
    start = D.init_adapters(8, 0)
    settings: dict = dict(lr=1e-2, max_grad_norm=1.0, schedule="cosine", warmup=2, total=5,
                          eps=1e-8, weight_decay=0.0)
    from shaderdsl.runtime import get_device
    trainer = DigitsTrainer(get_device(), base, start, 2.0, 16, lora.AdamW(**settings))
    assert set(trainer.bufs) == {"x", "labels", "losses"}
    assert set(trainer.base) == {"w1", "b1", "w2", "b2"}
    ref = {k: tuple(v.astype(np.float64) for v in p) for k, p in start.items()}
    state = {}
    for step, idx in enumerate(D.batches(len(data.train_y), 16, 5, 0), 1):
        trainer.load_batch(data.train_x[idx], data.train_y[idx])
        trainer.record()
        want = D.reference_step(base, ref, 2.0, data.train_x[idx], data.train_y[idx], state,
                                step, settings)
        assert abs(trainer.loss() - want) < 1e-5 * want
    for name, pair in trainer.adapters().items():
        for got, want in zip(pair, ref[name]):
            assert _rel(got, want) < 1e-4


def test_save_and_load_round_trip(tmp_path):
    """A trained network's adapters saved as one peft adapter (module names the
    layers' names) load into a fresh network of the same layers, and into
    nothing else."""
    rng = np.random.default_rng(1)
    spec = _mlp(rng, (6, 8, 8, 3), ("relu", "gelu"), frozen=(1,))
    names = iter(["fc1", "fc2", "fc3"])
    layers = [s if isinstance(s, str) else
              Linear(s["w"], s["b"], rank=2 if s["ad"] is not None else None, alpha=4,
                     name=next(names)) for s in spec]
    net = Network(layers, loss="xent", optimizer=lora.AdamW(lr=0.05))
    for _ in range(3):
        net.step(rng.normal(0, 1, (4, 6)), rng.integers(0, 3, 4))
    path = net.save_adapter(tmp_path / "adapter")
    assert sorted(lora.load_adapter(path)) == ["fc1", "fc3"]
    def like(rank, alpha, seed=0):
        return [s if isinstance(s, str) else Linear(
            s.weight, s.bias, rank=rank if s.adapter is not None else None, alpha=alpha,
            name=s.name, seed=seed) for s in layers]

    fresh = Network(like(2, 4, seed=9), loss="xent", optimizer=lora.AdamW())
    x = rng.normal(0, 1, (5, 6))
    assert _rel(fresh.forward(x), net.forward(x)) > 1e-3   # fc3's B moved off zero
    fresh.load_adapter(path)
    for name, (a, b) in net.adapters().items():
        np.testing.assert_array_equal(fresh.adapters()[name][0], a)
        np.testing.assert_array_equal(fresh.adapters()[name][1], b)
    np.testing.assert_array_equal(fresh.forward(x), net.forward(x))
    other = Network([Linear(np.ones((3, 6)), rank=2, alpha=4, name="head")], optimizer=None)
    with pytest.raises(ValueError, match=r"has the modules \['fc1', 'fc3'\].* \['head'\]"):
        other.load_adapter(path)
    wrong_scale = Network(like(2, 8))
    with pytest.raises(ValueError, match="'fc1' in .* has rank 2 and scale 2.0; the layer has "
                                         "rank 2 and scale 4.0"):
        wrong_scale.load_adapter(path)


def test_layers_of_different_ranks_and_alphas_save_as_peft_patterns(tmp_path):
    """Each layer's rank and alpha go into the file (r and lora_alpha the common
    ones, rank_pattern and alpha_pattern the others, as peft writes them)."""
    rng = np.random.default_rng(2)
    net = Network([Linear(rng.normal(0, 1, (8, 6)), rank=2, alpha=4, name="fc1"), "tanh",
                   Linear(rng.normal(0, 1, (3, 8)), rank=4, alpha=2, name="fc2")],
                  optimizer=lora.AdamW(lr=0.05))
    net.step(rng.normal(0, 1, (4, 6)), rng.normal(0, 1, (4, 3)))
    path = net.save_adapter(tmp_path / "adapter")
    loaded = lora.load_adapter(path)
    assert {k: (v.rank, v.scale) for k, v in loaded.items()} == {"fc1": (2, 2.0), "fc2": (4, 0.5)}
    for name, (a, b) in net.adapters().items():
        np.testing.assert_array_equal(loaded[name].a, a)
        np.testing.assert_array_equal(loaded[name].b, b)


class NoDevice:
    """A device that fails on any use: what is refused is refused before it."""

    def __getattr__(self, name):
        raise AssertionError(f"the device was touched ({name})")


@pytest.mark.parametrize("layers, match", [
    (lambda: [Linear(np.ones((4, 3)), rank=2), "relu", Linear(np.ones((2, 5)), rank=2)],
     r"layer 2 \('2'\) takes 5 inputs, but the layer before it gives 4"),
    (lambda: [Linear(np.ones((4, 3)), rank=2), "swish"],
     r"layer 1: unknown activation 'swish'; expected one of \('relu', 'gelu', 'silu', 'tanh'\)"),
    (lambda: [Linear(np.ones((4, 3)), adapter=(np.ones((2, 4)), np.ones((4, 2))), name="fc1")],
     r"Linear 'fc1': the adapter does not fit the layer \(3 -> 4\): A must be \[rank, 3\] and "
     r"B \[4, rank\], got A \[2, 4\] and B \[4, 2\]"),
    (lambda: [Linear(np.ones((4, 3)), adapter=(np.ones((2, 3)), np.ones((4, 3))))],
     r"got A \[2, 3\] and B \[4, 3\]"),
    (lambda: [Linear(np.ones((4, 3)), bias=np.ones(3), rank=2)],
     r"Linear: bias must be 4 finite floats \(one per output\), got float64 \(3,\)"),
    (lambda: [Linear(np.ones((4, 3)))], "no Linear layer has an adapter"),
    (lambda: [Linear(np.ones((4, 3)), rank=1, name="a"), Linear(np.ones((4, 4)), name="a")],
     "layer 1: the name 'a' is taken"),
    (lambda: ["relu"], "no Linear layer"),
])
def test_bad_layers_are_refused_by_name_before_the_device(layers, match):
    with pytest.raises(ValueError, match=match):
        Network(layers(), device=NoDevice())


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_clipping_six_adapted_layers_follows_float64(dtype):
    """max_grad_norm over more gradients than one kernel binds (6 adapted
    layers, 12 tensors; a frozen seventh outside the norm): norm_partials in
    two dispatches (7 + 5 tensors), then the begin. Clipping at every step
    (max_grad_norm 0.05); the norm, losses and adapters after 4 steps against
    the float64 autograd with torch's clip_grad_norm_: f32 with AdamW, f16
    with SGD (see test_f16_mixed_precision_follows_float64 for why SGD)."""
    from shaderdsl.runtime import get_device
    f16 = dtype == "f16"
    if f16 and not get_device().has_feature("shader-f16"):
        pytest.skip("the device lacks shader-f16")
    rng = np.random.default_rng(6)
    dims, batch, lr, clip = (12, 10, 9, 8, 10, 7, 6, 5), 6, 2e-2, 0.05
    spec = _mlp(rng, dims, ("gelu", "relu", "tanh", "silu", "gelu", "relu"), frozen=(3,),
                bias=(0, 2, 5, 6))
    held = np.float16 if f16 else np.float32
    spec: list = [s if isinstance(s, str) else dict(   # the weights as the GPU holds them
        s, w=held(s["w"]).astype(np.float64),
        b=None if s["b"] is None else held(s["b"]).astype(np.float64)) for s in _as32(spec)]
    opt = lora.SGD(lr=lr, max_grad_norm=clip) if f16 else lora.AdamW(lr=lr, max_grad_norm=clip)
    net = _network(spec, loss="mse", optimizer=opt, dtype=held)
    names = [st.kernel.name for plan in net.build(batch).net.optimizer.plans()
             for st in plan.steps]
    assert names == ["norm_partials"] * 2 + ["optim_begin"] + [names[-1]] * 6, names
    tol = 1.5e-3 if f16 else TOL   # adapters measured 4.2e-4 (f16), 2.2e-7 (f32)
    state: dict = {}
    for step in range(1, 5):
        x, y = rng.normal(0, 1, (batch, dims[0])), rng.normal(0, 1, (batch, dims[-1]))
        net.step(x, y)
        want = _reference_step(spec, held(x).astype(np.float64), held(y).astype(np.float64),
                               "mse", state, step, lr, sgd=f16, clip=clip)
        assert abs(net.loss() - want) <= tol * want, (step, net.loss(), want)
        norm = net.optimizer.last_norm()
        assert norm is not None and state["norm"] > 5 * clip   # it clipped
        assert abs(norm - state["norm"]) <= tol * state["norm"], (step, norm, state["norm"])
    trained = [s for s in spec if not isinstance(s, str) and s["ad"] is not None]
    assert len(trained) == 6
    for (name, pair), s in zip(net.adapters().items(), trained):
        for got, want in zip(pair, s["ad"]):
            assert _rel(got, want) < tol, (name, _rel(got, want))


def test_bad_batches_are_refused_before_anything_is_written():
    net = Network([Linear(np.ones((4, 3)), rank=2), "tanh"], loss="xent", batch=2,
                  device=NoDevice())
    with pytest.raises(ValueError, match=r"x must be \[rows, 3\] numbers, got float64 \(2, 4\)"):
        net.step(np.ones((2, 4)), np.zeros(2, int))
    with pytest.raises(ValueError, match=r"batches of 2 rows \(Network\(batch=2\)\), x has 3"):
        net.step(np.ones((3, 3)), np.zeros(3, int))
    with pytest.raises(ValueError, match=r"labels must be in 0..3 .* got 0..4"):
        net.step(np.ones((2, 3)), np.array([0, 4]))
    mse = Network([Linear(np.ones((4, 3)), rank=2)], device=NoDevice())
    with pytest.raises(ValueError, match=r"with loss 'mse', y must be \[2, 4\] numbers, got "
                                         r"float64 \(2, 3\)"):
        mse.step(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="loss: expected one of"):
        Network([Linear(np.ones((4, 3)), rank=2)], loss="l1", device=NoDevice())
    with pytest.raises(RuntimeError, match="no step recorded yet"):
        net.loss()


@pytest.mark.parametrize("read", ["loss", "adapters", "save_adapter", "forward"])
def test_a_bad_label_in_the_buffers_is_reported_at_the_next_read(read, tmp_path):
    """record() on labels written to the target buffer (the digits app's way):
    a label outside the classes in a step whose loss is never read raises at
    the next loss(), adapters(), save_adapter() or forward(), naming the step
    and token, once; the record is then clear."""
    rng = np.random.default_rng(4)
    net = _network(_mlp(rng, (6, 8, 4), ("relu",)), loss="xent")
    gpu = net.build(3)
    good = np.array([0, 3, 1], np.uint32)
    for labels in (good, np.array([1, 2, 9], np.uint32), good):
        net.device.write(gpu.values[0], np.float32(rng.normal(0, 1, (3, 6))))
        net.device.write(gpu.target, labels)
        net.record()
    reads = {"loss": net.loss, "adapters": net.adapters,
             "save_adapter": lambda: net.save_adapter(tmp_path / "adapter"),
             "forward": lambda: net.forward(np.zeros((2, 6)))}
    with pytest.raises(ValueError, match=r"label 9 at token 2 of step 2 .* outside 0..3"):
        reads[read]()
    assert np.isfinite(net.loss())  # reported once: the record is clear
    net.step(np.zeros((3, 6)), good)
    net.adapters()


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no clipping", "clip_grad_norm_ 0.5"])
def test_torch_peft_twenty_adamw_steps(tmp_path, clip):
    """The same 3-layer MLP in torch+peft (LoraConfig on modules "0", "2",
    "4" of an nn.Sequential): every adapter after 20 AdamW steps within 1e-5
    relative (f32), with and without torch's clip_grad_norm_ over the LoRA
    parameters (max_grad_norm), and this network's saved adapter loads into peft."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    peft = pytest.importorskip("peft", reason="peft is not installed")
    rng = np.random.default_rng(2)
    dims, batch, lr = (10, 16, 12, 4), 8, 1e-2
    spec = _mlp(rng, dims, ("gelu", "tanh"), rank=4)
    net = _network(spec, loss="mse", optimizer=lora.AdamW(lr=lr, max_grad_norm=clip))

    def torch_mlp():
        mods = []
        for s in spec:
            if isinstance(s, str):
                mods.append({"gelu": torch.nn.GELU, "tanh": torch.nn.Tanh}[s]())
                continue
            lin = torch.nn.Linear(s["w"].shape[1], s["w"].shape[0], bias=s["b"] is not None)
            with torch.no_grad():
                lin.weight.copy_(torch.tensor(s["w"], dtype=torch.float32))
                if s["b"] is not None:
                    lin.bias.copy_(torch.tensor(s["b"], dtype=torch.float32))
            mods.append(lin)
        return torch.nn.Sequential(*mods)

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2", "4"], lora_dropout=0.0)
    model = peft.get_peft_model(torch_mlp(), config)
    for k in (0, 2, 4):
        layer = model.base_model.model[k]
        with torch.no_grad():
            for part, value in zip((layer.lora_A, layer.lora_B), spec[k]["ad"]):
                part["default"].weight.copy_(torch.tensor(value, dtype=torch.float32))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt, clipped = torch.optim.AdamW(trained, lr=lr), []
    for _ in range(20):
        x, y = rng.normal(0, 1, (batch, dims[0])), rng.normal(0, 1, (batch, dims[-1]))
        net.step(x, y)
        opt.zero_grad()
        out = model(torch.tensor(x, dtype=torch.float32))
        torch.nn.functional.mse_loss(out, torch.tensor(y, dtype=torch.float32)).backward()
        if clip is not None:
            clipped.append(float(torch.nn.utils.clip_grad_norm_(trained, clip)) > clip)
        opt.step()
    assert clip is None or sum(clipped) >= 10  # clipping was active in most steps
    for k, name in zip((0, 2, 4), net.adapters()):
        layer = model.base_model.model[k]
        for got, want in zip(net.adapters()[name], (layer.lora_A["default"].weight,
                                                    layer.lora_B["default"].weight)):
            assert _rel(got, want.detach().numpy().astype(np.float64)) < 1e-5
    loaded = peft.PeftModel.from_pretrained(torch_mlp(), net.save_adapter(tmp_path / "ad"))
    x = rng.normal(0, 1, (5, dims[0]))
    with torch.no_grad():
        theirs = loaded(torch.tensor(x, dtype=torch.float32)).numpy().astype(np.float64)
    assert _rel(net.forward(x), theirs) < 1e-5


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_f16_mixed_precision_follows_float64(p):
    """dtype=np.float16: f16 weights, activations and gradients, f32 sums and
    masters; 4 SGD steps stay within f16's rounding of the float64 autograd
    (SGD: AdamW's first steps move each value by about lr times the sign of its
    gradient, so f16's noise flips whole steps where a gradient is near 0);
    with lora_dropout=p, the reference drawing keep_mask's masks."""
    from shaderdsl.runtime import get_device
    if not get_device().has_feature("shader-f16"):
        pytest.skip("the device lacks shader-f16")
    rng = np.random.default_rng(3)
    dims, batch, lr = (12, 16, 8, 5), 6, 0.05
    spec = _mlp(rng, dims, ("gelu", "relu"))
    def rounded(v):
        return None if v is None else np.float16(v).astype(np.float64)

    f16 = [s if isinstance(s, str) else dict(s, w=rounded(s["w"]), b=rounded(s["b"]))
           for s in spec]
    net = _network(f16, loss="mse", optimizer=lora.SGD(lr=lr), dtype=np.float16,
                   lora_dropout=p, dropout_seed=1)
    start: list = [s["ad"] for s in f16 if not isinstance(s, str)]
    state = {}
    for step in range(1, 5):
        x, y = rng.normal(0, 1, (batch, dims[0])), rng.normal(0, 1, (batch, dims[-1]))
        net.step(x, y)
        drop = {2 * j: keep_mask(1 + 2 * j, step - 1, (batch, dims[j]), p) / (1 - p)
                for j in range(3)} if p else None   # Linear j is at position 2 j
        want = _reference_step(f16, np.float16(x).astype(np.float64),
                               np.float16(y).astype(np.float64), "mse", state, step, lr, sgd=True,
                               drop=drop)
        assert abs(net.loss() - want) <= 1.5e-3 * want   # measured 3.4e-4
    trained: list = [s["ad"] for s in f16 if not isinstance(s, str)]
    for (name, pair), want_pair, first in zip(net.adapters().items(), trained, start):
        for got, want, before in zip(pair, want_pair, first):
            assert got.dtype == np.float32   # the masters
            assert _rel(got, want) < 1.5e-3, (name, _rel(got, want))   # measured 4.3e-4
            assert _rel(want, before) > 0.1   # SGD moved every adapter
    # forward() against its own adapters as the GPU holds them (f16), so that
    # the adapters' training noise above stays out: measured 6.2e-4, 1.1e-3 with p
    held = [s if isinstance(s, str) else dict(s, ad=tuple(np.float16(m).astype(np.float64)
                                                          for m in net.adapters()[str(k)]))
            for k, s in enumerate(f16)]
    assert _rel(net.forward(x), _reference_forward(held, np.float16(x).astype(np.float64))) < 2e-3
    with pytest.raises(ValueError, match="'big': weight has values past float16's range"):
        Network([Linear(np.full((2, 2), 1e5), rank=1, name="big")], dtype=np.float16,
                device=NoDevice())


def test_bench_network_quick(tmp_path):
    """python -m lora bench --network --quick: a row with the step, its base
    products and the rest, written as JSON."""
    import json

    from lora.apps.bench_network import network_main

    lines = []
    assert network_main(str(tmp_path), lines.append, quick=True) == 0
    (row,) = json.loads((tmp_path / "bench-network.json").read_text())
    assert row["base_products"] == 5   # 3 forward products, 2 input gradients
    assert 0 < row["base_us"] < row["step_us"] and row["layer_us"] > 0
    assert "base products" in lines[1]


def test_bench_network_command_line_options(tmp_path, capsys):
    """python -m lora bench --network --layers --lora-dropout --max-grad-norm:
    the rows and the log say the options they ran with (4 layers and clipping:
    the norm_partials path)."""
    import json

    from lora.apps import bench

    assert bench.main(["--network", "--quick", "--layers", "4", "--lora-dropout", "0.2",
                       "--max-grad-norm", "0.5", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "bench-network.json").read_text())
    assert (row["layers"], row["lora_dropout"], row["max_grad_norm"]) == (4, 0.2, 0.5)
    assert row["base_products"] == 7   # 4 forward products, 3 input gradients
    out = capsys.readouterr().out
    assert "4-layer MLP" in out and "dropout 0.2 clip 0.5: step" in out
    with pytest.raises(SystemExit):
        bench.main(["--network", "--layers", "0", "--out", str(tmp_path)])
    assert "expected a count of at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_tiled_base_products_are_the_plain_ones(dtype):
    """dense_tiled and dense_grad_input_tiled sum in the plain kernels' order:
    the same bits, sizes no multiple of a tile (and within float64's rounding)."""
    from lora.core.plan import Plan
    from shaderdsl.runtime import get_device
    dev = get_device()
    if dtype == "f16" and not dev.has_feature("shader-f16"):
        pytest.skip("the device lacks shader-f16")
    dt = np.float16 if dtype == "f16" else np.float32
    rng = np.random.default_rng(4)
    tokens, i, o = 70, 50, 130
    x, w, b = rng.normal(0, 1, (tokens, i)), rng.normal(0, 1, (o, i)), rng.normal(0, 1, o)
    g, dx0 = rng.normal(0, 1, (tokens, o)), rng.normal(0, 1, (tokens, i))
    bufs = {k: dev.buffer(v.astype(dt)) for k, v in dict(x=x, W=w, bias=b, g=g).items()}
    got = {}
    for name in ("dense", "dense_tiled"):
        y = dev.empty((tokens, o), dt)
        Plan(dev, name, [(name, dict(in_dim=i, out_dim=o, tokens=tokens, dtype=dtype))], {},
             bound={"x": bufs["x"], "W": bufs["W"], "bias": bufs["bias"], "y": y}).record()
        got[name] = dev.read(y).copy()
    for name in ("dense_grad_input", "dense_grad_input_tiled"):
        dx = dev.buffer(dx0.astype(dt))
        Plan(dev, name, [(name, dict(in_dim=i, out_dim=o, tokens=tokens, dtype=dtype,
                                     accumulate=True))], {},
             bound={"g": bufs["g"], "W": bufs["W"], "dx": dx}).record()
        got[name] = dev.read(dx).copy()
    np.testing.assert_array_equal(got["dense_tiled"], got["dense"])
    np.testing.assert_array_equal(got["dense_grad_input_tiled"], got["dense_grad_input"])
    r = [v.astype(dt).astype(np.float64) for v in (x, w, b, g, dx0)]
    tol = 1e-2 if dtype == "f16" else 1e-5
    assert _rel(got["dense_tiled"], r[0] @ r[1].T + r[2]) < tol
    assert _rel(got["dense_grad_input_tiled"], r[4] + r[3] @ r[1]) < tol


@pytest.mark.parametrize("form", ["dense", "dense_tiled", "dense_matrix"])
def test_base_products_into_and_from_a_block_of_columns(form, device):
    """The products on one chunk of a weight's rows (a language model's head
    split over bindings): y's columns c.. of wider rows (y_stride, y_column),
    and the input gradient from the same columns of g (g_stride, g_column)
    summed over chunks, equal to the products on the whole weight (float64);
    dense_matrix on the interpreter's fragments, the others on the device."""
    from lora.core.plan import Plan
    matrix = form == "dense_matrix"
    dev = _matrix_device() if matrix else device
    rng = np.random.default_rng(6)
    tokens, i, o, cut = 20, 24, 44, 28   # chunks of W's rows: 0..27 and 28..43
    dt = np.float16 if matrix else np.float32
    x, w, g = (rng.normal(0, 1, s).astype(dt) for s in ((tokens, i), (o, i), (tokens, o)))
    y, dx = dev.empty((tokens, o), dt), dev.empty((tokens, i), dt)
    xb, gb = dev.buffer(x), dev.buffer(g)
    grad = form.replace("dense", "dense_grad_input")
    typed = {} if matrix else {"dtype": "f32"}
    for k, (lo, hi) in enumerate(((0, cut), (cut, o))):
        wb = dev.buffer(np.ascontiguousarray(w[lo:hi]))
        Plan(dev, "chunk", [(form, dict(in_dim=i, out_dim=hi - lo, tokens=tokens, bias=False,
                                        y_stride=o, y_column=lo, **typed))], {},
             bound={"x": xb, "W": wb, "y": y}).record()
        Plan(dev, "grad chunk", [(grad, dict(in_dim=i, out_dim=hi - lo, tokens=tokens,
                                             accumulate=k > 0, g_stride=o, g_column=lo,
                                             **typed))], {},
             bound={"g": gb, "W": wb, "dx": dx}).record()
    r = [v.astype(np.float64) for v in (x, w, g)]
    tol = 1.5e-3 if matrix else 1e-5
    assert _rel(dev.read(y), r[0] @ r[1].T) < tol
    assert _rel(dev.read(dx), r[2] @ r[1]) < tol


def _matrix_device():
    """The interpreter with the H200's subgroup matrices (f16 16x16x16, subgroups of 32)."""
    from shaderdsl import interp
    return interp.Device(subgroup_size=32,
                         limits={"max-compute-workgroup-storage-size": 32768})


def test_f16_base_products_on_matrix_units():
    """dense_matrix and dense_grad_input_matrix (run by the interpreter, as
    lavapipe has no subgroup matrices) within f16's rounding of float64, sizes
    no multiple of a tile; an f16 Network picks them for a large weight where
    the device has the fragments, and the plain kernels for a small one."""
    from lora.core.plan import Plan
    dev = _matrix_device()
    rng = np.random.default_rng(5)
    tokens, i, o = 70, 40, 36
    x, w, b, g, dx0 = (rng.normal(0, 1, s).astype(np.float16)
                       for s in ((tokens, i), (o, i), (o,), (tokens, o), (tokens, i)))
    bufs = {k: dev.buffer(v) for k, v in dict(x=x, W=w, bias=b, g=g).items()}
    y, dx = dev.empty((tokens, o), np.float16), dev.buffer(dx0)
    Plan(dev, "dense", [("dense_matrix", dict(in_dim=i, out_dim=o, tokens=tokens))], {},
         bound={"x": bufs["x"], "W": bufs["W"], "bias": bufs["bias"], "y": y}).record()
    Plan(dev, "grad", [("dense_grad_input_matrix", dict(in_dim=i, out_dim=o, tokens=tokens,
                                                        accumulate=True))], {},
         bound={"g": bufs["g"], "W": bufs["W"], "dx": dx}).record()
    r = [v.astype(np.float64) for v in (x, w, b, g, dx0)]
    assert _rel(dev.read(y), r[0] @ r[1].T + r[2]) < 1.5e-3     # measured 2.9e-4
    assert _rel(dev.read(dx), r[4] + r[3] @ r[1]) < 1.5e-3      # measured 3.4e-4
    net = Network([Linear(rng.normal(0, 0.1, (128, 128)), rank=2), "relu",
                   Linear(rng.normal(0, 0.1, (4, 128)), rank=2)], dtype=np.float16, device=dev)
    gpu = net.build(8)
    kernels = [[p.steps[0].kernel.name for p, _ in steps]
               for steps in gpu.forwards + gpu.backwards]   # names end in the dtype
    assert kernels[0][0] == "dense_matrix" and kernels[2][0] == "dense_f16"
    assert kernels[3][-1] == "dense_grad_input_f16"   # the small layer's input gradient


def test_one_optimizer_for_two_trainers_is_refused(device):
    """A second network (or LayerTrainer) given an optimizer another one took
    is refused: re-attaching it would leave the first network's steps
    updating the second one's adapters. The first one keeps training."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    opt = lora.AdamW(lr=1e-2)
    first = Network([Linear(rng.normal(size=(2, 3)), rank=2, seed=1)], optimizer=opt,
                    device=device)
    second = Network([Linear(rng.normal(size=(2, 3)), rank=2, seed=2)], optimizer=opt,
                     device=device)
    first.step(x, y)
    taken = r"this AdamW already updates 2 parameter\(s\) .* give each trainer its own"
    with pytest.raises(RuntimeError, match=taken):
        second.step(x, y)
    with pytest.raises(RuntimeError, match=taken):
        Network([Linear(np.ones((2, 3)), rank=2)], optimizer=opt, device=NoDevice())
    weight = lora.Weight.init(device, rank=2, in_dim=3, out_dim=2, seed=0)
    with pytest.raises(RuntimeError, match=taken):
        lora.LayerTrainer(device, weight, 1.0, 4, opt)
    before = first.adapters()["0"][0]
    first.step(x, y)
    assert not np.array_equal(first.adapters()["0"][0], before)  # its own adapter moved


@pytest.mark.parametrize("optimizer, match", [
    ("adamw", "optimizer: expected a lora.AdamW or lora.SGD, got str"),
    (type("AdamW", (), {"__module__": "torch.optim.adamw"}),
     r"got AdamW \(torch.optim.AdamW is torch's: give lora.AdamW\(lr=...\)"),
])
def test_an_optimizer_not_ours_is_refused_when_the_network_is_made(optimizer, match):
    with pytest.raises(TypeError, match=match):
        Network([Linear(np.ones((2, 3)), rank=2)], optimizer=optimizer, device=NoDevice())


def test_torch_ignore_index_labels_get_a_hint():
    net = Network([Linear(np.ones((4, 3)), rank=2)], loss="xent", device=NoDevice())
    with pytest.raises(ValueError, match=r"got -100..2 \(-100 is torch's ignore_index, which the "
                                         r"loss here does not skip: leave those rows out"):
        net.step(np.ones((3, 3)), np.array([0, -100, 2]))


def test_build_of_another_batch_is_refused():
    """build(16) of a network of batch 4 returned buffers of 4 rows."""
    given = Network([Linear(np.ones((2, 3)), rank=2)], batch=4, device=NoDevice())
    with pytest.raises(ValueError, match=r"Network.build: this network takes batches of 4 rows "
                                         r"\(Network\(batch=4\)\), not 16"):
        given.build(16)


def test_forward_first_then_a_step_of_another_size(device):
    """forward before any step sets the batch (its buffers are made then): a
    step of another size says so and how to choose; build too."""
    rng = np.random.default_rng(5)
    net = Network([Linear(rng.normal(size=(2, 3)), rank=2)], device=device)
    assert net.forward(rng.normal(size=(3, 3))).shape == (3, 2)
    with pytest.raises(ValueError, match=r"batches of 3 rows \(set by the first forward\(x\), of 3 "
                                         r"rows, before any step: give Network\(..., batch=rows\)"):
        net.step(np.ones((8, 3)), np.ones((8, 2)))
    with pytest.raises(ValueError, match=r"takes batches of 3 rows \(set by the first forward"):
        net.build(8)


def test_f16_inputs_past_its_range_are_refused():
    """An f16 network stored x = 1e5 as infinity (numpy's overflow warning
    only) and trained or answered NaN; now refused by name, as lora.forward
    refuses it, before anything is written."""
    net = Network([Linear(np.ones((6, 8)), rank=2)], dtype=np.float16, device=NoDevice())
    past = r"x holds 100000, past float16's range \(65504\): stored as float16 it would be infinite"
    with pytest.raises(ValueError, match=r"Network.step: " + past):
        net.step(np.full((4, 8), 1e5), np.zeros((4, 6)))
    with pytest.raises(ValueError, match=r"Network.step: y holds 70000"):
        net.step(np.ones((4, 8)), np.full((4, 6), 7e4))
    with pytest.raises(ValueError, match=r"Network.forward: " + past):
        net.forward(np.full((4, 8), 1e5))


def test_save_adapter_writes_the_networks_lora_dropout(tmp_path, device):
    net = Network([Linear(np.ones((2, 3)), rank=2)], lora_dropout=0.25, device=device)
    config = json.loads((net.save_adapter(tmp_path / "a") / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.25 and config["use_rslora"] is False
