"""Python that would silently build the wrong kernel is refused at the user's line."""
from __future__ import annotations

import math

import numpy as np
import pytest

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32
from shaderdsl.errors import ShaderScopeError, ShaderTypeError


def build(body, **params):
    def kernel(m, **kw):
        x = m.declare_output_buffer("x", f32, 8)
        body(m, x, **kw)
    return sd.compile(kernel, 1, **params)


@pytest.mark.parametrize("opener", ["if_", "loop", "while_"])
def test_a_block_never_entered(opener):
    def body(m, x):
        args = {"if_": (x[0] > 0.0,), "loop": (4,), "while_": (x[0] > 0.0,)}[opener]
        getattr(m, opener)(*args)  # no `with`
        x[1] = 2.0
    with pytest.raises(ShaderScopeError, match=rf"test_traps.py:\d+: m.{opener}\(...\) was called "
                                               rf"but its block was never entered"):
        build(body)


def test_a_block_never_entered_at_the_end_of_the_build():
    with pytest.raises(ShaderScopeError, match="m.else_"):
        def body(m, x):
            with m.if_(x[0] > 0.0):
                x[1] = 1.0
            m.else_()
        build(body)


def test_loop_step_zero():
    def body(m, x):
        with m.loop(0, 10, 0):
            x[0] = 1.0
    with pytest.raises(ShaderTypeError, match=r"test_traps.py:\d+: a loop step of 0 never ends"):
        build(body)


@pytest.mark.parametrize("what, match", [
    (lambda x: x[0] ** 2, r"`\*\*` has no WGSL operator"),
    (lambda x: math.sqrt(x[0]), "instead of math"),
    (lambda x: max(x[0], x[1]), "B.max/B.min instead of Python's max"),
    (lambda x: x[0] < x[1] < x[2], "chained comparison"),
    (lambda x: list(range(x[0] > 0.0)), r"range\(expr\)"),
])
def test_python_that_needs_a_value_now(what, match):
    def body(m, x):
        x[3] = what(x)
    with pytest.raises(ShaderTypeError, match=rf"test_traps.py:\d+: .*{match}"):
        build(body)


def test_errors_on_a_loop_line_name_the_users_line():
    def body(m, x):
        with m.loop(0, x[0] + 1):  # f32 bound: the error is on this line
            pass
    with pytest.raises(ShaderTypeError) as info:
        build(body)
    assert "test_traps.py" in str(info.value) and "contextlib" not in str(info.value)


def test_rebinding_in_a_loop_is_caught_where_it_is_used():
    def body(m, x):
        acc = m.var(f32, 0.0, "acc")
        with m.loop(4) as j:
            acc = acc + x[j]  # rebinding: the WGSL acc never changes
        x[7] = acc
    with pytest.raises(ShaderScopeError, match="m.assign"):
        build(body)


def test_numpy_scalars_build_the_same_kernel():
    def body(m, x, n, scale, flag):
        with m.loop(n) as i:
            x[i] = x[i] * scale if flag else x[i]
    plain = build(body, n=4, scale=2.0, flag=True)
    numpy = build(body, n=np.int64(4), scale=np.float64(2.0), flag=np.bool_(True))
    assert numpy.wgsl == plain.wgsl and "2.0f" in plain.wgsl
    assert sd.compile(lambda m: m.declare_output_buffer("y", f32, np.int64(3)), np.int32(8)).wgsl \
        == sd.compile(lambda m: m.declare_output_buffer("y", f32, 3), 8).wgsl


def test_reserved_local_names_get_a_trailing_underscore():
    def body(m, x):
        v = m.var(f32, 1.0, "var")
        x[0] = v + B.abs(x[1])
    assert "var var_: f32 = 1.0f;" in build(body).wgsl


def _doubled_without_return(m, v):
    m.let(v * 2.0, "doubled")  # builds the value but forgets `return`


@pytest.mark.parametrize("use", [
    lambda m, x: x.__setitem__(1, _doubled_without_return(m, x[0])),
    lambda m, x: x.__setitem__(1, x[0] + _doubled_without_return(m, x[0])),
    lambda m, x: m.if_(_doubled_without_return(m, x[0])),
])
def test_a_helper_that_forgets_return_is_named_at_the_users_line(use):
    """None from a helper without `return` names the use's line and says why
    (it was "cannot use NoneType None"; as an if_ condition, "number None")."""
    line = use.__code__.co_firstlineno
    with pytest.raises(ShaderTypeError, match=rf"test_traps.py:{line}: None used as a shader "
                                              r"value: a helper function .* must `return` it"):
        build(use)


@pytest.mark.parametrize("declare", [
    lambda m: m.declare_input_buffer("v", np.float32),
    lambda m: m.declare_output_buffer("v", "f32"),
    lambda m: m.shared(np.float32, 4),
    lambda m: m.declare_uniform("v", np.dtype(np.float32)),
    lambda m: m.override("v", np.int32),
])
def test_a_numpy_dtype_for_a_type_is_refused_with_a_hint(declare):
    """m.shared(np.float32, 4) raised AttributeError from the emitter; the
    others named the dtype without saying what to give instead."""
    line = declare.__code__.co_firstlineno
    with pytest.raises(ShaderTypeError, match=rf"test_traps.py:{line}: .* got .*: give a "
                                              r"shaderdsl type \(from shaderdsl import f32"):
        sd.compile(lambda m: declare(m), 1)
