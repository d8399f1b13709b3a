"""Packed 8-bit integer dot products and the pack/unpack builtins.

WGSL's language extension packed_4x8_integer_dot_product (dot4I8Packed,
dot4U8Packed, pack4xI8, pack4xU8, their Clamp forms, unpack4xI8,
unpack4xU8) and the float packs (pack4x8snorm/unorm, pack2x16snorm/unorm/
float and their unpacks), checked three ways:

1. WGSL text and typing rules (no feature: naga and Tint accept them
   without an enable or requires directive);
2. the registry's numpy semantics (what the interpreter runs) against
   references written here independently, exactly: Python fractions for
   the normalized floats, numpy byte views for the integers; exhaustively
   over every 8- and 16-bit field where the function works per field;
3. the GPU against the interpreter and the references on random inputs
   (hypothesis) and on edge values.

Where WGSL leaves the GPU a choice, the test allows exactly that choice:

* pack*norm: the spec's value is floor(0.5 + scale * clamp(e)) of the exact
  product. GPUs round the product to f32 and round halves to even (lavapipe
  does: pack4x8snorm(-0.5) is -64 there, -63 by the spec), so where the
  exact scaled value lies within one f32 ulp of k + 0.5, k and k + 1 are
  both accepted (docs/errors.md, section 7);
* pack2x16float of a value between two f16 values: either neighbour (the
  interpreter rounds to nearest even); out of f16's finite range, NaN or
  infinite: indeterminate, pinned on lavapipe only;
* unpack*norm: a division, within 3 f32 ulps (lavapipe is exact);
* NaN in pack*norm: indeterminate; the interpreter uses min/max's rule (a
  NaN operand gives the other one, so NaN packs like -1 or 0), which
  lavapipe matches.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shaderdsl as sd
from examples import int8_matmul as IM
from shaderdsl import builtins as B
from shaderdsl import f32, i32, u32, vec4f, vec4i, vec4u
from shaderdsl.errors import ShaderTypeError
from shaderdsl.interp import Interpreter
from shaderdsl.ops import BUILTINS

SETTINGS = settings(max_examples=20, deadline=None)
N = 64  # invocations (rows of inputs) per dispatch

PACKING = {  # dsl name -> WGSL name
    "dot4_i8_packed": "dot4I8Packed", "dot4_u8_packed": "dot4U8Packed",
    "pack4x_i8": "pack4xI8", "pack4x_u8": "pack4xU8", "pack4x_i8_clamp": "pack4xI8Clamp",
    "pack4x_u8_clamp": "pack4xU8Clamp", "unpack4x_i8": "unpack4xI8", "unpack4x_u8": "unpack4xU8",
    **{n: n for n in ("pack4x8snorm", "pack4x8unorm", "pack2x16snorm", "pack2x16unorm",
                      "pack2x16float", "unpack4x8snorm", "unpack4x8unorm", "unpack2x16snorm",
                      "unpack2x16unorm", "unpack2x16float")},
}
NORM = {  # pack name -> (scale, lowest clamped value, fields, field width)
    "pack4x8snorm": (127, -1, 4, 8), "pack4x8unorm": (255, 0, 4, 8),
    "pack2x16snorm": (32767, -1, 2, 16), "pack2x16unorm": (65535, 0, 2, 16),
}


def sem(name):
    """The registry's semantics of a packing builtin (they need no types)."""
    return BUILTINS[name].semantics((), None)


# ================================================================ references

def ref_bytes(x, signed):
    """(n, 4) bytes of u32 words, byte 0 = bits 0..7."""
    words = np.ascontiguousarray(x, "<u4").reshape(-1)
    return words.view(np.int8 if signed else np.uint8).reshape(-1, 4)


def ref_pack_bytes(v):
    """Low 8 bits of each of the (n, 4) ints, as u32 words."""
    return (np.asarray(v, np.int64) & 0xFF).astype(np.uint8).view("<u4").reshape(-1)


def ref_halves(x):
    return np.ascontiguousarray(x, "<u4").reshape(-1).view("<u2").reshape(-1, 2)


def ref_norm(e: float, scale: int, low: int) -> int:
    """floor(1/2 + scale * min(1, max(low, e))), exactly; NaN counts as ``low``."""
    q = Fraction(low) if math.isnan(e) else min(Fraction(1), max(Fraction(low), Fraction(e)))
    return math.floor(Fraction(1, 2) + scale * q)


def ref_nearest(q: Fraction, dt: type[np.floating] = np.float32):
    """The ``dt`` value nearest to ``q`` (ties to the even significand), by exact
    comparison of the neighbours of numpy's guess."""
    c = dt(float(q))
    with np.errstate(over="ignore"):
        cands = [x for x in (c, np.nextafter(c, dt(np.inf)), np.nextafter(c, dt(-np.inf)))
                 if np.isfinite(x)]
    best = min(abs(Fraction(float(x)) - q) for x in cands)
    near = [x for x in cands if abs(Fraction(float(x)) - q) == best]
    bits = np.uint32 if dt == np.float32 else np.uint16
    return min(near, key=lambda x: int(np.array(x).view(bits)) & 1)


def ref_unnorm(field: int, scale: int) -> np.float32:
    return ref_nearest(max(Fraction(field, scale), Fraction(-1)))


# ================================================================ 1. WGSL text and typing

def _all_packing(m):
    x = m.declare_input_buffer("x", u32)
    vf = m.declare_input_buffer("vf", vec4f)
    vi = m.declare_input_buffer("vi", vec4i)
    o = m.declare_output_buffer("o", u32)
    fo = m.declare_output_buffer("fo", vec4f)
    i = m.let(m.global_id().x, "i")
    w, v = m.let(x[i], "w"), m.let(vf[i], "v")
    o[i] = (u32(B.dot4_i8_packed(w, 7)) + B.dot4_u8_packed(w, w) + B.pack4x_i8(vi[i])
            + B.pack4x_u8(vec4u(vi[i])) + B.pack4x_i8_clamp(vi[i]) + B.pack4x_u8_clamp(vec4u(w))
            + B.pack4x8snorm(v) + B.pack4x8unorm(v) + B.pack2x16snorm(v.xy)
            + B.pack2x16unorm(v.zw) + B.pack2x16float(v.xy))
    fo[i] = (vec4f(B.unpack4x_i8(w)) + vec4f(B.unpack4x_u8(w)) + B.unpack4x8snorm(w)
             + B.unpack4x8unorm(w) + vec4f(B.unpack2x16snorm(w), B.unpack2x16unorm(w))
             + vec4f(B.unpack2x16float(w), 0.0, 1.0))


def test_every_packing_builtin_is_registered_with_its_wgsl_name():
    assert {n: BUILTINS[n].wgsl for n in PACKING} == PACKING
    assert all(BUILTINS[n].feature is None for n in PACKING)


def test_wgsl_text_features_and_naga(naga):
    k = sd.compile(_all_packing, 64)
    for wgsl in PACKING.values():
        assert f"{wgsl}(" in k.wgsl, wgsl
    assert "dot4I8Packed(w, 7u)" in k.wgsl          # a Python int takes the u32 parameter
    assert k.features == frozenset() and "enable" not in k.wgsl and "requires" not in k.wgsl
    assert k.wgsl_for("tint") == k.wgsl
    naga(k)


@pytest.mark.parametrize("call, message", [
    (lambda v: B.dot4_i8_packed(v.x),  # pyright: ignore[reportCallIssue]  (the test: one argument)
     "takes 2 argument(s), got 1"),
    (lambda v: B.dot4_i8_packed(i32(v.x), v.x),
     "dot4_i8_packed() needs (u32, u32), got (i32, u32)"),
    (lambda v: B.dot4_u8_packed(v.x, -1), "-1 does not fit in u32"),
    (lambda v: B.pack4x_i8(v), "pack4x_i8() needs (vec4<i32>), got (vec4<u32>)"),
    (lambda v: B.pack4x_u8_clamp(v.xyz), "needs (vec4<u32>), got (vec3<u32>)"),
    (lambda v: B.pack4x8snorm(vec4i(v)), "pack4x8snorm() needs (vec4<f32>), got (vec4<i32>)"),
    (lambda v: B.pack2x16float(vec4f(v)), "needs (vec2<f32>), got (vec4<f32>)"),
    (lambda v: B.unpack4x_i8(f32(v.x)), "unpack4x_i8() needs (u32), got (f32)"),
    (lambda v: B.unpack2x16float(1.5), "float literal 1.5 used where u32 is expected"),
])
def test_packing_arguments_are_checked(call, message):
    def k(m):
        v = m.let(m.declare_input_buffer("x", vec4u)[0], "v")
        call(v)
    with pytest.raises(ShaderTypeError, match=None) as info:
        sd.compile(k, 1)
    assert message in str(info.value)


# ============================================================ 2. semantics against the references

def test_integer_unpacks_and_dots_of_every_byte():
    """Every byte value in every position: unpack4xI8/U8 sign- or zero-extend it,
    dot4 of a word with itself squares and sums its bytes."""
    x = (np.arange(256, dtype=np.uint32)[:, None] << np.array([0, 8, 16, 24], np.uint32))
    x = np.concatenate([x.reshape(-1), np.array([0x80808080, 0x7F7F7F7F, 0xFFFFFFFF], np.uint32)])
    for signed, unpack, dot in ((True, "unpack4x_i8", "dot4_i8_packed"),
                                (False, "unpack4x_u8", "dot4_u8_packed")):
        got = np.array([sem(unpack)(w) for w in x])
        assert got.dtype == (np.int32 if signed else np.uint32)
        assert np.array_equal(got, ref_bytes(x, signed))
        squares = np.array([sem(dot)(w, w) for w in x])
        assert np.array_equal(squares, (ref_bytes(x, signed).astype(np.int64) ** 2).sum(1))
    assert sem("dot4_i8_packed")(np.uint32(0x80808080), np.uint32(0x80808080)) == 4 * 128 * 128
    assert sem("dot4_i8_packed")(np.uint32(0x80808080), np.uint32(0x7F7F7F7F)) == -4 * 128 * 127
    assert sem("dot4_u8_packed")(np.uint32(0xFFFFFFFF), np.uint32(0xFFFFFFFF)) == 4 * 255 * 255


def test_integer_packs_wrap_or_clamp_each_component():
    v = np.array([[-129, -128, 127, 128], [255, 256, -1, 0],
                  [-2**31, 2**31 - 1, 1000, -1000]], np.int32)
    u = np.array([[0, 127, 128, 255], [256, 1000, 2**32 - 1, 2**31]], np.uint32)
    got = [sem("pack4x_i8")(r) for r in v]
    assert got == list(ref_pack_bytes(v)) and got[0] == 0x807F807F
    got = [sem("pack4x_i8_clamp")(r) for r in v]
    assert got == list(ref_pack_bytes(np.clip(v, -128, 127))) and got[0] == 0x7F7F8080
    assert [sem("pack4x_u8")(r) for r in u] == list(ref_pack_bytes(u))
    assert [sem("pack4x_u8_clamp")(r) for r in u] == [0xFF807F00, 0xFFFFFFFF]
    assert all(type(sem(n)(v[0] if "i8" in n else u[0])) is np.uint32
               for n in ("pack4x_i8", "pack4x_u8", "pack4x_i8_clamp", "pack4x_u8_clamp"))


# slow: the 16-bit fields, 65,536 values each through the interpreter, ~5 s each
@pytest.mark.parametrize("name, scale, signed", [
    ("unpack4x8snorm", 127, True), ("unpack4x8unorm", 255, False),
    pytest.param("unpack2x16snorm", 32767, True, marks=pytest.mark.slow),
    pytest.param("unpack2x16unorm", 65535, False, marks=pytest.mark.slow)])
def test_normalized_unpacks_are_correctly_rounded_for_every_field(name, scale, signed):
    """max(v / scale, -1) rounded once to f32, for every value of a field (the
    interpreter divides in float64 first: this shows that does not double-round)."""
    width = 8 if "4x8" in name else 16
    fields = np.arange(1 << width, dtype=np.int64)
    words = (fields * sum(1 << (width * i) for i in range(32 // width))).astype(np.uint32)
    got = np.array([sem(name)(w) for w in words])
    assert got.dtype == np.float32 and (got == got[:, :1]).all()   # every field alike
    values = np.where(fields >= 1 << (width - 1), fields - (1 << width), fields) if signed \
        else fields
    want = np.array([ref_unnorm(int(v), scale) for v in values], np.float32)
    assert np.array_equal(got[:, 0], want)


def test_half_unpack_and_pack_of_every_f16():
    halves = np.arange(1 << 16, dtype=np.uint32)
    got = np.array([sem("unpack2x16float")(w) for w in halves | halves << 16])
    want = halves.astype(np.uint16).view(np.float16).astype(np.float32)
    assert np.array_equal(got[:, 0], want, equal_nan=True)
    assert np.array_equal(got[:, 1], want, equal_nan=True)
    finite = np.isfinite(want)
    repacked = np.array([sem("pack2x16float")(np.array([h, -h], np.float32)) for h in want[finite]])
    assert np.array_equal(repacked & 0xFFFF, halves[finite])        # every finite f16 round-trips
    assert np.array_equal(repacked >> 16, halves[finite] ^ 0x8000)


def test_norm_packs_follow_the_spec_formula_at_ties_and_edges():
    """floor(0.5 + scale * clamp(e)): halves round up (-0.5 * 127 = -63.5 -> -63),
    +-inf clamp, NaN counts as the clamp's low end (min/max's NaN rule)."""
    s = sem("pack4x8snorm")
    assert ref_bytes(s(np.array([-0.5, 0.5, np.inf, -np.inf], np.float32)), True).tolist() == \
        [[-63, 64, 127, -127]]
    assert ref_bytes(s(np.array([np.nan, 1.0, -1.0, -0.0], np.float32)), True).tolist() == \
        [[-127, 127, -127, 0]]
    u = sem("pack4x8unorm")
    assert ref_bytes(u(np.array([0.5, np.nan, np.inf, -np.inf], np.float32)), False).tolist() == \
        [[128, 0, 255, 0]]
    ties = np.array([(2 * k + 1) / 2 / 127 for k in range(-127, 127)], np.float32)
    for name, (scale, low, count, width) in NORM.items():
        for e in np.concatenate([ties, np.array([1e-45, -1e-45, 3e38, np.nan], np.float32)]):
            v = np.full(count, e, np.float32)
            want = ref_norm(float(e), scale, low) & ((1 << width) - 1)
            assert sem(name)(v) == sum(want << (width * i) for i in range(count)), (name, e)


# ================================================================ 3. GPU, interpreter, reference

def _packing_rows(m):
    """Row i: every packing builtin applied to the inputs of row i."""
    w = m.declare_input_buffer("w", vec4u, N)        # (x, y, _, _): words
    vi = m.declare_input_buffer("vi", vec4i, N)
    vu = m.declare_input_buffer("vu", vec4u, N)
    vf = m.declare_input_buffer("vf", vec4f, N)
    iout = m.declare_output_buffer("iout", vec4i, 2 * N)
    uout = m.declare_output_buffer("uout", vec4u, 4 * N)
    fout = m.declare_output_buffer("fout", vec4f, 4 * N)
    i = m.let(m.global_id().x, "i")
    x, y = m.let(w[i].x, "x"), m.let(w[i].y, "y")
    a, b, v = m.let(vi[i], "a"), m.let(vu[i], "b"), m.let(vf[i], "v")
    iout[2 * i] = B.unpack4x_i8(x)
    iout[2 * i + 1] = vec4i(B.dot4_i8_packed(x, y), 0, 0, 0)
    uout[4 * i] = B.unpack4x_u8(x)
    uout[4 * i + 1] = vec4u(B.pack4x_i8(a), B.pack4x_i8_clamp(a), B.pack4x_u8(b),
                            B.pack4x_u8_clamp(b))
    uout[4 * i + 2] = vec4u(B.pack4x8snorm(v), B.pack4x8unorm(v), B.pack2x16snorm(v.xy),
                            B.pack2x16unorm(v.zw))
    uout[4 * i + 3] = vec4u(B.dot4_u8_packed(x, y), B.pack2x16float(v.xy),
                            B.pack2x16float(v.zw), 0)
    fout[4 * i] = B.unpack4x8snorm(x)
    fout[4 * i + 1] = B.unpack4x8unorm(x)
    fout[4 * i + 2] = vec4f(B.unpack2x16snorm(x), B.unpack2x16unorm(x))
    fout[4 * i + 3] = vec4f(B.unpack2x16float(x), B.unpack2x16float(y))


EDGE_INTS = np.array([0, 1, -1, 127, 128, -128, -129, 255, 256, -2**31, 2**31 - 1], np.int64)
EDGE_WORDS = np.array([0, 0x80808080, 0x7F7F7F7F, 0xFFFFFFFF, 0x00FF80FF, 0x7C00FC00,
                       0x7E00FBFF, 0x80008001, 0x00017FFF], np.uint32)


def _ints(rng, lo, hi, shape):
    """Uniform integers with a fifth of them edge values (in range)."""
    edges = EDGE_INTS[(EDGE_INTS >= lo) & (EDGE_INTS <= hi)]
    return np.where(rng.random(shape) < 0.2, rng.choice(edges, shape),
                    rng.integers(lo, hi, shape, endpoint=True))


def _floats(rng, shape):
    """f32 inputs: in and around [-1, 1], next to the ties of every pack*norm
    scale, tiny and large; all finite and within f16's range."""
    scale = rng.choice([127, 255, 32767, 65535], shape)
    k = np.floor(rng.uniform(-1, 1, shape) * scale)
    tie = ((k + 0.5) / scale).astype(np.float32)
    tie = np.nextafter(tie, tie * rng.choice([0.5, 1, 2], shape).astype(np.float32))  # -, =, +
    kinds = [rng.uniform(-1.2, 1.2, shape).astype(np.float32), tie,
             rng.choice(np.array([0.0, -0.0, 1e-45, -1e-40, 1.0, -1.0, 0.5, -0.5, 65504.0,
                                    -65504.0, 6e-8, 1e3], np.float32), shape),
             (rng.uniform(-1, 1, shape) * 2.0 ** rng.integers(-30, 16, shape)).astype(np.float32)]
    return np.choose(rng.integers(0, len(kinds), shape), kinds).astype(np.float32)


def make_inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    words = _ints(rng, 0, 2**32 - 1, (N, 4)).astype(np.uint32)
    words[:len(EDGE_WORDS), 0] = EDGE_WORDS
    return {"w": words, "vi": _ints(rng, -2**31, 2**31 - 1, (N, 4)).astype(np.int32),
            "vu": _ints(rng, 0, 2**32 - 1, (N, 4)).astype(np.uint32), "vf": _floats(rng, (N, 4))}


def outputs_zero() -> dict:
    return {"iout": np.zeros((2 * N, 4), np.int32), "uout": np.zeros((4 * N, 4), np.uint32),
            "fout": np.zeros((4 * N, 4), np.float32)}


def run_both(device, inputs):
    """(GPU outputs, interpreter outputs), each split into named (N, ...) arrays."""
    kernel = sd.compile(_packing_rows, 64)
    interp = Interpreter(_packing_rows, 64)
    assert interp.wgsl == kernel.wgsl
    bufs = {n: device.buffer(a) for n, a in {**inputs, **outputs_zero()}.items()}
    device.dispatch(kernel, bufs, 1)
    gpu = {n: device.read(bufs[n]).reshape(a.shape) for n, a in outputs_zero().items()}
    cpu = interp.dispatch({**inputs, **outputs_zero()}, 1)
    return split(gpu), split(cpu)


def split(out) -> dict:
    i, u, f = (out[n].reshape(N, -1, 4) for n in ("iout", "uout", "fout"))
    return {"unpack4x_i8": i[:, 0], "dot4_i8_packed": i[:, 1, 0], "unpack4x_u8": u[:, 0],
            "int_packs": u[:, 1], "norm_packs": u[:, 2], "dot4_u8_packed": u[:, 3, 0],
            "half_packs": u[:, 3, 1:3], "unpack4x8snorm": f[:, 0], "unpack4x8unorm": f[:, 1],
            "unpack2x16norm": f[:, 2], "unpack2x16float": f[:, 3]}


def ref_fields(words, count: int, width: int, signed: bool) -> np.ndarray:
    """(n, count) fields of u32 words as int64, sign-extended when ``signed``."""
    f = (np.asarray(words, np.int64)[..., None] >> (np.arange(count) * width)) & ((1 << width) - 1)
    return np.where(signed & (f >= 1 << (width - 1)), f - (1 << width), f)


def _norm_inputs(v) -> dict:
    """The components each pack*norm of _packing_rows reads."""
    return {"pack4x8snorm": v, "pack4x8unorm": v, "pack2x16snorm": v[:, :2],
            "pack2x16unorm": v[:, 2:]}


def reference(inputs) -> dict:
    """Every output of _packing_rows, from the references above."""
    x, y = inputs["w"][:, 0], inputs["w"][:, 1]
    a, b, v = inputs["vi"], inputs["vu"], inputs["vf"]
    xi, yi, xu, yu = (ref_bytes(w, s).astype(np.int64) for w, s in
                      ((x, True), (y, True), (x, False), (y, False)))
    norms = [[sum((ref_norm(float(e), *NORM[n][:2]) & ((1 << NORM[n][3]) - 1)) << (NORM[n][3] * k)
                  for k, e in enumerate(row)) for row in rows]
             for n, rows in _norm_inputs(v).items()]
    halves = [[int((np.float16(e) if e == 0 else ref_nearest(Fraction(float(e)), np.float16))
                   .view(np.uint16)) for e in row] for row in v]      # a zero keeps its sign
    return {
        "unpack4x_i8": xi, "unpack4x_u8": xu, "dot4_i8_packed": (xi * yi).sum(1),
        "dot4_u8_packed": (xu * yu).sum(1),
        "int_packs": np.stack([ref_pack_bytes(a), ref_pack_bytes(np.clip(a, -128, 127)),
                               ref_pack_bytes(b), ref_pack_bytes(np.minimum(b, 255))], 1),
        "norm_packs": np.array(norms, np.int64).T,
        "half_packs": np.array([[r[0] | r[1] << 16, r[2] | r[3] << 16] for r in halves]),
        "unpack4x8snorm": _unnorms(x, 4, 8, 127), "unpack4x8unorm": _unnorms(x, 4, 8, 255),
        "unpack2x16norm": np.concatenate([_unnorms(x, 2, 16, 32767),
                                          _unnorms(x, 2, 16, 65535)], 1),
        "unpack2x16float": np.concatenate([ref_halves(x).view(np.float16),
                                           ref_halves(y).view(np.float16)], 1).astype(np.float32),
    }


def _unnorms(x, count, width, scale):
    signed = scale in (127, 32767)
    return np.array([[ref_unnorm(int(f), scale) for f in row]
                     for row in ref_fields(x, count, width, signed)], np.float32)


def assert_same(got: dict, want: dict, who: str):
    for name in want:
        assert np.array_equal(got[name], want[name], equal_nan=got[name].dtype.kind == "f"), \
            f"{who}: {name}\n{got[name]}\n{want[name]}"


def norm_ok(word, e, scale: int, low: int, count: int, width: int) -> np.ndarray:
    """Fields of a GPU pack*norm word: the spec's value, or where the exact
    scaled value lies within an f32 ulp of a half, the integer on either side."""
    g = ref_fields(word, count, width, low < 0)
    x = scale * np.fmin(1.0, np.fmax(float(low), np.asarray(e, np.float64)))  # exact in f64
    near = np.abs(x - (np.floor(x) + 0.5)) <= np.spacing(np.abs(x).astype(np.float32))
    return (g == np.floor(x + 0.5)) | (near & ((g == np.floor(x)) | (g == np.floor(x) + 1)))


def half_ok(bits, e) -> np.ndarray:
    """A GPU f16 for f32 ``e`` (within f16's range): either f16 neighbour of e;
    zero for a value that rounds to a subnormal (WGSL may flush those)."""
    g = np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)
    e = np.asarray(e, np.float64)
    lo = np.array([float(np.float16(v)) if float(np.float16(v)) <= v else
                   float(np.nextafter(np.float16(v), np.float16(-np.inf))) for v in e.ravel()])
    lo = lo.reshape(e.shape)
    with np.errstate(over="ignore"):
        hi = np.where(lo == e, lo, np.nextafter(lo.astype(np.float16), np.float16(np.inf)))
    return (g == lo) | (g == hi) | ((np.abs(e) < 2.0 ** -14) & (g == 0))


def ulps(a, b) -> np.ndarray:
    """Distance in f32 steps (the order of the f32 bit patterns)."""
    def order(x):
        i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(order(a) - order(b))


def assert_gpu_allowed(gpu: dict, cpu: dict, inputs):
    """The GPU equals the interpreter where WGSL fixes the result, and makes one
    of the choices WGSL allows elsewhere (see the module docstring)."""
    exact = ("unpack4x_i8", "unpack4x_u8", "dot4_i8_packed", "dot4_u8_packed", "int_packs")
    assert_same({n: gpu[n] for n in exact}, {n: cpu[n] for n in exact}, "GPU")
    for k, (name, e) in enumerate(_norm_inputs(inputs["vf"]).items()):
        ok = norm_ok(gpu["norm_packs"][:, k], e, *NORM[name])
        assert ok.all(), f"{name}({e[~ok.all(1)][:3]}) = {gpu['norm_packs'][~ok.all(1), k][:3]:}"
    v = inputs["vf"]
    halves = ref_fields(gpu["half_packs"], 2, 16, False).reshape(N, 4)
    ok = half_ok(halves, v)
    assert ok.all(), f"pack2x16float({v[~ok][:4]}) -> {halves[~ok][:4]}"
    for name in ("unpack4x8snorm", "unpack4x8unorm", "unpack2x16norm"):
        assert ulps(gpu[name], cpu[name]).max() <= 3, name
    g, c = gpu["unpack2x16float"], cpu["unpack2x16float"]
    same = (g == c) | (np.isnan(g) & np.isnan(c)) | ((np.abs(c) < 2.0 ** -14) & (g == 0))
    assert same.all(), f"unpack2x16float: GPU {g[~same][:4]} vs {c[~same][:4]}"


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_gpu_interpreter_and_reference_agree(device, seed):
    inputs = make_inputs(seed)
    gpu, cpu = run_both(device, inputs)
    assert_same(cpu, reference(inputs), "interpreter")
    assert_gpu_allowed(gpu, cpu, inputs)


SPECIAL = np.array([[np.nan, np.inf, -np.inf, -0.5], [0.5, -np.inf, 65520.0, 1e30]], np.float32)


def test_nan_inf_and_halves(device):
    """The interpreter's values for NaN, +-inf and -0.5; what the GPU gives: inf
    clamps by the spec everywhere, -0.5 packs to -63 by the spec and -64 where
    halves round to even (lavapipe); NaN, and f16 packs out of range, are
    indeterminate in WGSL: pinned on lavapipe, which matches the interpreter."""
    inputs = make_inputs(1)
    inputs["vf"][:2] = SPECIAL
    gpu, cpu = run_both(device, inputs)
    snorm, unorm = (ref_fields(cpu["norm_packs"][:2, k], 4, 8, k == 0) for k in (0, 1))
    assert snorm.tolist() == [[-127, 127, -127, -63], [64, -127, 127, 127]]
    assert unorm.tolist() == [[0, 255, 0, 0], [128, 0, 255, 255]]
    halves = ref_fields(cpu["half_packs"][:2], 2, 16, False).reshape(2, 4)
    assert halves.tolist() == [[0x7E00, 0x7C00, 0xFC00, 0xB800], [0x3800, 0xFC00, 0x7C00, 0x7C00]]
    g = ref_fields(gpu["norm_packs"][:2, 0], 4, 8, True)
    assert g[0, 1:3].tolist() == [127, -127] and g[1, 1:].tolist() == [-127, 127, 127]
    assert g[0, 3] in (-63, -64)
    if "llvmpipe" in device.name and device.backend == "Vulkan":  # lavapipe, not llvmpipe's GL
        assert g[0].tolist() == [-127, 127, -127, -64]   # -0.5: half to even, unlike the spec
        cpu["norm_packs"][0, 0] = gpu["norm_packs"][0, 0]
        assert_same({n: v[:2] for n, v in gpu.items()}, {n: v[:2] for n, v in cpu.items()},
                    "lavapipe")                    # the rest (NaN included) as the interpreter


def _8bit(rng, shape, signed):
    """int8 or uint8 values, a quarter of them the extremes."""
    lo, hi = (-128, 127) if signed else (0, 255)
    v = np.where(rng.random(shape) < 0.25, rng.choice([lo, hi, 0, -1 if signed else 1], shape),
                 rng.integers(lo, hi, shape, endpoint=True))
    return v.astype(np.int8 if signed else np.uint8)


def _interp_matmul(a, b):
    (M, K), N = a.shape, b.shape[1]
    signed = a.dtype == np.int8
    interp = Interpreter(IM.int8_matmul, (IM.TILE, IM.TILE), M=M, K=K, N=N, signed=signed)
    c = np.zeros((M, N), np.int32 if signed else np.uint32)
    return interp.dispatch({**IM.inputs(a, b), "C": c}, IM.workgroups(M, N))["C"]


@SETTINGS
@given(M=st.integers(1, 70), K=st.integers(1, 300), N=st.integers(1, 70),
       seed=st.integers(0, 2**32 - 1), signed=st.booleans())
def test_int8_matmul_on_the_gpu_is_exact(device, M, K, N, seed, signed):
    rng = np.random.default_rng(seed)
    a, b = _8bit(rng, (M, K), signed), _8bit(rng, (K, N), signed)
    got = IM.run(device, a, b)
    assert got.dtype == (np.int32 if signed else np.uint32) and got.shape == (M, N)
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@settings(max_examples=10, deadline=None)
@given(M=st.integers(1, 10), K=st.integers(1, 13), N=st.integers(1, 10),
       seed=st.integers(0, 2**32 - 1), signed=st.booleans())
def test_int8_matmul_in_the_interpreter_is_exact(M, K, N, seed, signed):
    rng = np.random.default_rng(seed)
    a, b = _8bit(rng, (M, K), signed), _8bit(rng, (K, N), signed)
    assert np.array_equal(_interp_matmul(a, b), a.astype(np.int64) @ b.astype(np.int64))


def test_int8_matmul_extremes(device):
    """-128 * -128 summed over K = 4096 (2**26) and 255 * 255 over 4096, exactly;
    the int8 example's WGSL compiles with no feature."""
    for dt, v in ((np.int8, -128), (np.uint8, 255)):
        a, b = np.full((3, 4096), v, dt), np.full((4096, 5), v, dt)
        assert (IM.run(device, a, b) == 4096 * v * v).all()
    a = np.array([[-128, 127, -1, 0, 5]], np.int8)
    b = np.array([[-128], [127], [-128], [99], [-7]], np.int8)
    assert _interp_matmul(a, b).tolist() == [[128 * 128 + 127 * 127 + 128 - 35]]
    assert sd.compile(IM.int8_matmul, (8, 8), M=1, K=1, N=1).features == frozenset()


def test_int8_matmul_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="cannot multiply int8"):
        IM.inputs(np.zeros((2, 3), np.int8), np.zeros((4, 2), np.int8))
    with pytest.raises(ValueError, match="2-D int8 or uint8"):
        IM.pack_rows(np.zeros((2, 3), np.int16))
