"""Command line: ``python -m lora {wgsl,demo,check,bench,train,export}``.

    python -m lora wgsl fused_forward --rank 8 --in-dim 2560 --out-dim 2560 --scale 2.0
    python -m lora demo            # the seed case on the default adapter, every path
    python -m lora check           # every kernel and path once against numpy
    python -m lora bench ...       # lora.apps.bench (benchmarks)
    python -m lora train ...       # lora.apps.train_cli (fine-tune on scikit-learn's digits)
    python -m lora export --out web/  # the forward as an ES module for web pages (lora.apps.web)
    python -m lora export --demo web/ # a self-contained page running it in the browser
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

KERNELS = ("project_a", "project_b", "add_scaled", "fused_b_add", "fused_forward", "tiled_forward")


def build_kernel(name: str, rank: int, in_dim: int, out_dim: int, scale: float, tokens: int = 1,
                 projection: str = "workgroup", threads: int = 256, outputs_per_thread: int = 1,
                 subgroups: bool = False, tile_tokens: int = 16, dtype: str = "f32",
                 rank_group: int = 0, token_block: int = 1):
    """The Kernel a plan would dispatch for these parameters (lora.kernels.KERNELS)."""
    from ..kernels import KERNELS as SPECS

    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected one of {KERNELS}")
    if rank_group < 0:
        raise ValueError(f"rank_group must be >= 0 (0: all ranks in one workgroup), got {rank_group}")
    if name == "project_a" and projection == "seed":
        name = "project_a_seed"
    given = dict(rank=rank, in_dim=in_dim, out_dim=out_dim, scale=float(scale), tokens=tokens,
                 threads=threads, outputs_per_thread=outputs_per_thread, subgroups=subgroups,
                 tile_tokens=tile_tokens, dtype=dtype, token_block=token_block,
                 rank_group=rank_group if 0 < rank_group < rank else 0,
                 num_elements=tokens * out_dim)
    spec = SPECS[name]
    return spec.kernel(**{k: v for k, v in given.items() if k in spec.parameter_names})


def _registry_kernel(name: str, params: list[str]):
    """Any kernel of lora.kernels.KERNELS from name=value parameters (Python literals)."""
    import ast

    from ..kernels import KERNELS as SPECS

    given = {}
    for item in params:
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"parameter {item!r} is not name=value")
        try:
            given[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            given[key] = text
    try:
        return SPECS[name].kernel(**given)
    except TypeError as e:
        raise ValueError(str(e)) from None


def cmd_wgsl(args) -> int:
    from shaderdsl.errors import ShaderDSLError

    if args.kernel not in KERNELS or args.params:
        try:
            kernel = _registry_kernel(args.kernel, args.params)
        except (ShaderDSLError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(kernel.wgsl, end="")
        return 0
    for what in ("rank", "in_dim", "out_dim", "tokens", "threads", "outputs_per_thread",
                 "token_block"):
        if getattr(args, what) < 1:
            print(f"error: --{what.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        kernel = build_kernel(args.kernel, args.rank, args.in_dim, args.out_dim, args.scale,
                              args.tokens, args.projection, args.threads, args.outputs_per_thread,
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
    from .. import hesper
    return hesper


def _random(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _runner(dev, name, weight, scale, x_buf, out_buf, h_buf, y_buf, **kw):
    """A zero-argument function running one forward of strategy ``name`` the way
    its execute function does (``auto``: the chosen or a given ``strategy``)."""
    F = _execute()
    if name == "three":
        return lambda: F.execute_lora_forward(dev, weight, scale, x_buf, out_buf, h_buf, y_buf, **kw)
    if name == "split":
        return lambda: F.execute_lora_forward_fused(dev, weight, scale, x_buf, out_buf, h_buf, **kw)
    if name == "auto":
        return lambda: F.execute_lora_forward_auto(dev, weight, scale, x_buf, out_buf,
                                                   strategy=kw.get("strategy"))
    kw.pop("projection", None)
    return lambda: F.execute_lora_forward_single(dev, weight, scale, x_buf, out_buf, **kw)


ROW_NAMES = {"three": "three: project_a, project_b, add_scaled",
             "split": "split: project_a, fused_b_add",
             "single": "single: fused_forward (one dispatch)",
             "seed": "seed: Hesper's design (2 dispatches)",
             "auto": "auto: chosen"}


# ---------------------------------------------------------------- demo

def _demo_problem(args):
    """Config, host arrays, the float64 reference and its tolerance."""
    from ..core import reference as R
    from ..core.config import Config

    cfg = Config(args.rank, args.alpha)
    rng = np.random.default_rng(args.seed)
    a = _random(rng, (cfg.rank, args.dim))
    b = _random(rng, (args.dim, cfg.rank))
    lead = () if args.tokens == 1 else (args.tokens,)
    x, base = _random(rng, lead + (args.dim,)), _random(rng, lead + (args.dim,))
    return cfg, a, b, x, base, R.forward(x, a, b, cfg.scale, base), \
        R.tolerance(x, a, b, cfg.scale, base)


def _demo_row(dev, run, out_buf, base, ref, tol, args) -> tuple[bool, str]:
    """Run once (checking against numpy), then time; returns (ok, table cells)."""
    from ..core import reference as R

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
    from shaderdsl.runtime import get_device

    from ..core import reference as R
    from ..core.tuning import choose
    from ..core.weight import Weight

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
        run = _runner(dev, "auto" if name == "seed" else name, weight, cfg.scale, x_buf, out_buf,
                      h_buf, y_buf, **({"strategy": "seed"} if name == "seed" else {}))
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


# ---------------------------------------------------------------- export (web pages)

def _export_shape(args):
    """(Shape, Strategy, embedded adapter or None) from the export arguments."""
    from ..core.strategy import Strategy
    from .web import Shape, embedded_adapter

    adapter, dims = None, dict(rank=args.rank, in_dim=args.in_dim, out_dim=args.out_dim,
                               scale=args.scale)
    if args.adapter:
        adapter, dims = embedded_adapter(args.adapter, args.module)
    shape = Shape(tokens=args.tokens, dtype=args.dtype, **dims)
    default = "split:256" if shape.tokens > 1 else "single:256:1"
    return shape, Strategy.parse(args.strategy or default), adapter


def _show_page(page, screenshot) -> int:
    """Open the demo page in headless Chromium, print its verdict, save a screenshot."""
    def verdict(r):
        t = r["timings"]
        return (f"demo page in headless Chromium ({r['adapter']}): "
                f"{'ok' if r['ok'] else 'FAILED'}, max error {r['maxErr']:.3e}; compile "
                f"{t['compile']:.0f} ms, forward {t['each']:.3f} ms")
    return _open_page(page, "window.loraDemo", "demo page", verdict, screenshot, 120.0)


def cmd_export(args) -> int:
    """Write the forward as an ES module (--out), the training step (--train),
    each with the adapter-file module beside it, and/or the demo page (--demo)."""
    import shlex
    from pathlib import Path

    from shaderdsl.errors import ShaderDSLError

    from . import web, web_train
    from .web_adapter import ADAPTER_DTS, ADAPTER_JS

    try:
        shape, strategy, adapter = _export_shape(args)
        command = "python -m lora " + shlex.join(args.argv)
        files = {}
        if args.out:
            files["lora_forward.js"] = (args.out, web.module_js(shape, strategy, command))
            files["lora_forward.d.ts"] = (args.out, web.module_dts(shape, strategy, command))
        if args.train:
            train = web_train.TrainShape(
                shape.rank, shape.in_dim, shape.out_dim, shape.tokens, shape.scale * shape.rank,
                args.loss, args.optimizer, args.lr, args.max_grad_norm, args.seed)
            files["lora_train.js"] = (args.train,
                                      web_train.module_js(web_train.record_layer(train), command))
            files["lora_train.d.ts"] = (args.train, web_train.module_dts(command))
        for folder in {args.out, args.train} - {None}:
            files[f"{folder}/lora_adapter.js"] = (folder, ADAPTER_JS)
            files[f"{folder}/lora_adapter.d.ts"] = (folder, ADAPTER_DTS)
        if args.demo:
            files["index.html"] = (args.demo, web.demo_page(shape, strategy, command, adapter,
                                                            args.seed, args.repeat))
        if args.train_demo:
            run = web_train.DigitsRun(steps=args.steps, rank=args.rank, seed=args.seed)
            files[f"{args.train_demo}/index.html"] = (args.train_demo,
                                                      web_train.digits_page(run, command))
    except (ShaderDSLError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not files:
        print("error: give --out DIR (the forward), --train DIR (the training step), --demo "
              "DIR (the forward's page) and/or --train-demo DIR (the training page)",
              file=sys.stderr)
        return 2
    for name, (folder, text) in files.items():
        path = Path(folder) / Path(name).name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    if args.demo and (args.screenshot or args.open):
        return _show_page(Path(args.demo) / "index.html", args.screenshot)
    if args.train_demo and (args.screenshot or args.open):
        return _show_training_page(Path(args.train_demo) / "index.html", args.screenshot)
    return 0


def _show_training_page(page, screenshot) -> int:
    """Open the training page in headless Chromium, print what it did, save a screenshot."""
    def verdict(r):
        losses = r["losses"]
        return (f"training page in headless Chromium: loss {losses[0]:.4f} -> "
                f"{losses[-1]:.4f} over {len(losses)} steps, test accuracy "
                f"{r['accuracyBefore']:.1%} -> {r['accuracyAfter']:.1%}, {r['stepMs']:.1f} ms "
                f"a step")
    return _open_page(page, "window.loraTrainDemo", "training page", verdict, screenshot, 600.0)


def _open_page(page, until: str, what: str, verdict, screenshot, timeout: float) -> int:
    """Load ``page`` until ``until`` is set, print ``verdict(result)`` (or its
    error), save the screenshot; 0 where the page says ok."""
    from shaderdsl.browser import load_page

    result = load_page(page, until, timeout=timeout, screenshot=screenshot)
    if result.get("error"):
        print(f"{what}: error: {result['error']}", file=sys.stderr)
        return 1
    print(verdict(result))
    if screenshot:
        print(screenshot)
    return 0 if result["ok"] else 1


def _export_parser(sub) -> None:
    e = sub.add_parser("export", help="the forward as an ES module for web pages, or a demo page")
    e.add_argument("--rank", type=int, default=8)
    e.add_argument("--in-dim", type=int, default=2560)
    e.add_argument("--out-dim", type=int, default=2560)
    e.add_argument("--tokens", type=int, default=1)
    e.add_argument("--scale", type=float, default=2.0, help="alpha / rank (default 2)")
    e.add_argument("--strategy", help="a strategy text (default single:256:1 for one token, "
                                      "split:256 for more)")
    e.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                   help="storage of A, B, x and output (f16 needs shader-f16 in the browser)")
    e.add_argument("--out", metavar="DIR", help="write lora_forward.js and lora_forward.d.ts here "
                   "(and lora_adapter.js: peft files in the page)")
    e.add_argument("--train", metavar="DIR", help="write lora_train.js and lora_train.d.ts here "
                   "(and lora_adapter.js): the whole training step, one submit a step")
    e.add_argument("--loss", choices=("mse", "xent"), default="mse", help="--train: the loss")
    e.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="--train: the optimizer (default adamw)")
    e.add_argument("--lr", type=float, default=1e-3, help="--train: learning rate (default 1e-3)")
    e.add_argument("--max-grad-norm", type=float, default=None,
                   help="--train: clip the gradients' global norm to this")
    e.add_argument("--train-demo", metavar="DIR", help="write DIR/index.html: a self-contained "
                   "page fine-tuning LoRA on a frozen digits network in the browser (python -m "
                   "lora train's task; --rank, --steps, --seed; --open, --screenshot)")
    e.add_argument("--steps", type=int, default=200, help="--train-demo: steps (default 200)")
    e.add_argument("--demo", metavar="DIR", help="write a self-contained demo page DIR/index.html")
    e.add_argument("--adapter", metavar="DIR", help="a peft adapter directory: its weights (and "
                   "shapes and scale) go into the page instead of random ones")
    e.add_argument("--module", help="with --adapter: the layer to use (default: the first)")
    e.add_argument("--seed", type=int, default=0, help="seed of the page's random inputs")
    e.add_argument("--repeat", type=int, default=20, help="forwards the page times (default 20)")
    e.add_argument("--open", action="store_true",
                   help="run the demo page in headless Chromium and print its verdict")
    e.add_argument("--screenshot", metavar="PNG", help="--open, and save a screenshot of the page")


# ---------------------------------------------------------------- check

class _SelfCheck:
    """Every kernel and execute function once, on a small odd shape, against numpy."""

    SHAPE = dict(rank=5, in_dim=37, out_dim=300, tokens=2, scale=-0.75)

    def __init__(self, dev):
        from ..core.weight import Weight

        self.dev, self.F = dev, _execute()
        rank, in_dim, out_dim, T = (self.SHAPE[k] for k in ("rank", "in_dim", "out_dim", "tokens"))
        rng = np.random.default_rng(1234)
        self.a, self.b = _random(rng, (rank, in_dim)), _random(rng, (out_dim, rank))
        self.x, self.base = _random(rng, (T, in_dim)), _random(rng, (T, out_dim))
        self.h, self.y = _random(rng, (T, rank)), _random(rng, (T, out_dim))
        self.w = Weight.from_numpy(dev, self.a, self.b)
        self.scale = self.SHAPE["scale"]

    @staticmethod
    def result(got, want, tol):
        from ..core import reference as R

        err = np.abs(np.asarray(got, np.float64) - want)
        return R.within(got, want, tol), float(np.nanmax(err)) if err.size else 0.0

    def nans(self, shape):
        return self.dev.buffer(np.full(shape, np.nan, np.float32))

    def project_a(self, **kw):
        from ..core import reference as R

        xb, hb = self.dev.buffer(self.x), self.nans(self.h.shape)
        self.F.execute_project_a(self.dev, self.w, xb, hb, **kw)
        return self.result(self.dev.read(hb), R.project_a(self.a, self.x), R.h_tolerance(self.x, self.a))

    def project_b(self):
        from ..core import reference as R

        yb = self.nans(self.y.shape)
        self.F.execute_project_b(self.dev, self.w, self.dev.buffer(self.h), yb)
        tol = R.RTOL_Y * R.project_b(np.abs(self.b), np.abs(self.h)) + R.ATOL
        return self.result(self.dev.read(yb), R.project_b(self.b, self.h), tol)

    def add_scaled(self):
        from ..core import reference as R

        ob, s = self.dev.buffer(self.base), self.scale
        self.F.execute_add_scaled(self.dev, self.dev.buffer(self.y), ob, self.base.size, s)
        tol = R.RTOL_ADD * (abs(s) * np.abs(self.y) + np.abs(self.base))
        return self.result(self.dev.read(ob), R.add_scaled(self.y, self.base, s), tol)

    def fused_b_add(self):
        from ..core import reference as R

        ob, s = self.dev.buffer(self.base), self.scale
        self.F.execute_fused_b_add(self.dev, self.w, s, self.dev.buffer(self.h), ob)
        mag = abs(s) * R.project_b(np.abs(self.b), np.abs(self.h)) + np.abs(self.base)
        return self.result(self.dev.read(ob), R.fused_b_add(self.b, self.h, self.base, s),
                           R.RTOL_Y * mag + R.ATOL)

    def forward(self, name, one_token=False, **kw):
        from ..core import reference as R

        xs, bs = (self.x[0], self.base[0]) if one_token else (self.x, self.base)
        xb, ob = self.dev.buffer(xs), self.dev.buffer(bs)
        hb, yb = self.nans(xs.shape[:-1] + (self.SHAPE["rank"],)), self.nans(bs.shape)
        _runner(self.dev, name, self.w, self.scale, xb, ob, hb, yb, **kw)()
        return self.result(self.dev.read(ob), R.forward(xs, self.a, self.b, self.scale, bs),
                           R.tolerance(xs, self.a, self.b, self.scale, bs))

    def save_activation(self):
        src, dst = self.dev.buffer(self.x), self.nans(self.x.shape)
        self.F.save_activation(self.dev, src, dst, self.x.size)
        got = self.dev.read(dst)
        return bool(np.array_equal(got, self.x)), float(np.abs(got - self.x).max())

    def numpy_forward(self):
        from ..core import reference as R
        from ..core.auto import forward

        got = forward(self.x, self.a, self.b, self.base, scale=self.scale, device=self.dev)
        want = R.forward(self.x, self.a, self.b, self.scale, self.base)
        return self.result(got, want, R.tolerance(self.x, self.a, self.b, self.scale, self.base))

    def items(self) -> list:
        """(name, function returning (ok, max error), or None when the adapter lacks subgroups)."""
        sub = self.dev.has_feature("subgroup")
        run = lambda f, *a, **kw: (lambda: f(*a, **kw))  # noqa: E731
        maybe = lambda f, *a, **kw: run(f, *a, **kw) if sub else None  # noqa: E731
        return [
            ("kernel project_a (workgroup)", run(self.project_a)),
            ("kernel project_a (seed)", run(self.project_a, projection="seed")),
            ("kernel project_a (workgroup, subgroups)", maybe(self.project_a, subgroups=True)),
            ("kernel project_b", self.project_b),
            ("kernel add_scaled", self.add_scaled),
            ("kernel fused_b_add", self.fused_b_add),
            ("single: execute_lora_forward_single", run(self.forward, "single")),
            ("single:256:2:sg: execute_lora_forward_single",
             maybe(self.forward, "single", subgroups=True, outputs_per_thread=2)),
            ("three: execute_lora_forward", run(self.forward, "three")),
            ("three:256:seed: execute_lora_forward", run(self.forward, "three", projection="seed")),
            ("split: execute_lora_forward_fused", run(self.forward, "split")),
            ("split, one token", run(self.forward, "split", one_token=True)),
            ("save_activation", self.save_activation),
            ("lora.forward (numpy in and out)", self.numpy_forward),
        ]


def cmd_check(args) -> int:
    from shaderdsl.runtime import get_device

    dev = get_device()
    items = _SelfCheck(dev).items()
    print(f"lora self-check on {dev.name} ({dev.backend}): "
          + ", ".join(f"{k} {v}" for k, v in _SelfCheck.SHAPE.items()) + "; against numpy float64")
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
        bench = importlib.import_module("lora.apps.bench")
    except ModuleNotFoundError as e:
        if e.name != "lora.apps.bench":
            raise
        print("error: lora.apps.bench is not available in this checkout (lora/apps/bench.py is missing)",
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

    from ..kernels import KERNELS as SPECS

    w = sub.add_parser("wgsl", help="print the WGSL of one LoRA kernel")
    w.add_argument("kernel", choices=sorted(SPECS),
                   help="a kernel of lora.kernels.KERNELS; the forward ones also take the "
                        "options below, every one takes name=value parameters")
    w.add_argument("params", nargs="*", metavar="name=value",
                   help="the kernel function's parameters, e.g. out_dim=64 rank=4 (Python literals)")
    w.add_argument("--rank", type=int, default=8)
    w.add_argument("--in-dim", type=int, default=2560)
    w.add_argument("--out-dim", type=int, default=2560)
    w.add_argument("--scale", type=float, default=2.0)
    w.add_argument("--tokens", type=int, default=1)
    w.add_argument("--projection", choices=("workgroup", "seed"), default="workgroup",
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
    _export_parser(sub)
    sub.add_parser("bench", help="benchmarks (lora.apps.bench); arguments go to it", add_help=False)
    sub.add_parser("train", help="fine-tune LoRA adapters on scikit-learn's digits (lora.apps.train_cli)",
                   add_help=False)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "train":
        from .train_cli import main as train
        return train(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "wgsl":
        return cmd_wgsl(args)
    for what in ("rank", "dim", "in_dim", "out_dim", "tokens", "repeat", "trials"):
        if getattr(args, what, 1) < 1:
            print(f"error: --{what.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.command == "export":
        args.argv = argv
        return cmd_export(args)
    if args.command == "demo":
        return cmd_demo(args)
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
