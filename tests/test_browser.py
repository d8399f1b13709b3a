"""The browser device (shaderdsl.browser): kernels run by headless Chromium's
WebGPU (its own Dawn, Tint and validation; SwiftShader on a machine without
a GPU), against numpy, the GPU device (wgpu) and the interpreter.

Every example kernel and every LoRA strategy of test_strategies runs here
on small shapes, with the tolerances of test_examples.py and test_lora.py
(in units of U = 2**-24, scaled by the sum of absolute terms; the LoRA
forward within ``lora.reference.tolerance``). Bad input gets the GPU
device's exceptions and messages; a kernel that never ends is reported
(BrowserTimeoutError, the browser restarted) and the next test still runs.
One browser serves the whole session (``shaderdsl.browser.get_device``).
Everything skips, saying how to install Chromium, where there is none.
"""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from helpers import assert_refused_alike, scale128
from test_strategies import STRATEGY_TEXTS

import shaderdsl as sd
from examples import bitonic, half, histogram, int8_matmul, matmul, reduction, saxpy, scan
from examples import rows as rows_mod
from lora import Strategy, Weight, forward_plan
from lora import reference as R
from shaderdsl import browser, f16, f32, u32
from shaderdsl import builtins as B
from shaderdsl.errors import (
    BindingError,
    BrowserError,
    BrowserTimeoutError,
    FeatureError,
    WGSLCompileError,
)
from shaderdsl.kernel import Binding, Kernel

pytestmark = pytest.mark.browser

U = 2.0 ** -24


@pytest.fixture(scope="session")
def web():
    """The process's browser device: one Chromium for every test (a skip,
    saying how to get one, where there is none)."""
    why = browser.unavailable_reason()
    if why:
        pytest.skip(f"browser tests: {why}")
    return browser.get_device()


def nonzero(rng, shape, dtype=np.float32):
    """Random values in +-[0.1, 1): varied in sign and size, never zero."""
    mag = rng.uniform(0.1, 1.0, shape)
    return np.where(rng.random(shape) < 0.5, -mag, mag).astype(dtype)


def f64(a):
    return np.asarray(a, np.float64)


# ---------------------------------------------------------------- the device

def test_device_reports_the_browsers_adapter(web):
    assert web.backend == "browser" and "Chrome/" in web.name
    assert web.limits["max-compute-workgroups-per-dimension"] >= 65535
    assert web.limits["max-compute-invocations-per-workgroup"] >= 256
    assert "subgroups" not in web.features  # spelled as kernels spell it
    assert web.launch_seconds < 30
    assert repr(web).startswith("<browser.Device")


def test_one_browser_per_process(web):
    assert browser.get_device() is web


def test_bytes_travel_exactly(web):
    """NaN payloads, infinities, -0.0, subnormals and every f16 bit pattern survive."""
    special = np.array([0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001,
                        0x807FFFFF, 0x3F800000], np.uint32).view(np.float32)
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for arr in (special, halves, np.arange(-5, 6, dtype=np.int32), np.zeros((2, 0), np.float32)):
        got = web.read(web.buffer(arr))
        assert got.dtype == arr.dtype and got.shape == arr.shape
        assert got.tobytes() == arr.tobytes()


def test_a_kernel_copies_every_bit(web):
    def copy_bits(m):
        src = m.declare_input_buffer("src", u32)
        dst = m.declare_output_buffer("dst", u32)
        i = m.global_id().x
        with m.if_(i < B.array_length(src)):
            dst[i] = src[i]
    bits = np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    dst = web.empty(1000, np.uint32)
    web.dispatch_1d(sd.compile(copy_bits, 64), {"src": web.buffer(bits), "dst": dst}, 1000)
    assert np.array_equal(web.read(dst), bits)


def test_large_buffers_go_in_pieces(web):
    """Over 8 MiB a buffer is written and read a piece per call."""
    arr = np.random.default_rng(1).standard_normal(9 << 18).astype(np.float32)  # 9 MiB
    buf = web.buffer(arr)
    assert np.array_equal(web.read(buf), arr)
    web.write(buf, -arr)
    assert np.array_equal(web.read(buf), -arr)


def test_write_copy_release_and_collected_buffers(web):
    a, b = web.buffer(np.arange(8, dtype=np.float32)), web.zeros(8, np.float32)
    web.copy(a, b, 16)
    assert web.read(b).tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
    web.write(a, np.full(8, 7, np.float32))
    web.copy(a, b)
    assert web.read(b).tolist() == [7] * 8
    web.release(a)
    web.release(a)  # a second release is a no-op
    with pytest.raises(BindingError, match="was released"):
        web.read(a)
    count = "sd.state.buffers.size"
    before = web.host.evaluate(count, 10)
    for _ in range(5):
        web.buffer(np.zeros(4, np.float32))
    gc.collect()
    web.sync()  # sends the collected buffers' releases
    assert web.host.evaluate(count, 10) <= before


# ---------------------------------------------------------------- batches and uniform values

def scaled(m):
    x = m.declare_input_buffer("x", f32)
    out = m.declare_output_buffer("out", f32)
    s = m.declare_uniform("s", f32)
    i = m.global_id().x
    with m.if_(i < B.array_length(x)):
        out[i] = out[i] + x[i] * s


def test_a_batch_is_one_submit_and_each_dispatch_its_own_value(web):
    k = sd.compile(scaled, 64)
    x, out = web.buffer(np.ones(100, np.float32)), web.zeros(100, np.float32)
    before = web.stats["submits"]
    with web.batch(timestamps=True) as batch:
        for s in (1.0, 2.0, 4.0, np.float32(8.0)):
            web.dispatch(k, {"x": x, "out": out, "s": s}, 2)
        assert web.in_batch
    assert web.stats["submits"] == before + 1
    assert web.read(out).tolist() == [15.0] * 100
    if web.has_feature("timestamp-query"):
        assert batch.gpu_time_ns is not None and batch.gpu_time_ns > 0


def test_an_exception_in_a_batch_drops_its_work(web):
    k = sd.compile(scaled, 64)
    x, out = web.buffer(np.ones(64, np.float32)), web.zeros(64, np.float32)
    with pytest.raises(RuntimeError, match="boom"):
        with web.batch(timestamps=True):
            web.dispatch(k, {"x": x, "out": out, "s": 3.0}, 1)
            raise RuntimeError("boom")
    assert not web.in_batch
    assert web.read(out).tolist() == [0.0] * 64
    with web.batch(timestamps=True) as batch:  # the next timed batch still times
        web.dispatch(k, {"x": x, "out": out, "s": web.uniform(1.0)}, 1)
    assert web.read(out).tolist() == [1.0] * 64
    assert batch.gpu_time_ns is None or batch.gpu_time_ns > 0


# ---------------------------------------------------------------- the examples against numpy

@pytest.mark.parametrize("n", [1, 63, 65, 1000])
@pytest.mark.parametrize("a_from, bake_n", [("override", True), ("uniform", False),
                                            ("override", False)])
def test_saxpy(web, n, a_from, bake_n):
    rng = np.random.default_rng(n)
    x, y, a = nonzero(rng, n), nonzero(rng, n), 2.5
    got = saxpy.run(web, a, x, y, a_from=a_from, bake_n=bake_n)
    want = f64(a) * f64(x) + f64(y)
    assert np.all(np.abs(got - want) <= 2 * U * (np.abs(f64(a) * f64(x)) + np.abs(f64(y))))


@pytest.mark.parametrize("n, workgroup, subgroups", [(1, 64, False), (1000, 64, False),
                                                     (70_000, 256, False), (257, 64, True),
                                                     (70_000, 256, True)])
def test_reduction(web, n, workgroup, subgroups):
    x = nonzero(np.random.default_rng(n), n)
    got = reduction.run(web, x, subgroups=subgroups, workgroup_size=workgroup)
    depth, count = 0, n
    while count > 1:
        depth += workgroup.bit_length() - 1
        count = -(-count // workgroup)
    assert abs(got - f64(x).sum()) <= 2 * max(depth, 1) * U * np.abs(f64(x)).sum()


@pytest.mark.parametrize("M, K, N, tile", [(1, 1, 1, 4), (33, 17, 9, 8), (40, 40, 40, 16)])
def test_matmul(web, M, K, N, tile):
    rng = np.random.default_rng(M)
    a, b = nonzero(rng, (M, K)), nonzero(rng, (K, N))
    got = matmul.run(web, a, b, tile=tile)
    tol = 2 * (K + 1) * U * (np.abs(f64(a)) @ np.abs(f64(b)))
    assert np.all(np.abs(got - f64(a) @ f64(b)) <= tol)


@pytest.mark.parametrize("private", [False, True])
@pytest.mark.parametrize("spread", [3, 2**32])
def test_histogram_is_exact(web, private, spread):
    rng = np.random.default_rng(spread)
    values = rng.integers(0, spread, 20_000, dtype=np.uint64).astype(np.uint32)
    got = histogram.run(web, values, 37, private=private, workgroup_size=128)
    np.testing.assert_array_equal(got, np.bincount(values % 37, minlength=37))


@pytest.mark.parametrize("signed", [True, False])
def test_int8_matmul_is_exact(web, signed):
    rng = np.random.default_rng(3)
    dt = np.int8 if signed else np.uint8
    info = np.iinfo(dt)
    a = rng.integers(info.min, info.max + 1, (37, 301)).astype(dt)
    b = rng.integers(info.min, info.max + 1, (301, 45)).astype(dt)
    want = a.astype(np.int64) @ b.astype(np.int64)
    got = int8_matmul.run(web, a, b)
    assert np.array_equal(got.astype(np.int64), want)


@pytest.mark.parametrize("n, subgroups", [(1, False), (5000, False), (70_000, False),
                                          (70_000, True)])
def test_scan_is_exact(web, n, subgroups):
    x = np.random.default_rng(n).integers(-1000, 1000, n).astype(np.int32)
    assert np.array_equal(scan.run(web, x, subgroups=subgroups), np.cumsum(x, dtype=np.int64))


@pytest.mark.parametrize("n", [1, 300, 5000])
def test_bitonic_sort_with_a_value_per_pass(web, n):
    """One pipeline, a (k, j) uniform value per dispatch, every pass in one submit."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    before = web.stats["submits"]
    assert np.array_equal(bitonic.run(web, x), np.sort(x))
    assert web.stats["submits"] - before == 2  # every pass in one, the read's copy in another


@pytest.mark.parametrize("cols", [1, 63, 300])
def test_softmax_and_layer_norm_rows(web, cols):
    rng = np.random.default_rng(cols)
    x = nonzero(rng, (3, cols)) * 8
    got = rows_mod.run(web, rows_mod.softmax, x)
    np.testing.assert_allclose(got, rows_mod.softmax_reference(x),
                               rtol=64 * U * np.log2(cols + 1) + 1e-6, atol=0)
    x = nonzero(rng, (3, cols)) + 3.0
    gamma, beta = nonzero(rng, cols), nonzero(rng, cols)
    got = rows_mod.run(web, rows_mod.layer_norm, x, gamma=gamma, beta=beta)
    scale = np.abs(gamma) / np.sqrt(f64(x).var(axis=1, keepdims=True) + 1e-5) * 4 + np.abs(beta)
    want = rows_mod.layer_norm_reference(x, gamma, beta)
    assert (np.abs(got - want) <= 256 * U * np.log2(cols + 2) * scale).all()


def test_half_needs_shader_f16(web):
    w, x = np.ones((8, 8), np.float16), np.ones(8, np.float32)
    if not web.has_feature("shader-f16"):
        with pytest.raises(FeatureError):
            half.run(web, w, x)
        pytest.skip(f"{web.name} lacks shader-f16: the f16 example is refused (FeatureError)")
    assert np.array_equal(half.run(web, w, x), np.full(8, 8.0, np.float32))


def test_three_implementations_agree(web, device, interp_device):
    """Browser, GPU device (wgpu) and interpreter on one small input each:
    integer kernels bit for bit, float ones within the examples' bounds."""
    rng = np.random.default_rng(7)
    x = rng.integers(-1000, 1000, 300).astype(np.int32)
    values = rng.integers(0, 2**32, 500, dtype=np.uint64).astype(np.uint32)
    a, b = nonzero(rng, (9, 13)), nonzero(rng, (13, 6))
    for run in (lambda d: scan.run(d, x, subgroups=d.has_feature("subgroup")),
                lambda d: histogram.run(d, values, 19, private=True)):
        results = [run(d) for d in (web, device, interp_device)]
        assert all(np.array_equal(r, results[0]) for r in results)
    tol = 2 * 14 * U * (np.abs(f64(a)) @ np.abs(f64(b)))
    for d in (web, device, interp_device):
        assert np.all(np.abs(matmul.run(d, a, b, tile=4) - f64(a) @ f64(b)) <= tol)


# ---------------------------------------------------------------- every LoRA strategy

@pytest.mark.one_per_kind  # default tier: one strategy of each kind, the others slow
@pytest.mark.parametrize("strategy", STRATEGY_TEXTS)
def test_lora_strategy_matches_numpy(web, strategy):
    """Rank 5, 131 -> 259, 37 tokens: ragged for every workgroup and tile."""
    if strategy.endswith(":sg") and not web.has_feature("subgroup"):
        pytest.skip(f"{web.name} lacks 'subgroup'")
    rng = np.random.default_rng(37)
    a, b, x, base = (rng.standard_normal(shape).astype(np.float32)
                     for shape in ((5, 131), (259, 5), (37, 131), (37, 259)))
    plan = forward_plan(web, Weight.from_numpy(web, a, b), -0.75, 37, Strategy.parse(strategy))
    out = web.buffer(base)
    plan(web.buffer(x), out)
    got = web.read(out).astype(np.float64)
    assert not np.isnan(got).any()
    bound = R.tolerance(x, a, b, -0.75, base)
    assert np.all(np.abs(got - R.forward(x, a, b, -0.75, base)) <= bound)


def test_lora_one_token_and_auto(web):
    """The numpy entry point on the browser device, one token, a forced strategy."""
    from lora import forward

    rng = np.random.default_rng(1)
    a, b, x, base = (rng.standard_normal(shape).astype(np.float32)
                     for shape in ((8, 300), (200, 8), 300, 200))
    got = forward(x, a, b, base, alpha=16.0, device=web, strategy="single:64:1")
    assert np.all(np.abs(got - R.forward(x, a, b, 2.0, base)) <= R.tolerance(x, a, b, 2.0, base))


def test_lora_f16_is_refused_without_shader_f16(web):
    if web.has_feature("shader-f16"):
        pytest.skip("this browser's adapter has shader-f16")
    with pytest.raises(FeatureError, match="shader-f16"):
        Weight.from_numpy(web, np.ones((2, 4)), np.ones((4, 2)), dtype=np.float16)


# ---------------------------------------------------------------- bad input: the GPU's errors

def test_bad_input_same_errors_as_the_gpu(web, device):
    assert_refused_alike(device, web)


def test_features_the_browser_lacks_are_refused(web):
    def neg16(m):
        x = m.declare_output_buffer("x", f16)
        x[m.global_id().x] = -x[m.global_id().x]
    k = sd.compile(neg16, 64)
    if web.has_feature("shader-f16"):
        pytest.skip("this browser's adapter has shader-f16")
    with pytest.raises(FeatureError, match=r"needs feature\(s\) 'shader-f16' .* lacks it"):
        web.dispatch(k, {"x": web.zeros(64, np.float32)}, 1)
    with pytest.raises(FeatureError):
        web.prepare(k)


def test_compile_errors_name_the_line(web):
    wgsl = "// kernel broken\n@compute @workgroup_size(1)\nfn main() {\n    let x: f32 = 1u;\n}\n"
    k = Kernel("broken", wgsl, (1, 1, 1), ())
    with pytest.raises(WGSLCompileError, match="broken") as e:
        web.prepare(k)
    assert e.value.wgsl_line == 4 and "let x: f32 = 1u;" in e.value.excerpt
    with pytest.raises(WGSLCompileError, match="(?i)constant"):  # an override with no value
        web.prepare(sd.compile(scale128, 64))


def test_a_binding_the_page_must_refuse(web):
    """What the host checks let through and WebGPU refuses comes back as BrowserError."""
    wgsl = ("// kernel wrong_layout\n"
            "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n"
            "@compute @workgroup_size(1)\nfn main() { x[0] = 1.0; }\n")
    k = Kernel("wrong_layout", wgsl, (1, 1, 1), (Binding(0, "x", "read", f32),))
    with pytest.raises((BrowserError, WGSLCompileError)):
        web.prepare(k)
    assert web.read(web.buffer(np.ones(2, np.float32))).tolist() == [1.0, 1.0]


# ---------------------------------------------------------------- a kernel that never ends

def spin(m):
    x = m.declare_output_buffer("x", u32)
    with m.while_(x[0] == 0):
        x[1] = x[1] + 1


def test_a_hung_kernel_is_reported_and_the_browser_restarted(web):
    old, web.timeout = web.timeout, 3.0
    try:
        buf = web.buffer(np.zeros(4, np.uint32))
        started = time.perf_counter()
        web.dispatch(sd.compile(spin, 1), {"x": buf}, 1)
        with pytest.raises(BrowserTimeoutError, match=r"spin.*never ends.*restarted"):
            web.read(buf)
        assert time.perf_counter() - started < 30
    finally:
        web.timeout = old
    assert web.stats["restarts"] >= 1
    assert buf.released and "lost when the browser restarted" in repr(buf)
    with pytest.raises(BindingError, match="was released"):
        web.read(buf)
    ones = np.ones(10, np.float32)
    assert saxpy.run(web, 2.0, ones, ones).tolist() == [3.0] * 10


def test_a_crashed_browser_is_restarted(web):
    """The browser is this process's child; killing it is what a crash looks like."""
    import os
    import signal

    buf = web.buffer(np.ones(4, np.float32))
    os.killpg(web.host.browser.pid, signal.SIGKILL)
    with pytest.raises(BrowserError, match="(?s)browser exited.*restarted"):
        web.read(buf)
    assert buf.released
    assert web.read(web.buffer(np.ones(4, np.float32))).tolist() == [1.0] * 4


def test_the_next_test_still_runs(web):
    assert web.read(web.buffer(np.arange(3, dtype=np.int32))).tolist() == [0, 1, 2]


# ---------------------------------------------------------------- no browser

def test_no_chromium_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("SHADERDSL_CHROMIUM", raising=False)
    assert browser.find_chromium() is None and not browser.chromium_available()
    with pytest.raises(BrowserError, match=r"apt-get install chromium.*SHADERDSL_CHROMIUM|"
                                           r"SHADERDSL_CHROMIUM.*apt-get install chromium"):
        browser.Device()
    monkeypatch.setenv("SHADERDSL_CHROMIUM", "/nonexistent/chrome")
    with pytest.raises(BrowserError, match="SHADERDSL_CHROMIUM='/nonexistent/chrome' is not"):
        browser.Device()


def test_the_run_tool_serves_a_module_page_and_prints_an_expression(web, tmp_path, capsys):
    """python -m shaderdsl.browser run PAGE --eval EXPR: a page of one's own that imports
    an exported kernel (a module script: it needs http, which the tool serves) prints the
    expression's value once set; a missing page is refused."""
    from shaderdsl.__main__ import main as shaderdsl_main
    from shaderdsl.browser.__main__ import main as run_main

    assert shaderdsl_main(["export", "examples.saxpy:saxpy", "n=4", "--out", str(tmp_path)]) == 0
    (tmp_path / "page.html").write_text("""<!doctype html><script type="module">
import { dispatch, kernel } from "./saxpy.js";
const device = await (await navigator.gpu.requestAdapter()).requestDevice();
const U = GPUBufferUsage, make = values => { const b = device.createBuffer({size: 16,
  usage: U.STORAGE | U.COPY_SRC | U.COPY_DST}); device.queue.writeBuffer(b, 0, values); return b; };
const x = make(new Float32Array([1, 2, 3, 4])), y = make(new Float32Array([1, 1, 1, 1]));
dispatch(device, {x, y}, 1, {constants: {a: 2}});
const read = device.createBuffer({size: 16, usage: U.MAP_READ | U.COPY_DST});
const enc = device.createCommandEncoder(); enc.copyBufferToBuffer(y, 0, read, 0, 16);
device.queue.submit([enc.finish()]); await read.mapAsync(GPUMapMode.READ);
window.result = {y: Array.from(new Float32Array(read.getMappedRange())), url: location.protocol};
</script>""")
    capsys.readouterr()
    assert run_main(["run", str(tmp_path / "page.html"), "--eval", "window.result",
                     "--timeout", "60"]) == 0
    assert capsys.readouterr().out == '{"y": [3, 5, 7, 9], "url": "http:"}\n'
    assert run_main(["run", str(tmp_path / "nothing.html"), "--eval", "1"]) == 2
    assert "nothing.html: no such file" in capsys.readouterr().err


def test_the_run_tool_reports_a_page_that_stops(web, tmp_path, capsys):
    """A page that throws (uncaught), or whose module import fails to load, is reported
    at once with what it threw, not after --timeout as "still unset"; a file:// URL is
    served over http as a path is (the driver's Chromium would read module scripts from
    file://, which a browser refuses)."""
    from shaderdsl.browser.__main__ import main as run_main

    (tmp_path / "throws.html").write_text("""<!doctype html><script type="module">
const device = navigator.gpu.requestAdapter();  // not awaited
throw new TypeError("loraForward: device must be a GPUDevice");
</script>""")
    (tmp_path / "missing.html").write_text("""<!doctype html><script type="module">
import { loraForward } from "./lora_forwrd.js";
window.result = 1;
</script>""")
    (tmp_path / "fine.html").write_text("<script>window.result = location.protocol;</script>")
    capsys.readouterr()
    started = time.monotonic()
    assert run_main(["run", str(tmp_path / "throws.html"), "--eval", "window.result"]) == 1
    assert ("the page stopped before window.result was set: TypeError: loraForward: device "
            "must be a GPUDevice") in capsys.readouterr().err
    assert run_main(["run", str(tmp_path / "missing.html"), "--eval", "window.result"]) == 1
    assert ("a script failed to load: an inline module script (one of its imports: a wrong "
            "path, a 404?)") in capsys.readouterr().err
    assert time.monotonic() - started < 30  # not the default --timeout of 120 s
    assert run_main(["run", (tmp_path / "fine.html").as_uri(), "--eval", "window.result"]) == 0
    captured = capsys.readouterr()
    assert captured.out == '"http:"\n' and "served" not in captured.out
    assert "serving" in captured.err and "over http" in captured.err
