"""LoRA dropout: the adapter's input dropped as peft drops it (torch.nn.Dropout:
each element zeroed with probability p, the others scaled by 1 / (1 - p)),
drawn by a counter-based generator: a hash of (seed, step, element index).

The mask needs no generator state, only the step, which the kernel reads from
the optimizer's ``state`` (the steps done before this one), so a recorded
training loop draws a new mask each step without a host write, and every
runtime that runs the same WGSL (a GPU, the interpreter, the exported JS
trainer) draws the same mask. The hash is PCG's output permutation as Jarzynski
and Olano's "Hash Functions for GPU Rendering" (JCGT 2020) use it, written once
here for the kernel and once for numpy (:func:`keep_mask`, the tests' yardstick):

    pcg(v)  = (w >> 22) ^ w,  w = ((s >> ((s >> 28) + 4)) ^ s) * 277803737,
              s = v * 747796405 + 2891336453            (all mod 2^32)
    key     = pcg(seed + pcg(step))
    r[i]    = pcg(key ^ pcg(i))       i: the element's index in x, row-major
    kept    = r[i] >= threshold,      threshold = round(p 2^32)
"""
from __future__ import annotations

import numpy as np

from shaderdsl import builtins as B
from shaderdsl import f32, u32

from .common import storage_scalar, store_output, widen, width
from .optimizer import STATE, STATE_SIZE

PCG_MULTIPLIER, PCG_INCREMENT, PCG_OUTPUT = 747796405, 2891336453, 277803737


def threshold(p: float) -> int:
    """The u32 below which a hash drops its element: round(p 2^32), for 0 <= p < 1."""
    real = isinstance(p, (int, float, np.integer, np.floating)) and not isinstance(p, bool)
    if not real or not 0.0 <= p < 1.0:
        raise ValueError(f"lora_dropout: expected a probability in [0, 1), got {p!r}")
    return min(round(p * 2.0**32), 2**32 - 1)


def pcg(m, v):
    """PCG's hash of the u32 expression ``v`` (see the module docstring)."""
    s = m.let(v * u32(PCG_MULTIPLIER) + u32(PCG_INCREMENT), "s")
    w = m.let(((s >> ((s >> u32(28)) + u32(4))) ^ s) * u32(PCG_OUTPUT), "w")
    return (w >> u32(22)) ^ w


def dropout(m, n, keep_from, scale, seed, dtype="f32", threads=256):
    """xd = x * (scale where kept, else 0) for ``n`` elements of ``dtype``,
    ``w`` (4 where it divides n, else 1) a thread (grid ceil(n / (w threads)));
    kept where the element's hash is >= ``keep_from`` (:func:`threshold`),
    with the step read from the optimizer's ``state``."""
    x = m.declare_input_buffer("x", storage_scalar(dtype), n)
    xd = m.declare_output_buffer("xd", storage_scalar(dtype), n)
    state = m.declare_input_buffer("state", f32, STATE_SIZE)
    step = m.let(u32(state[STATE["step"]]), "step")
    key = m.let(pcg(m, u32(seed) + pcg(m, step)), "key")
    w = width(n)
    first = m.let(m.global_id().x * w, "first")
    for q in range(w):
        i = m.let(first + q, f"i{q}")
        with m.if_(i < n):
            kept = pcg(m, key ^ pcg(m, i)) >= u32(keep_from)
            store_output(xd, i, widen(x[i]) * B.select(0.0, float(np.float32(scale)), kept))


def _pcg_numpy(v: np.ndarray) -> np.ndarray:
    s = (v.astype(np.uint64) * PCG_MULTIPLIER + PCG_INCREMENT) & 0xFFFFFFFF
    w = (((s >> ((s >> 28) + 4)) ^ s) * PCG_OUTPUT) & 0xFFFFFFFF
    return (w >> 22) ^ w


def keep_mask(seed: int, step: int, shape, p: float) -> np.ndarray:
    """The kernel's mask in numpy (True: kept) for the element indices of
    ``shape``, at ``step`` (the optimizer's steps before this one)."""
    key = _pcg_numpy((seed + _pcg_numpy(np.array(step))) & 0xFFFFFFFF)
    index = np.arange(int(np.prod(shape)), dtype=np.uint64).reshape(shape)
    return _pcg_numpy(key ^ _pcg_numpy(index)) >= threshold(p)
