"""compile(): run a kernel function on a fresh ShaderM and package the result.

The one build path: the builder records the tree, the emitter prints it, and
the Kernel keeps both (the interpreter runs the tree, the runtime the text).
"""
from __future__ import annotations

import functools
import inspect
import sys
import traceback

import numpy as np

from . import context, uniformity
from . import types as T
from .builder import ShaderM
from .emit import emit
from .errors import KernelBuildError, ShaderDSLError, is_positive_int
from .expr import RefKind
from .kernel import Binding, Kernel, Override
from .location import is_library_file, shown
from .types import size_and_align


def _python(v):
    """numpy scalars as the Python values they stand for (np.float64(1.0) is 1.0),
    so that they build the same kernel and hit the same cache entry."""
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, tuple):
        return tuple(_python(x) for x in v)
    return v


def _workgroup_size(ws) -> tuple[int, int, int]:
    dims = tuple(_python(v) for v in ws) if isinstance(ws, (tuple, list)) else (_python(ws),)
    sizes = [int(v) for v in dims if is_positive_int(v)]
    if not 1 <= len(dims) <= 3 or len(sizes) != len(dims):
        raise ValueError(f"workgroup_size must be 1 to 3 positive ints, got {dims!r}")
    x, y, z = sizes + [1] * (3 - len(sizes))
    return x, y, z


def _bytes(t) -> int:
    """Workgroup bytes of an array type (bool, not host-shareable, counts 4)."""
    if T.scalar_of(t.elem) == T.bool_:
        return 4 * t.length * T.components(t.elem)
    return size_and_align(t)[0]


def compile(fn, workgroup_size: int | np.integer | tuple = 64, *, name: str | None = None,
            **params) -> Kernel:
    """Run ``fn(m, **params)`` on a new ShaderM and return its Kernel.

    Results are cached by (fn, workgroup_size, name, params) when the params
    are hashable, so compiling the same kernel again costs a dict lookup.
    """
    ws = _workgroup_size(workgroup_size)
    params = {k: _python(v) for k, v in params.items()}
    try:
        key = (fn, ws, name, tuple(sorted((k, _exact(v)) for k, v in params.items())))
        hash(key)
    except TypeError:
        return _build(fn, ws, name, params)
    return _cached_build(key)


def _exact(v):
    """A cache key part that tells apart values Python calls equal: 0.0 and
    -0.0, 1 and 1.0 and True each make different WGSL."""
    if isinstance(v, tuple):
        return tuple(_exact(x) for x in v)
    return (type(v), v.hex() if isinstance(v, float) else v)


@functools.lru_cache(maxsize=1024)
def _cached_build(key) -> Kernel:
    fn, ws, name, params = key
    return _build(fn, ws, name, {k: _value(v) for k, v in params})


def _value(part):
    """Inverse of _exact."""
    if isinstance(part, tuple) and part and isinstance(part[0], type):
        kind, v = part
        return float.fromhex(v) if kind is float else v
    return tuple(_value(x) for x in part)


def _check_parameters(fn, name: str, params: dict) -> None:
    """The kernel function's missing or unknown parameters, named before it runs
    (Python's own TypeError would point into this module)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: let the call say
        return
    taken = list(sig.parameters.values())[1:]  # after m
    if any(p.kind is p.VAR_KEYWORD for p in taken):
        return
    missing = [p.name for p in taken if p.default is p.empty and p.name not in params
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(params) - {p.name for p in taken})
    if not missing and not unknown:
        return
    code = getattr(fn, "__code__", None)
    where = f" ({shown((code.co_filename, code.co_firstlineno))})" if code else ""
    parts = [f"needs {', '.join(missing)}"] if missing else []
    parts += [f"takes no {', '.join(unknown)}"] if unknown else []
    raise KernelBuildError(f"kernel function {name!r}{where} {' and '.join(parts)}: it takes "
                           f"{', '.join(p.name for p in taken) or 'no parameters'} (give them "
                           f"to compile() as name=value, or on the command line as name=value)")


def _build(fn, ws, name, params) -> Kernel:
    name = name or getattr(fn, "__name__", "kernel")
    if not isinstance(name, str) or not name.isprintable() or not name:
        raise ValueError(f"kernel name must be a one-line printable str, got {name!r}")
    _check_parameters(fn, name, params)
    builder = ShaderM(ws, name)
    context.push(builder)
    try:
        fn(builder, **params)
    except ShaderDSLError:
        raise
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if not is_library_file(f.filename)), frames[-1])
        raise KernelBuildError(f"kernel function {name!r} raised {type(e).__name__} at "
                               f"{frame.filename}:{frame.lineno}: {e}") from e
    finally:
        context.pop()
    m = builder.module()
    try:
        uniformity.check(m)
        wgsl, source_map, features, first_use = emit(m)
    except RecursionError:  # the walks recurse into operands: a chain of hundreds is too deep
        raise KernelBuildError(
            f"kernel {name!r}: an expression is nested too deeply to compile (Python's "
            f"recursion limit is {sys.getrecursionlimit()}), such as a sum a + b + c + ... of "
            f"hundreds of terms: add into an m.var with += (in m.loop), or sum in shorter "
            f"runs and add their totals") from None
    bindings = tuple(
        Binding(k, r.name, "uniform" if r.kind == RefKind.UNIFORM else r.access,
                r.type if r.kind == RefKind.UNIFORM else r.type.elem,
                None if r.kind == RefKind.UNIFORM else r.type.length,
                r.shape and tuple(d if isinstance(d, int) else d.name for d in r.shape),
                m.holds.get(r.name))
        for k, r in enumerate(m.bindings))
    overrides = tuple(Override(r.name, r.type, None if d is None else d.value)
                      for r, d in m.overrides)
    workgroup_bytes = sum(_bytes(r.type) for r in m.workgroup_vars)
    return Kernel(name=name, wgsl=wgsl, workgroup_size=ws, bindings=bindings,
                  overrides=overrides, features=features, source_map=source_map,
                  workgroup_bytes=workgroup_bytes, feature_lines=first_use, ir=m)
