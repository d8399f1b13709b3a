"""The forward as users call it: the autotuned plan cached on the weight
(:func:`auto_plan`), and :func:`forward`, numpy in and numpy out."""
from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from shaderdsl import checks as sd_checks

from . import checks as C
from . import tuning
from .cache import clear_plan_cache, get_or_build
from .forward import forward_plan
from .plan import Plan
from .strategy import Strategy
from .weight import Weight, storage_dtype


def auto_plan(device, weight, scale: float, tokens: int, strategy=None) -> Plan:
    """The weight's cached forward plan for ``tokens`` tokens: the strategy
    given (or ``$LORA_STRATEGY``); "auto": the autotuned fastest (measured
    once, cached on disk); None: the tuned one where the cache has it, else
    the model's (``tuning.model``: nothing timed). From 2 to
    ``tuning.RUNTIME_TOKENS`` tokens the plan is a run-time one, chosen and
    kept per bucket of counts (``tuning.BUCKETS``): a new count in a bucket
    seen before compiles nothing. One token, and counts past the last
    bucket or the binding-size limit, are baked."""
    fits_binding(device, weight, tokens)
    bucket = tuning.runtime_bucket(device, weight, tokens)

    def build():
        if bucket:
            chosen = tuning.choose_bucket(device, weight, scale, bucket, strategy)
            return forward_plan(device, weight, scale, None, chosen, max_tokens=bucket[1])
        return forward_plan(device, weight, scale, tokens,
                            tuning.choose(device, weight, scale, tokens, strategy))

    return get_or_build(weight, ("auto", scale, bucket or tokens, str(strategy)), build,
                        (weight.a, weight.b))


def fits_binding(device, weight, tokens: int) -> None:
    """x and the output of ``tokens`` tokens each fit one storage binding
    (max-storage-buffer-binding-size); else a BindingError naming the buffer,
    its size, the limit and how many tokens fit, before any strategy is tried."""
    fit = tuning.fitting_tokens(device, weight)
    for name, dim in (("x", weight.in_dim), ("output", weight.out_dim)):
        what = (f"lora forward of {tokens} token(s) (at most {fit} fit; split the batch): "
                f"{name} [{tokens}, {dim}] {weight.dtype.name}")
        sd_checks.binding_size(what, tokens * dim * weight.dtype.itemsize, device)


def forward(x, a, b, base=None, *, alpha: float | None = None, scale: float | None = None,
            device=None, strategy=None, dtype: DTypeLike = np.float32) -> np.ndarray:
    """``base + scale * B @ (A @ x)`` on the GPU, numpy in and numpy out.

    ``x``: ``(in_dim,)``, ``(tokens, in_dim)`` or with more leading dimensions
    (``[batch, seq, in_dim]``, as torch's Linear takes; no tokens give an empty
    result); ``a``: ``[rank, in_dim]``;
    ``b``: ``[out_dim, rank]``; ``base``: the base layer's output, shaped like
    the result (``x.shape[:-1] + (out_dim,)``), default zeros. Any real float
    dtype in; stored on the GPU and returned as ``dtype`` (float32, or float16
    where the adapter has shader-f16); sums are float32 either way.

    The factor is ``scale`` if given, else ``alpha / rank``; with neither it is
    1 (alpha = rank, as ``Config(rank)``). ``strategy``: None for the tuned
    choice where one is cached, else a model's (what ran fastest on the H200
    for such a shape; nothing is timed); "auto" to time every candidate once
    per shape and device (cached on disk; progress on stderr after a second);
    or a strategy (or its text, such as ``"single"``;
    :mod:`lora.core.strategy`). ``device`` defaults to
    ``shaderdsl.runtime.get_device()``.
    """
    from shaderdsl.runtime import get_device

    dtype = storage_dtype(dtype)
    p = C.host_problem(x, a, b, base, dtype)
    s = C.scale_of(alpha, scale, p.a.shape[0])
    if strategy not in (None, "auto") and not isinstance(strategy, Strategy):
        strategy = Strategy.parse(strategy)  # bad text: refused before any buffer exists
    dev = get_device() if device is None else C.device_of(device)
    if p.tokens == 0:  # as torch: an empty batch gives an empty result
        return p.out.reshape(p.shape).copy()
    weight = Weight.from_numpy(dev, p.a, p.b, dtype=dtype)
    x_buf = dev.buffer(p.x, name="lora.x")
    out_buf = dev.buffer(p.out, name="lora.output")
    try:
        auto_plan(dev, weight, s, p.tokens, strategy)(x_buf, out_buf)
        return dev.read(out_buf).reshape(p.shape).copy()
    finally:
        for buf in (x_buf, out_buf, weight.a, weight.b):
            dev.release(buf)
        clear_plan_cache(weight)
