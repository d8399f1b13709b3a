"""WGSL values as numpy values: the representation the operation semantics use.

Scalars are numpy scalars of the WGSL type (np.float32, np.float16,
np.int32, np.uint32, np.bool_), vectors small numpy arrays, fixed arrays
numpy arrays of those. Integer arithmetic is done in int64 and wrapped back
to 32 bits, as WGSL's two's-complement rules say.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from . import types as T
from .types import DTYPES, MATRIX_DTYPES

I64 = np.dtype(np.int64)
F64 = np.dtype(np.float64)
# Float -> integer conversions saturate (WGSL); these are the limits that an
# f32 can hold exactly (2**31 - 1 and 2**32 - 1 are not f32 values).
FLOAT_TO_INT = {"i32": (-2.0 ** 31, 2147483520.0), "u32": (0.0, 4294967040.0)}


def dtype_of(t: T.WType) -> np.dtype:
    """numpy dtype of one component of ``t`` (scalar, vector, atomic, subgroup
    matrix or array thereof)."""
    while isinstance(t, T.Array):
        t = t.elem
    if isinstance(t, T.SubgroupMatrix):
        return MATRIX_DTYPES[t.component]
    s = T.scalar_of(t)
    if s is None:
        raise TypeError(f"no numpy dtype for {t}")
    return DTYPES[s.name]


def shape_of(t: T.WType) -> tuple:
    """numpy shape of a value of type ``t`` (() for scalars)."""
    if isinstance(t, T.Array):
        if t.length is None:
            raise TypeError(f"{t} has no fixed shape")
        return (t.length,) + shape_of(t.elem)
    if isinstance(t, T.Vector):
        return (t.size,)
    if isinstance(t, T.SubgroupMatrix):   # the whole matrix, as every lane sees it
        return (t.rows, t.cols)
    return ()


def zero_value(t: T.WType):
    """WGSL's zero value of ``t``."""
    shape, dt = shape_of(t), dtype_of(t)
    return np.zeros(shape, dt) if shape else dt.type(0)


def scalar(x):
    """A numpy scalar for a 0-d result, the array itself otherwise."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


def copy(v):
    return v.copy() if isinstance(v, np.ndarray) else v


def wrap(r, dt):
    """An int64 result wrapped to the 32-bit dtype (two's complement), scalar or vector."""
    return scalar(np.asarray(r).astype(dt))


def int_wrapper(dt) -> Callable[[int], np.generic]:
    """``wrap`` for one invocation's Python-int result, without numpy's arrays (integer
    arithmetic on scalars is the interpreter's commonest operation)."""
    make = dt.type
    if dt.kind == "i":
        return lambda r: make(signed(r))
    return lambda r: make(r & 0xFFFFFFFF)


def convert(src: T.Scalar, dst: T.Scalar) -> Callable:
    """WGSL value conversion ``dst(x)`` for x of scalar type ``src`` (componentwise)."""
    dt = DTYPES[dst.name]
    if src == dst:
        return copy
    if dst == T.bool_:
        return lambda v: scalar(np.asarray(v != 0))
    if src.is_float and dst.is_int:
        lo, hi = FLOAT_TO_INT[dst.name]

        def f2i(v):
            x = np.trunc(np.asarray(v, F64))
            x = np.where(np.isnan(x), 0.0, np.clip(x, lo, hi))
            return scalar(x.astype(dt))
        return f2i
    # int <-> int reinterprets the bits; int/bool -> float rounds to nearest;
    # float <-> float rounds; bool -> int gives 0 or 1.
    return lambda v: scalar(np.asarray(v).astype(dt))


def bits(v: int) -> int:
    """The 32 bits of an integer, as a non-negative Python int."""
    return int(v) & 0xFFFFFFFF


def signed(v: int) -> int:
    """The 32 bits of an integer read as i32."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def per_component(fn, dt):
    """Apply a Python-int function to each component; the result wraps to ``dt``."""
    def f(v):
        if isinstance(v, np.ndarray):
            return np.array([fn(int(c)) for c in v], I64).astype(dt)
        return wrap(np.int64(fn(int(v))), dt)
    return f
