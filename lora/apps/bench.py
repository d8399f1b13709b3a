"""``python -m lora bench``: LoRA forward and training-step timings beside seed, numpy and PyTorch.

For each (dtype, tokens, rank, in_dim, out_dim): the autotuned strategy and
Hesper's ``seed`` design are checked against float64 numpy, then timed with
GPU timestamps around a batch of forwards (median of repeats). Effective
bandwidth is the minimal bytes (x read, output read and written, A and B read
once) over that time, also given as a fraction of a copy bandwidth measured
here with a DSL copy kernel. PyTorch is optional: with CUDA it is timed with
CUDA events, eagerly and as a CUDA graph, in the same process, in the same
dtype (float16 rows: PyTorch in fp16). numpy runs in float32 for both dtypes
(its float16 matmul is not a fair CPU baseline). f16 rows are skipped, with a
message, on adapters without shader-f16. The JSON is rewritten after every
case, so a run cut short keeps what it measured. Training steps
(lora.apps.bench_train, beside PyTorch's strongest step too) follow the
forward cases unless ``--train no``; a table of every row beside PyTorch ends
the run (lora.apps.bench_table).

``--tokens-sweep`` times a serving loop of varying token counts instead
(lora.apps.bench_sweep); ``--profile`` splits forwards into dispatches and phases
(lora.apps.bench_profile); ``--gemm`` times the matrix-unit GEMM
(lora.apps.bench_gemm); ``--ceiling`` what the hardware gives any kernel
(lora.apps.bench_ceiling); ``--many`` many adapters in one batch
(lora.apps.bench_many); ``--network`` a 3-layer MLP's training step
(lora.apps.bench_network; ``--layers``, ``--lora-dropout`` and
``--max-grad-norm`` change what it trains); ``--lm`` a language model's training
step, prefill and decode beside transformers + peft (lora.apps.bench_lm); ``--attention``
each attention kernel of the language model alone beside torch's SDPA
(lora.apps.bench_attention).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import shaderdsl as sd
from shaderdsl import f32
from shaderdsl.runtime import COMPILER, WGPU_BUILD, get_device

from ..core import reference
from ..core.forward import forward_plan
from ..core.strategy import Strategy
from ..core.tuning import autotune, quick_timing, time_plan
from ..core.weight import Weight
from . import bench_table, bench_train
from .bench_attention import attention_main
from .bench_ceiling import ceiling_main, copy_bandwidth
from .bench_gemm import gemm_main, parse_shapes
from .bench_lm import MODELS as LM_MODELS
from .bench_lm import PARTS as LM_PARTS
from .bench_lm import lm_main
from .bench_many import many_main
from .bench_network import Options as NetworkOptions
from .bench_network import network_main
from .bench_profile import profile_main
from .bench_sweep import sweep_main
from .bench_train import NUMPY_DTYPES, SCALE, optional_torch

FULL = {"tokens": (1, 16, 512, 4096), "ranks": (8, 16, 64),
        "dims": ((2560, 2560), (4096, 4096), (2560, 10240)), "dtypes": ("f32", "f16")}
QUICK = {"tokens": (1, 16), "ranks": (8,), "dims": ((256, 320),), "dtypes": ("f32", "f16")}


def bump(m, n):
    """output[i] += 1: the least a dependent dispatch can do."""
    out = m.declare_output_buffer("output", f32, n)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < n):
        out[i] += 1.0


def dispatch_floor(device, dispatches: int = 2000) -> float:
    """Microseconds per dispatch of a chain of tiny dependent dispatches: the
    GPU-side cost any one-dispatch forward pays."""
    k = sd.compile(bump, 256, n=2560)
    buf = device.zeros(2560, np.float32)
    times = []
    for _ in range(5):
        with device.batch(timestamps=True) as b:
            for _ in range(dispatches):
                device.dispatch(k, [buf], 10)
        if b.gpu_time_ns is None:
            return float("nan")
        times.append(b.gpu_time_ns / dispatches / 1000)
    return statistics.median(times)


def minimal_bytes(tokens, rank, in_dim, out_dim, itemsize=4) -> int:
    return itemsize * (tokens * in_dim + 2 * tokens * out_dim + rank * in_dim + out_dim * rank)


def numpy_time(x, a, b, out, repeats) -> float:
    """Median microseconds of the float32 forward in numpy on the CPU."""
    x, a, b, out = (v.astype(np.float32) for v in (x, a, b, out))
    times = []
    for _ in range(repeats):
        o = out.copy()
        t0 = time.perf_counter()
        o += SCALE * ((x @ a.T) @ b.T)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def torch_times(x, a, b, out, forwards: int) -> dict:
    """PyTorch CUDA eager and CUDA-graph microseconds per forward, or why not."""
    torch = optional_torch()
    if torch is None:
        return {"torch": "not installed"}
    if not torch.cuda.is_available():
        return {"torch": f"{torch.__version__} without CUDA"}
    dev = torch.device("cuda")
    X, A, B, Out = (torch.from_numpy(np.ascontiguousarray(v)).to(dev) for v in (x, a, b, out))
    single = X.shape[0] == 1

    def step():
        if single:
            h = torch.mv(A, X[0])
            Out[0].add_(torch.mv(B, h), alpha=SCALE)
        else:
            Out.addmm_(X @ A.T, B.T, alpha=SCALE)

    def timed(fn) -> float:
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000 / forwards)
        return statistics.median(times)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    eager = timed(lambda: [step() for _ in range(forwards)])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(min(forwards, 100)):
            step()
    per_graph = min(forwards, 100)
    graph_us = statistics.median(
        [timed(lambda: [graph.replay() for _ in range(max(1, forwards // per_graph))])
         for _ in range(1)]) * forwards / (max(1, forwards // per_graph) * per_graph)
    return {"torch": torch.__version__, "torch_eager_us": eager, "torch_graph_us": graph_us}


def host_time(device, plan, x_buf, out_buf, forwards: int = 2000) -> float:
    """Microseconds of Python time to record one forward into a batch."""
    with device.batch():
        t0 = time.perf_counter()
        for _ in range(forwards):
            plan.record(x_buf, out_buf)
        t1 = time.perf_counter()
    device.sync()
    return (t1 - t0) / forwards * 1e6


def alone_and_read(device, plan, x_buf, out_buf, repeats: int = 50) -> float:
    """Median wall microseconds of one forward submitted alone and read back."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with device.batch():
            plan.record(x_buf, out_buf)
            device.read(out_buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6



def bench_case(device, dtype, tokens, rank, in_dim, out_dim, copy_gbps, quick, log) -> dict:
    rng = np.random.default_rng(tokens * 1000 + rank)
    npdt = NUMPY_DTYPES[dtype]
    a = (rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)).astype(npdt)
    b = rng.standard_normal((out_dim, rank)).astype(npdt)
    x = rng.standard_normal((tokens, in_dim)).astype(npdt)
    base = rng.standard_normal((tokens, out_dim)).astype(npdt)
    want = reference.forward(x, a, b, SCALE, base)
    magnitude = reference.forward(np.abs(x), np.abs(a), np.abs(b), abs(SCALE), np.abs(base))
    weight = Weight.from_numpy(device, a, b, dtype=npdt)
    x_buf = device.buffer(x if tokens > 1 else x[0])
    out_buf = device.buffer(base if tokens > 1 else base[0])
    forwards = 5 if quick else max(4, min(1000, 4_000_000 // (tokens * (in_dim + out_dim))))
    row = {"dtype": dtype, "tokens": tokens, "rank": rank, "in_dim": in_dim, "out_dim": out_dim,
           "min_bytes": minimal_bytes(tokens, rank, in_dim, out_dim, np.dtype(npdt).itemsize)}
    best = autotune(device, weight, SCALE, tokens, use_cache=False,
                    forwards=5 if quick else None)
    row["strategy"] = str(best)
    for label, strategy in (("best", best), ("seed", Strategy.parse("seed"))):
        plan = forward_plan(device, weight, SCALE, tokens, strategy)
        device.write(out_buf, base if tokens > 1 else base[0])
        plan(x_buf, out_buf)
        got = device.read(out_buf).reshape(tokens, out_dim).astype(np.float64)
        row[f"{label}_rel_err"] = reference.rel_error(got, want, magnitude)
        row[f"{label}_gpu_us"] = time_plan(device, plan, x_buf, out_buf, forwards if label == "best"
                                           else 2, 3 if quick else 5)
        if label == "best":
            row["host_us"] = host_time(device, plan, x_buf, out_buf, 50 if quick else 2000)
            row["dispatches"] = plan.dispatches
            if tokens == 1:
                row["alone_read_us"] = alone_and_read(device, plan, x_buf, out_buf,
                                                      5 if quick else 100)
    t = row["best_gpu_us"]
    row["gbps"] = row["min_bytes"] / (t * 1e3)
    row["frac_copy"] = row["gbps"] / copy_gbps if copy_gbps else None
    row["vs_seed"] = row["seed_gpu_us"] / t
    row["numpy_us"] = numpy_time(x, a, b, base, 3 if quick else 10)
    row["vs_numpy"] = row["numpy_us"] / t
    row.update(torch_times(x, a, b, base, forwards))
    for k in ("torch_eager_us", "torch_graph_us"):
        if k in row:
            row[k.replace("_us", "").replace("torch_", "vs_torch_")] = row[k] / t
    torch_text = (f"torch graph {row['torch_graph_us']:.1f} us" if "torch_graph_us" in row
                  else f"PyTorch: {row['torch']}")
    for buf in (x_buf, out_buf, weight.a, weight.b):
        device.release(buf)
    log(f"{dtype} T={tokens:5d} r={rank:2d} {in_dim}->{out_dim}: {row['strategy']:>15} "
        f"{t:8.2f} us ({row['gbps']:.0f} GB/s), seed {row['seed_gpu_us']:.1f} us, "
        f"host {row['host_us']:.1f} us, {torch_text}, err {row['best_rel_err']:.1e}")
    return row


def run(quick: bool, log=print, grid: dict | None = None, save=None, train: str = "also",
        backwards: tuple = (None,), train_grid: dict | None = None) -> dict:
    """Measure every case of ``grid`` (and, unless ``train`` is "no", the training
    steps of lora.apps.bench_train over ``train_grid``, once per backward
    strategy of ``backwards``, None for the default; "only": those alone);
    ``save(result)`` is called after each case."""
    device = get_device()
    grid = grid or (QUICK if quick else FULL)
    log(f"adapter: {device.name} ({device.backend}), wgpu build {WGPU_BUILD} ({COMPILER})")
    copy = copy_bandwidth(device, 16 if quick else 512, 0.0 if quick else 3.0)
    floor = dispatch_floor(device, 50 if quick else 2000)
    log(f"copy bandwidth: {copy:.0f} GB/s; dependent-dispatch floor: {floor:.2f} us")
    dtypes = list(grid["dtypes"])
    skipped = []
    if "f16" in dtypes and not device.has_feature("shader-f16"):
        dtypes.remove("f16")
        skipped.append("f16: adapter lacks shader-f16")
        log(f"f16 cases skipped: {device.name} lacks shader-f16")
    result = {"adapter": device.name, "backend": device.backend, "wgpu_build": WGPU_BUILD,
              "compiler": COMPILER, "copy_gbps": copy, "dispatch_floor_us": floor, "quick": quick,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "skipped": skipped, "rows": []}
    cases = [] if train == "only" else \
        [(d, t, r, i, o) for d in dtypes for (i, o) in grid["dims"] for r in grid["ranks"]
         for t in grid["tokens"]]
    tgrid = train_grid or (bench_train.QUICK if quick else bench_train.FULL)
    train_cases = [] if train == "no" else \
        [(t, r, i, o, bw, d) for d in tgrid["dtypes"] if d in dtypes
         for (i, o) in tgrid["dims"] for r in tgrid["ranks"] for t in tgrid["tokens"]
         for bw in backwards]
    total = len(cases) + len(train_cases)
    if not quick and total:  # a run's first case measures slow on the H200 (optimisation notes
        log("warm-up, not recorded:", end=" ")  # 16, 27): it runs once before the record
        if cases:
            bench_case(device, *cases[0], copy, quick, log)
        else:
            _train_row(device, train_cases[0], copy, quick, log)
    for k, case in enumerate(cases, 1):
        log(f"[{k}/{total}]", end=" ")
        result["rows"].append(bench_case(device, *case, copy, quick, log))
        if save:
            save(result)
    for k, case in enumerate(train_cases, len(cases) + 1):
        log(f"[{k}/{total}]", end=" ")
        result.setdefault("train_rows", []).append(_train_row(device, case, copy, quick, log))
        if save:
            save(result)
    for line in bench_table.tables(result):
        log(line)
    return result


def _train_row(device, case, copy, quick, log) -> dict:
    tokens, rank, in_dim, out_dim, backward, dtype = case
    return bench_train.train_case(device, tokens, rank, in_dim, out_dim, copy, quick, log,
                                  backward=backward, dtype=dtype)


def plot(results: list[dict], path: str) -> bool:
    """Left: GPU time per forward against tokens for the headline shape (the
    first rank and dims measured), each build beside seed and PyTorch. Right:
    PyTorch CUDA-graph time over ours for every measured case (above 1: faster).
    False when there is nothing to draw or no matplotlib."""
    results = [r for r in results if r["rows"]]
    if not results:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    head = results[0]["rows"][0]
    shape = (head["rank"], head["in_dim"], head["out_dim"])
    torch_drawn = set()
    for res in results:
        for dtype in sorted({r.get("dtype", "f32") for r in res["rows"]}, reverse=True):
            rows = sorted((r for r in res["rows"] if r.get("dtype", "f32") == dtype and
                           (r["rank"], r["in_dim"], r["out_dim"]) == shape),
                          key=lambda r: r["tokens"])
            tokens = [r["tokens"] for r in rows]
            left.plot(tokens, [r["best_gpu_us"] for r in rows], marker="o",
                      label=f"shaderdsl {dtype} ({res['compiler']})")
            if dtype == "f32":
                left.plot(tokens, [r["seed_gpu_us"] for r in rows], linestyle=":", marker=".",
                          label=f"seed design f32 ({res['compiler']})")
            if dtype not in torch_drawn and rows and "torch_graph_us" in rows[0]:
                left.plot(tokens, [r["torch_graph_us"] for r in rows], linestyle="--",
                          label=f"PyTorch CUDA graph {dtype}")
                torch_drawn.add(dtype)
            cases = [r for r in res["rows"]
                     if "torch_graph_us" in r and r.get("dtype", "f32") == dtype]
            right.scatter(range(len(cases)),
                          [r["torch_graph_us"] / r["best_gpu_us"] for r in cases],
                          label=f"{res['compiler']} {dtype}", marker="o" if dtype == "f32" else "^")
    left.set(xscale="log", yscale="log", xlabel="tokens", ylabel="GPU time per forward (us)",
             title=f"rank {shape[0]}, {shape[1]} -> {shape[2]}")
    left.legend(fontsize=7)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set(yscale="log", xlabel="case (order of the JSON rows)",
              ylabel="PyTorch CUDA graph time / ours (same dtype)",
              title="every case (above 1: we are faster)")
    right.legend(fontsize=7)
    fig.suptitle(f"LoRA forward on {results[0]['adapter']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- command line

GRID_KEYS = ("tokens", "ranks", "dims", "dtypes")


def _positive(value: str) -> int:
    """An int of at least 1 (argparse's type for counts)."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a count of at least 1, got {value}")
    return n


def _names(allowed) -> Callable[[str], tuple]:
    """argparse's type for a comma-separated subset of ``allowed`` (any case)."""
    by_lower = {name.lower(): name for name in allowed}

    def parse(value: str) -> tuple:
        names = [v.strip() for v in value.split(",")]
        bad = [n for n in names if n.lower() not in by_lower]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; expected some of "
                                             f"{', '.join(allowed)}")
        return tuple(by_lower[n.lower()] for n in names)
    return parse


def _lm_arguments(p: argparse.ArgumentParser) -> None:
    """--lm and its options (lora.apps.bench_lm); --attention, its attention
    kernels alone (lora.apps.bench_attention)."""
    p.add_argument("--attention", action="store_true",
                   help="each attention kernel of the LM (forward, delta, grad_kv, grad_q; SIMT "
                        "and on matrix units) at SmolLM2's and Qwen2.5's shapes, checked "
                        "against float64, beside torch's SDPA (lora.apps.bench_attention)")
    p.add_argument("--lm", action="store_true",
                   help="a transformer LM with LoRA (rank 16, all-linear) in SmolLM2-135M's and "
                        "Qwen2.5-0.5B's shapes: the training step (8 x 512 tokens, f16 and "
                        "f32), prefill and greedy decode (batch 1 and 8) beside transformers + "
                        "peft (lora.apps.bench_lm); with --quick, tiny models")
    p.add_argument("--lm-models", type=_names(tuple(LM_MODELS)), metavar="NAMES",
                   help=f"--lm: comma-separated models (default all: {', '.join(LM_MODELS)})")
    p.add_argument("--lm-parts", type=_names(LM_PARTS), default=LM_PARTS, metavar="PARTS",
                   help=f"--lm: comma-separated parts (default all: {', '.join(LM_PARTS)})")
    p.add_argument("--lm-timeout", type=float, metavar="SECONDS",
                   help="--lm: the time limit of each section (default 300; --quick 120)")
    p.add_argument("--lm-train-shape", metavar="BATCHxSEQ",
                   type=lambda v: tuple(_positive(n) for n in v.split("x")),
                   help="--lm: the training step's batch and sequence (default 8x512)")


QUICK_HELP = "a short run for CI: small shapes, each time one batch (noisy), no tuned choice stored"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lora bench",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG")
    p.add_argument("--tokens", type=lambda v: tuple(int(t) for t in v.split(",")),
                   help="comma-separated token counts, of the forward and training rows "
                        "(default: the full matrix's)")
    p.add_argument("--ranks", type=lambda v: tuple(int(t) for t in v.split(",")),
                   help="comma-separated ranks")
    p.add_argument("--dims", type=lambda v: tuple(tuple(int(d) for d in p.split("x"))
                                                  for p in v.split(",")),
                   help="comma-separated IN x OUT pairs, e.g. 2560x2560,2560x10240")
    p.add_argument("--dtypes", type=lambda v: tuple(v.split(",")),
                   help="comma-separated storage dtypes, f32 and/or f16 (default: both)")
    p.add_argument("--train", choices=("also", "no", "only"), default="also",
                   help="training steps (lora.apps.bench_train) too (default), not, or alone")
    p.add_argument("--backward", default=(None,),
                   type=lambda v: tuple(None if t == "default" else t for t in v.split(",")),
                   help="training rows: comma-separated backward strategies to time each step "
                        "with (e.g. default,split:256; default: the trainer's default)")
    p.add_argument("--both-builds", action="store_true",
                   help="also run under Dawn (SHADERDSL_WGPU=dawn) in a subprocess, if installed")
    p.add_argument("--tokens-sweep", action="store_true",
                   help="time a serving loop of varying token counts (1..8192) end to end, "
                        "run-time T against T baked per count (and PyTorch eager)")
    p.add_argument("--profile", action="store_true",
                   help="where a forward's time goes: each dispatch and phase of several "
                        "strategies alone, and the read-back's pieces (lora.apps.bench_profile)")
    p.add_argument("--gemm", nargs="?", const="issue", type=parse_shapes, metavar="SHAPES",
                   help="the GEMM engine swept beside torch.mm, each variant checked first: "
                        "'issue' (default: 4096^3, the transformer shapes), squares (4096) "
                        "or MxNxK products (4096x576x576) (lora.apps.bench_gemm)")
    p.add_argument("--ceiling", action="store_true",
                   help="what the hardware gives a kernel: copies, subgroup-matrix loads, "
                        "stores and multiplies, direct and staged GEMM (lora.apps.bench_ceiling)")
    p.add_argument("--many", nargs="?", const="all", metavar="COUNTS",
                   help="many adapters in one batch (AdapterPool): 1-100 adapters, decode and "
                        "prefill, beside PyTorch's loop and padded bmm (lora.apps.bench_many); "
                        "COUNTS: comma-separated adapter counts alone (e.g. 1)")
    p.add_argument("--network", action="store_true",
                   help="the training step of a 3-layer MLP with LoRA on every layer (one "
                        "lora.Network submit) beside torch+peft (lora.apps.bench_network)")
    p.add_argument("--layers", type=_positive, metavar="N",
                   help="--network: Linear layers in the MLP (default 3)")
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="--network: peft's lora_dropout in every step (ours and torch+peft's)")
    p.add_argument("--max-grad-norm", type=float, metavar="NORM",
                   help="--network: clip every step's gradients to this global norm "
                        "(ours and torch's clip_grad_norm_; default: no clipping)")
    _lm_arguments(p)
    p.add_argument("--forwards", type=int,
                   help="--tokens-sweep: forwards in the loop (default 1000; --quick 100)")
    p.add_argument("--baked-forwards", type=int,
                   help="--tokens-sweep: forwards of the baked loop, the first of the same "
                        "counts (default: all)")
    p.add_argument("--strategy", default="auto",
                   help="--tokens-sweep: force a strategy (e.g. tiled:256:16) instead of "
                        "autotuning each bucket")
    return p


def _special_run(args, log) -> int | None:
    """The exit code of a bench other than the forward/training matrix (--tokens-sweep,
    --profile, --gemm, --ceiling, --attention, --many, --lm, --network); None when none was
    asked for."""
    if args.tokens_sweep:
        return sweep_main(args, log)
    if args.profile:
        profile_main(args.out, dispatch_floor, log)
        return 0
    if args.gemm:
        return gemm_main(args.out, args.gemm, log)
    if args.ceiling:
        return ceiling_main(args.out, log)
    if args.attention:
        return attention_main(args.out, log, args.quick)
    if args.many:
        counts = None if args.many == "all" else tuple(int(n) for n in args.many.split(","))
        return many_main(args.out, log, args.quick, counts)
    if args.lm:
        changes = {} if args.lm_timeout is None else {"timeout_s": args.lm_timeout}
        if args.lm_train_shape:
            changes.update(zip(("train_batch", "train_seq"), args.lm_train_shape))
        return lm_main(args.out, log, args.quick, args.lm_models, args.lm_parts, **changes)
    if args.network:  # a 3-layer MLP's step
        return network_main(args.out, log, args.quick, opts=NetworkOptions(
            args.layers, args.lora_dropout, args.max_grad_norm))
    return None


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with quick_timing() if args.quick else contextlib.nullcontext():
        return _main(p, args)


def _main(p: argparse.ArgumentParser, args) -> int:

    def log(*a, **kw):
        print(*a, **kw, flush=True)

    bad = set(args.dtypes or ()) - set(NUMPY_DTYPES)
    if bad:
        p.error(f"--dtypes: unknown {', '.join(sorted(bad))}; expected f32 and/or f16")
    special = _special_run(args, log)
    if special is not None:
        return special

    grid = dict(QUICK if args.quick else FULL)
    train_grid = dict(bench_train.QUICK if args.quick else bench_train.FULL)
    for key in GRID_KEYS:
        if getattr(args, key):
            grid[key] = getattr(args, key)
            if key in train_grid:  # the training rows take the same subset
                train_grid[key] = getattr(args, key)
    name = os.path.join(args.out, f"bench-{COMPILER}.json")

    def save(result):
        with open(name + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(name + ".tmp", name)

    results = [run(args.quick, log, grid, save, args.train, args.backward, train_grid)]
    save(results[0])
    log(f"wrote {name}")
    if args.both_builds and WGPU_BUILD != "dawn":
        cmd = [sys.executable, "-m", "lora", "bench", "--out", args.out, "--train", args.train] + \
            (["--quick"] if args.quick else []) + \
            (["--backward", ",".join(str(b) for b in args.backward)]
             if args.backward != (None,) else [])
        for key in GRID_KEYS:
            if getattr(args, key):
                cmd += [f"--{key}", ",".join("x".join(map(str, v)) if isinstance(v, tuple)
                                              else str(v) for v in getattr(args, key))]
        r = subprocess.run(cmd, env={**os.environ, "SHADERDSL_WGPU": "dawn"})
        other = os.path.join(args.out, "bench-tint.json")
        if r.returncode == 0 and os.path.exists(other):
            with open(other) as f:
                results.append(json.load(f))
        else:
            log("Dawn run failed or wgpudawn is not installed; plotting wgpu-native only")
    png = os.path.join(args.out, "bench.png")
    log(f"wrote {png}" if plot(results, png) else "no plot: no rows, or matplotlib not installed")
    return 0
