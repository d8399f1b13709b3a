"""``python -m lora bench --gemm``: the GEMM engine (shaderdsl.matmul, f16 in,
f32 sums) swept over its parameters at 4096^3 and at issue 43's transformer
shapes, beside ``torch.mm`` fp16; where the adapter has no f16 -> f32
16x16x16 subgroup matrices it says so and stops.

Each shape (M x N x K: tokens x out x in) runs in one layout:

* ``plain``: A [M, K] and B [K, N] row-major, C f32 (the squares, as
  optimisation note 40 timed them);
* ``linear``: a Linear layer's y = x W^T as ``dense_matrix`` computes it, x
  [M, K], W [N, K] (a column-major right factor), y f16 (the transformer
  shapes; 4096^3 too).

Each variant (``variants``: the tiling lora.core.tilings' rule picks, then
one parameter changed at a time: block, k_step and staging, read width, pad,
workgroup order, exact, the in-place epilogue) is checked against float64
on 64 rows spread over M (C cleared to NaN first, so a row nothing wrote
fails) before it is timed; a wrong one is logged WRONG and never named
fastest. At 4096^3 three ceilings follow, the 256 x 128 block without its
global reads, without 7 of 8 staging stores, and without either: what a
step costs without each (their results are wrong by design: not checked).
Each shape's line ``fastest`` compares the best with the rule's choice, then
come ``torch.mm`` fp16's and, where ``onnxruntime-webgpu`` and ``onnx`` are
installed, ONNX Runtime's WebGPU execution provider's on the same inputs
(lora.apps.bench_peers: f16 out, checked on the same rows; the run says once
why it has none and how to install it, and why tinygrad has none). The JSON
(``gemm-<compiler>.json``) has every time, rate and error.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace

import numpy as np

from shaderdsl import compile as compile_kernel
from shaderdsl.errors import BindingError, DispatchError, WGSLCompileError
from shaderdsl.matmul import MatrixTiling, gemm
from shaderdsl.runtime import COMPILER, get_device
from shaderdsl.types import MatrixConfig

from ..core.tilings import BLOCKS, fits, product_tiling
from . import bench_peers
from .bench_ceiling import batch_us
from .bench_train import optional_torch

CONFIG = MatrixConfig("f16", "f32", 16, 16, 16)
H200_LIMITS = {"max-compute-workgroup-storage-size": 49152,
               "max-compute-invocations-per-workgroup": 1024}
# issue 43's transformer products (tokens x out x in), its square GEMM
ISSUE_SHAPES = ((4096, 4096, 4096, "plain"), (4096, 4096, 4096, "linear"),
                (4096, 576, 576, "linear"), (4096, 1536, 576, "linear"),
                (4096, 49152, 576, "linear"), (4096, 896, 4864, "linear"))
LAYOUTS = {"plain": dict(a_major="row", b_major="row", out="f32"),
           "linear": dict(a_major="row", b_major="col", out="f16")}
CHECK_ROWS = 64
# what a step of the 256 x 128 block costs without its global reads, without
# 7 of 8 staging stores, without either (wrong results: timed, not checked; note 42)
ABLATIONS = (("no global reads", "loads"), ("one staging store a read", "stores"),
             ("neither", "loads+stores"))


def _tiling(subgroups, fragments, k_step, **kw) -> MatrixTiling:
    return MatrixTiling(CONFIG, subgroups, fragments, k_step, **kw)


def variants(M: int, N: int, K: int, layout: str,
             limits=None) -> list[tuple[str, MatrixTiling, dict]]:
    """(name, tiling, gemm options) of each variant timed at this shape: the
    rule's tiling (for ``limits``, default the H200's) first, then the 256 x
    128 block with one parameter changed (each a hypothesis of notes 42-47:
    all of them on the plain square, with the in-place epilogue and the
    ceilings; k_step 32 single-buffered, prefetch 2 and group 8 elsewhere),
    then the rule's other blocks (each exact where whole) and the 128 x 128
    block with prefetch 2; those over ``limits`` left out."""
    opts = dict(LAYOUTS[layout])
    limits = limits or H200_LIMITS
    rule = product_tiling(M, N, K, opts["a_major"], opts["b_major"], limits)
    big = _whole(_tiling((4, 2), (4, 4), 16, read_width=8), M, N, K)
    out = [("rule", rule, {}), ("256x128", big, {})]
    changed = [("k_step 32 single-buffered", _whole(replace(big, k_step=32, stages=1), M, N, K)),
               ("prefetch 2", replace(big, prefetch=2)), ("group 8", replace(big, group=8))]
    square = layout == "plain"
    if square:
        changed += [("not exact", replace(big, exact=False)),
                    ("4-element reads", _whole(replace(big, read_width=4), M, N, K)),
                    ("pad 0", replace(big, pad=0))]
    out += [(f"256x128 {what}", t, {}) for what, t in changed if t != big]
    if square:   # results straight to the f32 output; the step's ceilings
        out.append(("256x128 in place", big, {"in_place": True}))
        out += [(f"ceiling: {what}", big, {"ablate": ablate}) for what, ablate in ABLATIONS]
    blocks = [_whole(_tiling(s, f, k, read_width=8), M, N, K) for s, f, k in BLOCKS[1:]]
    out += [(f"{t.rows}x{t.cols} {t.subgroups[0]}x{t.subgroups[1]} sg", t, {}) for t in blocks]
    out.append(("128x128 prefetch 2", replace(blocks[1], prefetch=2), {}))
    if square:
        out += [("128x128 k_step 16", _whole(replace(blocks[1], k_step=16), M, N, K), {}),
                ("128x128 4 sg of 4x4",
                 _whole(_tiling((2, 2), (4, 4), 16, read_width=8), M, N, K), {})]
    seen, unique = set(), []
    for name, t, extra in out:  # the rule's tiling is also one of the others: time it once
        key = (str(t), tuple(sorted(extra.items())))
        if key not in seen and fits(t, limits, opts["a_major"], opts["b_major"]):
            seen.add(key)
            unique.append((name, t, {**opts, **extra}))
    return unique


def _whole(t: MatrixTiling, M, N, K) -> MatrixTiling:
    return replace(t, exact=t.whole(M, N, K))


def torch_mm_us(M: int, N: int, K: int, layout: str) -> float | None:
    """torch.mm fp16 of the same product (W [N, K] transposed for "linear"),
    CUDA events, median of 5 batches of 20."""
    torch = optional_torch()
    if torch is None or not torch.cuda.is_available():
        return None
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = torch.randn(*((N, K) if layout == "linear" else (K, N)), device="cuda",
                    dtype=torch.float16)
    right = w.t() if layout == "linear" else w
    for _ in range(5):
        torch.mm(x, right)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            torch.mm(x, right)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(times)


class _Problem:
    """One shape's inputs on the device, its output and the float64 rows to check."""

    def __init__(self, device, M, N, K, layout):
        rng = np.random.default_rng(M + N + K)
        self.shape, self.layout = (M, N, K), layout
        self.a = a = rng.standard_normal((M, K)).astype(np.float16)
        self.b = b = rng.standard_normal((K, N)).astype(np.float16)  # kept for a peer
        stored_b = np.ascontiguousarray(b.T) if LAYOUTS[layout]["b_major"] == "col" else b
        self.dtype = np.float16 if LAYOUTS[layout]["out"] == "f16" else np.float32
        self.device = device
        self.bufs = {"A": device.buffer(a.reshape(-1)), "B": device.buffer(stored_b.reshape(-1)),
                     "C": device.empty(M * N, self.dtype)}
        self.rows = np.unique(np.linspace(0, M - 1, CHECK_ROWS).astype(np.int64))
        self.want = a[self.rows].astype(np.float64) @ b.astype(np.float64)
        self.cleared = np.full(M * N, np.nan, self.dtype)

    def error(self) -> float:
        """The largest error of the checked rows over their largest value (NaN:
        a row not written)."""
        M, N, _ = self.shape
        got = self.device.read(self.bufs["C"]).reshape(M, N)[self.rows].astype(np.float64)
        return float(np.abs(got - self.want).max() / np.abs(self.want).max())

    def release(self) -> None:
        for buf in self.bufs.values():
            self.device.release(buf)


def gemm_case(device, shape: tuple, log, chosen=None, peer=None) -> dict:
    """One shape (M, N, K, layout) at each variant (``chosen``: a list of
    ``variants``' entries; default all), each checked, then timed; then ORT
    WebGPU's product where ``peer`` (bench_peers.start's) is given."""
    M, N, K, layout = shape
    problem = _Problem(device, M, N, K, layout)
    tol = 2.0**-10 if problem.dtype == np.float16 else 1e-4  # the f16 output's rounding
    row = {"shape": [M, N, K], "layout": layout, "tilings": {}, "refused": {},
           "torch_mm_us": torch_mm_us(M, N, K, layout)}
    flops = 2 * M * N * K
    for name, tiling, opts in chosen or variants(M, N, K, layout, device.limits):
        label = f"{name}: {tiling}{', in place' if opts.get('in_place') else ''}"
        try:
            t0 = time.perf_counter()
            kernel = compile_kernel(gemm, tiling.threads, M=M, N=N, K=K, tiling=tiling, **opts)
            err = None
            if not opts.get("ablate"):  # a ceiling's results are wrong by design
                device.write(problem.bufs["C"], problem.cleared)
                device.dispatch(kernel, problem.bufs, tiling.grid(M, N))
                err = problem.error()
            us = batch_us(device, kernel, problem.bufs, tiling.grid(M, N))
        except (DispatchError, WGSLCompileError, BindingError) as e:  # over a limit, refused
            log(f"  {M}x{N}x{K} {label}: {e}")
            row["refused"][label] = str(e)
            continue
        right = err is not None and err < tol
        row["tilings"][label] = {"variant": name, "tiling": str(tiling), "us": us,
                                 "tflops": flops / us / 1e6, "rel_err": err, "right": right,
                                 "seconds": time.perf_counter() - t0}
        checked = "not checked (a ceiling)" if err is None else \
            f"rel err {err:.1e}{'' if right else ' WRONG'}"
        log(f"{M}x{N}x{K} {layout} {label}: {us:.1f} us, {flops / us / 1e6:.1f} TFLOP/s, "
            f"{checked}")
    _log_fastest(row, log)
    if peer is not None:
        row["ort_webgpu"] = _ort_row(peer, problem, log)
    problem.release()
    return row


def _ort_row(peer, problem: _Problem, log) -> dict:
    """ORT WebGPU's fp16 product of ``problem``'s inputs (bench_peers.gemm), or
    why there is none (``peer`` a line: gemm_main said it once)."""
    if isinstance(peer, str):
        return {"why": peer}
    M, N, K = problem.shape
    shape = f"{M}x{N}x{K} {problem.layout}"
    try:
        row = bench_peers.gemm(peer, problem.a, problem.b, problem.layout)
    except Exception as e:  # ORT's errors are its own classes; one shape failing ends nothing
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log(f"{shape} ORT WebGPU fp16: failed: {why}")
        return {"why": why}
    log(f"{shape} ORT WebGPU fp16: {row['us']:.1f} us, {row['tflops']:.1f} TFLOP/s, "
        f"rel err {row['rel_err']:.1e}{'' if row['right'] else ' WRONG'} (f16 sums)")
    return row


def _log_fastest(row: dict, log) -> None:
    """The fastest right variant of ``row`` beside the rule's choice and torch.mm."""
    timed = row["tilings"]
    right = [t for t in timed if timed[t]["right"]]
    M, N, K = row["shape"]
    shape = f"{M}x{N}x{K} {row['layout']}"
    if right:
        best = max(right, key=lambda t: timed[t]["tflops"])
        rule = next((t for t in right if timed[t]["variant"] == "rule"), None)
        versus = f", {timed[best]['tflops'] / timed[rule]['tflops']:.2f}x the rule's" \
            if rule else ", the rule's tiling failed"
        log(f"{shape} fastest: {best}, {timed[best]['tflops']:.1f} TFLOP/s{versus}")
    if row["torch_mm_us"]:
        log(f"{shape} torch.mm fp16: {row['torch_mm_us']:.1f} us, "
            f"{2 * M * N * K / row['torch_mm_us'] / 1e6:.1f} TFLOP/s")


def parse_shapes(text: str) -> tuple:
    """``--gemm``'s value: "issue" (ISSUE_SHAPES), or comma-separated squares
    ("4096", plain) and products ("4096x576x576": tokens x out x in, linear)."""
    if text == "issue":
        return ISSUE_SHAPES
    out = []
    for item in text.split(","):
        dims = [int(v) for v in item.split("x")]
        if len(dims) == 1:
            out.append((dims[0], dims[0], dims[0], "plain"))
        elif len(dims) == 3:
            out.append((*dims, "linear"))
        else:
            raise ValueError(f"--gemm: expected 'issue', sizes (4096) or MxNxK products "
                             f"(4096x576x576), got {item!r}")
    return tuple(out)


def gemm_main(out_dir: str, shapes, log) -> int:
    device = get_device()
    if CONFIG not in device.subgroup_matrix_configs:
        log(f"{device.name} ({device.backend}) has no {CONFIG} subgroup matrices "
            f"(Dawn on a GPU with matrix units: SHADERDSL_WGPU=dawn)")
        return 1
    toggles = os.environ.get("SHADERDSL_DAWN_TOGGLES")
    peer = bench_peers.start()
    if isinstance(peer, str):
        log(peer)
    log(bench_peers.TINYGRAD_WHY)
    t0 = time.perf_counter()
    # the first case after process start runs slow (idle clocks: optimisation notes 16,
    # 27): the first shape's first variant once, unrecorded
    M, N, K, layout = shapes[0]
    gemm_case(device, shapes[0], lambda *a: None, variants(M, N, K, layout, device.limits)[:1])
    result = {"adapter": device.name, "compiler": COMPILER, "dawn_toggles": toggles,
              "limits": {k: device.limits.get(k) for k in H200_LIMITS},
              "peers": {"ort_webgpu": peer if isinstance(peer, str) else peer.ort.__version__,
                        "tinygrad": bench_peers.TINYGRAD_WHY},
              "rows": [gemm_case(device, shape, log, peer=peer) for shape in shapes]}
    result["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"gemm-{COMPILER}.json"), "w") as f:
        json.dump(result, f, indent=1)
    log(f"gemm: {len(shapes)} shapes in {result['seconds']:.0f} s")
    return 0
