"""The LoRA forward in numpy: the yardstick every kernel is checked against.

Each function mirrors one kernel (or path) and computes in float64 unless
told otherwise (``dtype=np.float32`` gives a plain f32 numpy answer). Token
layout matches the GPU buffers: ``x`` is ``(in_dim,)`` or ``(tokens, in_dim)``,
``h`` is ``(..., rank)``, ``y``/``base``/output ``(..., out_dim)``.

:func:`tolerance` gives the elementwise error bound the tests allow between a
GPU result and this reference (see docs/lora.md, "Accuracy").
"""
from __future__ import annotations

import numpy as np

F64 = np.float64

# Relative tolerances (see ``tolerance``): per kernel and for a whole path.
RTOL_H = 1e-5      # h = A @ x, up to 5000-long f32 sums
RTOL_Y = 1e-5      # y = B @ h, up to 64-long sums
RTOL_ADD = 1e-6    # output + scale * y: two roundings (2**-23 ~ 1.2e-7)
RTOL_OUT = 1e-4    # a whole forward: h's error carried through B, plus B's sums
ATOL = 1e-30       # only for results that underflow; inputs here are O(1)


def _f(a, dtype):
    return np.asarray(a, dtype)


def project_a(a, x, dtype=F64) -> np.ndarray:
    """h = A @ x for every token: ``x (..., in_dim) -> h (..., rank)``."""
    return _f(x, dtype) @ _f(a, dtype).T


def project_b(b, h, dtype=F64) -> np.ndarray:
    """y = B @ h for every token: ``h (..., rank) -> y (..., out_dim)``."""
    return _f(h, dtype) @ _f(b, dtype).T


def add_scaled(y, output, scale, dtype=F64) -> np.ndarray:
    """``output + scale * y`` (the kernel does it in place)."""
    return _f(output, dtype) + _f(scale, dtype) * _f(y, dtype)


def fused_b_add(b, h, output, scale, dtype=F64) -> np.ndarray:
    """``output + scale * B @ h``: project_b and add_scaled in one."""
    return add_scaled(project_b(b, h, dtype), output, scale, dtype)


def lora_delta(x, a, b, scale, dtype=F64) -> np.ndarray:
    """``scale * B @ (A @ x)``: what the adapter adds to the base output."""
    return _f(scale, dtype) * project_b(b, project_a(a, x, dtype), dtype)


def forward(x, a, b, scale, base=None, dtype=F64) -> np.ndarray:
    """``base + scale * B @ (A @ x)``; ``base`` defaults to zeros."""
    delta = lora_delta(x, a, b, scale, dtype)
    return delta if base is None else _f(base, dtype) + delta


def tolerance(x, a, b, scale, base=None, rtol: float = RTOL_OUT, atol: float = ATOL) -> np.ndarray:
    """Elementwise bound on ``|gpu - forward(...)|`` for a whole forward:
    ``rtol * (|scale| * |B| @ (|A| @ |x|) + |base|) + atol``.

    Every rounding error of a sum is at most the unit roundoff (2**-24) times
    the sum of the absolute values of its terms, so the error scales with the
    absolute-value products, not with the (possibly cancelling) result.
    """
    mag = abs(float(scale)) * project_b(np.abs(_f(b, F64)), project_a(np.abs(_f(a, F64)), np.abs(_f(x, F64))))
    if base is not None:
        mag = mag + np.abs(_f(base, F64))
    return rtol * mag + atol


F16_ROUNDING = 2.0 ** -11  # float16's unit roundoff: the store of an f32 result to f16


def f16_tolerance(x, a, b, scale, base=None) -> np.ndarray:
    """Bound for a forward stored as float16 (inputs already float16 values,
    sums in f32): the f32 bound of :func:`tolerance`, plus rounding the result
    to the nearest float16, at most 2**-11 of it (2**-25 among subnormals)."""
    tol = tolerance(x, a, b, scale, base)
    want = np.abs(forward(x, a, b, scale, base))
    return tol + F16_ROUNDING * (want + tol) + 2.0 ** -25


def h_tolerance(x, a, rtol: float = RTOL_H, atol: float = ATOL) -> np.ndarray:
    """Elementwise bound on ``|gpu h - project_a(a, x)|``: ``rtol * |A| @ |x| + atol``."""
    return rtol * project_a(np.abs(_f(a, F64)), np.abs(_f(x, F64))) + atol


def within(got, want, tol) -> bool:
    """True when every ``|got - want| <= tol`` (NaN anywhere fails)."""
    got = np.asarray(got, F64)
    return bool(got.shape == np.shape(want) and np.all(np.abs(got - want) <= tol))


__all__ = ["project_a", "project_b", "add_scaled", "fused_b_add", "lora_delta", "forward",
           "tolerance", "f16_tolerance", "h_tolerance", "within", "RTOL_H", "RTOL_Y", "RTOL_ADD",
           "RTOL_OUT", "ATOL", "F16_ROUNDING"]
