"""The backward of a LoRA layer: its plan builder, the forward of a training
step (which leaves h for it), and ``backward`` (numpy in, numpy out).

With s the scale, h = A x saved by the forward and g = dL/d(out):
dh = s g B, dB = s g^T h, dA = dh^T x, dx = dh A (see lora.kernels.backward).
Gradients are float32; x, g and dx are stored like the weight. Each gradient
is overwritten, or accumulated with ``accumulate=True`` (micro-batches).
"""
from __future__ import annotations

import functools

import numpy as np

from ..core import checks as C
from ..core import tuning
from ..core.checks import check_f16
from ..core.forward import LIKE_WEIGHT, forward_plan
from ..core.plan import Plan, Role
from ..core.strategy import Strategy
from ..core.weight import Weight, wgsl_dtype
from ..kernels.dropout import threshold
from ..kernels.matrix import FRAGMENT
from .strategy import Backward

# what each result of a one-result backward (Hesper's gradB, gradDh, gradA, inputGrad) reads
ONE_RESULT = {"dB": ("g", "h", "dB"), "dh": ("g", "dh"), "dA": ("dh", "x", "dA"),
              "dx": ("dh", "dx")}


def backward_of(strategy, tokens: int, weight, device) -> Backward:
    """A Backward from itself, its text, or None for the default for the shape."""
    if strategy is None:
        matrix = weight.dtype == np.float16 and \
            FRAGMENT in getattr(device, "subgroup_matrix_configs", ())
        return Backward.for_shape(weight.layer_shape(tokens), device.has_feature("subgroup"),
                                  matrix)
    return strategy if isinstance(strategy, Backward) else Backward.parse(strategy)


def _roles(weight, only: str | None, with_dx: bool) -> dict:
    """The buffers a backward is given, in their positional order."""
    dt, r, i, o = weight.dtype, weight.rank, weight.in_dim, weight.out_dim
    f32 = np.dtype(np.float32)
    every = {"g": Role("grad_out_buf", dt, (o,), why=LIKE_WEIGHT),
             "x": Role("x_buf", dt, (i,), why=LIKE_WEIGHT), "h": Role("h_buf", f32, (r,)),
             "dh": Role("dh_buf", f32, (r,), writes=True),
             "dA": Role("grad_a_buf", f32, (r, i), per_token=False, writes=True),
             "dB": Role("grad_b_buf", f32, (o, r), per_token=False, writes=True),
             "dx": Role("grad_x_buf", dt, (i,), writes=True, why=LIKE_WEIGHT)}
    names = ONE_RESULT[only] if only else ("g", "x", "h", "dA", "dB") + (("dx",) if with_dx else ())
    return {role: every[role] for role in names}


def _fixed(size: tuple, tokens: int) -> tuple:
    """A backward's scratch shape: fixed, as its token count is."""
    return size


def backward_plan(device, weight, scale: float, tokens: int, strategy=None, *,
                  accumulate: bool = False, with_dx: bool = True, only: str | None = None,
                  dh_parts: int = 0) -> Plan:
    """The Plan of one backward for ``tokens`` tokens: given g, x, h, dA, dB
    (and dx unless ``with_dx=False``: a first layer), in that order; it owns
    dh and the partial sums of dA and dB. ``only``: one result ("dh", "dB",
    "dA" or "dx") from the buffers ``ONE_RESULT`` names. ``strategy``: a
    Backward, its text, or None (the default for the shape). ``dh_parts``
    (0: none): its dh [dh_parts, rank] is written by another plan (the mse
    loss's, at one token) before it runs; split only (ValueError otherwise)."""
    check_f16(device, weight.dtype, "backward plan")
    strategy = backward_of(strategy, tokens, weight, device)
    shape = weight.layer_shape(tokens, scale)
    if only is None:
        kernels = strategy.kernels(shape, accumulate, with_dx, dh_parts)
    else:
        kernels = strategy.kernels_of(only, shape, accumulate)
    roles = _roles(weight, only, with_dx)
    sizes = dict(strategy.scratch(shape), **({"dh": (dh_parts, shape.rank)} if dh_parts else {}))
    scratch = {k: functools.partial(_fixed, size) for k, size in sizes.items() if k not in roles}
    label = (f"backward {strategy} rank={shape.rank} in={shape.in_dim} out={shape.out_dim} "
             f"scale={shape.scale} {weight.dtype.name}")
    return Plan(device, label, kernels, roles, bound={"A": weight.a, "B": weight.b},
                scratch=scratch, tokens=tokens, strategy=strategy, weight=weight)


def train_forward_plan(device, weight, scale: float, tokens: int, strategy=None, *,
                       given=("h",), from_base: bool = False) -> Plan:
    """The forward of a training step: ``output += scale * B @ (A @ x)`` that
    also leaves h = A @ x for the backward, in the ``h`` buffer it is given
    (x, output, h) or, with ``given=()``, its own (``plan.h``). ``strategy``:
    a forward strategy or its text; None or "auto": as the forward chooses
    (``lora.core.tuning.choose``: the tuned choice if cached, else the
    model's; "auto" tunes). ``from_base``: see forward_plan."""
    if strategy is None or strategy == "auto":
        strategy = tuning.choose(device, weight, scale, tokens, strategy, save_h=True)
    return forward_plan(device, weight, scale, tokens, strategy, given=given, save_h=True,
                        from_base=from_base)


def dropout_plan(device, weight, tokens: int, p: float, seed: int, state) -> Plan:
    """LoRA dropout of the adapter's input, as peft applies it: given x and xd
    [tokens, in_dim] (stored like the weight), xd = x with each element zeroed
    with probability ``p`` and the rest scaled by 1 / (1 - p); the mask is
    lora.kernels.dropout's hash of (``seed``, the step count in the
    optimizer's ``state``, the element's index). The forward and backward of
    the adapter then read xd for x; the base layer sees x."""
    keep_from = threshold(p)  # ValueError outside [0, 1)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or \
            not 0 <= seed < 2**32:
        raise ValueError(f"seed: expected an int in [0, 2^32), got {seed!r}")
    dt, n = weight.dtype, tokens * weight.in_dim
    params = dict(n=n, keep_from=keep_from, scale=1.0 / (1.0 - p), seed=int(seed),
                  dtype=wgsl_dtype(dt))
    return Plan(device, f"dropout p={p} seed={seed} tokens={tokens} in={weight.in_dim}",
                [("dropout", params)],
                {"x": Role("x_buf", dt, (weight.in_dim,), why=LIKE_WEIGHT),
                 "xd": Role("dropped x", dt, (weight.in_dim,), writes=True, why=LIKE_WEIGHT)},
                bound={"state": state}, tokens=tokens)


def backward(x, a, b, grad_out, *, alpha: float | None = None, scale: float | None = None,
             device=None, strategy=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grad_x, grad_a, grad_b) of ``out = base + scale * B @ (A @ x)`` for the
    upstream gradient ``grad_out``, on the GPU in float32; numpy in and out.
    Shapes as lora.forward: x ``(in_dim,)``, ``(tokens, in_dim)`` or with more
    leading dimensions, grad_out like the output. ``scale`` if given, else
    ``alpha / rank``, else 1."""
    from shaderdsl.runtime import get_device

    p = C.host_problem(x, a, b, grad_out, np.float32, "grad_out")
    am, bm, tokens = p.a, p.b, p.tokens
    s = C.scale_of(alpha, scale, am.shape[0])
    dev = get_device() if device is None else C.device_of(device)
    if strategy is not None and not isinstance(strategy, Backward):
        strategy = Backward.parse(strategy)  # bad text: refused before any buffer exists
    if tokens == 0:  # as torch: no tokens, no gradient
        return (np.zeros(np.shape(x), np.float32), np.zeros(am.shape, np.float32),
                np.zeros(bm.shape, np.float32))
    weight = Weight.from_numpy(dev, am, bm)
    bufs = {"x": dev.buffer(p.x), "g": dev.buffer(p.out),
            "h": dev.empty((tokens, am.shape[0]), np.float32),
            "dA": dev.empty(am.shape, np.float32), "dB": dev.empty(bm.shape, np.float32),
            "dx": dev.empty(p.x.shape, np.float32), "out": dev.empty(p.out.shape, np.float32)}
    plans = []
    try:
        plans = [train_forward_plan(dev, weight, s, tokens),
                 backward_plan(dev, weight, s, tokens, strategy)]
        with dev.batch():
            plans[0](bufs["x"], bufs["out"], h=bufs["h"])
            plans[1](bufs["g"], bufs["x"], bufs["h"], bufs["dA"], bufs["dB"], bufs["dx"])
        return (dev.read(bufs["dx"]).reshape(np.shape(x)).copy(), dev.read(bufs["dA"]).copy(),
                dev.read(bufs["dB"]).copy())
    finally:
        for plan in plans:
            plan.release()
        for buf in (*bufs.values(), weight.a, weight.b):
            dev.release(buf)


__all__ = ["Backward", "Strategy", "backward", "backward_plan", "dropout_plan",
           "train_forward_plan"]
