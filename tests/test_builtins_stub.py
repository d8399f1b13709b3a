"""shaderdsl/builtins.pyi names every builtin of the registry with its signature."""
import inspect

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
