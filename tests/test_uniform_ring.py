"""Per-dispatch uniform values (the uniform ring), on the GPU.

A uniform binding given a plain value instead of a Buffer gets that value in
its own dispatch, even when many dispatches share one batch and one submit:
the values are packed into a ring buffer at aligned offsets, written once
before the submit and bound with dynamic offsets. Results are compared with
numpy in float64; tolerances are in units of U = 2**-24 (float32's unit
roundoff). Counters come from ``device.stats``.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import shaderdsl as sd
from examples.bench_params import Sorter, bitonic, passes
from examples.bench_params import main as bench_main
from shaderdsl import BindingError, f16, f32, i32, vec2u, vec4f
from shaderdsl import builtins as B

U = 2.0 ** -24
_names = itertools.count()


def fresh(fn, workgroup=64, **params):
    """A kernel no other test has compiled (a new name is new WGSL): its
    compile counts start at zero."""
    return sd.compile(fn, workgroup, name=f"{fn.__name__}_{next(_names)}", **params)


def axpb(m):
    """y[i] += x[i] * a + b"""
    x = m.declare_input_buffer("x", f32)
    y = m.declare_output_buffer("y", f32)
    a = m.declare_uniform("a", f32)
    b = m.declare_uniform("b", f32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < B.array_length(y)):
        y[i] = y[i] + x[i] * a + b


def add_a(m):
    """y[i] += a"""
    y = m.declare_output_buffer("y", f32)
    a = m.declare_uniform("a", f32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < B.array_length(y)):
        y[i] = y[i] + a


RING = "the uniform ring (device.uniform_ring, its ring_* stats) is the wgpu device's"


def delta(device, before: dict) -> dict:
    return {k: device.stats[k] - before[k] for k in before}


def test_per_dispatch_values_in_one_batch_match_numpy(device):
    rng = np.random.default_rng(1)
    n, steps = 1000, 40
    x = rng.uniform(-1, 1, n).astype(np.float32)
    a = rng.uniform(-2, 2, steps).astype(np.float32)
    b = rng.uniform(-1, 1, steps).astype(np.float32)
    kernel = fresh(axpb)
    xb, yb = device.buffer(x), device.zeros(n, np.float32)
    before = dict(device.stats)
    with device.batch():
        for t in range(steps):  # numpy scalars and Python floats: both are float32
            device.dispatch_1d(kernel, {"x": xb, "y": yb, "a": a[t], "b": float(b[t])}, n)
    grew = delta(device, before)
    got = device.read(yb)
    terms = np.outer(a.astype(np.float64), x) + b.astype(np.float64)[:, None]
    want = terms.sum(axis=0)
    # each step rounds its product and two sums once (or fuses them): every
    # rounding is at most U times a partial sum, itself at most sum |terms|
    tol = 3 * steps * U * np.abs(terms).sum(axis=0)
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()
    # had every dispatch seen the last values, the result would be steps * (x a + b)
    assert not np.allclose(got, steps * (x * a[-1] + b[-1]), atol=1e-3)
    assert grew["submits"] == 1 and grew["dispatches"] == steps
    assert grew["pipelines"] == 1 and grew["modules"] == 1


@pytest.mark.needs_wgpu(RING)
def test_bitonic_sort_one_pipeline_one_submit(device):
    n = 1 << 12
    values = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    sorter = Sorter(device, "ring", n)
    sorter.kernel = fresh(bitonic, 256, how="uniform")
    buf = device.empty(n, np.float32)
    grew = []
    for start in (values, values[::-1].copy(), -values):
        buf.write(start)
        before = dict(device.stats)
        with device.batch():
            sorter.record(buf)
        grew.append(delta(device, before))
        assert np.array_equal(device.read(buf), np.sort(start))
    assert all(g["submits"] == 1 and g["dispatches"] == len(passes(n)) == 78 for g in grew)
    assert [g["pipelines"] for g in grew] == [1, 0, 0] and grew[0]["modules"] == 1
    # once the ring has grown to fit a sort (and its bind group is made), a
    # sort allocates and compiles nothing: one ring write, one submit
    third = grew[2]
    assert third["bind_groups"] == third["ring_buffers"] == third["modules"] == 0
    assert third["ring_writes"] == 1


@pytest.mark.needs_wgpu(RING)
def test_more_dispatches_than_the_ring_holds(device):
    ring = device.uniform_ring
    count = ring.slots + 37
    assert count < 5000  # so the sums below stay exact in float32 (< 2**24)
    kernel = fresh(add_a)
    y = device.zeros(64, np.float32)
    before = dict(device.stats)
    with device.batch():
        for t in range(count):  # distinct values: no two share a slot
            device.dispatch(kernel, {"y": y, "a": float(t + 1)}, 1)
    grew = delta(device, before)
    # integers below 2**24 add exactly in float32
    assert np.all(device.read(y) == count * (count + 1) / 2)
    assert grew["submits"] == 1 and grew["ring_buffers"] >= 1 and grew["ring_writes"] >= 2
    assert ring.slots >= count and ring.pending == 0
    # the grown ring is reused: the same batch again allocates nothing
    y.write(np.zeros(64, np.float32))
    before = dict(device.stats)
    with device.batch():
        for t in range(count):
            device.dispatch(kernel, {"y": y, "a": float(t + 1)}, 1)
    again = delta(device, before)
    assert np.all(device.read(y) == count * (count + 1) / 2)
    assert again["ring_buffers"] == 0 and again["ring_writes"] == 1 and again["submits"] == 1


@pytest.mark.needs_wgpu(RING)
def test_values_across_reads_in_a_batch_and_outside_batches(device):
    """A read in a batch submits (writing the ring) and the ring restarts at
    offset 0; outside a batch each dispatch is its own submit and write."""
    kernel = fresh(add_a)
    y = device.zeros(8, np.float32)
    with device.batch():
        for t in (1.0, 2.0, 4.0):
            device.dispatch(kernel, {"y": y, "a": t}, 1)
        mid = device.read(y)
        for t in (8.0, 16.0):
            device.dispatch(kernel, {"y": y, "a": t}, 1)
    assert np.all(mid == 7.0) and np.all(device.read(y) == 31.0)
    before = dict(device.stats)
    for t in (32.0, 64.0):
        device.dispatch(kernel, {"y": y, "a": t}, 1)
    assert np.all(device.read(y) == 127.0)
    grew = delta(device, before)
    assert grew["submits"] == 3 and grew["ring_writes"] == 2  # 2 dispatches + the read


def mixed(m, half: bool):
    """Vector, signed and (optionally) f16 uniforms next to a uniform Buffer."""
    out = m.declare_output_buffer("out", f32, 8)
    v = m.declare_uniform("v", vec4f)
    p = m.declare_uniform("p", vec2u)
    s = m.declare_uniform("s", i32)
    w = m.declare_uniform("w", f32)
    out[0] = v.x + v.w
    out[1] = f32(p.x * 10 + p.y)
    out[2] = f32(s)
    out[3] = w
    if half:
        h = m.declare_uniform("h", f16)
        out[4] = f32(h)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_vector_signed_and_half_values_next_to_a_buffer(device, half):
    if half and not device.has_feature("shader-f16"):
        pytest.skip("adapter lacks shader-f16")
    kernel = fresh(mixed, 1, half=half)
    out = device.zeros(8, np.float32)
    w = device.uniform(0.25)  # a Buffer and values in one dispatch
    extra = {"h": np.float16(1.5)} if half else {}
    with device.batch():
        for t in range(3):
            device.dispatch(kernel, {"out": out, "w": w, "s": np.int32(-5 - t), **extra,
                                     "v": np.array([t, 0, 0, 10 * t], np.float32),
                                     "p": np.array([t, 7], np.uint32)}, 1)
            if t == 1:
                mid = device.read(out)
    assert mid[:4].tolist() == [11.0, 17.0, -6.0, 0.25]
    assert device.read(out)[:5].tolist() == [22.0, 27.0, -7.0, 0.25, 1.5 if half else 0.0]
    before = dict(device.stats)
    with pytest.raises(BindingError, match=r"binding 'v' \(@binding\(1\)\): expected float32\[4\] "
                                           r"\(WGSL vec4<f32>\), got float32\[3\] from array"):
        device.dispatch(kernel, {"out": out, "w": w, "s": np.int32(0), "p": np.zeros(2, np.uint32),
                                 "v": np.zeros(3, np.float32), **extra}, 1)
    assert device.stats == before


def bad_cases():
    vec = np.array([1.0, 2.0], np.float32)
    return {
        "str": ({"a": "2"}, r"binding 'a' \(@binding\(2\)\): expected a Buffer \(device.uniform\) "
                            r"or a float32 scalar \(WGSL f32\), got '2': uniform: expected a numpy "
                            r"array or scalar, got str"),
        "None": ({"a": None}, r"binding 'a' .* got None: uniform: expected a numpy array"),
        "bool": ({"b": True}, r"binding 'b' .* got True: uniform: bool is not host-shareable"),
        "float64": ({"a": np.float64(2.0)},
                    r"binding 'a' .*: expected a Buffer \(device.uniform\) or a float32 scalar "
                    r"\(WGSL f32\), got np.float64\(2.0\): uniform: dtype <f8 \(float64\) is "
                    r"not supported"),
        "Python int for f32": ({"a": 3}, r"expected a float32 scalar \(WGSL f32\), got a uint32 "
                                         r"scalar from 3; pass np.float32\(...\)"),
        "vector for a scalar": ({"a": vec}, r"expected a float32 scalar \(WGSL f32\), got "
                                            r"float32\[2\] from array"),
        "negative int": ({"a": -1}, r"uniform: Python int -1 does not fit u32"),
        "value for storage": ({"x": 3.0},
                              r"binding 'x' \(@binding\(0\)\): a plain value \(3.0\) is accepted "
                              r"only by a uniform binding; 'x' is a storage buffer \(read\): "
                              r"give it a Buffer"),
    }


@pytest.mark.needs_wgpu(RING)
@pytest.mark.parametrize("case", list(bad_cases()))
def test_bad_values_are_refused_before_any_gpu_work(device, case):
    change, match = bad_cases()[case]
    kernel = fresh(axpb)
    x, y = device.buffer(np.ones(4, np.float32)), device.buffer(np.full(4, 7.0, np.float32))
    good = {"x": x, "y": y, "a": 1.0, "b": 2.0}
    device.dispatch(kernel, good, 1)  # compiled and bound: only the value is new
    before, pending = dict(device.stats), device.uniform_ring.pending
    with pytest.raises(BindingError, match=match):
        device.dispatch(kernel, {**good, **change}, 1)
    assert device.stats == before and device.uniform_ring.pending == pending
    # in a batch the exception drops what the batch recorded, values included
    with pytest.raises(BindingError, match=match):
        with device.batch():
            device.dispatch(kernel, good, 1)
            device.dispatch(kernel, {**good, **change}, 1)
    assert device.uniform_ring.pending == 0
    assert device.read(y).tolist() == [10.0] * 4  # only the first, unbatched dispatch ran


def store_one(m):
    y = m.declare_output_buffer("y", f32)
    y[0] = 1.0


def test_value_for_storage_binding_of_a_kernel_without_uniforms(device):
    kernel = fresh(store_one, 1)
    with pytest.raises(BindingError, match=r"a plain value \(np.float32\(2.0\)\) is accepted only "
                                           r"by a uniform binding"):
        device.dispatch(kernel, {"y": np.float32(2.0)}, 1)


def test_too_many_uniforms_for_dynamic_offsets(device, monkeypatch):
    kernel = fresh(axpb)
    device.prepare(kernel)  # module and static pipeline: the refusal must add nothing
    x, y = device.buffer(np.ones(4, np.float32)), device.zeros(4, np.float32)
    monkeypatch.setitem(device.limits, "max-dynamic-uniform-buffers-per-pipeline-layout", 1)
    before = dict(device.stats)
    with pytest.raises(BindingError, match=r"has 2 uniform bindings, over max-dynamic-uniform-"
                                           r"buffers-per-pipeline-layout = 1"):
        device.dispatch(kernel, {"x": x, "y": y, "a": 1.0, "b": 2.0}, 1)
    assert device.stats == before
    # Buffers still work: the Buffer path has no dynamic offsets
    device.dispatch(kernel, {"x": x, "y": y, "a": device.uniform(1.0), "b": device.uniform(2.0)}, 1)
    assert device.read(y).tolist() == [3.0] * 4


@pytest.mark.needs_wgpu(RING)
def test_buffer_path_is_unchanged(device):
    """Buffers only: the cached static pipeline and bind group, no ring; the
    same kernel with values compiles its own (dynamic-offset) pipeline once."""
    kernel = fresh(add_a)
    y, a = device.zeros(4, np.float32), device.uniform(1.0)
    before = dict(device.stats)
    for _ in range(3):
        device.dispatch(kernel, {"y": y, "a": a}, 1)
    grew = delta(device, before)
    assert grew["pipelines"] == 1 and grew["bind_groups"] == 1
    assert grew["ring_writes"] == grew["ring_buffers"] == 0
    device.prepare(kernel, uniform_values=True)
    before = dict(device.stats)
    device.dispatch(kernel, {"y": y, "a": 2.0}, 1)
    assert delta(device, before)["pipelines"] == 0  # prepare compiled it
    assert device.read(y).tolist() == [5.0] * 4


def test_bench_writes_json_and_sorts(tmp_path, capsys):
    out = tmp_path / "params.json"
    assert bench_main(["--log2n", "10", "--repeats", "1", "--ways", "override,ring,rewrite",
                       "--driver-cache", "--out", str(out)]) == 0  # --driver-cache: os.environ kept
    report = json.loads(out.read_text())
    rows = {r["way"]: r for r in report["results"]}
    assert report["passes"] == 55 and all(r["sorted"] for r in rows.values())
    assert rows["ring"]["pipelines_compiled"] == 1 and rows["ring"]["submits_per_sort"] == 1
    assert rows["override"]["pipelines_compiled"] == 55
    assert rows["rewrite"]["submits_per_sort"] == 55
    assert all(r["recompiles_when_warm"] == 0 and r["wall_ms"] > 0 for r in rows.values())
    assert report["binding"]["record_dynamic_offsets_us"] > 0
    assert "| ring | 1, 1 |" in capsys.readouterr().out
