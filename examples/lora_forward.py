"""The LoRA forward, ``out = base + (alpha/rank) * B @ (A @ x)``, three ways.

What it shows:

* ``Config`` (rank, alpha, scale) and ``Weight`` (A and B on the GPU);
* the execute functions on buffers you manage: the three-dispatch path,
  the fused two-dispatch path and the single-dispatch path, each adding the
  LoRA delta in place to a buffer that holds the base output;
* several calls recorded into one batch (one submit), with the GPU time;
* ``save_activation`` keeping x for a backward pass;
* ``lora.forward``: numpy in, numpy out, for when you do not manage buffers;
* every result checked against the float64 numpy reference.

Run ``python -m examples.lora_forward``.
"""
from __future__ import annotations

import numpy as np

import lora
from lora import reference as R
from lora.hesper import (
    execute_lora_forward,
    execute_lora_forward_fused,
    execute_lora_forward_single,
    save_activation,
)
from shaderdsl.runtime import get_device


def main(rank: int = 8, in_dim: int = 1000, out_dim: int = 700, tokens: int = 4) -> None:
    dev = get_device()
    cfg = lora.Config(rank, alpha=16.0)
    rng = np.random.default_rng(0)
    # Weight.init gives peft's start (B = 0, a delta of exactly zero); random B
    # here so the delta is something to check.
    a = rng.standard_normal((rank, in_dim)).astype(np.float32)
    b = rng.standard_normal((out_dim, rank)).astype(np.float32)
    x = rng.standard_normal((tokens, in_dim)).astype(np.float32)
    base = rng.standard_normal((tokens, out_dim)).astype(np.float32)  # BitLinear(x), say

    weight = lora.Weight.from_numpy(dev, a, b)
    want = R.forward(x, a, b, cfg.scale, base)
    tol = R.tolerance(x, a, b, cfg.scale, base)
    print(f"{dev.name} ({dev.backend}); {weight!r}, {tokens} tokens, scale {cfg.scale}")

    x_buf = dev.buffer(x, name="x")
    out_buf = dev.buffer(base, name="output")                    # holds the base output
    h_buf = dev.empty((tokens, rank), np.float32, name="h")      # scratch: A @ x
    y_buf = dev.empty((tokens, out_dim), np.float32, name="y")   # scratch: B @ h
    saved = dev.empty((tokens, in_dim), np.float32, name="saved x")

    paths = {
        "three-dispatch": lambda: execute_lora_forward(dev, weight, cfg.scale, x_buf, out_buf,
                                                       h_buf, y_buf),
        "fused (2 dispatches)": lambda: execute_lora_forward_fused(dev, weight, cfg.scale,
                                                                   x_buf, out_buf, h_buf),
        "single dispatch": lambda: execute_lora_forward_single(dev, weight, cfg.scale, x_buf,
                                                               out_buf),
    }
    ok = True
    for name, run in paths.items():
        dev.write(out_buf, base)           # start from the base output again
        run()                              # output += scale * B @ (A @ x), in place
        got = dev.read(out_buf)
        good = R.within(got, want, tol)
        ok &= good
        print(f"  {name:<22} max |err| {np.abs(got - want).max():.2e}  "
              f"{'OK' if good else 'WRONG'}")

    # Many forwards in one batch: recorded, then submitted once; timed on the GPU.
    dev.write(out_buf, base)
    with dev.batch(timestamps=True) as batch:
        save_activation(dev, x_buf, saved)  # keep x for the backward pass
        for _ in range(10):
            execute_lora_forward_fused(dev, weight, cfg.scale, x_buf, out_buf, h_buf)
    got = dev.read(out_buf)
    good = R.within(got, base + 10 * (want - base), 10 * tol) and np.array_equal(dev.read(saved), x)
    ok &= good
    timing = f"{batch.gpu_time_ns / 10 / 1e3:.1f} us GPU each" if batch.gpu_time_ns else "untimed"
    print(f"  10 fused forwards in one batch ({timing}), x saved  {'OK' if good else 'WRONG'}")

    # No buffers at all: numpy in, numpy out (one token here).
    got = lora.forward(x[0], a, b, base[0], alpha=cfg.alpha)
    good = R.within(got, want[0], tol[0])
    ok &= good
    print(f"  lora.forward (numpy)   max |err| {np.abs(got - want[0]).max():.2e}  "
          f"{'OK' if good else 'WRONG'}")
    if not ok:
        raise SystemExit("a result did not match numpy")


if __name__ == "__main__":
    main()
