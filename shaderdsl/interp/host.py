"""The host side of an interpreted dispatch: numpy arrays bound to a kernel's bindings.

Arrays are copied in (the caller's arrays are never modified) and checked the
way a GPU device checks buffers: names, dtype (``shaderdsl.checks``), whole
elements and fixed lengths; overrides are checked and typed like literals.
"""
from __future__ import annotations

import numpy as np

from .. import types as T
from .. import values as V
from ..errors import BindingError
from ..expr import literal


def bind(module, buffers: dict, overrides) -> tuple[dict, dict]:
    """(env with every binding and override, outputs name -> (flat copy, shape))."""
    name = module.name
    names = [r.name for r in module.bindings]
    extra = sorted(set(buffers) - set(names))
    if extra:
        raise BindingError(f"kernel {name!r} has no binding(s) {extra}; it has {names}")
    env: dict = {}
    outputs: dict = {}
    for r in module.bindings:
        if r.name not in buffers:
            raise BindingError(f"kernel {name!r}: no array given for binding {r.name!r}")
        if r.kind == "uniform":
            env[r.name] = _uniform(r, buffers[r.name])
            continue
        work, view = _storage(name, r, buffers[r.name], module.holds.get(r.name))
        env[r.name] = view
        if r.access == "read_write":
            outputs[r.name] = (work, np.shape(buffers[r.name]))
    env.update(_overrides(module, overrides))
    return env, outputs


def _storage(kernel: str, r, value, holds=None) -> tuple[np.ndarray, np.ndarray]:
    """A flat copy of ``value`` and its view as elements of the binding
    (``holds``: the values the array holds where the kernel reads their
    bits through u32 elements)."""
    elem = r.type.elem
    dt = V.dtype_of(elem)
    arr = np.asarray(value)
    want = dt if holds is None else V.dtype_of(holds)
    if arr.dtype != want:
        raise BindingError(f"kernel {kernel!r}: binding {r.name!r} ({r.type}) needs "
                           f"a {want.name} array, got {arr.dtype.name}")
    if holds is not None:
        arr = np.ascontiguousarray(arr).reshape(-1).view(dt)
    comps = T.components(elem)
    if arr.size % comps:
        raise BindingError(f"kernel {kernel!r}: binding {r.name!r} holds {elem} "
                           f"elements, but the array has {arr.size} values, not a "
                           f"multiple of {comps}")
    work = arr.reshape(-1).copy()
    view = work.reshape(-1, comps) if comps > 1 else work
    length = r.type.length
    if length is not None:
        if len(view) < length:
            raise BindingError(f"kernel {kernel!r}: binding {r.name!r} ({r.type}) "
                               f"needs {length} elements, got {len(view)}")
        view = view[:length]
    return work, view


def _uniform(r, value):
    dt = V.dtype_of(r.type)
    if isinstance(value, (bool, np.bool_)):
        raise BindingError(f"uniform {r.name!r}: bool is not host-shareable")
    if isinstance(value, (int, float)):
        scalar = T.scalar_of(r.type)
        assert scalar is not None, "declare_uniform takes scalars and vectors only"
        arr = np.asarray(literal(value, scalar).value, dt)
    else:
        arr = np.asarray(value)
        if arr.dtype != dt:
            raise BindingError(f"uniform {r.name!r} ({r.type}) needs {dt.name}, got "
                               f"{arr.dtype.name}")
    arr = arr.reshape(-1)
    n = T.components(r.type)
    if arr.size < n:
        raise BindingError(f"uniform {r.name!r} ({r.type}) needs {n} value(s), got {arr.size}")
    return arr[:n].copy() if isinstance(r.type, T.Vector) else arr[0]


def _overrides(module, overrides) -> dict:
    given = dict(overrides or {})
    known = {r.name for r, _ in module.overrides}
    if set(given) - known:
        raise BindingError(f"kernel {module.name!r} has no override(s) "
                           f"{sorted(set(given) - known)}; it has {sorted(known)}")
    env = {}
    for r, default in module.overrides:
        if r.name in given:
            v = literal(given[r.name], r.type).value
        elif default is not None:
            v = default.value
        else:
            raise BindingError(f"kernel {module.name!r}: override {r.name!r} has no default; "
                               f"pass overrides={{{r.name!r}: ...}}")
        env[r.name] = V.DTYPES[r.type.name].type(v)
    return env
