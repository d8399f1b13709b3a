"""Helpers the docs name that no other test reached: ``emit.expr_text``
(docs/dsl.md, section 2) and ``types.matrix_config`` (section 3.8)."""
import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import f32
from shaderdsl.emit import expr_text
from shaderdsl.types import MatrixConfig, matrix_config


def test_expr_text_is_the_wgsl_of_one_expression():
    """The text the kernel would contain: literal suffixes, the parentheses
    precedence needs (and only those), a comparison among a call's arguments
    parenthesized, builtins under their WGSL names."""
    got = []

    def k(m):
        x = m.declare_input_buffer("x", f32)
        out = m.declare_output_buffer("out", f32)
        i = m.global_id().x
        got.extend(expr_text(e) for e in (
            x[i] * 2.0, (x[i] + 1.0) * 2.0, x[i] * 2.0 + 1.0, x[i] - (x[i] - 1.0),
            B.select(x[i], 0.0, x[i] < 1.0), -x[i], i % 3, B.inverse_sqrt(x[i])))
        out[i] = x[i]
    sd.compile(k, 64)
    assert got == ["x[global_id.x] * 2.0f", "(x[global_id.x] + 1.0f) * 2.0f",
                   "x[global_id.x] * 2.0f + 1.0f", "x[global_id.x] - (x[global_id.x] - 1.0f)",
                   "select(x[global_id.x], 0.0f, (x[global_id.x] < 1.0f))", "-x[global_id.x]",
                   "global_id.x % 3u", "inverseSqrt(x[global_id.x])"]


CONFIGS = (MatrixConfig("f16", "f16", 16, 16, 16), MatrixConfig("f16", "f32", 8, 8, 8),
           MatrixConfig("f16", "f32", 16, 16, 16), MatrixConfig("i8", "i32", 16, 16, 32))


def test_matrix_config_picks_the_first_shape_of_those_types():
    assert matrix_config(CONFIGS, "f16", "f32") is CONFIGS[1]
    assert matrix_config(CONFIGS, "f16", "f16") is CONFIGS[0]
    assert matrix_config(CONFIGS, "i8", "i32") is CONFIGS[3]


def test_matrix_config_filters_by_m_and_n():
    assert matrix_config(CONFIGS, "f16", "f32", m=16) is CONFIGS[2]
    assert matrix_config(CONFIGS, "f16", "f32", n=8) is CONFIGS[1]
    assert matrix_config(CONFIGS, "f16", "f32", m=16, n=16) is CONFIGS[2]


def test_matrix_config_is_none_where_the_adapter_has_no_such_shape():
    assert matrix_config(CONFIGS, "f32", "f32") is None
    assert matrix_config(CONFIGS, "f16", "f32", m=32) is None
    assert matrix_config(CONFIGS, "f16", "f32", m=8, n=16) is None
    assert matrix_config((), "f16", "f32") is None
