"""WGSL text of each DSL construct, checked as text and compiled by naga."""
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shaderdsl as sd
from shaderdsl import array, atomic, f16, f32, i32, u32, vec2f, vec3u, vec4f, vec4h, vec4u
from shaderdsl import builtins as B
from shaderdsl.emit import float_text


def body(kernel):
    """The entry point's statement lines, stripped of indentation."""
    lines = kernel.wgsl.splitlines()
    start = next(k for k, line in enumerate(lines)
                 if line.startswith(") {") or (line.startswith("fn main") and line.endswith("{")))
    return [line.strip() for line in lines[start + 1:-1]]


def k_of(fn, ws: int | tuple = 64, **params):
    return sd.compile(fn, ws, **params)


def test_saxpy_whole_text(naga):
    def saxpy(m, n):
        x = m.declare_input_buffer("x", f32)
        y = m.declare_output_buffer("y", f32)
        a = m.override("a", f32, 2.0)
        i = m.global_id().x
        with m.if_(i < n):
            y[i] = a * x[i] + y[i]

    k = k_of(saxpy, n=100)
    assert k.wgsl == (
        "// kernel saxpy\n"
        "override a: f32 = 2.0f;\n\n"
        "@group(0) @binding(0) var<storage, read> x: array<f32>;\n"
        "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n\n"
        "@compute @workgroup_size(64, 1, 1)\n"
        "fn main(@builtin(global_invocation_id) global_id: vec3<u32>) {\n"
        "    if (global_id.x < 100u) {\n"
        "        y[global_id.x] = a * x[global_id.x] + y[global_id.x];\n"
        "    }\n"
        "}\n")
    assert [b.name for b in k.bindings] == ["x", "y"]
    assert [b.access for b in k.bindings] == ["read", "read_write"]
    assert k.workgroup_size == (64, 1, 1)
    assert k.features == frozenset()
    naga(k)


def test_section_order_and_declarations(naga):
    def decls(m):
        m.shared(f32, 32, "tile")
        o = m.declare_output_buffer("o", f32, 16)
        u = m.declare_uniform("params", vec4u)
        c = m.override("count", u32)
        x = m.declare_input_buffer("x", vec4f)
        o[m.local_index()] = f32(u.x + c) + x[0].w

    k = k_of(decls, (8, 4))
    text = k.wgsl
    order = [text.index(s) for s in ("override count: u32;",
                                      "@binding(0) var<storage, read_write> o: array<f32, 16>;",
                                      "@binding(1) var<uniform> params: vec4<u32>;",
                                      "@binding(2) var<storage, read> x: array<vec4<f32>>;",
                                      "var<workgroup> tile: array<f32, 32>;",
                                      "@compute @workgroup_size(8, 4, 1)")]
    assert order == sorted(order)
    assert [b.access for b in k.bindings] == ["read_write", "uniform", "read"]
    assert k.bindings[0].length == 16 and k.bindings[1].elem == vec4u
    assert [o.name for o in k.overrides] == ["count"]
    naga(k)


def test_builtins_declared_only_when_used(naga):
    def one(m):
        o = m.declare_output_buffer("o", u32)
        o[0] = m.num_workgroups().x

    k = k_of(one)
    assert "num_workgroups" in k.wgsl and "global_invocation_id" not in k.wgsl
    naga(k)

    def all_(m):
        o = m.declare_output_buffer("o", u32)
        o[m.global_id().x] = (m.local_id().y + m.workgroup_id().z + m.num_workgroups().x
                              + m.local_index())

    k = k_of(all_)
    for b in ("global_invocation_id", "local_invocation_id", "workgroup_id", "num_workgroups",
              "local_invocation_index"):
        assert f"@builtin({b})" in k.wgsl
    naga(k)


def test_operators_and_precedence(naga):
    def ops(m):
        o = m.declare_output_buffer("o", f32)
        q = m.declare_output_buffer("q", u32)
        a = m.let(o[0], "a")
        b = m.let(o[1], "b")
        o[2] = (a + b) * (a - b) / 2.0 % 3.0 - -a
        i = m.let(q[0], "i")
        q[1] = (i & 0xFF) | (i ^ 3) | (i << 2) >> u32(1)
        q[2] = ~i + i // 3
        c = m.let((a < b) & (b >= 1.0) | ~(a == b))
        o[3] = B.select(1.0, 2.0, c)

    k = k_of(ops)
    lines = body(k)
    assert "o[2u] = (a + b) * (a - b) / 2.0f % 3.0f - -a;" in lines
    assert "q[1u] = (i & 255u) | (i ^ 3u) | ((i << 2u) >> 1u);" in lines
    assert "q[2u] = ~i + i / 3u;" in lines
    assert any(line.endswith("= (a < b && b >= 1.0f) || !(a == b);") for line in lines)
    naga(k)


def test_casts_vectors_swizzles_bitcast(naga):
    def v(m):
        o = m.declare_output_buffer("o", vec4f)
        u = m.declare_output_buffer("u", u32)
        g = m.global_id()
        w = m.let(vec4f(f32(g.x), f32(g.y), 0.5, 1.0))
        o[g.x] = w.wzyx * 2.0 + vec4f(1.0)
        o[1].x = w.y
        u[0] = B.bitcast(u32, w.x) + u32(i32(-3) * 2)
        p = m.let(vec2f(w.xy))
        o[2] = vec4f(p, p)

    k = k_of(v)
    lines = body(k)
    assert "let _t0 = vec4<f32>(f32(global_id.x), f32(global_id.y), 0.5f, 1.0f);" in lines
    assert "o[global_id.x] = _t0.wzyx * 2.0f + vec4<f32>(1.0f);" in lines
    assert "o[1u].x = _t0.y;" in lines
    assert "u[0u] = bitcast<u32>(_t0.x) + u32(-3i * 2i);" in lines
    naga(k)


def test_statements(naga):
    def stmts(m):
        o = m.declare_output_buffer("o", f32)
        acc = m.var(f32, 0.0, "acc")
        n = m.var(u32, 10, "n")
        m.comment("sum a few terms")
        with m.loop(0, 8, 2) as k:
            with m.if_(k == 4):
                m.continue_()
            acc += f32(k)
        with m.loop(8, 0, -1, name="j") as j:
            acc -= f32(j)
        with m.while_(n > 0):
            n -= 1
            with m.if_(n == 3):
                m.break_()
        with m.if_(acc > 1.0):
            o[0] = acc
        with m.elif_(acc < -1.0):
            o[0] = -acc
        with m.else_():
            m.return_()
        m.barrier()
        m.storage_barrier()
        arr = m.var(array(f32, 4), name="arr")
        for r in m.static_loop(range(4)):
            arr[r] = f32(r) * acc
        o[1] = arr[0] + arr[3]

    k = k_of(stmts)
    lines = body(k)
    assert lines[:3] == ["var acc: f32 = 0.0f;", "var n: u32 = 10u;", "// sum a few terms"]
    assert "for (var _i0: u32 = 0u; _i0 < 8u; _i0 += 2u) {" in lines
    assert "for (var j: u32 = 8u; j > 0u; j -= 1u) {" in lines
    assert "while (n > 0u) {" in lines
    assert ["if (acc > 1.0f) {", "o[0u] = acc;", "} else if (acc < -1.0f) {", "o[0u] = -acc;",
            "} else {", "return;", "}"] == lines[lines.index("if (acc > 1.0f) {"):][:7]
    assert "continue;" in lines and "break;" in lines
    assert "workgroupBarrier();" in lines and "storageBarrier();" in lines
    assert "var arr: array<f32, 4>;" in lines
    assert "arr[3u] = 3.0f * acc;" in lines
    naga(k)


def test_let_snapshots_and_stale_expressions_raise():
    def ok(m):
        o = m.declare_output_buffer("o", f32)
        acc = m.var(f32, 1.0, "acc")
        snap = m.let(acc * 2.0, "snap")
        acc += 1.0
        o[0] = snap + acc

    lines = body(k_of(ok))
    assert lines[1] == "let snap = acc * 2.0f;"

    def stale(m):
        o = m.declare_output_buffer("o", f32)
        acc = m.var(f32, 1.0, "acc")
        e = acc * 2.0
        acc += 1.0
        o[0] = e

    with pytest.raises(sd.ShaderScopeError, match="assigned after the expression was built"):
        k_of(stale)

    def stale_in_loop(m):
        o = m.declare_output_buffer("o", f32)
        acc = m.var(f32, 1.0, "acc")
        e = acc + 1.0
        with m.loop(4):
            o[0] = e
            acc += 1.0

    with pytest.raises(sd.ShaderScopeError, match="built before a loop"):
        k_of(stale_in_loop)


def test_declarations_in_nested_blocks_are_hoisted_and_locals_scoped(naga):
    def hoist(m):
        o = m.declare_output_buffer("o", f32)
        with m.if_(m.global_id().x == 0):
            x = m.declare_input_buffer("x", f32)
            t = m.shared(f32, 4, "t")
            t[0] = x[0]
            o[0] = t[0]

    k = k_of(hoist)
    assert [b.name for b in k.bindings] == ["o", "x"]
    assert k.wgsl.index("var<workgroup> t") < k.wgsl.index("fn main")
    naga(k)

    def escape(m):
        o = m.declare_output_buffer("o", f32)
        with m.if_(m.global_id().x == 0):
            inner = m.let(o[1])
        o[0] = inner

    with pytest.raises(sd.ShaderScopeError, match="inside a block that has ended"):
        k_of(escape)


@pytest.mark.parametrize("expr, message", [
    (lambda f, u: f + u, "between f32 and u32"),
    (lambda f, u: u + 1.5, "float literal 1.5 used where u32"),
    (lambda f, u: -u, "unary minus needs a signed type"),
    (lambda f, u: f << u, "needs an integer left operand"),
    (lambda f, u: f & f, "needs integer or bool operands"),
    (lambda f, u: B.sqrt(u), "sqrt() does not accept u32"),
    (lambda f, u: B.min(f, u), "needs arguments of one type"),
    (lambda f, u: u + (-1), "does not fit in u32"),
    (lambda f, u: vec4f(f, f), "needs 1 or 4 components"),
    (lambda f, u: f.x, "f32 has no member 'x'"),
])
def test_type_errors_name_the_python_line(expr, message):
    def bad(m):
        fb = m.declare_input_buffer("fb", f32)
        ub = m.declare_input_buffer("ub", u32)
        expr(fb[0], ub[0])

    with pytest.raises(sd.ShaderTypeError) as info:
        k_of(bad)
    assert message in str(info.value)
    if isinstance(info.value, sd.ShaderTypeError):
        assert re.search(r"test_codegen\.py:\d+", str(info.value))


def test_more_misuse_raises():
    def python_if(m):
        o = m.declare_output_buffer("o", f32)
        if o[0] > 1.0:
            pass

    with pytest.raises(sd.ShaderTypeError, match="no Python truth value"):
        k_of(python_if)

    def write_input(m):
        x = m.declare_input_buffer("x", f32)
        x[0] = 1.0

    with pytest.raises(sd.ShaderTypeError, match="read-only"):
        k_of(write_input)

    def assign_let(m):
        o = m.declare_output_buffer("o", f32)
        t = m.let(o[0])
        t += 1.0

    with pytest.raises(sd.ShaderTypeError, match="is a let"):
        k_of(assign_let)

    def else_alone(m):
        m.declare_output_buffer("o", f32)
        with m.else_():
            pass

    with pytest.raises(sd.ShaderScopeError, match="must directly follow"):
        k_of(else_alone)

    def break_outside(m):
        m.break_()

    with pytest.raises(sd.ShaderScopeError, match="outside a loop"):
        k_of(break_outside)


@pytest.mark.parametrize("name, why", [
    ("target", "reserved word"), ("fn", "keyword"), ("f32", "predeclared"), ("min", "predeclared"),
    ("_x", "leading '_'"), ("2x", "not a usable identifier"), ("a-b", "not a usable identifier"),
])
def test_bad_names(name, why):
    def k(m):
        m.declare_input_buffer(name, f32)

    with pytest.raises(sd.ShaderNameError, match=re.escape(why)):
        k_of(k)


def test_duplicate_names():
    def k(m):
        m.declare_input_buffer("x", f32)
        m.declare_output_buffer("x", f32)

    with pytest.raises(sd.ShaderNameError, match="already declared"):
        k_of(k)

    def locals_get_suffix(m):
        o = m.declare_output_buffer("o", f32)
        a = m.let(o[0], "v")
        b = m.let(o[1], "v")
        o[2] = a + b

    assert "let v_1 = o[1u];" in body(k_of(locals_get_suffix))


def test_kernel_function_raising_is_wrapped():
    def k(m):
        m.declare_input_buffer("x", f32)
        raise ValueError("boom")

    with pytest.raises(sd.KernelBuildError,
                       match="raised ValueError at .*test_codegen.py:\\d+: boom"):
        k_of(k)
    # the builder stack is clean afterwards: a good kernel still compiles
    assert "fn main" in k_of(lambda m: m.declare_input_buffer("x", f32)).wgsl


def test_features_from_the_tree(naga):
    def half(m):
        x = m.declare_input_buffer("x", vec4h)
        o = m.declare_output_buffer("o", f32)
        o[0] = f32(x[0].x * 2.0)

    k = k_of(half)
    assert k.features == {"shader-f16"} and k.wgsl.splitlines()[1] == "enable f16;"
    assert "2.0h" in k.wgsl
    naga(k)

    def named_like_subgroup(m):  # a name containing "subgroupAdd" text must not add a feature
        o = m.declare_output_buffer("mySubgroupAddBuffer", f32)
        o[0] = 1.0

    assert k_of(named_like_subgroup).features == frozenset()

    def sg(m):
        x = m.declare_input_buffer("x", f32)
        o = m.declare_output_buffer("o", f32)
        s = m.let(B.subgroup_add(x[m.global_id().x]))
        o[m.subgroup_invocation_id()] = s + B.subgroup_shuffle_xor(s, 1)

    k = k_of(sg)
    assert k.features == {"subgroup"}
    assert "enable subgroups;" not in k.wgsl  # naga refuses it and needs none
    naga(k)


def test_atomics_emit_immediately(naga):
    def hist(m):
        x = m.declare_input_buffer("x", u32)
        h = m.declare_output_buffer("h", atomic(u32))
        i = m.global_id().x
        with m.if_(i < B.array_length(x)):
            old = B.atomic_add(h[x[i] % 16], 1)
            B.atomic_max(h[16], old)
            B.atomic_store(h[17], 3)

    lines = body(k_of(hist))
    assert "let _t0 = atomicAdd(&h[x[global_id.x] % 16u], 1u);" in lines
    assert "let _t1 = atomicMax(&h[16u], _t0);" in lines
    assert "atomicStore(&h[17u], 3u);" in lines
    naga(k_of(hist))

    def misuse(m):
        h = m.declare_output_buffer("h", atomic(u32))
        h[0] = 1

    with pytest.raises(sd.ShaderTypeError, match="atomic"):
        k_of(misuse)


def test_math_builtins_compile(naga):
    def maths(m):
        o = m.declare_output_buffer("o", f32)
        v = m.declare_output_buffer("v", vec4f)
        x = m.let(o[0], "x")
        terms = [B.sqrt(x), B.exp(x), B.log(x), B.pow(x, 2.0), B.tanh(x), B.abs(x), B.min(x, 1.0),
                 B.max(x, 0.0), B.clamp(x, 0.0, 1.0), B.fma(x, x, 1.0), B.sin(x), B.cos(x),
                 B.floor(x), B.ceil(x), B.round(x), B.fract(x), B.exp2(x), B.log2(x),
                 B.inverse_sqrt(x), B.sign(x), B.trunc(x), B.mix(x, 1.0, 0.5), B.step(0.5, x),
                 B.smoothstep(0.0, 1.0, x), B.saturate(x), B.tan(x),
                 B.dot(v[0], v[1]), B.length(v[0]), B.distance(v[0], v[1])]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        o[1] = total
        v[2] = B.normalize(v[0])
        c = m.let(B.cross(v[0].xyz, v[1].xyz))
        v[3] = vec4f(c, 1.0)
        u = m.declare_output_buffer("u", u32)
        u[0] = (B.count_ones(u[1]) + B.reverse_bits(u[2]) + B.first_leading_bit(u[3])
                + B.first_trailing_bit(u[4]))
        with m.if_(B.all_(v[0] > vec4f(0.0)) & B.any_(v[1] < vec4f(0.0))):
            o[2] = 1.0

    naga(k_of(maths))


def test_cache_key_and_compile_cache():
    def k(m, n):
        o = m.declare_output_buffer("o", u32)
        o[0] = u32(n)

    a, b, c = k_of(k, n=1), k_of(k, n=1), k_of(k, n=2)
    assert a is b and a.cache_key == b.cache_key and a.cache_key != c.cache_key


def test_source_map_points_at_python_lines():
    def k(m):
        o = m.declare_output_buffer("o", f32)
        o[0] = 1.0  # marker line

    kern = k_of(k)
    line = next(n for n, text in enumerate(kern.wgsl.splitlines(), 1) if "o[0u] = 1.0f;" in text)
    where = kern.python_line(line)
    first = test_source_map_points_at_python_lines.__code__.co_firstlineno
    assert where is not None and where.endswith(f"test_codegen.py:{first + 3}")


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_f32_literal_round_trips(x):
    text = float_text(x, f32)
    assert text.endswith("f")
    assert re.fullmatch(r"-?(\d+\.\d+|\d+(\.\d+)?e-?\d+)f", text), text
    back = np.float32(float(text[:-1]))
    assert back == np.float32(x) and math.copysign(1, back) == math.copysign(1, x)


@settings(max_examples=100, deadline=None)
@given(st.floats(width=16, allow_nan=False, allow_infinity=False))
def test_f16_literal_round_trips(x):
    text = float_text(x, f16)
    assert np.float16(float(text[:-1])) == np.float16(x)


def test_literal_ranges_and_non_finite():
    with pytest.raises(sd.ShaderTypeError, match="no literal for inf"):
        def k(m):
            o = m.declare_output_buffer("o", f32)
            o[0] = math.inf
        k_of(k)
    with pytest.raises(sd.ShaderTypeError, match="out of range for f32"):
        def k2(m):
            o = m.declare_output_buffer("o", f32)
            o[0] = 1e39
        k_of(k2)


def test_python_assignment_inside_a_block_is_refused():
    def k(m):
        x = m.declare_input_buffer("x", f32)
        out = m.declare_output_buffer("out", f32)
        value = m.var(f32, 0.0, "value")
        with m.if_(m.global_id().x < 10):
            value = x[m.global_id().x]  # a Python rebinding, not a WGSL assignment
        out[m.global_id().x] = value

    with pytest.raises(sd.ShaderScopeError, match=r"m.assign\(value, value\)"):
        k_of(k)

    def fixed(m):
        x = m.declare_input_buffer("x", f32)
        out = m.declare_output_buffer("out", f32)
        value = m.var(f32, 0.0, "value")
        with m.if_(m.global_id().x < 10):
            m.assign(value, x[m.global_id().x])
        out[m.global_id().x] = value

    assert "value = x[global_id.x];" in body(k_of(fixed))


def test_python_rebinding_of_a_var_in_a_loop_is_refused():
    """``acc = acc + x[j]; y[j] = acc`` in a loop: used only inside the block, the
    rebinding would compile to ``y[j] = acc + x[j]`` with acc never updated."""
    def k(m):
        x = m.declare_input_buffer("x", f32, 8)
        y = m.declare_output_buffer("y", f32, 8)
        acc = m.var(f32, 0.0, "acc")
        with m.loop(8) as j:
            acc = acc + x[j]
            y[j] = acc

    with pytest.raises(sd.ShaderScopeError, match=r"test_codegen.py:\d+: `acc` held the var "
                                                  r"`acc` when this block opened and holds "
                                                  r"another expression now: .* Write "
                                                  r"`m.assign\(acc, value\)` inside the block"):
        k_of(k)


def test_more_refusals():
    def swizzle_store(m):
        o = m.declare_output_buffer("o", vec4f)
        o[0].xy = vec2f(1.0, 2.0)

    with pytest.raises(sd.ShaderTypeError, match="cannot assign to a swizzle"):
        k_of(swizzle_store)

    def scalar_member(m):
        m.declare_output_buffer("o", f32)
        v = m.var(f32, 0.0)
        v.x = 1.0

    with pytest.raises(sd.ShaderTypeError, match="only vectors have components"):
        k_of(scalar_member)

    def atomic_var(m):
        m.var(atomic(u32))

    with pytest.raises(sd.ShaderTypeError, match="atomics live in storage"):
        k_of(atomic_var)

    def vec3_buffer(m):
        m.declare_input_buffer("v", vec3u)

    with pytest.raises(sd.ShaderTypeError, match="16-byte stride"):
        k_of(vec3_buffer)

    def runtime_broadcast_lane(m):
        o = m.declare_output_buffer("o", f32)
        o[0] = B.subgroup_broadcast(o[1], m.subgroup_invocation_id())

    with pytest.raises(sd.ShaderTypeError, match="constant lane"):
        k_of(runtime_broadcast_lane)


def test_floordiv_assign_and_mix_scalar(naga):
    def k(m):
        o = m.declare_output_buffer("o", vec4f)
        n = m.var(u32, 9, "n")
        n //= 3
        o[0] = B.mix(o[1], o[2], 0.25) + vec4f(f32(n))

    lines = body(k_of(k))
    assert "n /= 3u;" in lines and "o[0u] = mix(o[1u], o[2u], 0.25f) + vec4<f32>(f32(n));" in lines
    naga(k_of(k))


def test_compound_swizzle_store_is_refused():
    def k(m):
        o = m.declare_output_buffer("o", vec4f)
        o[0].xy += vec2f(1.0, 2.0)

    with pytest.raises(sd.ShaderTypeError, match="cannot assign to a swizzle"):
        k_of(k)


def test_signed_remainder_goes_through_a_helper_naga_cannot_miscompile():
    """naga's OpSRem is undefined under Vulkan for negative operands (the H200
    gave -100 % 7 = 2): an i32 `%` calls a helper dividing instead, once per type."""
    def k(m):
        a, b = m.declare_input_buffer("a", i32), m.declare_input_buffer("b", i32)
        o, u = m.declare_output_buffer("o", i32), m.declare_output_buffer("u", u32)
        i = m.let(m.global_id().x, "i")
        o[i] = a[i] % b[i] + (sd.vec2i(a[i], 1) % b[i]).y
        v = m.var(a[i], name="v")
        m.assign(v, b[i], op="%")
        o[i + 1] = v
        u[i] = u32(i) % 3
    wgsl = sd.compile(k, 4).wgsl
    assert wgsl.count("fn _rem_i32(a: i32, b: i32) -> i32 {") == 1
    assert "fn _rem_vec2i(a: vec2<i32>, b: vec2<i32>) -> vec2<i32> {" in wgsl
    assert "o[i] = _rem_i32(a[i], b[i]) + (_rem_vec2i(vec2<i32>(a[i], 1i), vec2<i32>(b[i]))).y;" \
        in wgsl
    assert "v = _rem_i32(v, b[i]);" in wgsl and "u[i] = u32(i) % 3u;" in wgsl
