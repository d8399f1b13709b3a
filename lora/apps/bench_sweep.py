"""``python -m lora bench --tokens-sweep``: a serving loop of varying token counts.

``--forwards`` forwards whose token counts are drawn from a serving mix
(``serving_tokens``: 1 to 8192), each end to end (upload x and the base
output, forward, read back) through ``execute_lora_forward_auto`` with
run-time token counts, after a warm-up of one forward per bucket; then the
same loop with a plan baked for each token count (compiling for every new
count), numpy, and PyTorch eager where installed. It prints and writes the
compiles and host times of each. Part of ``python -m lora bench`` (lora.apps.bench).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from shaderdsl.runtime import COMPILER, WGPU_BUILD, get_device

from ..core import reference, tuning
from ..core.forward import forward_plan
from ..core.weight import Weight
from ..hesper import execute_lora_forward_auto
from .bench_train import NUMPY_DTYPES, SCALE, optional_torch

SWEEP = {"ranks": (8,), "dims": ((2560, 2560),), "dtypes": ("f32",), "forwards": 1000}
SWEEP_QUICK = {"ranks": (8,), "dims": ((256, 320),), "dtypes": ("f32",), "forwards": 100}
COMPILE_STATS = ("modules", "pipelines")


def serving_tokens(rng, n: int, max_tokens: int = 8192, decode: float = 0.7) -> np.ndarray:
    """Token counts of ``n`` forwards of a serving loop: with probability
    ``decode`` a decode step (a batch of 1 to 64 running sequences, one token
    each, uniform), else a prefill (a prompt: log-normal, median 512 tokens,
    sigma 1, clipped to 1..max_tokens)."""
    steps = rng.integers(1, 65, n)
    prompts = np.clip(np.rint(rng.lognormal(np.log(512), 1.0, n)), 1, max_tokens)
    return np.where(rng.random(n) < decode, steps, prompts).astype(np.int64)


def _compiles(device) -> dict:
    return {k: device.stats[k] for k in COMPILE_STATS}


def _summary(times: list[float]) -> dict:
    us = np.asarray(times) * 1e6
    return {"mean_us": float(us.mean()), "median_us": float(np.median(us)),
            "p99_us": float(np.percentile(us, 99)), "total_s": float(us.sum() / 1e6)}


def serving_loop(device, counts, data, run) -> dict:
    """Each T of ``counts`` end to end: upload x and base (``data(T)``), ``run``
    the forward, read the output back. Wall time per forward (``wall``) and the
    part spent in ``run`` (``host``: checks, recording, submit), with the
    modules and pipelines compiled during the loop."""
    before = _compiles(device)
    wall, host = [], []
    for t in counts:
        x, base = data(t)
        t0 = time.perf_counter()
        x_buf, out_buf = device.buffer(x), device.buffer(base)
        t1 = time.perf_counter()
        run(x_buf, out_buf)
        t2 = time.perf_counter()
        device.read(out_buf)
        wall.append(time.perf_counter() - t0)
        host.append(t2 - t1)
        device.release(x_buf)
        device.release(out_buf)
    after = _compiles(device)
    return {"forwards": len(counts), "wall": _summary(wall), "host": _summary(host),
            **{k: after[k] - before[k] for k in COMPILE_STATS}}


def torch_loop(counts, data, a, b, scale) -> dict:
    """The same loop in PyTorch eager (CUDA where available, else the CPU):
    numpy in, addmm, numpy out; or why it did not run."""
    torch = optional_torch()
    if torch is None:
        return {"torch": "not installed"}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    A, B = (torch.from_numpy(np.ascontiguousarray(v)).to(dev) for v in (a, b))

    def step(t):
        x, base = data(t)
        X = torch.from_numpy(x).to(dev)
        Out = torch.from_numpy(base).to(dev, copy=True)
        Out.addmm_(X @ A.T, B.T, alpha=scale)
        return Out.cpu().numpy()

    for t in counts[:10]:
        step(t)
    wall = []
    for t in counts:
        t0 = time.perf_counter()
        step(t)
        wall.append(time.perf_counter() - t0)
    return {"torch": torch.__version__, "torch_device": str(dev), "wall": _summary(wall)}


def numpy_loop(counts, data, a, b, scale) -> dict:
    wall = []
    for t in counts:
        x, base = data(t)
        t0 = time.perf_counter()
        _ = base + scale * ((x @ a.T) @ b.T)
        wall.append(time.perf_counter() - t0)
    return {"wall": _summary(wall)}


def _sweep_data(rng, npdt, rank, in_dim, out_dim, most):
    a = (rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)).astype(npdt)
    b = rng.standard_normal((out_dim, rank)).astype(npdt)
    x_all = rng.standard_normal((most, in_dim)).astype(npdt)
    base_all = rng.standard_normal((most, out_dim)).astype(npdt)
    return a, b, lambda t: (x_all[:t], base_all[:t])


def _warm_up(device, weight, counts, strategy) -> dict:
    """One forward per bucket the loop touches (tuning and compiles happen here)."""
    before, t0 = _compiles(device), time.perf_counter()
    seen = {}
    for t in counts:
        seen.setdefault(tuning.runtime_bucket(device, weight, int(t)) or int(t), int(t))
    for t in seen.values():
        x = device.empty((t, weight.in_dim), weight.dtype)
        out = device.empty((t, weight.out_dim), weight.dtype)
        execute_lora_forward_auto(device, weight, SCALE, x, out, strategy=strategy)
        device.read(out)
    after = _compiles(device)
    plans = {str(k[2]): str(p.strategy) for k, p in weight.plans.items()}
    return {"seconds": time.perf_counter() - t0, "buckets": plans,
            **{k: after[k] - before[k] for k in COMPILE_STATS}}


def _baked_run(device, weight, strategy_of):
    """A forward through a Plan with T baked in, one per token count (the
    former behaviour: each new count compiles)."""
    plans = {}

    def run(x_buf, out_buf):
        t = x_buf.size // weight.in_dim
        plan = plans.get(t)
        if plan is None:
            plan = plans[t] = forward_plan(device, weight, SCALE, t, strategy_of(t))
        plan(x_buf, out_buf)
    return run, plans


def _check_sample(device, weight, counts, data, a, b, strategy) -> float:
    """Max relative error of a few forwards of the loop against float64 numpy."""
    worst = 0.0
    for t in counts[:: max(1, len(counts) // 10)]:
        x, base = data(int(t))
        out = device.buffer(base)
        execute_lora_forward_auto(device, weight, SCALE, device.buffer(x), out, strategy=strategy)
        got = device.read(out).reshape(base.shape).astype(np.float64)
        magnitude = reference.forward(np.abs(x), np.abs(a), np.abs(b), SCALE, np.abs(base))
        want = reference.forward(x, a, b, SCALE, base)
        worst = max(worst, reference.rel_error(got, want, magnitude))
    return worst


def sweep_case(device, dtype, rank, in_dim, out_dim, counts, baked_forwards, strategy,
               log) -> dict:
    npdt = NUMPY_DTYPES[dtype]
    a, b, data = _sweep_data(np.random.default_rng(rank), npdt, rank, in_dim, out_dim,
                             int(counts.max()))
    weight = Weight.from_numpy(device, a, b, dtype=npdt)
    row = {"dtype": dtype, "rank": rank, "in_dim": in_dim, "out_dim": out_dim,
           "warm_up": _warm_up(device, weight, counts, strategy)}
    log(f"{dtype} r={rank} {in_dim}->{out_dim}: warm-up (one forward per bucket, tuning and "
        f"compiles) {row['warm_up']['seconds']:.1f} s, {row['warm_up']['pipelines']} pipelines; "
        f"strategies {row['warm_up']['buckets']}")
    row["rel_err"] = _check_sample(device, weight, counts, data, a, b, strategy)
    row["runtime"] = serving_loop(device, counts.tolist(), data, lambda x, o:
                                  execute_lora_forward_auto(device, weight, SCALE, x, o,
                                                            strategy=strategy))
    _log_loop(log, "run-time T (auto path)", row["runtime"])
    chosen = {key[2]: plan.strategy for key, plan in weight.plans.items()}  # bucket or T
    run, plans = _baked_run(device, weight,
                            lambda t: chosen[tuning.runtime_bucket(device, weight, t) or t])
    row["baked"] = serving_loop(device, counts[:baked_forwards].tolist(), data, run)
    _log_loop(log, "T baked per count (before)", row["baked"])
    for plan in plans.values():
        plan.release()
    row["numpy"] = numpy_loop(counts.tolist(), data, a.astype(np.float32),
                              b.astype(np.float32), SCALE)
    log(f"  {'numpy (CPU, compute only)':28} {row['numpy']['wall']['mean_us']:10.1f} us mean")
    row["torch"] = torch_loop(counts.tolist(), data, a, b, SCALE)
    if "wall" in row["torch"]:
        t = row["torch"]
        log(f"  {'PyTorch eager (' + t['torch_device'] + ')':28} {t['wall']['mean_us']:10.1f} us "
            f"mean, median {t['wall']['median_us']:.1f} us (upload, addmm, read back)")
    else:
        log(f"  PyTorch eager: skipped ({row['torch']['torch']})")
    for buf in (weight.a, weight.b):
        device.release(buf)
    return row


def _log_loop(log, label, r) -> None:
    log(f"  {label:28} {r['forwards']:5d} forwards, {r['modules']:4d} modules and "
        f"{r['pipelines']:4d} pipelines compiled; wall per forward mean "
        f"{r['wall']['mean_us']:9.1f} us, median {r['wall']['median_us']:9.1f} us, p99 "
        f"{r['wall']['p99_us']:9.1f} us; host (check, record, submit) median "
        f"{r['host']['median_us']:7.1f} us; total {r['wall']['total_s']:.2f} s")


def run_sweep(grid: dict, forwards: int, baked_forwards: int, strategy, log=print,
              save=None) -> dict:
    """The serving-loop sweep for every (dtype, rank, dims) of ``grid``."""
    device = get_device()
    counts = serving_tokens(np.random.default_rng(2026), forwards)
    log(f"adapter: {device.name} ({device.backend}), wgpu build {WGPU_BUILD} ({COMPILER})")
    log(f"tokens sweep: {forwards} forwards, T from the serving mix (70% decode steps of 1..64 "
        f"tokens, 30% prefills, log-normal median 512, clipped to 1..8192): mean "
        f"{counts.mean():.0f}, max {counts.max()}, {len(set(counts.tolist()))} distinct; "
        f"baked loop: the first {baked_forwards}")
    result = {"adapter": device.name, "backend": device.backend, "wgpu_build": WGPU_BUILD,
              "compiler": COMPILER, "forwards": forwards, "baked_forwards": baked_forwards,
              "strategy": strategy, "tokens": counts.tolist(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "rows": []}
    dtypes = [d for d in grid["dtypes"] if d == "f32" or device.has_feature("shader-f16")]
    for dtype in dtypes:
        for in_dim, out_dim in grid["dims"]:
            for rank in grid["ranks"]:
                result["rows"].append(sweep_case(device, dtype, rank, in_dim, out_dim, counts,
                                                 baked_forwards, strategy, log))
                if save:
                    save(result)
    return result



def sweep_main(args, log) -> int:
    """``--tokens-sweep``: the serving loop, written to DIR/tokens-sweep-COMPILER.json."""
    grid = dict(SWEEP_QUICK if args.quick else SWEEP)
    for key in ("ranks", "dims", "dtypes"):
        if getattr(args, key):
            grid[key] = getattr(args, key)
    forwards = args.forwards or grid["forwards"]
    if forwards < 1 or (args.baked_forwards is not None and args.baked_forwards < 0):
        log("error: --forwards must be >= 1 and --baked-forwards >= 0")
        return 2
    baked = forwards if args.baked_forwards is None else min(args.baked_forwards, forwards)
    name = os.path.join(args.out, f"tokens-sweep-{COMPILER}.json")

    def save(result):
        with open(name + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(name + ".tmp", name)

    save(run_sweep(grid, forwards, baked, args.strategy, log, save))
    log(f"wrote {name}")
    return 0
