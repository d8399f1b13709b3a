"""Training-step benchmark: forward + MSE + backward + AdamW for one adapted
layer, on the GPU beside PyTorch in the same process: eager and CUDA graph
(AdamW(capturable=True)), and the strongest step we know (the loss and its
backward by torch.compile max-autotune, fused AdamW, the whole step in one CUDA
graph). Part of ``python -m lora bench`` (lora.apps.bench).

A step here is what PyTorch's does: ``out = base + s (x A^T) B^T``, the mean
squared error against a target, its gradient, dA and dB (no dx: x needs no
gradient), and one AdamW step of A and B. Ours copies the base output into
the output buffer first (our forward adds in place), a copy kernel in the
same submit, except where the forward reads the base itself (``single``).
The minimal bytes of a step are x, base and target read once.
An f16 row trains an f16 weight in mixed precision (LayerTrainer: f16
storage, f32 masters and sums) beside PyTorch's fp16 autocast step alone
(an f32 row: beside both its f32 and fp16 autocast graphs, and its f32
strongest step).
"""
from __future__ import annotations

import importlib
import importlib.util
import statistics
import time

import numpy as np

from ..core import reference
from ..core.tuning import median_us
from ..core.weight import Weight
from ..training.optim import AdamW
from ..training.trainer import LayerTrainer

FULL = {"tokens": (1, 16, 512, 4096), "ranks": (8, 16, 64), "dims": ((2560, 2560),),
        "dtypes": ("f32", "f16")}
QUICK = {"tokens": (1, 16), "ranks": (8,), "dims": ((256, 320),), "dtypes": ("f32",)}
SCALE, LR = 2.0, 1e-4  # the benches' LoRA scale (bench, bench_sweep use it too)
NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16}


def optional_torch():
    """PyTorch, or None where it is not installed: the comparisons with it are
    optional (its Linux wheels bring CUDA), and it is imported by name so that
    the type checker does not need it either."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _problem(tokens, rank, in_dim, out_dim):
    rng = np.random.default_rng(tokens * 7 + rank)
    a, _ = reference.init_lora(in_dim, out_dim, rank, seed=rank)
    b = (rng.standard_normal((out_dim, rank)) * 0.01).astype(np.float32)  # as after some training
    x, base, target = (rng.standard_normal((tokens, d)).astype(np.float32)
                       for d in (in_dim, out_dim, out_dim))
    return a, b, x, base, target


def _check_one_step(device, trainer, a, b, x, base, target, bufs) -> float:
    """Relative error of A and B (the masters) after one step, against float64
    of the values as stored (f16 rows: the output and g rounded to f16)."""
    trainer.record(bufs["x"], bufs["out"], bufs["target"], bufs["base"])
    dt = bufs["x"].dtype
    x, base, target, a16, b16 = (v.astype(dt) for v in (x, base, target, a, b))
    loss, g = reference.mse(reference.forward(x, a16, b16, SCALE, base).astype(dt), target)
    d = reference.backward(x, a16, b16, g.astype(dt), SCALE)
    zero = np.zeros_like
    want_a = reference.adamw_step(a, d["grad_a"], zero(a), zero(a), 1, LR)[0]
    want_b = reference.adamw_step(b, d["grad_b"], zero(b), zero(b), 1, LR)[0]
    got_a, got_b = (device.read(m) for m in trainer.masters)
    return float(max(np.abs(got_a - want_a).max() / np.abs(want_a).max(),
                     np.abs(got_b - want_b).max() / np.abs(want_b).max()))


def _time_steps(device, trainer, bufs, steps: int, repeats: int) -> float:
    """Median GPU microseconds per step (tuning.median_us, at most 20 000 a batch)."""
    return median_us(device, lambda: trainer.record(bufs["x"], bufs["out"], bufs["target"],
                                                    bufs["base"]), steps, repeats, most=20_000)


def profile_step(device, trainer, bufs, repeats: int) -> dict:
    """GPU microseconds of each dispatch of a step on its own (the copy, the
    forward's kernels, the loss, the backward's, the optimizer's): each is
    recorded ``repeats`` times in one timed batch."""
    from ..core.plan import record_steps

    given = {**bufs, "g": trainer.g, "dA": trainer.grad_a, "dB": trainer.grad_b,
             "want": bufs["target"], "output": bufs["out"], "h": trainer.h}
    forward, *_ = trainer.plans()
    what = {id(forward): "forward", id(trainer.loss_plan): "loss", id(trainer.backward): "backward"}
    parts = [(f"{what.get(id(plan), 'optimizer')} {s.kernel.name}", [s],
              {**given, **plan.bound, **plan.scratch})
             for plan in trainer.plans() for s in plan.steps]
    out = {}
    for name, steps, bs in parts:
        with device.batch(timestamps=True) as b:
            for _ in range(repeats):
                record_steps(device, steps, bs)
        key = name if name not in out else f"{name} ({len(out)})"
        out[key] = (b.gpu_time_ns or float("nan")) / repeats / 1e3
    if forward is trainer.forward:  # the base is copied into the output first
        with device.batch(timestamps=True) as b:
            for _ in range(repeats):
                trainer._copy_base(bufs["base"], bufs["out"])
        out["copy base -> out"] = (b.gpu_time_ns or float("nan")) / repeats / 1e3
    return out


def _cuda_us(torch, fn, calls: int, repeats: int = 5) -> float:
    """Median CUDA-event microseconds per call, over ``repeats`` runs of ``fn``
    (which makes ``calls`` calls)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def _captured(torch, step, warm_up: int = 3):
    """``step`` run ``warm_up`` times on a side stream, then captured in one CUDA
    graph: the order torch's CUDA-graph docs give, so that lazy initialisation
    (optimizer state, gradients, compilation) stays out of the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_up):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def torch_step(torch, a, b, x, base, target, half: bool, compiled: bool, device: str = "cuda"):
    """PyTorch's training step on ``device``, as a function: zero the gradients,
    the loss, its backward, one AdamW step. ``half``: x, base and target in fp16,
    the products under fp16 autocast (A, B and AdamW in fp32). ``compiled``: the
    loss (and so, through AOTAutograd, its backward) by
    ``torch.compile(mode="max-autotune-no-cudagraphs")`` and the fused AdamW:
    the strongest step we know once captured in a CUDA graph. Compilation
    happens at the first call."""
    dev = torch.device(device)
    # copies (torch.tensor): on the CPU, from_numpy would share, and so train, the caller's arrays
    A, B = (torch.nn.Parameter(torch.tensor(v, device=dev)) for v in (a, b))
    X, BASE, TGT = (torch.tensor(v, device=dev, dtype=torch.float16 if half else torch.float32)
                    for v in (x, base, target))

    def loss():
        with torch.autocast(dev.type, dtype=torch.float16, enabled=half):
            out = BASE + SCALE * ((X @ A.T) @ B.T)
        return torch.nn.functional.mse_loss(out.float(), TGT.float())

    if compiled:
        # a fresh cache per row: one shared by every row would reach dynamo's recompile
        # limit after a few shapes and run the rest eagerly, silently
        torch._dynamo.reset()
        loss = torch.compile(loss, mode="max-autotune-no-cudagraphs", dynamic=False)
    # (capturable needs CUDA: on the CPU the step runs only to check that it builds)
    opt = torch.optim.AdamW([A, B], lr=LR, capturable=dev.type == "cuda",
                            fused=True if compiled else None)

    def step():
        opt.zero_grad(set_to_none=False)
        loss().backward()
        opt.step()
    return step


def torch_step_times(a, b, x, base, target, steps: int, half: bool = False) -> dict:
    """PyTorch CUDA eager and CUDA-graph microseconds per training step
    (``torch_step``, not compiled), or why not; keys start ``torch_fp16_`` for
    ``half``."""
    torch = optional_torch()
    if torch is None:
        return {"torch": "not installed"}
    if not torch.cuda.is_available():
        return {"torch": f"{torch.__version__} without CUDA"}
    step = torch_step(torch, a, b, x, base, target, half, compiled=False)
    graph = _captured(torch, step)
    eager = _cuda_us(torch, lambda: [step() for _ in range(steps)], steps)
    graph_us = _cuda_us(torch, lambda: [graph.replay() for _ in range(steps)], steps)
    key = "torch_fp16_" if half else "torch_"
    return {"torch": torch.__version__, f"{key}eager_us": eager, f"{key}graph_us": graph_us}


STRONGEST = "torch.compile max-autotune-no-cudagraphs + fused AdamW, one CUDA graph"


def why_no_strongest(torch) -> str | None:
    """Why PyTorch's strongest step cannot run with this (installed) torch, or
    None where it can."""
    if not torch.cuda.is_available():
        return f"{torch.__version__} without CUDA"
    if importlib.util.find_spec("triton") is None:
        return f"{torch.__version__} without triton (torch.compile's GPU kernels)"
    return None


def torch_strongest_time(a, b, x, base, target, steps: int, half: bool = False) -> dict:
    """Microseconds per step of PyTorch's strongest training step (``torch_step``
    compiled, the whole step in one CUDA graph; key ``torch_strongest_us``,
    ``torch_fp16_strongest_us`` for ``half``) and the seconds its compilation,
    warm-up and capture took; or, in ``torch_strongest``, why not."""
    torch = optional_torch()
    why = "not installed" if torch is None else why_no_strongest(torch)
    if torch is None or why is not None:
        return {"torch_strongest": why}
    t0 = time.perf_counter()
    try:
        graph = _captured(torch, torch_step(torch, a, b, x, base, target, half, compiled=True))
    except Exception as e:  # whatever compile or capture raised: the row says it, the bench goes on
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return {"torch_strongest": f"failed: {type(e).__name__}: {first}"}
    build_s = time.perf_counter() - t0
    us = _cuda_us(torch, lambda: [graph.replay() for _ in range(steps)], steps)
    key = "torch_fp16_" if half else "torch_"
    return {"torch_strongest": STRONGEST, f"{key}strongest_us": us,
            "torch_strongest_build_s": build_s}


def train_case(device, tokens, rank, in_dim, out_dim, copy_gbps, quick, log,
               backward=None, dtype="f32") -> dict:
    """One training step's row (``backward``: a strategy text, None for the
    default; ``dtype``: "f16" trains in mixed precision)."""
    a, b, x, base, target = _problem(tokens, rank, in_dim, out_dim)
    npdt = NUMPY_DTYPES[dtype]
    weight = Weight.from_numpy(device, a, b, dtype=npdt)
    trainer = LayerTrainer(device, weight, SCALE, tokens, AdamW(lr=LR), loss="mse",
                           backward=backward)
    bufs = {"x": device.buffer(x.astype(npdt)), "base": device.buffer(base.astype(npdt)),
            "target": device.buffer(target.astype(npdt)), "out": device.empty(base.shape, npdt)}
    row = {"kind": "train", "dtype": dtype, "tokens": tokens, "rank": rank, "in_dim": in_dim,
           "out_dim": out_dim, "forward": str(trainer.forward.strategy),
           "backward": str(trainer.backward.strategy),
           "min_bytes": np.dtype(npdt).itemsize * tokens * (in_dim + 2 * out_dim),
           "dispatches": sum(len(p.steps) for p in trainer.plans())
           + (trainer.plans()[0] is trainer.forward)}  # and the base copy, where there is one
    row["rel_err"] = _check_one_step(device, trainer, a, b, x, base, target, bufs)
    steps = 5 if quick else max(10, min(500, 20_000_000 // (tokens * (in_dim + out_dim))))
    row["gpu_us"] = _time_steps(device, trainer, bufs, steps, 3 if quick else 5)
    row["profile_us"] = profile_step(device, trainer, bufs, 3 if quick else max(20, steps))
    row["gbps"] = row["min_bytes"] / (row["gpu_us"] * 1e3)
    row["min_bytes_us"] = row["min_bytes"] / (copy_gbps * 1e3) if copy_gbps else None
    for half in ((True,) if dtype == "f16" else (False, True)):
        row.update(torch_step_times(a, b, x, base, target, steps, half=half))
        if f"{'torch_fp16_' if half else 'torch_'}graph_us" not in row:
            break  # not installed, or no CUDA
    row.update(torch_strongest_time(a, b, x, base, target, steps, half=dtype == "f16"))
    key = "torch_fp16_" if dtype == "f16" else "torch_"
    for what in ("graph", "eager", "strongest"):  # PyTorch's time over ours: above 1, ours wins
        if f"{key}{what}_us" in row:
            row[f"vs_torch_{what}"] = row[f"{key}{what}_us"] / row["gpu_us"]
    for buf in bufs.values():
        device.release(buf)
    log(f"train {dtype} T={tokens:5d} r={rank:2d} {in_dim}->{out_dim}: {row['forward']} + "
        f"{row['backward']} {row['gpu_us']:8.2f} us ({row['dispatches']} dispatches, "
        f"min bytes at copy speed {row['min_bytes_us'] or float('nan'):.1f} us), "
        f"{_torch_text(row)}, err {row['rel_err']:.1e}")
    log("      per dispatch (us): "
        + ", ".join(f"{k} {v:.1f}" for k, v in row["profile_us"].items()))
    return row


def _torch_text(row) -> str:
    """PyTorch's times of a training row, as measured."""
    parts = [f"{what} graph {row[k + 'graph_us']:.1f} us, eager {row[k + 'eager_us']:.1f}"
             for what, k in (("torch", "torch_"), ("torch fp16 autocast", "torch_fp16_"))
             if k + "graph_us" in row]
    parts = parts or [f"PyTorch: {row['torch']}"]
    strongest = [f"{what} strongest {row[k + 'strongest_us']:.1f} us "
                 f"(built in {row['torch_strongest_build_s']:.0f} s)"
                 for what, k in (("torch", "torch_"), ("torch fp16 autocast", "torch_fp16_"))
                 if k + "strongest_us" in row]
    if not strongest and row["torch_strongest"] != row["torch"]:  # (no need to say twice)
        strongest = [f"torch strongest: {row['torch_strongest']}"]
    return "; ".join(parts + strongest)
