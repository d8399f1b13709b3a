"""Command line: ``python -m lora {wgsl,demo,check,bench}``.

    python -m lora wgsl fused_forward --rank 8 --in-dim 2560 --out-dim 2560 --scale 2.0
    python -m lora demo            # the seed case on the default adapter, every path
    python -m lora check           # every kernel and path once against numpy
    python -m lora bench ...       # lora.bench (benchmarks)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

KERNELS = ("project_a", "project_b", "add_scaled", "fused_b_add", "fused_forward", "tiled_forward")


# ---------------------------------------------------------------- wgsl

def build_kernel(name: str, rank: int, in_dim: int, out_dim: int, scale: float, tokens: int = 1,
                 strategy: str = "workgroup", threads: int = 256, outputs_per_thread: int = 1,
                 subgroups: bool = False, tile_tokens: int = 16, dtype: str = "f32",
                 rank_group: int = 0, token_block: int = 1):
    """The Kernel the execute functions would dispatch for these parameters."""
    from . import kernels as K

    if name == "project_a":
        return K.project_a_kernel(rank, in_dim, tokens, strategy=strategy, threads=threads,
                                  subgroups=subgroups, dtype=dtype, rank_group=rank_group)
    if name == "project_b":
        return K.project_b_kernel(out_dim, rank, tokens, threads, dtype)
    if name == "add_scaled":
        return K.add_scaled_kernel(tokens * out_dim, scale, threads, dtype)
    if name == "fused_b_add":
        return K.fused_b_add_kernel(out_dim, rank, scale, tokens, threads, dtype)
    if name == "fused_forward":
        return K.fused_forward_kernel(rank, in_dim, out_dim, scale, tokens, threads,
                                      outputs_per_thread, subgroups, dtype=dtype)
    if name == "tiled_forward":
        return K.tiled_forward_kernel(rank, in_dim, out_dim, scale, tokens, threads, tile_tokens,
                                      dtype=dtype, token_block=token_block)
    raise ValueError(f"unknown kernel {name!r}; expected one of {KERNELS}")


def cmd_wgsl(args) -> int:
    from shaderdsl.errors import ShaderDSLError

    for what in ("rank", "in_dim", "out_dim", "tokens", "threads", "outputs_per_thread",
                 "token_block"):
        if getattr(args, what) < 1:
            print(f"error: --{what.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        kernel = build_kernel(args.kernel, args.rank, args.in_dim, args.out_dim, args.scale,
                              args.tokens, args.strategy, args.threads, args.outputs_per_thread,
                              args.subgroups, args.tile_tokens, args.dtype, args.rank_group,
                              args.token_block)
    except (ShaderDSLError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(kernel.wgsl, end="")
    if args.info:
        print(f"// workgroup_size: {kernel.workgroup_size}")
        print(f"// features: {sorted(kernel.features)}")
        for b in kernel.bindings:
            print(f"// binding {b.index}: {b.name} {b.access} {b.elem} length={b.length}")
    return 0


# ---------------------------------------------------------------- shared by demo and check

def _execute():
    """The module of execute functions."""
    from . import execute
    return execute


def _random(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _runner(dev, path, weight, scale, x_buf, out_buf, h_buf, y_buf, **kw):
    """A zero-argument function running one forward on ``path``."""
    F = _execute()
    if path == "three":
        return lambda: F.execute_lora_forward(dev, weight, scale, x_buf, out_buf, h_buf, y_buf, **kw)
    if path == "fused":
        return lambda: F.execute_lora_forward_fused(dev, weight, scale, x_buf, out_buf, h_buf, **kw)
    if path == "auto":
        return lambda: F.execute_lora_forward_auto(dev, weight, scale, x_buf, out_buf,
                                                   strategy=kw.get("strategy"))
    kw.pop("strategy", None)
    return lambda: F.execute_lora_forward_single(dev, weight, scale, x_buf, out_buf, **kw)


PATH_NAMES = {"three": "three-dispatch (project_a, project_b, add_scaled)",
              "fused": "fused (project_a, fused_b_add)",
              "single": "single (fused_forward)",
              "seed": "seed: Hesper's design (2 dispatches)",
              "auto": "auto: autotuned"}


# ---------------------------------------------------------------- demo

def cmd_demo(args) -> int:
    from shaderdsl.runtime import get_device

    from . import reference as R
    from .config import Config
    from .weight import Weight

    dev = get_device()
    cfg = Config(args.rank, args.alpha)
    in_dim = out_dim = args.dim
    T = args.tokens
    rng = np.random.default_rng(args.seed)
    a = _random(rng, (cfg.rank, in_dim))
    b = _random(rng, (out_dim, cfg.rank))
    xshape = (in_dim,) if T == 1 else (T, in_dim)
    oshape = (out_dim,) if T == 1 else (T, out_dim)
    x, base = _random(rng, xshape), _random(rng, oshape)
    ref = R.forward(x, a, b, cfg.scale, base)
    tol = R.tolerance(x, a, b, cfg.scale, base)

    print(f"LoRA forward: out = base + (alpha/rank) * B @ (A @ x)   rank {cfg.rank}, "
          f"in_dim {in_dim}, out_dim {out_dim}, {T} token(s), alpha {cfg.alpha:g} "
          f"-> scale {cfg.scale:g}")
    print(f"adapter: {dev.name}  backend {dev.backend}  type {dev.adapter_type}")
    print(f"A, B, x, base ~ N(0, 1), float32 (seed {args.seed}); reference: numpy float64")
    timed = dev.has_feature("timestamp-query")
    print(f"timing: {args.trials} batches of {args.repeat} forwards each; GPU time from "
          f"{'timestamp queries' if timed else '(no timestamp-query on this adapter)'}, median")
    header = (f"{'path':<50} {'disp':>4} {'subm':>4} {'max abs err':>11} {'max rel err':>11} "
              f"{'tol':>4} {'first ms':>8} {'GPU us/fwd':>10} {'host us/fwd':>11}")
    weight = Weight.from_numpy(dev, a, b)
    x_buf = dev.buffer(x, name="x")
    h_buf = dev.empty(xshape[:-1] + (cfg.rank,), np.float32, name="h")
    y_buf = dev.empty(oshape, np.float32, name="y")
    out_buf = dev.empty(oshape, np.float32, name="output")
    from .tuning import choose
    t0 = time.perf_counter()
    best = choose(dev, weight, cfg.scale, T)
    print(f"auto: chose {best} in {time.perf_counter() - t0:.1f} s (timed once per shape "
          f"and adapter, then cached)")
    print()
    print(header)
    print("-" * len(header))
    failed = False
    for path in ("three", "fused", "single", "seed", "auto"):
        if path == "seed":
            run = _runner(dev, "auto", weight, cfg.scale, x_buf, out_buf, h_buf, y_buf,
                          strategy="seed")
        else:
            run = _runner(dev, path, weight, cfg.scale, x_buf, out_buf, h_buf, y_buf)
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
        failed |= not ok
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
        name = PATH_NAMES[path] + (f" ({best})" if path == "auto" else "")
        print(f"{name:<50} {disp:>4} {subm:>4} {err.max():11.3e} "
              f"{err.max() / np.abs(ref).max():11.3e} {'ok' if ok else 'FAIL':>4} "
              f"{first_ms:8.1f} {gpu_text} {statistics.median(host):11.2f}")
    print()
    print("disp/subm: dispatches and queue submits for one forward (device.stats); "
          "max rel err = max|got - ref| / max|ref|;")
    print(f"tol: every element within {R.RTOL_OUT:g} * (|scale| |B| @ (|A| @ |x|) + |base|); "
          "first ms: first call incl. compile and read-back;")
    print("host us/fwd: CPU time to record one forward into a batch; "
          "GPU us/fwd: batch GPU time / forwards.")
    print("auto: the fastest strategy for this shape and adapter, timed once and cached "
          "(lora/tuning.py); python -m lora bench compares them on a real GPU.")
    return 1 if failed else 0


# ---------------------------------------------------------------- check

def _check_items(dev):
    """(name, function returning (ok, max error)) for every kernel and path."""
    from . import reference as R
    from .weight import Weight

    F = _execute()
    rng = np.random.default_rng(1234)
    rank, in_dim, out_dim, T, scale = 5, 37, 300, 2, -0.75
    a, b = _random(rng, (rank, in_dim)), _random(rng, (out_dim, rank))
    x, base = _random(rng, (T, in_dim)), _random(rng, (T, out_dim))
    hval, yval = _random(rng, (T, rank)), _random(rng, (T, out_dim))
    w = Weight.from_numpy(dev, a, b)
    nan = np.float32("nan")

    def result(got, want, tol):
        err = np.abs(np.asarray(got, np.float64) - want)
        return R.within(got, want, tol), float(np.nanmax(err)) if err.size else 0.0

    def project_a(**kw):
        def go():
            xb, hb = dev.buffer(x), dev.buffer(np.full((T, rank), nan))
            F.execute_project_a(dev, w, xb, hb, **kw)
            return result(dev.read(hb), R.project_a(a, x), R.h_tolerance(x, a))
        return go

    def project_b():
        yb = dev.buffer(np.full((T, out_dim), nan))
        F.execute_project_b(dev, w, dev.buffer(hval), yb)
        want = R.project_b(b, hval)
        return result(dev.read(yb), want, R.RTOL_Y * R.project_b(np.abs(b), np.abs(hval)) + R.ATOL)

    def add_scaled():
        ob = dev.buffer(base)
        F.execute_add_scaled(dev, dev.buffer(yval), ob, base.size, scale)
        want = R.add_scaled(yval, base, scale)
        return result(dev.read(ob), want, R.RTOL_ADD * (abs(scale) * np.abs(yval) + np.abs(base)))

    def fused_b_add():
        ob = dev.buffer(base)
        F.execute_fused_b_add(dev, w, scale, dev.buffer(hval), ob)
        want = R.fused_b_add(b, hval, base, scale)
        mag = abs(scale) * R.project_b(np.abs(b), np.abs(hval)) + np.abs(base)
        return result(dev.read(ob), want, R.RTOL_Y * mag + R.ATOL)

    def path(name, tokens=T, **kw):
        def go():
            xs = x if tokens == T else x[0]
            bs = base if tokens == T else base[0]
            xb, ob = dev.buffer(xs), dev.buffer(bs)
            hb = dev.buffer(np.full(xs.shape[:-1] + (rank,), nan))
            yb = dev.buffer(np.full(bs.shape, nan))
            _runner(dev, name, w, scale, xb, ob, hb, yb, **kw)()
            return result(dev.read(ob), R.forward(xs, a, b, scale, bs),
                          R.tolerance(xs, a, b, scale, bs))
        return go

    def save_activation():
        src, dst = dev.buffer(x), dev.buffer(np.full(x.shape, nan))
        F.save_activation(dev, src, dst, x.size)
        got = dev.read(dst)
        return bool(np.array_equal(got, x)), float(np.abs(got - x).max())

    def numpy_forward():
        got = F.forward(x, a, b, base, scale=scale, device=dev)
        return result(got, R.forward(x, a, b, scale, base), R.tolerance(x, a, b, scale, base))

    sub = dev.has_feature("subgroup")
    items = [
        ("kernel project_a (workgroup)", project_a()),
        ("kernel project_a (seed)", project_a(strategy="seed")),
        ("kernel project_a (workgroup, subgroups)", project_a(subgroups=True) if sub else None),
        ("kernel project_b", project_b),
        ("kernel add_scaled", add_scaled),
        ("kernel fused_b_add", fused_b_add),
        ("kernel fused_forward (single path)", path("single")),
        ("kernel fused_forward (subgroups, 2 outputs/thread)",
         path("single", subgroups=True, outputs_per_thread=2) if sub else None),
        ("path three-dispatch", path("three")),
        ("path three-dispatch, seed strategy", path("three", strategy="seed")),
        ("path fused (two dispatches)", path("fused")),
        ("path fused, one token", path("fused", tokens=1)),
        ("save_activation", save_activation),
        ("lora.forward (numpy in and out)", numpy_forward),
    ]
    return items, dict(rank=rank, in_dim=in_dim, out_dim=out_dim, tokens=T, scale=scale)


def cmd_check(args) -> int:
    from shaderdsl.runtime import get_device

    dev = get_device()
    items, shape = _check_items(dev)
    print(f"lora self-check on {dev.name} ({dev.backend}): "
          + ", ".join(f"{k} {v}" for k, v in shape.items()) + "; against numpy float64")
    failures = 0
    for name, fn in items:
        if fn is None:
            print(f"SKIP  {name}: adapter lacks 'subgroup'")
            continue
        try:
            ok, err = fn()
        except Exception as e:  # report and carry on: the point is a full list
            ok, err = False, None
            detail = f"{type(e).__name__}: {e}"
        else:
            detail = f"max abs err {err:.2e}"
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print(f"{len(items) - failures} of {len(items)} passed" if failures else "all passed")
    return 1 if failures else 0


# ---------------------------------------------------------------- bench

def cmd_bench(argv) -> int:
    import importlib

    try:
        bench = importlib.import_module("lora.bench")
    except ModuleNotFoundError as e:
        if e.name != "lora.bench":
            raise
        print("error: lora.bench is not available in this checkout (lora/bench.py is missing)",
              file=sys.stderr)
        return 2
    rc = bench.main(argv)
    return 0 if rc is None else int(rc)


# ---------------------------------------------------------------- main

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lora",
                                description="LoRA forward on WebGPU: print kernels, run the demo, "
                                            "self-check, benchmark.")
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser("wgsl", help="print the WGSL of one LoRA kernel")
    w.add_argument("kernel", choices=KERNELS)
    w.add_argument("--rank", type=int, default=8)
    w.add_argument("--in-dim", type=int, default=2560)
    w.add_argument("--out-dim", type=int, default=2560)
    w.add_argument("--scale", type=float, default=2.0)
    w.add_argument("--tokens", type=int, default=1)
    w.add_argument("--strategy", choices=("workgroup", "seed"), default="workgroup",
                   help="project_a only: one workgroup per token, or Hesper's one thread per h")
    w.add_argument("--threads", type=int, default=256, help="workgroup size (default 256)")
    w.add_argument("--outputs-per-thread", type=int, default=1, help="fused_forward only")
    w.add_argument("--subgroups", action="store_true",
                   help="project_a/fused_forward: reduce with subgroupAdd")
    w.add_argument("--tile-tokens", type=int, default=16, help="tiled_forward only")
    w.add_argument("--token-block", type=int, default=1,
                   help="tiled_forward only: tokens per thread while computing h (default 1)")
    w.add_argument("--rank-group", type=int, default=0,
                   help="project_a only: ranks per workgroup (default 0: all)")
    w.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                   help="storage of A, B, x and output (default f32)")
    w.add_argument("--info", action="store_true", help="also print bindings and features")

    d = sub.add_parser("demo", help="run the seed case through every path; errors and timings")
    d.add_argument("--rank", type=int, default=8)
    d.add_argument("--dim", type=int, default=2560, help="in_dim = out_dim (default 2560)")
    d.add_argument("--tokens", type=int, default=1)
    d.add_argument("--alpha", type=float, default=16.0, help="default 16: scale 2 at rank 8")
    d.add_argument("--repeat", type=int, default=200, help="forwards per timed batch")
    d.add_argument("--trials", type=int, default=5, help="timed batches (median reported)")
    d.add_argument("--seed", type=int, default=0)

    sub.add_parser("check", help="run every kernel and path once against numpy; exit 1 on failure")
    sub.add_parser("bench", help="benchmarks (lora.bench); arguments go to it", add_help=False)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "wgsl":
        return cmd_wgsl(args)
    for what in ("rank", "dim", "tokens", "repeat", "trials"):
        if getattr(args, what, 1) < 1:
            print(f"error: --{what} must be >= 1", file=sys.stderr)
            return 2
    if args.command == "demo":
        return cmd_demo(args)
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
