"""Many adapters in one batch (lora.forward_many, AdapterPool, ManyPlan):
every form of the kernels against the float64 reference
(``reference.forward_many``, bound ``reference.many_tolerance``: the
single-adapter forward's bound row by row, plus f16's rounding of the
result), mixed ranks 1..64 (multiples of 4 and not), plain and rslora
scales, rows with no adapter (-1), decode and prefill shapes; the pool's
add and remove leaving the other adapters bit-equal; bad input refused
before anything runs, or (device ids) reported at the next read."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from numpy.typing import DTypeLike

import lora
from lora import reference as R
from lora.core import many as many_module
from lora.core.auto import auto_plan
from lora.core.many_plan import CANDIDATES, chosen_form, segments
from shaderdsl import interp
from shaderdsl.errors import BindingError, DispatchError

NO_TORCH = "torch is not installed (the torch extra: pip install -e '.[torch]')"

IN, OUT = 40, 24
RANKS = (1, 3, 4, 13, 64, 8)
FORMS = {"fused segments": dict(segments=True, fused=True, tile_tokens=4),
         "fused rows": dict(segments=False, fused=True, lanes=8),
         "split segments": dict(segments=True, fused=False, tile_tokens=3),
         "split rows": dict(segments=False, fused=False, threads=64, lanes=4),
         "split rows in rank blocks": dict(segments=False, fused=False, threads=64, lanes=8,
                                           rank_block=16),
         "fused segments, 4 rank rows": dict(segments=True, fused=True, tile_tokens=3,
                                             rank_rows=4, lanes=32),
         "split rows, 4 rank rows in blocks": dict(segments=False, fused=False, threads=64,
                                                   lanes=16, rank_rows=4, rank_block=16)}


def needs_f16(device, dtype):
    if np.dtype(dtype) == np.float16 and not device.has_feature("shader-f16"):
        pytest.skip(f"adapter {device.name!r} ({device.backend}) lacks shader-f16")


def adapters(rng, ranks, in_dim=IN, out_dim=OUT, dtype: DTypeLike = np.float32):
    """Fresh LoraLayers of these ranks, every other one rslora, alphas not the rank."""
    out = []
    for k, r in enumerate(ranks):
        a = rng.standard_normal((r, in_dim)) / np.sqrt(in_dim)
        b = rng.standard_normal((out_dim, r))
        out.append(lora.LoraLayer(a.astype(dtype), b.astype(dtype), alpha=1.5 * r + k,
                                  use_rslora=bool(k % 2)))
    return out


def triples(layers):
    return [(layer.a, layer.b, layer.scale) for layer in layers]


def check(got, x, layers, ids, base, dtype, what=""):
    """got within many_tolerance of float64 numpy (inputs as stored)."""
    f16 = np.dtype(dtype) == np.float16
    assert got.dtype == dtype, what
    x64 = np.asarray(x, dtype).astype(np.float64)
    base64 = None if base is None else np.asarray(base, dtype).astype(np.float64)
    trip = [(np.asarray(a, dtype), np.asarray(b, dtype), s) for a, b, s in triples(layers)]
    want = R.forward_many(x64, trip, ids, base64).reshape(got.shape)
    tol = R.many_tolerance(x64, trip, ids, base64, f16=f16).reshape(got.shape)
    bad = np.argwhere(~(np.abs(got.astype(np.float64) - want) <= tol))
    assert bad.size == 0, (f"{what}: {len(bad)} element(s) out of tolerance, first at "
                           f"{bad[0].tolist()}: got {got[tuple(bad[0])]}, want "
                           f"{want[tuple(bad[0])]}")


def batch(rng, tokens, n, dtype=np.float32, none=True):
    x = rng.standard_normal((tokens, IN)).astype(dtype)
    base = rng.standard_normal((tokens, OUT)).astype(dtype)
    ids = rng.integers(-1 if none else 0, n, tokens)
    return x, base, ids


# ---------------------------------------------------------------- against float64

@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("tokens", [1, 7, 45], ids=["one", "decode", "prefill"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_matches_float64(device, form, tokens, dtype):
    needs_f16(device, dtype)
    rng = np.random.default_rng(tokens)
    layers = adapters(rng, RANKS, dtype=dtype)
    pool = lora.AdapterPool(device, IN, OUT, dtype=dtype, slots=2, rows=8)
    slots = [pool.add(layer, f"layers[{k}]") for k, layer in enumerate(layers)]
    assert slots == list(range(len(layers)))
    plan = pool.forward_plan(64, one_adapter=False, **FORMS[form])  # one row: the kernels
    x, base, ids = batch(rng, tokens, len(layers), dtype)
    x_buf, out_buf = device.buffer(x), device.buffer(base)
    plan.record(x_buf, ids, out_buf)
    check(plan.read(out_buf), x, layers, ids, base, dtype, form)
    for buf in (x_buf, out_buf):
        device.release(buf)
    plan.release()
    pool.release()


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_forward_many_numpy_in_and_out(device, dtype):
    """Leading dimensions as lora.forward takes them, ids shaped like them, and no
    base; layers as a mapping, the rows naming them (or indexing its order)."""
    needs_f16(device, dtype)
    rng = np.random.default_rng(1)
    layers = adapters(rng, (2, 64, 5), dtype=dtype)
    x = rng.standard_normal((2, 3, IN))
    ids = np.array([[0, -1, 2], [1, 1, 0]])
    got = lora.forward_many(x, layers, ids, dtype=dtype, device=device)
    assert got.shape == (2, 3, OUT)
    check(got.reshape(6, OUT), x.reshape(6, IN), layers, ids, None, dtype)
    assert np.all(got[0, 1] == 0)  # id -1: the base (zeros) alone
    named = dict(zip("abc", layers))  # rows named as peft's adapter_names does
    names = [["a", "__base__", "c"], ["b", "b", "a"]]
    for ids_given in (names, ids):
        same = lora.forward_many(x, named, ids_given, dtype=dtype, device=device)
        assert np.array_equal(same, got)
    one = lora.forward_many(x[0, 0], layers, 1, device=device)
    check(one.reshape(1, OUT), x[0, :1], layers, [1], None, np.float32)
    assert lora.forward_many(np.zeros((0, IN)), layers, [], device=device).shape == (0, OUT)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_one_adapter_on_every_row_is_lora_forward(device, dtype, monkeypatch):
    """Every row naming one adapter: lora.forward itself (its autotuned plan
    and baked rank), bit for bit; a -1 among them: the many kernels."""
    needs_f16(device, dtype)
    rng = np.random.default_rng(2)
    layers = adapters(rng, (12, 5), dtype=dtype)
    x, base, _ = batch(rng, 9, 1, dtype)
    ran = []

    def many(*args):
        ran.append(args[4])
        return real(*args)

    real = many_module._many
    monkeypatch.setattr(many_module, "_many", many)
    got = lora.forward_many(x, layers, np.ones(9, int), base, dtype=dtype, device=device)
    want = lora.forward(x, layers[1].a, layers[1].b, base, scale=layers[1].scale,
                        dtype=dtype, device=device)
    assert np.array_equal(got, want) and not ran
    ids = np.r_[np.ones(8, int), -1]
    got = lora.forward_many(x, layers, ids, base, dtype=dtype, device=device)
    assert len(ran) == 1 and list(ran[0]) == list(ids)
    check(got, x, layers, ids, base, dtype)


def test_a_plan_records_lora_forwards_plan_for_one_adapter(device, monkeypatch):
    """ManyPlan with host ids all naming one slot: lora.forward's plan (the
    same strategy, on a copy of the adapter), not the many kernels; a slot
    refilled since gets a new copy; a route made before its slot was emptied
    is refused. Rank 16, not 64: lora.forward's plan for 20 tokens of rank 64 is a
    512-thread tiled kernel that takes lavapipe 20-40 s to compile."""
    rng = np.random.default_rng(12)
    layers = adapters(rng, (4, 16, 9))
    pool = lora.AdapterPool(device, IN, OUT)
    for layer in layers:
        pool.add(layer)
    plan = pool.forward_plan(32)
    x, base, _ = batch(rng, 20, 1)
    x_buf = device.buffer(x)
    route = plan.route(np.full(20, 1))
    assert route.single == 1 and plan.route(np.r_[np.full(19, 1), -1]).single == -1
    weight = lora.Weight.from_numpy(device, layers[1].a, layers[1].b)
    own = auto_plan(device, weight, layers[1].scale, 20)
    single = plan.single_plan(1, 20)
    assert single is not None and single.strategy == own.strategy
    monkeypatch.setattr(plan, "steps", None)  # the many kernels are not recorded
    out_buf = device.buffer(base)
    plan.record(x_buf, np.full(20, 1), out_buf)
    want = lora.forward(x, layers[1].a, layers[1].b, base, scale=layers[1].scale, device=device)
    assert np.array_equal(plan.read(out_buf), want)
    pool.remove(1)
    assert pool.add(layers[2]) == 1  # slot 1 now holds the rank-9 adapter
    out_buf = device.buffer(base)
    plan.record(x_buf, np.full(20, 1), out_buf)
    want = lora.forward(x, layers[2].a, layers[2].b, base, scale=layers[2].scale, device=device)
    assert np.array_equal(plan.read(out_buf), want)
    route = plan.route(np.full(20, 0))
    pool.remove(0)
    out_buf = device.buffer(base)
    with pytest.raises(BindingError, match=r"this route names slot\(s\) \[0\], whose adapter was "
                                           r"removed"):
        plan.record(x_buf, route, out_buf)
    assert np.array_equal(plan.read(out_buf), base)
    plan.release()
    assert not plan._weights
    pool.release()


@pytest.mark.parametrize("table", ["h200-many-tint.json", "h200-many-matrix-tint.json"])
def test_the_form_rule_follows_the_h200_table(table):
    """chosen_form picks, on every batch of the H200's tables with more than one
    adapter (one adapter takes lora.forward's plan), a form within 1.13x of the
    fastest there: the SIMT forms where the table has no matrix forms (the first,
    and f32), the matrix forms' rule in f16 where it has them."""
    path = pathlib.Path(__file__).parent.parent / "docs" / "bench" / table
    cycle = (4, 8, 16, 32, 64)
    for row in json.loads(path.read_text())["rows"]:
        n, label = row["adapters"], row["label"]
        if n == 1 and "one adapter: lora.forward's plan" in row["forms"]:
            assert row["one_adapter_us"] <= 1.1 * row["forms"]["one adapter: lora.forward's plan"]
            continue
        ranks = ([64] * n if n == 1 or "padded" in label else
                 [4] * 31 + [64] if label.startswith("31") else [cycle[k % 5] for k in range(n)])
        matrix = any(form.startswith("matrix") for form in row["forms"])
        form = chosen_form(row["rows"], row["used"], float(np.mean(ranks)), matrix)
        best = min(row["forms"].values())
        assert row["forms"][form] <= 1.13 * best, (label, row["dtype"], row["kind"], form)
    assert chosen_form(64, 4, 24.8) == "split rows rr4 l64 rb16"
    assert chosen_form(4096, 4, 24.8) == "split segments t8 rb16"
    assert chosen_form(4096, 1, 64.0) == "fused segments t16"
    assert chosen_form(64, 4, 24.8, matrix=True) == "split rows rr4 l64 rb16"
    assert chosen_form(64, 25, 24.8, matrix=True) == "matrix split t16 s2 cs8"
    assert chosen_form(4000, 100, 24.8, matrix=True) == "matrix fused t64"
    assert chosen_form(4096, 32, 24.8, matrix=True) == "matrix split t32 s2 cs8"


@pytest.fixture
def chosen(monkeypatch) -> list:
    """The forms forward_many's calls of chosen_form return, in order."""
    names: list = []

    def rule(*args):
        names.append(chosen_form(*args))
        return names[-1]

    monkeypatch.setattr(many_module, "chosen_form", rule)
    return names


@pytest.mark.parametrize("rows, ranks, ids, form", [
    (24, (4, 13, 8), "scattered", "split rows rr4 l64 rb16"),
    (96, (4, 13, 8), "segments", "split segments t8 rb16"),
    (2200, (64,), "every other", "fused segments t16"),
])
def test_forward_many_takes_the_chosen_form(device, chosen, rows, ranks, ids, form):
    """Each form the rule can choose, chosen and right against float64."""
    rng = np.random.default_rng(rows)
    layers = adapters(rng, ranks)
    x, base, _ = batch(rng, rows, len(ranks))
    ids = {"scattered": rng.integers(-1, len(ranks), rows),
           "segments": np.repeat(np.arange(len(ranks)), rows // len(ranks)),
           "every other": np.tile([0, -1], rows // 2)}[ids]
    got = lora.forward_many(x, layers, ids, base, device=device)
    assert chosen == [form]
    check(got, x, layers, ids, base, np.float32, form)


def test_run_time_counts_share_one_plan(device):
    """One plan, any row count up to max_tokens: nothing compiled after the first."""
    rng = np.random.default_rng(3)
    layers = adapters(rng, (4, 9))
    pool = lora.AdapterPool(device, IN, OUT)
    for layer in layers:
        pool.add(layer)
    plan = pool.forward_plan(40, tile_tokens=2)
    kernels = {id(s.kernel) for s in plan.steps(True, False)}
    for tokens in (1, 2, 17, 40):
        x, base, ids = batch(rng, tokens, 2)
        x_buf, out_buf = device.buffer(x), device.buffer(base)
        plan(x_buf, ids, out_buf)
        check(plan.read(out_buf), x, layers, ids, base, np.float32, f"{tokens} rows")
    assert {id(s.kernel) for s in plan.steps(True, False)} == kernels
    out_buf = device.buffer(base[:1])
    plan(device.buffer(x[:1]), np.int64(1), out_buf)  # one row: a scalar id
    check(plan.read(out_buf), x[:1], layers, [1], base[:1], np.float32, "a scalar id")
    fixed = plan.with_ids(ids)  # what lora.core.tuning.time_plan records
    out_buf = device.buffer(base)
    fixed.record(x_buf, out_buf)
    check(plan.read(out_buf), x, layers, ids, base, np.float32, "with_ids")
    with pytest.raises(BindingError, match="1 to 40 rows"):
        plan.route(np.zeros(41, int))
    room = device.limits["max-compute-workgroup-storage-size"]
    with pytest.raises(DispatchError, match=f"'many_fused' declares .* over max-compute-"
                                            f"workgroup-storage-size = {room}"):
        pool.forward_plan(8, tile_tokens=room // 4 // (256 + 64) + 1)


@pytest.mark.slow  # 16 plans' kernels: about 30 s of compiling on lavapipe
def test_every_candidate_builds_or_names_the_limit(device):
    """lora.core.many_plan.CANDIDATES (the bench's sweep): each builds and is
    right here, or is refused for the device's workgroup memory."""
    rng = np.random.default_rng(11)
    layers = adapters(rng, (3, 64))
    pool = lora.AdapterPool(device, IN, OUT)
    for layer in layers:
        pool.add(layer)
    x, base, ids = batch(rng, 20, 2)
    x_buf = device.buffer(x)
    for name, options in CANDIDATES.items():
        try:
            plan = pool.forward_plan(20, **options)
        except DispatchError as e:
            assert "max-compute-workgroup-storage-size" in str(e), name
            continue
        except ValueError as e:  # an f32 pool: the matrix forms take f16
            assert options.get("matrix") and "dtype float16" in str(e), name
            continue
        out_buf = device.buffer(base)
        plan(x_buf, ids, out_buf)
        check(plan.read(out_buf), x, layers, ids, base, np.float32, name)
    pool.release()


def test_segments_sort_rows_into_tiles():
    ids = np.array([2, -1, 0, 2, 2, 0, -1, 2], np.int32)
    order, tiles = segments(ids, 2)
    assert order.tolist() == [2, 5, 0, 3, 4, 7]
    assert tiles.tolist() == [[0, 2, 0, 0], [2, 2, 2, 0], [4, 2, 2, 0]]
    order, tiles = segments(np.full(3, -1, np.int32), 4)
    assert order.size == 0 and tiles.shape == (0, 4)


# ---------------------------------------------------------------- the pool


def test_add_and_remove_leave_the_others_bit_equal(device):
    """Removing an adapter, reusing its room with another rank and growing the
    buffers (a device copy) move no other adapter: their A, B and outputs are
    bit-equal; nothing is recompiled (the plan made first still serves)."""
    rng = np.random.default_rng(4)
    layers = adapters(rng, (3, 8, 5))
    pool = lora.AdapterPool(device, IN, OUT, slots=1, rows=4)
    for layer in layers:
        pool.add(layer)
    plan = pool.forward_plan(16, tile_tokens=4)
    x, base, _ = batch(rng, 12, 3)
    ids = np.array([0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2])
    x_buf = device.buffer(x)

    def run(ids):
        out_buf = device.buffer(base)
        plan(x_buf, ids, out_buf)
        return plan.read(out_buf)

    before, kept = run(ids), {s: pool.read(s) for s in (0, 2)}
    pool.remove(1)
    assert pool.slots == [0, 2] and len(pool) == 2
    new = adapters(rng, (2, 30))
    assert pool.add(new[0]) == 1 and pool.add(new[1]) == 3  # the freed slot, then a new one
    after = run(ids)
    assert after.tobytes() == before.tobytes()
    for s, (a, b) in kept.items():
        got_a, got_b = pool.read(s)
        assert got_a.tobytes() == a.tobytes() and got_b.tobytes() == b.tobytes()
    mixed = np.array([0, 1, 2, 3, -1, 3, 1, 0, 2, 3, 1, 0])
    check(run(mixed), x, [layers[0], new[0], layers[2], new[1]], mixed, base, np.float32)
    with pytest.raises(ValueError, match="slot 7 holds no adapter"):
        pool.remove(7)
    pool.release()


def test_a_refused_add_loses_nothing(device):
    rng = np.random.default_rng(5)
    layers = adapters(rng, (4, 6))
    pool = lora.AdapterPool(device, IN, OUT, max_rank=8)
    for layer in layers:
        pool.add(layer)
    kept = {s: pool.read(s) for s in pool.slots}
    table = pool.host_table.copy()
    device.sync()
    dispatches = device.stats["dispatches"]
    wrong = adapters(rng, (4,), in_dim=IN + 1)[0]
    with pytest.raises(BindingError, match=r"adapter 'q': A \[4, 41\] and B \[24, 4\] do not "
                                           r"fit <AdapterPool 2 adapter\(s\) in=40 out=24"):
        pool.add(wrong, "adapter 'q'")
    with pytest.raises(ValueError, match="rank 12 is over the pool's max_rank 8"):
        pool.add(adapters(rng, (12,))[0])
    nan = adapters(rng, (4,))[0]
    nan.a[0, 0] = np.nan
    with pytest.raises(BindingError, match="NaN"):
        pool.add(nan)
    with pytest.raises(TypeError, match="expected a lora.LoraLayer"):
        pool.add((layers[0].a, layers[0].b))
    assert device.stats["dispatches"] == dispatches
    assert np.array_equal(pool.host_table, table) and pool.slots == [0, 1]
    for s, (a, b) in kept.items():
        got_a, got_b = pool.read(s)
        assert np.array_equal(got_a, a) and np.array_equal(got_b, b)
    pool.release()


def test_a_pool_that_would_outgrow_a_binding_is_refused():
    """Growth past max-storage-buffer-binding-size is refused before anything
    changes (limit patched to 4 KiB: 64 rows of A at in_dim 16)."""
    dev = interp.Device(limits={"max-storage-buffer-binding-size": 4096})
    rng = np.random.default_rng(10)
    pool = lora.AdapterPool(dev, 16, 8, slots=2, rows=16)
    pool.add(adapters(rng, (16,), 16, 8)[0])
    pool.add(adapters(rng, (16,), 16, 8)[0])  # grows A to 32 rows
    kept, table = [pool.read(s) for s in (0, 1)], pool.host_table.copy()
    buffers = (pool.a, pool.b, pool.table)
    with pytest.raises(BindingError, match=r"no room for 40 more A rows: the buffer would grow "
                                           r"to 8192 bytes, over max-storage-buffer-binding-size"):
        pool.add(adapters(rng, (40,), 16, 8)[0], "big")
    assert (pool.a, pool.b, pool.table) == buffers and np.array_equal(pool.host_table, table)
    for s, (a, b) in enumerate(kept):
        got_a, got_b = pool.read(s)
        assert np.array_equal(got_a, a) and np.array_equal(got_b, b)


# ---------------------------------------------------------------- bad ids


def test_host_ids_refused_before_anything(device):
    rng = np.random.default_rng(6)
    layers = adapters(rng, (2, 3, 4))
    x, base, _ = batch(rng, 4, 3)
    device.sync()
    dispatches = device.stats["dispatches"]
    for ids, match in (([0, 3, 1, 0], r"ids: id 3 at row 1 is outside \[-1, 3\)"),
                       ([0, -2, 1, 0], r"id -2 at row 1 is outside \[-1, 3\)"),
                       ([0, 1.0, 1, 0], "expected integers"),
                       ([0, 1, 1], r"one id per row of x, shape \(4,\)"),
                       ([[0, 1]] * 2, r"one id per row of x, shape \(4,\) .*got \(2, 2\)")):
        with pytest.raises((ValueError, BindingError), match=match):
            lora.forward_many(x, layers, ids, base, device=device)
    bad = adapters(rng, (2,), out_dim=OUT + 2)
    with pytest.raises(BindingError, match=r"layers\[3\]: A \[2, 40\] and B \[26, 2\] do not "
                                           r"fit the first layer's shape 40 -> 24"):
        lora.forward_many(x, layers + bad, [0, 1, 2, 3], device=device)
    named = dict(zip("pqr", layers))
    for given, ids, match in ((layers, ["p", "q", "r", "p"], "names need layers as a mapping"),
                              (named, ["p", "s", "__base__", "s"],
                               r"ids: 's' names no adapter of layers \(expected one of \['p', "
                               r"'q', 'r'\] or '__base__'; 2 row\(s\) refused"),
                              ([{"q_proj": layers[0]}], [0, 0, 0, 0],
                               r"layers\[0\]: expected a lora.LoraLayer, got dict \(load_adapter "
                               r"returns .*adapter\['q_proj'\]\)")):
        with pytest.raises((ValueError, TypeError, BindingError), match=match):
            lora.forward_many(x, given, ids, base, device=device)
    assert device.stats["dispatches"] == dispatches
    pool = lora.AdapterPool(device, IN, OUT)
    for layer in layers:
        pool.add(layer)
    pool.remove(1)
    plan = pool.forward_plan(8)
    with pytest.raises(ValueError, match=r"id 1 at row 2 names slot 1, which holds no adapter "
                                         r"\(slots in use: \[0, 2\]\)"):
        plan.route([0, 2, 1, -1])
    pool.release()


def test_a_pool_routes_rows_by_the_names_add_gave(device):
    """plan.route takes the names given to pool.add (peft's adapter_names,
    "__base__" for none) and gives the bits of the same slots; a removed name
    is forgotten, a taken or reserved name is refused before anything changes."""
    rng = np.random.default_rng(12)
    layers = adapters(rng, (3, 8, 5))
    pool = lora.AdapterPool(device, IN, OUT)
    for name, layer in zip(("support", "legal", "code"), layers):
        pool.add(layer, name)
    plan = pool.forward_plan(8)
    x, base, _ = batch(rng, 5, 3)
    x_buf = device.buffer(x)

    def run(ids):
        out_buf = device.buffer(base)
        plan(x_buf, ids, out_buf)
        return plan.read(out_buf)

    named = run(["code", "__base__", "support", "legal", "code"])
    assert named.tobytes() == run([2, -1, 0, 1, 2]).tobytes()
    for bad, match in (("legal", r"the name 'legal' is taken by slot 1; remove it first"),
                       ("__base__", "a name must be a non-empty str other than '__base__'")):
        with pytest.raises(ValueError, match=match):
            pool.add(layers[0], bad)
    pool.remove(1)
    assert pool.names == {"support": 0, "code": 2}
    with pytest.raises(ValueError, match=r"ids: 'legal' names no adapter of the pool \(expected "
                                         r"one of \['support', 'code'\] or '__base__'"):
        plan.route(["legal", "code", "code", "code", "code"])
    pool.release()


@pytest.mark.parametrize("form", ["fused rows", "split rows", "fused segments",
                                  "split segments"])
def test_device_ids_are_reported_at_the_next_read(device, form):
    """Ids in a device buffer are checked by the kernels: a row naming no
    adapter (past the table, or a removed slot) gets no delta, the others
    are right, and plan.read raises once, naming the first and the largest
    id; the flags then start afresh."""
    rng = np.random.default_rng(7)
    layers = adapters(rng, (5, 16, 2))
    pool = lora.AdapterPool(device, IN, OUT)
    for layer in layers:
        pool.add(layer)
    pool.remove(1)
    plan = pool.forward_plan(8, **FORMS[form])
    x, base, _ = batch(rng, 6, 3)
    ids = np.array([0, 9, 2, -1, 1, 0], np.int32)
    x_buf, out_buf, ids_buf = device.buffer(x), device.buffer(base), device.buffer(ids)
    with device.batch():  # one submit, as with a base layer's dispatches
        plan.record(x_buf, ids_buf, out_buf)
    with pytest.raises(ValueError, match=r"ids: 2 row\(s\) named no adapter of <AdapterPool "
                                         r".*\[0, 2\]\), the first at row 1, one of their ids "
                                         r"9; those rows got no delta"):
        plan.read(out_buf)
    got = device.read(out_buf)
    good = np.where(np.isin(ids, [0, 2]), ids, -1)
    check(got, x, layers, good, base, np.float32)
    assert np.array_equal(got[[1, 3, 4]], base[[1, 3, 4]])
    out2 = device.buffer(base)
    plan.record(x_buf, device.buffer(good.astype(np.int32)), out2)
    check(plan.read(out2), x, layers, good, base, np.float32)  # no error: flags were reset
    with pytest.raises(BindingError, match="int32"):
        plan.record(x_buf, device.buffer(ids.astype(np.float32)), out2)
    pool.release()


# ---------------------------------------------------------------- the interpreter, peft


@pytest.mark.parametrize("form", ["fused segments", "split rows"])
def test_interpreter_small_shapes(form):
    """Under the interpreter's race, uninitialised-read and bounds checks."""
    dev = interp.Device()
    rng = np.random.default_rng(8)
    layers = adapters(rng, (1, 5, 8), in_dim=12, out_dim=8)
    pool = lora.AdapterPool(dev, 12, 8, max_rank=8, slots=1, rows=2)
    for layer in layers:
        pool.add(layer)
    plan = pool.forward_plan(8, **dict(FORMS[form], threads=16, lanes=4))
    x = rng.standard_normal((5, 12)).astype(np.float32)
    base = rng.standard_normal((5, 8)).astype(np.float32)
    ids = np.array([2, -1, 0, 2, 1])
    out_buf = dev.buffer(base)
    plan(dev.buffer(x), ids if form == "fused segments" else dev.buffer(ids.astype(np.int32)),
         out_buf)
    got = plan.read(out_buf)
    trip = triples(layers)
    assert np.all(np.abs(got - R.forward_many(x, trip, ids, base)) <=
                  R.many_tolerance(x, trip, ids, base))


def test_peft_mixed_batches(device):
    """peft's ``model(x, adapter_names=[...])`` on a Linear with three adapters
    (mixed ranks, one rslora, "__base__" rows) against forward_many, 1e-5;
    on sequences [samples, tokens, in], one name per sample as peft takes them."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    base_layer = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    specs = {"a": (4, 8.0, False), "b": (13, 16.0, True), "c": (64, 32.0, False)}
    model = None
    for name, (r, alpha, rs) in specs.items():
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=["0"],
                              init_lora_weights=False)
        if model is None:
            model = peft.get_peft_model(base_layer, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    assert model is not None
    model.eval()  # peft refuses adapter_names in training mode
    x = torch.randn(6, IN)
    names = ["a", "__base__", "c", "b", "a", "c"]
    with torch.no_grad():
        want = model(x, adapter_names=names).numpy()
        base = model.base_model.model[0].base_layer(x).numpy()
    module = model.base_model.model[0]
    layers = {n: lora.LoraLayer(module.lora_A[n].weight.detach().numpy(),
                                module.lora_B[n].weight.detach().numpy(), specs[n][1],
                                use_rslora=specs[n][2]) for n in specs}
    got = lora.forward_many(x.numpy(), layers, names, base, device=device)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    seqs = torch.randn(3, 4, IN)  # peft's adapter_names: one per sample, its every token
    with torch.no_grad():
        want = model(seqs, adapter_names=["c", "__base__", "b"]).numpy()
        base = module.base_layer(seqs).numpy()
    got = lora.forward_many(seqs, layers, ["c", "__base__", "b"], base, device=device)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [5, 600], ids=["one block", "three blocks"])
def test_the_gpu_sort_equals_the_host_sort(device, tokens):
    """Device ids with segments: the GPU's counting sort (lora.kernels.many_sort)
    gives the host's order and tiles exactly (it is stable), then tiles of 0
    rows up to its bound, and the forward is right."""
    rng = np.random.default_rng(9)
    layers = adapters(rng, (3, 6, 1, 16, 4))
    pool = lora.AdapterPool(device, IN, OUT, slots=8)
    for layer in layers:
        pool.add(layer)
    plan = pool.forward_plan(tokens, tile_tokens=4, fused=False)
    x, base, ids = batch(rng, tokens, len(layers))
    x_buf, out_buf = device.buffer(x), device.buffer(base)
    route = plan.device_route(device.buffer(ids.astype(np.int32)))
    plan.record(x_buf, route, out_buf)
    check(plan.read(out_buf), x, layers, ids, base, np.float32)
    order, tiles = segments(ids.astype(np.int32), 4)
    assert device.read(route.buffers["order"])[:len(order)].tolist() == order.tolist()
    got = device.read(route.buffers["tiles"])
    assert got[:len(tiles)].tolist() == tiles.tolist()
    assert route.items <= len(got) and not got[len(tiles):route.items].any()
    pool.release()


# ---------------------------------------------------------------- on matrix units

MATRIX_RANKS = (4, 8, 13, 64)  # 8: removed before the batch
MATRIX_IN, MATRIX_OUT = 72, 200  # 2-3 slices of in_dim and 2-4 blocks of columns, the last partial
# The default tier's case (lavapipe runs the interpreter at a few seconds a form): the
# same edges at a third of the work: ranks 4, 13 and 32 (the pool's max_rank: two
# fragments), 24 rows (a partial tile for each adapter), out_dim 72 (blocks of 64 columns:
# one full, one partial; of 128: one partial); --full runs MATRIX_RANKS at 72 -> 200.
SMALL_RANKS, SMALL_OUT, SMALL_TOKENS = (4, 8, 13, 32), 72, 24


def matrix_case(dev, tokens, seed, ranks=MATRIX_RANKS, out_dim=MATRIX_OUT):
    """An f16 pool on ``dev`` holding ranks[0], ranks[2] and ranks[3] (4, 13
    and 64) in slots 0, 2 and 3 (slot 1's rank 8 removed; a rank-5 adapter put in
    its room, then removed too), and a batch whose rows name them or -1, in
    segments that fill no tile."""
    rng = np.random.default_rng(seed)
    dims = MATRIX_IN, out_dim
    layers = adapters(rng, ranks, *dims, dtype=np.float16)
    pool = lora.AdapterPool(dev, *dims, dtype=np.float16, slots=4, rows=8, max_rank=max(ranks))
    for layer in layers:
        pool.add(layer)
    pool.remove(1)
    assert pool.add(adapters(rng, (5,), *dims, dtype=np.float16)[0]) == 1
    pool.remove(1)
    ids = rng.choice([-1, 0, 2, 3], tokens, p=[0.1, 0.2, 0.3, 0.4])
    x = rng.standard_normal((tokens, dims[0])).astype(np.float16)
    base = rng.standard_normal((tokens, dims[1])).astype(np.float16)
    return pool, layers, x, base, ids


def check_matrix(got, x, layers, ids, base, what=""):
    """got within many_tolerance (f16) of float64, plus scale * h's rounding to
    f16 as the matrix form stages it (2^-11 of |B| |scale h|, row by row)."""
    tri = triples(layers)
    x64, base64 = x.astype(np.float64), base.astype(np.float64)
    want = R.forward_many(x64, tri, ids, base64)
    tol = R.many_tolerance(x64, tri, ids, base64, f16=True)
    for i, (a, b, s) in enumerate(tri):
        rows = ids == i
        h = np.abs(s * x64[rows] @ a.astype(np.float64).T)
        tol[rows] += 2.0 ** -11 * h @ np.abs(b.astype(np.float64)).T
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= tol), f"{what}: worst {np.max(err - tol):.3g} over the bound"
    return float(np.max(err / tol))


MATRIX_FORMS = {  # (options, the kernels)
    "fused t16": (dict(tile_tokens=16), ["many_matrix"]),
    "fused t32, 2 column splits": (dict(tile_tokens=32, column_splits=2), ["many_matrix"]),
    "fused t64": (dict(tile_tokens=64), ["many_matrix"]),
    "split t16, 3 slices": (dict(tile_tokens=16, fused=False, splits=3),
                            ["many_matrix_shrink", "many_matrix_expand"]),
    "split t64, 2 slices, 3 column splits": (dict(tile_tokens=64, fused=False, splits=2,
                                                  column_splits=3),
                            ["many_matrix_shrink", "many_matrix_expand"]),
}


# The default tier's small case of one fused and one split form (each kernel and option
# of the others is in them); the rest, and the full cases, in --full
DEFAULT_MATRIX_FORMS = ("fused t64", "split t64, 2 slices, 3 column splits")


def _matrix_form_param(form: str, small: bool):
    slow = not small or form not in DEFAULT_MATRIX_FORMS
    return pytest.param(form, small, id=f"{form}-{'small' if small else 'full'}",
                        marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("form, small", [_matrix_form_param(f, s) for f in MATRIX_FORMS
                                         for s in (True, False)])
def test_matrix_form_matches_float64_in_the_interpreter(form, small):
    """The matrix forms (lora.kernels.many_matrix) on the interpreter as the H200
    is (f16 16x16x16 fragments, subgroups of 32, 48 KiB of workgroup memory,
    races checked): mixed ranks 4, 13 (scalar B reads) and 64 (32 in the small
    case), rows of -1, tiles that are not full, a removed slot, in_dim no
    multiple of a slice and out_dim no multiple of a block of columns; host ids,
    and (tiles of 16) device ids sorted on the GPU. Within f16's bound of
    float64 plus h's rounding to f16 (check_matrix; measured: at most 0.43-0.54
    of it)."""
    from helpers import h200_interp
    dev = h200_interp()
    options, kernels = MATRIX_FORMS[form]
    if small:
        tokens, ranks, out_dim = SMALL_TOKENS, SMALL_RANKS, SMALL_OUT
    else:
        tokens = 70 if options["tile_tokens"] == 64 else 45
        ranks, out_dim = MATRIX_RANKS, MATRIX_OUT
    pool, layers, x, base, ids = matrix_case(dev, tokens, len(form), ranks, out_dim)
    plan = pool.forward_plan(tokens, matrix=True, one_adapter=False, **options)
    assert [k for k, _ in plan.kernels(True, False)] == kernels and "matrix" in repr(plan)
    x_buf = dev.buffer(x)
    for route in (plan.route(ids), dev.buffer(ids.astype(np.int32))):
        out_buf = dev.buffer(base)
        plan.record(x_buf, route, out_buf)
        ratio = check_matrix(plan.read(out_buf), x, layers, ids, base, form)
        print(f"{form}: at most {ratio:.2f} of the bound")
        if options["tile_tokens"] != 16:
            break  # the GPU's sort once is enough: it is the SIMT forms'
    pool.release()


def test_matrix_form_is_refused_without_what_it_needs(device):
    """No subgroup matrices (lavapipe, or the interpreter without them), an f32
    pool, rows instead of segments, tiles not of 16, 32 or 64 rows: each refused
    naming what is needed, before anything runs."""
    from shaderdsl.errors import FeatureError
    rng = np.random.default_rng(2)
    none = interp.Device(subgroup_size=32, subgroup_matrix_configs=())
    for dev in (none,) + (() if device.subgroup_matrix_configs else (device,)):
        if not dev.has_feature("shader-f16"):
            continue
        pool = lora.AdapterPool(dev, IN, OUT, dtype=np.float16)
        with pytest.raises(FeatureError, match=r"needs f16->f32 16x16x16 subgroup matrices .* "
                                               r"has none"):
            pool.forward_plan(16, matrix=True, tile_tokens=16)
    dev = interp.Device(subgroup_size=32, limits={"max-compute-workgroup-storage-size": 49152})
    pool = lora.AdapterPool(dev, IN, OUT)
    with pytest.raises(ValueError, match="needs a pool of dtype float16, got float32"):
        pool.forward_plan(16, matrix=True, tile_tokens=16)
    pool = lora.AdapterPool(dev, IN, OUT, dtype=np.float16)
    pool.add(adapters(rng, (4,), dtype=np.float16)[0])
    with pytest.raises(ValueError, match="give segments=True"):
        pool.forward_plan(16, matrix=True, segments=False)
    with pytest.raises(ValueError, match=r"tile_tokens must be one of \(16, 32, 64\)"):
        pool.forward_plan(16, matrix=True, tile_tokens=8)
    with pytest.raises(ValueError, match="give matrix=True, fused=False"):
        pool.forward_plan(16, matrix=True, tile_tokens=16, splits=2)
    small = interp.Device(subgroup_size=32)  # WebGPU's 16 KiB: tiles of 16 at rank 64 need 39
    with pytest.raises(DispatchError, match="'many_matrix_f16' declares 39424 bytes"):
        lora.AdapterPool(small, IN, OUT, dtype=np.float16).forward_plan(16, matrix=True,
                                                                        tile_tokens=16)


def test_the_bench_skips_the_matrix_forms_it_cannot_build(device):
    """bench --many times every candidate; a matrix form on an f32 batch (or on a
    device without subgroup matrices) is left out, the log saying why."""
    from lora.apps.bench_many import make_case, ours
    lines = []
    case = make_case("f32", "prefill", [4, 8], 64)
    got = ours(device, case, lines.append, ("fused segments t4", "matrix fused t16"))
    assert set(got["forms"]) == {"fused segments t4"} and got["correct"]
    assert any("not built (matrix fused t16)" in line and "float16" in line
               for line in lines), lines


def test_matrix_form_on_the_gpu(device):
    """Where the adapter has f16 -> f32 16x16x16 subgroup matrices (the H200 under
    Dawn): every matrix candidate compiles there and is right."""
    from lora.kernels.matrix import FRAGMENT
    if FRAGMENT not in device.subgroup_matrix_configs or not device.has_feature("shader-f16"):
        pytest.skip(f"{device.name} has no {FRAGMENT} subgroup matrices")
    pool, layers, x, base, ids = matrix_case(device, 300, 4)
    x_buf = device.buffer(x)
    for name, options in CANDIDATES.items():
        if options.get("matrix"):
            plan = pool.forward_plan(300, one_adapter=False, **options)
            out_buf = device.buffer(base)
            plan(x_buf, ids, out_buf)
            check_matrix(plan.read(out_buf), x, layers, ids, base, name)
    pool.release()


def test_matrix_form_workgroup_indices_are_proven():
    """Every workgroup-array index of many_matrix lies provably inside its
    array by Tint's integer range analysis (tests/range_check.py, note 37), so
    Dawn's robustness leaves them unclamped, at each tile and a small rank."""
    from range_check import unproven

    from lora.kernels.registry import KERNELS
    for tile, rank, splits in ((16, 64, 1), (32, 16, 2), (64, 64, 1), (64, 13, 1)):
        common = dict(max_rank=rank, tile_tokens=tile)
        for name, params in (("many_matrix", dict(in_dim=2560, out_dim=2560,
                                                  column_splits=splits)),
                             ("many_matrix_shrink", dict(in_dim=2560, splits=4)),
                             ("many_matrix_expand", dict(out_dim=2560, splits=4,
                                                         column_splits=splits * 3))):
            k = KERNELS[name].kernel(**common, **params)
            assert unproven(k.wgsl) == [], (name, tile, rank)


def test_a_pool_takes_names_where_it_takes_slots_and_blames_miscounted_ids(device):
    """pool.remove, rank, scale and read take the name add gave as well as the
    slot; an unknown name is refused naming the pool's names. A batch whose
    ids are fewer or more than x's and output's rows is refused naming ids,
    before anything is written; a mapping's layer is named by its key."""
    rng = np.random.default_rng(13)
    layers = adapters(rng, (3, 8))
    pool = lora.AdapterPool(device, IN, OUT)
    for name, layer in zip(("support", "legal"), layers):
        pool.add(layer, name)
    assert pool.rank("legal") == 8 and pool.scale("legal") == pool.scale(1)
    assert np.array_equal(pool.read("support")[0], pool.read(0)[0])
    with pytest.raises(ValueError, match=r"no adapter is named 'code' \(names: \['legal', "
                                         r"'support'\]; slots in use: \[0, 1\]\)"):
        pool.remove("code")
    pool.remove("legal")
    assert pool.names == {"support": 0} and pool.slots == [0]
    plan = pool.forward_plan(8)
    x, base, _ = batch(rng, 5, 1)
    x_buf, out_buf = device.buffer(x), device.buffer(base)
    for ids in (["support"] * 4, device.buffer(np.zeros(6, np.int32))):
        with pytest.raises(BindingError, match=r"ids: [46] id\(s\) for x and output of 5 rows; "
                                               r"expected one id per row"):
            plan.record(x_buf, ids, out_buf)
    assert np.array_equal(plan.read(out_buf), base)
    bad = adapters(rng, (2,), out_dim=OUT + 2)[0]
    with pytest.raises(BindingError, match=r"layers\['v_proj'\]: A \[2, 40\] and B \[26, 2\] do "
                                           r"not fit the first layer's shape 40 -> 24"):
        lora.forward_many(x, {"q_proj": layers[0], "v_proj": bad}, [0, 1, 0, 1, 0],
                          device=device)
    pool.release()


@pytest.mark.parametrize("segments", [True, False])
def test_a_route_is_refused_once_an_adapter_it_names_is_gone(device, segments):
    """A route made before pool.remove gave the removed adapter's rows no
    delta, and one made before its slot was refilled ran the new adapter on
    them, both silently; now both are refused, the output untouched. A route
    whose adapters all stay serves on after other adapters come and go."""
    rng = np.random.default_rng(14)
    layers = adapters(rng, (4, 8, 3))
    pool = lora.AdapterPool(device, IN, OUT)
    for name, layer in zip("abc", layers):
        pool.add(layer, name)
    plan = pool.forward_plan(8, segments=segments)
    x, base, _ = batch(rng, 5, 1)
    x_buf = device.buffer(x)
    for ids in (["a", "b", "a", "b", "a"], ["b"] * 5):
        route = plan.route(ids)
        pool.remove("b")
        for refill in (False, True):
            if refill:
                pool.add(layers[2], "b again")  # into slot 1
            out_buf = device.buffer(base)
            with pytest.raises(BindingError, match=r"this route names slot\(s\) \[1\], whose "
                                                   r"adapter was removed \(or replaced\)"):
                plan.record(x_buf, route, out_buf)
            assert np.array_equal(plan.read(out_buf), base)
        pool.remove("b again")
        pool.add(layers[1], "b")
    route = plan.route(["a", "__base__", "a", "a", "a"])
    pool.remove("c")
    pool.add(layers[2], "c")
    out_buf = device.buffer(base)
    plan.record(x_buf, route, out_buf)
    check(plan.read(out_buf), x, [layers[0]], [0, -1, 0, 0, 0], base, np.float32)
    pool.release()


def test_a_refused_record_leaves_the_last_route(device):
    """plan.record(x, host ids, output) with an output of another dtype or
    shape routed the ids first, which replaced the plan's last route (a
    Route the server held was then refused as replaced): x and output are now
    checked before the ids are routed."""
    rng = np.random.default_rng(15)
    layers = adapters(rng, (4, 8))
    pool = lora.AdapterPool(device, IN, OUT)
    for name, layer in zip("ab", layers):
        pool.add(layer, name)
    plan = pool.forward_plan(8)
    x, base, _ = batch(rng, 5, 2)
    x_buf = device.buffer(x)
    held = plan.route(["a", "b", "__base__", "b", "a"])
    for bad, match in ((device.buffer(base.astype(np.float16)), "expected dtype float32"),
                       (device.buffer(np.zeros((5, OUT + 1), np.float32)),
                        r"output: expected shape \(5, 24\)")):
        with pytest.raises(BindingError, match=match):
            plan.record(x_buf, ["b"] * 5, bad)
    out_buf = device.buffer(base)
    plan.record(x_buf, held, out_buf)
    check(plan.read(out_buf), x, layers, [0, 1, -1, 1, 0], base, np.float32)
    pool.release()


def test_adding_and_removing_in_one_thread_while_another_serves(device):
    """A server thread records batches naming adapter "a" by name while
    another thread adds and removes other adapters: add, remove and route
    hold the device's lock, so each batch sees the pool before or after a
    change and gives what one thread gives, bit for bit."""
    import threading

    rng = np.random.default_rng(16)
    layers = adapters(rng, (4, 8, 13))
    pool = lora.AdapterPool(device, IN, OUT)
    pool.add(layers[0], "a")
    plan = pool.forward_plan(8)
    x, base, _ = batch(rng, 6, 1)
    x_buf = device.buffer(x)
    ids = ["a", "__base__", "a", "a", "__base__", "a"]

    def serve():
        out_buf = device.buffer(base)
        plan.record(x_buf, ids, out_buf)
        return plan.read(out_buf).tobytes()

    want, got, errors = serve(), [], []

    def churn():
        try:
            for k in range(12):
                pool.add(layers[1 + k % 2], "churn")
                pool.remove("churn")
        except BaseException as e:  # raised below, in the test's thread
            errors.append(e)

    other = threading.Thread(target=churn, daemon=True)
    other.start()
    while other.is_alive() and len(got) < 40:
        got.append(serve())
    other.join(120)
    assert not errors and not other.is_alive()
    assert got and all(g == want for g in got)
    pool.release()


def test_one_id_per_sample_of_sequences(device):
    """x [samples, tokens, in] takes ids per row ([samples, tokens] or flat)
    or one per sample (peft's adapter_names): each of its tokens gets it."""
    rng = np.random.default_rng(17)
    layers = adapters(rng, (4, 8))
    x = rng.standard_normal((3, 2, IN)).astype(np.float32)
    per_row = lora.forward_many(x, layers, [[1, 1], [-1, -1], [0, 0]], device=device)
    assert np.array_equal(lora.forward_many(x, layers, [1, -1, 0], device=device), per_row)
    with pytest.raises(BindingError, match=r"expected one id per row of x, shape \(3, 2\) "
                                           r"\(x.shape\[:-1\]\) or \(6,\), or one per sample "
                                           r"\(3,\) as peft's adapter_names, got \(2,\)"):
        lora.forward_many(x, layers, [0, 1], device=device)


@pytest.mark.parametrize("form", ["fused segments", "split segments", "fused rows"])
def test_a_batch_without_adapters_leaves_the_output(device, form):
    """A batch whose rows are all "__base__" (host ids) made no tile, and the
    segment forms dispatched 0 workgroups (DispatchError); now nothing is
    dispatched and the output keeps the base layer's values."""
    rng = np.random.default_rng(18)
    pool = lora.AdapterPool(device, IN, OUT)
    pool.add(adapters(rng, (4,))[0], "a")
    plan = pool.forward_plan(8, **FORMS[form])
    x, base, _ = batch(rng, 5, 1)
    out_buf = device.buffer(base)
    plan.record(device.buffer(x), ["__base__"] * 5, out_buf)
    assert np.array_equal(plan.read(out_buf), base)
    pool.release()


@pytest.mark.parametrize("rows, used", [(64, 20), (1200, 20), (4000, 4)])
def test_forward_many_takes_the_matrix_forms_where_they_run(device, chosen, rows, used):
    """An f16 batch where the device has f16 16x16x16 subgroup matrices (the H200
    under Dawn): forward_many takes the matrix form chosen_form names (decode of
    many adapters: split t16; prefill of few rows per adapter: fused t64; of
    many: split t32), right against float64 (check_matrix)."""
    from lora.core.many import matrix_runs
    from lora.kernels.matrix import FRAGMENT
    if not matrix_runs(device, np.float16, MATRIX_IN, MATRIX_OUT, 64):
        pytest.skip(f"{device.name} has no f16 {FRAGMENT} subgroup matrices (or the room)")
    rng = np.random.default_rng(rows)
    ranks = [(4, 13, 64, 8)[k % 4] for k in range(used)]
    layers = adapters(rng, ranks, MATRIX_IN, MATRIX_OUT, dtype=np.float16)
    ids = rng.integers(-1, used, rows) if rows < 32 * used else \
        np.repeat(np.arange(used), -(-rows // used))[:rows]
    x = rng.standard_normal((rows, MATRIX_IN)).astype(np.float16)
    base = rng.standard_normal((rows, MATRIX_OUT)).astype(np.float16)
    got = lora.forward_many(x, layers, ids, base, device=device, dtype=np.float16)
    assert chosen[0].startswith("matrix"), chosen
    check_matrix(got, x, layers, ids, base, chosen[0])
