"""shaderdsl.builtins: its stub (builtins.pyi) names every builtin of the
registry with its signature, and its messages name a builtin as the DSL spells it."""
import inspect
import re

import pytest

import shaderdsl as sd
from shaderdsl import ShaderTypeError, f32, u32
from shaderdsl import builtins as B
from shaderdsl.ops import BUILTINS


def test_stub_is_current():
    """Fails when an entry was added or changed without regenerating the stub
    (the command is in shaderdsl/builtins.py's docstring)."""
    with open(B.__file__.replace(".py", ".pyi")) as f:
        assert f.read() == B.stub()


def test_stub_arity_matches_rule():
    """The stub's argument names are as many as the rule takes."""
    for op in BUILTINS.values():
        assert op.rule is not None
        rule = inspect.signature(op.rule).parameters.values()
        if any(p.kind == p.VAR_POSITIONAL for p in rule):
            assert op.params, f"{op.name}: its rule takes *args, so the entry names them"
        else:
            assert not op.params or len(op.params) == len(rule), op.name


@pytest.mark.parametrize("call, message", [
    (lambda x: B.inverse_sqrt(x), "inverse_sqrt() does not accept u32"),
    (lambda x: B.count_ones(f32(x)), "count_ones() does not accept f32"),
    (lambda x: B.pack4x_i8(x), "pack4x_i8() needs (vec4<i32>), got (u32)"),
    (lambda x: B.atomic_load(x), "atomic_load() needs an atomic<u32|i32> location"),
    (lambda x: B.subgroup_shuffle_xor(x, f32(1.0)), "subgroup_shuffle_xor() lane must be u32"),
    (lambda x: B.all_(f32(x)), "all_() needs bool or vecN<bool>, got f32"),
])
def test_messages_name_the_dsl_spelling(call, message):
    """`B.inverse_sqrt(u32)` says inverse_sqrt(), not WGSL's inverseSqrt()."""
    def k(m):
        x = m.declare_input_buffer("x", u32, 1)
        out = m.declare_output_buffer("out", u32, 1)
        out[0] = call(x[0])
    with pytest.raises(ShaderTypeError, match=re.escape(message)):
        sd.compile(k, 1)
