"""``python -m lora demo``: the seed case on the default adapter through every
path (three, split, single, seed, auto): errors against numpy float64,
dispatches and submits per forward, and timings."""
from __future__ import annotations

import statistics
import time

import numpy as np

from shaderdsl.runtime import get_device

from ..core import reference as R
from ..core.config import Config
from ..core.tuning import choose
from ..core.weight import Weight
from .check_cli import forward_runner, normal

ROW_NAMES = {"three": "three: project_a, project_b, add_scaled",
             "split": "split: project_a, fused_b_add",
             "single": "single: fused_forward (one dispatch)",
             "seed": "seed: Hesper's design (2 dispatches)",
             "auto": "auto: chosen"}


def _demo_problem(args):
    """Config, host arrays, the float64 reference and its tolerance."""
    cfg = Config(args.rank, args.alpha)
    rng = np.random.default_rng(args.seed)
    a = normal(rng, (cfg.rank, args.dim))
    b = normal(rng, (args.dim, cfg.rank))
    lead = () if args.tokens == 1 else (args.tokens,)
    x, base = normal(rng, lead + (args.dim,)), normal(rng, lead + (args.dim,))
    return cfg, a, b, x, base, R.forward(x, a, b, cfg.scale, base), \
        R.tolerance(x, a, b, cfg.scale, base)


def _demo_row(dev, run, out_buf, base, ref, tol, args) -> tuple[bool, str]:
    """Run once (checking against numpy), then time; returns (ok, table cells)."""
    dev.write(out_buf, base)
    before = dict(dev.stats)
    t0 = time.perf_counter()
    run()
    disp = dev.stats["dispatches"] - before["dispatches"]
    subm = dev.stats["submits"] - before["submits"]
    got = dev.read(out_buf)
    first_ms = (time.perf_counter() - t0) * 1e3
    err = np.abs(got.astype(np.float64) - ref)
    ok = R.within(got, ref, tol)
    gpu, host = [], []
    for _ in range(args.trials):
        with dev.batch(timestamps=True) as batch:
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                run()
            host.append((time.perf_counter() - t0) / args.repeat * 1e6)
        dev.sync()
        if batch.gpu_time_ns is not None:
            gpu.append(batch.gpu_time_ns / args.repeat / 1e3)
    gpu_text = f"{statistics.median(gpu):10.2f}" if gpu else f"{'n/a':>10}"
    return ok, (f"{disp:>4} {subm:>4} {err.max():11.3e} {err.max() / np.abs(ref).max():11.3e} "
                f"{'ok' if ok else 'FAIL':>4} {first_ms:8.1f} {gpu_text} "
                f"{statistics.median(host):11.2f}")


def cmd_demo(args) -> int:
    dev = get_device()
    cfg, a, b, x, base, ref, tol = _demo_problem(args)
    print(f"LoRA forward: out = base + (alpha/rank) * B @ (A @ x)   rank {cfg.rank}, "
          f"in_dim {args.dim}, out_dim {args.dim}, {args.tokens} token(s), alpha {cfg.alpha:g} "
          f"-> scale {cfg.scale:g}")
    print(f"adapter: {dev.name}  backend {dev.backend}  type {dev.adapter_type}")
    print(f"A, B, x, base ~ N(0, 1), float32 (seed {args.seed}); reference: numpy float64")
    timed = dev.has_feature("timestamp-query")
    print(f"timing: {args.trials} batches of {args.repeat} forwards each; GPU time from "
          f"{'timestamp queries' if timed else '(no timestamp-query on this adapter)'}, median")
    weight = Weight.from_numpy(dev, a, b)
    x_buf, out_buf = dev.buffer(x, name="x"), dev.empty(base.shape, np.float32, name="output")
    h_buf = dev.empty(x.shape[:-1] + (cfg.rank,), np.float32, name="h")
    y_buf = dev.empty(base.shape, np.float32, name="y")
    t0 = time.perf_counter()
    best = choose(dev, weight, cfg.scale, args.tokens)
    print(f"auto: chose {best} in {time.perf_counter() - t0:.1f} s (the tuning cache's choice "
          f"if it has one, else a model's: nothing timed)\n")
    header = (f"{'strategy':<50} {'disp':>4} {'subm':>4} {'max abs err':>11} {'max rel err':>11} "
              f"{'tol':>4} {'first ms':>8} {'GPU us/fwd':>10} {'host us/fwd':>11}")
    print(header + "\n" + "-" * len(header))
    failed = False
    for name in ROW_NAMES:
        run = forward_runner(dev, "auto" if name == "seed" else name, weight, cfg.scale, x_buf,
                             out_buf, h_buf, y_buf,
                             **({"strategy": "seed"} if name == "seed" else {}))
        ok, cells = _demo_row(dev, run, out_buf, base, ref, tol, args)
        failed |= not ok
        print(f"{ROW_NAMES[name] + (f' ({best})' if name == 'auto' else ''):<50} {cells}")
    print("\ndisp/subm: dispatches and queue submits for one forward (device.stats); "
          "max rel err = max|got - ref| / max|ref|;")
    print(f"tol: every element within {R.RTOL_OUT:g} * (|scale| |B| @ (|A| @ |x|) + |base|); "
          "first ms: first call incl. compile and read-back;")
    print("host us/fwd: CPU time to record one forward into a batch; "
          "GPU us/fwd: batch GPU time / forwards.")
    print("auto: the tuned strategy if the cache has one, else a model's of what ran fastest "
          "on the H200 (lora/core/tuning.py; strategy='auto' tunes); python -m lora bench "
          "compares them on a real GPU.")
    return 1 if failed else 0
