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
from numpy.typing import DTypeLike

F64 = np.float64

# Relative tolerances (see ``tolerance``): per kernel and for a whole path.
RTOL_H = 1e-5      # h = A @ x, up to 5000-long f32 sums
RTOL_Y = 1e-5      # y = B @ h, up to 64-long sums
RTOL_ADD = 1e-6    # output + scale * y: two roundings (2**-23 ~ 1.2e-7)
RTOL_OUT = 1e-4    # a whole forward: h's error carried through B, plus B's sums
ATOL = 1e-30       # only for results that underflow; inputs here are O(1)


def _f(a, dtype):
    return np.asarray(a, dtype)


def project_a(a, x, dtype: DTypeLike = F64) -> np.ndarray:
    """h = A @ x for every token: ``x (..., in_dim) -> h (..., rank)``."""
    return _f(x, dtype) @ _f(a, dtype).T


def project_b(b, h, dtype: DTypeLike = F64) -> np.ndarray:
    """y = B @ h for every token: ``h (..., rank) -> y (..., out_dim)``."""
    return _f(h, dtype) @ _f(b, dtype).T


def add_scaled(y, output, scale, dtype: DTypeLike = F64) -> np.ndarray:
    """``output + scale * y`` (the kernel does it in place)."""
    return _f(output, dtype) + _f(scale, dtype) * _f(y, dtype)


def fused_b_add(b, h, output, scale, dtype: DTypeLike = F64) -> np.ndarray:
    """``output + scale * B @ h``: project_b and add_scaled in one."""
    return add_scaled(project_b(b, h, dtype), output, scale, dtype)


def lora_delta(x, a, b, scale, dtype: DTypeLike = F64) -> np.ndarray:
    """``scale * B @ (A @ x)``: what the adapter adds to the base output."""
    return _f(scale, dtype) * project_b(b, project_a(a, x, dtype), dtype)


def forward(x, a, b, scale, base=None, dtype: DTypeLike = F64) -> np.ndarray:
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
    magnitude_h = project_a(np.abs(_f(a, F64)), np.abs(_f(x, F64)))
    mag = abs(float(scale)) * project_b(np.abs(_f(b, F64)), magnitude_h)
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


def forward_many(x, layers, ids, base=None, dtype=F64) -> np.ndarray:
    """``base + scale_i * B_i @ (A_i @ x)`` row by row, i = ``ids[row]`` (-1:
    the base alone): the multi-adapter forward. ``x`` ``(tokens, in_dim)``;
    ``layers``: (A, B, scale) triples; ``base`` default zeros."""
    xs = _f(x, dtype).reshape(-1, np.shape(x)[-1])
    ids = np.asarray(ids).reshape(-1)
    out_dim = np.shape(layers[0][1])[0]
    out = np.zeros((len(xs), out_dim), dtype) if base is None else \
        _f(base, dtype).reshape(len(xs), out_dim).copy()
    for i, (a, b, scale) in enumerate(layers):
        rows = ids == i
        out[rows] += lora_delta(xs[rows], a, b, scale, dtype)
    return out


def many_tolerance(x, layers, ids, base=None, f16: bool = False) -> np.ndarray:
    """:func:`tolerance` row by row, each with its adapter (rows of id -1: none);
    ``f16``: plus the rounding of the result to float16, as :func:`f16_tolerance`."""
    rtol = RTOL_OUT
    xs = np.reshape(x, (-1, np.shape(x)[-1]))
    ids = np.asarray(ids).reshape(-1)
    mag = np.zeros((len(xs), np.shape(layers[0][1])[0]))
    for i, (a, b, scale) in enumerate(layers):
        rows = ids == i
        mag[rows] = tolerance(xs[rows], a, b, scale, None, rtol, 0.0)
    if base is not None:
        mag += rtol * np.abs(np.reshape(base, mag.shape).astype(F64))
    tol = mag + ATOL
    if not f16:
        return tol
    want = np.abs(forward_many(x, layers, ids, base))
    return tol + F16_ROUNDING * (want + tol) + 2.0 ** -25


__all__ = ["project_a", "project_b", "add_scaled", "fused_b_add", "lora_delta", "forward",
           "tolerance", "f16_tolerance", "h_tolerance", "within", "forward_many",
           "many_tolerance", "RTOL_H", "RTOL_Y", "RTOL_ADD", "RTOL_OUT", "ATOL", "F16_ROUNDING"]


# ================================================================ training
#
# The backward of ``out = base + s * B @ (A @ x)`` for every token, the
# losses, the optimizers and the initialisation, in float64 unless told
# otherwise. x and g are ``(tokens, dim)`` (or ``(dim,)`` for one token).

def backward(x, a, b, g, scale, dtype=F64) -> dict:
    """Gradients of a LoRA layer: with h = A x and upstream gradient g,
    dh = s g B, dB = s g^T h, dA = dh^T x, dx = dh A. Returns a dict with
    ``h``, ``dh``, ``grad_a`` [rank, in], ``grad_b`` [out, rank], ``grad_x``."""
    x2, g2 = np.atleast_2d(_f(x, dtype)), np.atleast_2d(_f(g, dtype))
    a, b, s = _f(a, dtype), _f(b, dtype), _f(scale, dtype)
    h = x2 @ a.T
    dh = s * (g2 @ b)
    grad_x = dh @ a
    return {"h": h, "dh": dh, "grad_a": dh.T @ x2, "grad_b": s * (g2.T @ h),
            "grad_x": grad_x.reshape(np.shape(x))}


def mse(out, target, dtype=F64) -> tuple[float, np.ndarray]:
    """Mean squared error over every element and its gradient 2 (out - target) / N."""
    d = _f(out, dtype) - _f(target, dtype)
    return float(np.mean(d * d)), 2.0 * d / d.size


def softmax_cross_entropy(logits, labels, dtype=F64) -> tuple[float, np.ndarray]:
    """Mean over tokens of -log softmax(logits)[label], and its gradient
    (softmax - onehot) / tokens. logits ``(tokens, classes)``, labels ints."""
    z = np.atleast_2d(_f(logits, dtype))
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    labels = np.asarray(labels).reshape(-1)
    rows = np.arange(len(labels))
    loss = float(np.mean(-np.log(p[rows, labels])))
    grad = p.copy()
    grad[rows, labels] -= 1.0
    return loss, (grad / len(labels)).reshape(np.shape(logits))


def adamw_step(p, g, m, v, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
               dtype: DTypeLike = F64):
    """One step of torch.optim.AdamW (decoupled weight decay, bias correction),
    in the order its implementation computes it:

        p *= 1 - lr * wd
        m  = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
        p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    ``step`` is t (1 for the first step). Returns (p, m, v)."""
    p, g, m, v = (_f(z, dtype) for z in (p, g, m, v))
    b1, b2 = (p.dtype.type(beta) for beta in betas)
    one = p.dtype.type(1)
    lr_, eps_, wd = (p.dtype.type(z) for z in (lr, eps, weight_decay))
    t = p.dtype.type(step)
    p = p * (one - lr_ * wd)
    m = b1 * m + (one - b1) * g
    v = b2 * v + (one - b2) * (g * g)
    bc1, bc2 = one - b1 ** t, one - b2 ** t
    denom = np.sqrt(v) / np.sqrt(bc2) + eps_
    return p - (lr_ / bc1) * m / denom, m, v


def sgd_step(p, g, buf, step, lr, momentum=0.0, weight_decay=0.0, dtype: DTypeLike = F64):
    """One step of torch.optim.SGD (dampening 0, no Nesterov): g += wd p;
    buf = g on the first step, else momentum buf + g; p -= lr buf. Returns (p, buf)."""
    p, g, buf = (_f(z, dtype) for z in (p, g, buf))
    g = g + p.dtype.type(weight_decay) * p
    buf = g if step == 1 or momentum == 0 else p.dtype.type(momentum) * buf + g
    return p - p.dtype.type(lr) * buf, buf


def clip_scale(grads, max_norm: float, dtype=F64) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    norm = np.sqrt(sum(float(np.sum(_f(gr, dtype) ** 2)) for gr in grads))
    return min(1.0, max_norm / (norm + 1e-6))


def learning_rate(step: int, lr: float, schedule: str = "constant", warmup: int = 0,
                  total: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate at ``step`` (1-based): ``constant``; ``linear`` warm-up
    over ``warmup`` steps then constant; ``cosine``: warm-up, then a cosine
    decay to ``min_ratio * lr`` at step ``total``."""
    if warmup and step <= warmup:
        return lr * step / warmup
    if schedule != "cosine":
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + np.cos(np.pi * progress)))


def init_lora(in_dim: int, out_dim: int, rank: int, seed: int = 0, *, kind: str = "kaiming",
              dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """A fresh adapter as peft makes one: B = 0 and A from Kaiming-uniform with
    a = sqrt(5) (bound 1/sqrt(in_dim)), or ``kind="gaussian"``: A ~ N(0, 1/rank)
    (peft's init_lora_weights="gaussian"). Seeded: the same seed, the same A."""
    rng = np.random.default_rng(seed)
    if kind == "kaiming":
        bound = 1.0 / np.sqrt(in_dim)
        a = rng.uniform(-bound, bound, (rank, in_dim))
    elif kind == "gaussian":
        a = rng.normal(0.0, 1.0 / rank, (rank, in_dim))
    else:
        raise ValueError(f"init kind must be 'kaiming' or 'gaussian', got {kind!r}")
    return a.astype(dtype), np.zeros((out_dim, rank), dtype)


__all__ += ["backward", "mse", "softmax_cross_entropy", "adamw_step", "sgd_step", "clip_scale",
            "learning_rate", "init_lora"]


def rel_error(got, want, magnitude) -> float:
    """The largest error relative to 1 + the result's magnitude (|B| |A| |x| summed)."""
    return float(np.max(np.abs(got - want) / (1.0 + magnitude)))

