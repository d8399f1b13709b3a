"""@sd.function: one typed WGSL fn per module, callable from any kernel, run by
the GPU and the interpreter alike."""
# pyright: reportInvalidTypeForm=false
# (@sd.function annotates parameters and results with WGSL types, f32 and the like: DSL
# values, which pyright checks as Python type expressions and refuses)
import numpy as np
import pytest

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32, interp, u32, vec2f
from shaderdsl.errors import ShaderScopeError, ShaderTypeError


@sd.function
def gelu(m, x: f32) -> f32:
    inner = m.let(0.7978846 * (x + 0.044715 * x * x * x), "inner")
    return 0.5 * x * (1.0 + B.tanh(inner))


@sd.function
def repeated_gelu(m, x: f32, times: u32) -> f32:
    acc = m.var(f32, 0.0, "acc")
    with m.loop(times):
        acc += gelu(m, x)
    return acc


@sd.function
def swap(m, v: vec2f) -> vec2f:
    return vec2f(v.y, v.x)


def gelu_kernel(m, n):
    x = m.declare_input_buffer("x", f32, n)
    y = m.declare_output_buffer("y", f32, n)
    i = m.global_id().x
    with m.if_(i < n):
        y[i] = gelu(m, x[i] * 2.0) + repeated_gelu(m, x[i], 3) + swap(m, vec2f(x[i], 1.0)).x


def gelu64(v):
    return 0.5 * v * (1 + np.tanh(0.7978846 * (v + 0.044715 * v ** 3)))


def test_functions_match_numpy_on_gpu_and_interpreter(device):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(100).astype(np.float32)
    x64 = x.astype(np.float64)
    want = gelu64(2 * x64) + 3 * gelu64(x64) + 1.0
    k = sd.compile(gelu_kernel, 64, n=100)
    yb = device.empty(100, np.float32)
    device.dispatch(k, {"x": device.buffer(x), "y": yb}, 2)
    np.testing.assert_allclose(device.read(yb), want, rtol=1e-5, atol=1e-5)
    cpu = interp.run(gelu_kernel, 64, 2, {"x": x, "y": np.zeros(100, np.float32)}, n=100)
    np.testing.assert_allclose(cpu["y"], want, rtol=1e-5, atol=1e-5)


def test_each_function_is_emitted_once_callees_first():
    wgsl = sd.compile(gelu_kernel, 64, n=100).wgsl
    assert wgsl.count("fn gelu(") == 1 and wgsl.count("fn repeated_gelu(") == 1
    assert wgsl.index("fn gelu(") < wgsl.index("fn repeated_gelu(") < wgsl.index("fn main(")
    assert "let gelu_r = gelu(x[global_id.x] * 2.0f);" in wgsl  # the argument appears once
    assert "fn swap(v: vec2<f32>) -> vec2<f32> {" in wgsl


def test_a_function_may_hold_barriers(device):
    @sd.function
    def workgroup_total(m, value: f32) -> f32:
        return sd.collectives.reduce(m, value, "sum")

    def k(m):
        x = m.declare_input_buffer("x", f32, 64)
        y = m.declare_output_buffer("y", f32, 64)
        i = m.local_index()
        y[i] = workgroup_total(m, x[i])

    rng = np.random.default_rng(1)
    x = rng.standard_normal(64).astype(np.float32)
    kernel = sd.compile(k, 64)
    yb = device.empty(64, np.float32)
    device.dispatch(kernel, {"x": device.buffer(x), "y": yb}, 1)
    want = np.full(64, x.astype(np.float64).sum())
    np.testing.assert_allclose(device.read(yb), want, rtol=1e-5, atol=1e-5)
    cpu = interp.run(k, 64, 1, {"x": x, "y": np.zeros(64, np.float32)})
    np.testing.assert_allclose(cpu["y"], want, rtol=1e-5, atol=1e-5)


def test_a_function_that_writes_a_buffer_makes_older_reads_stale():
    def k(m):
        y = m.declare_output_buffer("y", f32, 4)

        @sd.function
        def bump(m, v: f32):
            y[0] = v

        old = y[0] + 1.0
        bump(m, 2.0)
        y[1] = old

    with pytest.raises(ShaderScopeError, match="reads `y`, which was assigned after"):
        sd.compile(k, 1)


def _kernel_calling(fn, *args):
    def k(m):
        y = m.declare_output_buffer("y", f32, 4)
        r = fn(m, *[a(m) if callable(a) else a for a in args])
        y[0] = r if r is not None else 0.0
    return k


def test_bad_functions_are_refused():
    with pytest.raises(ShaderTypeError, match="annotate parameter 'x'"):
        @sd.function
        def untyped(m, x):
            return x

    with pytest.raises(ShaderTypeError, match="argument 'x' must be f32, got u32"):
        sd.compile(_kernel_calling(gelu, lambda m: m.global_id().x), 1)
    with pytest.raises(ShaderTypeError, match=r"takes 1 argument\(s\) after m, got 2"):
        sd.compile(_kernel_calling(gelu, 1.0, 2.0), 1)

    @sd.function
    def wrong(m, x: f32) -> u32:
        return x

    with pytest.raises(ShaderTypeError, match="annotated -> u32 but returns f32"):
        sd.compile(_kernel_calling(wrong, 1.0), 1)

    @sd.function
    def recursive(m, x: f32) -> f32:
        return recursive(m, x)

    with pytest.raises(ShaderTypeError, match="cannot be recursive"):
        sd.compile(_kernel_calling(recursive, 1.0), 1)


def test_builtin_values_become_parameters(device):
    """A function using m.global_id() (or a builtin the kernel made) takes it
    as an extra parameter that each caller passes on."""
    def k(m):
        y = m.declare_output_buffer("y", f32, 128)
        lid = m.local_index()

        @sd.function
        def position(m, scale: f32) -> f32:
            return f32(m.global_id().x) * scale + f32(lid)

        @sd.function
        def outer(m, scale: f32) -> f32:
            return position(m, scale)

        y[m.global_id().x] = outer(m, 2.0)

    kernel = sd.compile(k, 64)
    assert "fn position(scale_1: f32, global_id: vec3<u32>, local_index: u32) -> f32" in kernel.wgsl
    assert "let position_r = position(scale, global_id, local_index);" in kernel.wgsl
    yb = device.empty(128, np.float32)
    device.dispatch(kernel, {"y": yb}, 2)
    want = np.arange(128) * 2.0 + np.arange(128) % 64
    np.testing.assert_array_equal(device.read(yb), want)
    np.testing.assert_array_equal(interp.run(k, 64, 2, {"y": np.zeros(128, np.float32)})["y"], want)


def test_a_function_cannot_return_early():
    @sd.function
    def inner(m, x: f32):
        m.return_()

    with pytest.raises(ShaderScopeError, match=r"m.return_\(\) inside function 'inner'"):
        sd.compile(_kernel_calling(inner, 1.0), 1)


def test_a_function_cannot_see_the_callers_locals():
    def k(m):
        y = m.declare_output_buffer("y", f32, 4)
        local = m.let(f32(m.global_id().x), "local")

        @sd.function
        def uses_local(m, x: f32) -> f32:
            return x + local

        y[0] = uses_local(m, 1.0)

    with pytest.raises(ShaderScopeError, match="uses `local` of the kernel"):
        sd.compile(k, 1)
