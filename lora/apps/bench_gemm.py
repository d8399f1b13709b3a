"""``python -m lora bench --gemm``: the matrix-unit GEMM (shaderdsl.matmul.gemm,
f16 in, f32 sums) at several tilings beside ``torch.mm`` in fp16, square
sizes; where the adapter has no f16 -> f32 16x16x16 subgroup matrices it
says so and stops."""
from __future__ import annotations

import json
import os
import statistics

import numpy as np

from shaderdsl import compile as compile_kernel
from shaderdsl.errors import DispatchError, WGSLCompileError
from shaderdsl.matmul import MatrixTiling, gemm
from shaderdsl.runtime import COMPILER, get_device
from shaderdsl.types import MatrixConfig

from .bench_ceiling import batch_us
from .bench_train import optional_torch

CONFIG = MatrixConfig("f16", "f32", 16, 16, 16)


def _tiling(subgroups, fragments, k_step, **kw) -> MatrixTiling:
    return MatrixTiling(CONFIG, subgroups, fragments, k_step, **kw)


# The first six: the tilings of 2026-12-04 (4x2 x 2x4, k_step 32: 155.9 TFLOP/s at 4096^3,
# 158.5 grouped); the rest: optimisation note 40's variants of the staged pipeline, each
# within the H200's 48 KiB of workgroup memory (tests/test_matmul.py checks)
TILINGS = (_tiling((2, 2), (2, 2), 16), _tiling((2, 2), (2, 4), 32), _tiling((2, 2), (4, 4), 32),
           _tiling((4, 2), (2, 4), 32), _tiling((2, 2), (4, 4), 32, group=8),
           _tiling((4, 2), (2, 4), 32, group=8),
           # 16-byte reads (half the global load instructions and their bounds math)
           _tiling((4, 2), (2, 4), 32, read_width=8),
           _tiling((4, 2), (2, 4), 32, group=8, read_width=8),
           _tiling((2, 2), (4, 4), 32, read_width=8),
           # the step: shallower (half the workgroup memory and prefetch registers) and deeper
           _tiling((4, 2), (2, 4), 16), _tiling((4, 2), (2, 4), 16, read_width=8),
           _tiling((4, 2), (2, 4), 64, stages=1),
           _tiling((4, 2), (2, 4), 64, stages=1, read_width=8),
           _tiling((2, 2), (2, 2), 64),
           # 16 accumulators per subgroup in 256 x 128 and 128 x 256 blocks
           _tiling((4, 2), (4, 4), 16), _tiling((4, 2), (4, 4), 16, read_width=8),
           _tiling((4, 2), (4, 4), 32, stages=1, read_width=8),
           _tiling((2, 4), (4, 4), 16, read_width=8),
           _tiling((2, 4), (4, 4), 32, stages=1, read_width=8),
           # no edge tests (sizes of whole blocks and steps)
           _tiling((4, 2), (2, 4), 32, exact=True),
           _tiling((4, 2), (2, 4), 32, read_width=8, exact=True),
           _tiling((4, 2), (2, 4), 32, group=8, read_width=8, exact=True),
           _tiling((4, 2), (4, 4), 32, stages=1, read_width=8, exact=True))


def torch_mm_us(size: int) -> float | None:
    torch = optional_torch()
    if torch is None:
        return None
    if not torch.cuda.is_available():
        return None
    x, y = (torch.randn(size, size, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(5):
        torch.mm(x, y)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            torch.mm(x, y)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(times)


def gemm_case(device, size: int, log, tilings=TILINGS) -> dict:
    """``size``^3 at each of ``tilings`` (MatrixTilings), checked on 64 rows."""
    rng = np.random.default_rng(size)
    a, b = (rng.standard_normal((size, size)).astype(np.float16) for _ in range(2))
    # the factors as each read width binds them: vec4<f16>, or the same bytes as vec4<u32>
    inputs = {4: {"A": device.buffer(a), "B": device.buffer(b)}}
    inputs[8] = inputs[4]
    out = device.empty(size * size, np.float32)
    cleared = np.full(size * size, np.nan, np.float32)  # so a row nothing wrote fails its check
    row = {"size": size, "tilings": {}, "refused": {}, "torch_mm_us": torch_mm_us(size)}
    check = slice(0, 64)  # rows checked against float64 (the whole product is slow in numpy)
    want = a[check].astype(np.float64) @ b.astype(np.float64)
    for tiling in tilings:
        if tiling.exact and not tiling.whole(size, size, size):
            log(f"  {tiling}: {size}^3 is no whole number of its blocks and steps")
            continue
        kernel = compile_kernel(gemm, tiling.threads, M=size, N=size, K=size, tiling=tiling)
        bufs = {**inputs[tiling.read_width], "C": out}
        device.write(out, cleared)
        try:
            us = batch_us(device, kernel, bufs, tiling.grid(size, size))
        except (DispatchError, WGSLCompileError) as e:  # over a limit, or Tint refused it
            log(f"  {tiling}: {e}")
            row["refused"][str(tiling)] = str(e)
            continue
        got = device.read(out).reshape(size, size)[check]
        err = float(np.abs(got - want).max() / np.abs(want).max())  # NaN: a row not written
        row["tilings"][str(tiling)] = {"us": us, "tflops": 2 * size**3 / us / 1e6, "rel_err": err}
        wrong = "" if err < 1e-3 else " WRONG"
        log(f"{size}^3 {tiling}: {us:.1f} us, {2 * size**3 / us / 1e6:.1f} TFLOP/s, "
            f"rel err {err:.1e}{wrong}")
    _log_fastest(row, log)
    if row["torch_mm_us"]:
        log(f"{size}^3 torch.mm fp16: {row['torch_mm_us']:.1f} us, "
            f"{2 * size**3 / row['torch_mm_us'] / 1e6:.1f} TFLOP/s")
    for buf in [out, *(buf for bufs in inputs.values() for buf in bufs.values())]:
        device.release(buf)
    return row


def _log_fastest(row: dict, log) -> None:
    """The fastest tiling of ``row`` beside the best of 2026-12-04 (TILINGS[3])."""
    timed = row["tilings"]
    right = [t for t in timed if timed[t]["rel_err"] < 1e-3]
    if not right:
        return
    name = max(right, key=lambda t: timed[t]["tflops"])
    base = timed.get(str(TILINGS[3]))
    versus = f", {timed[name]['tflops'] / base['tflops']:.2f}x {TILINGS[3]}" if base else ""
    log(f"{row['size']}^3 fastest: {name}, {timed[name]['tflops']:.1f} TFLOP/s{versus}")


def gemm_main(out_dir: str, sizes, log) -> int:
    device = get_device()
    if CONFIG not in device.subgroup_matrix_configs:
        log(f"{device.name} ({device.backend}) has no {CONFIG} subgroup matrices "
            f"(Dawn on a GPU with matrix units: SHADERDSL_WGPU=dawn)")
        return 1
    toggles = os.environ.get("SHADERDSL_DAWN_TOGGLES")
    result = {"adapter": device.name, "compiler": COMPILER, "dawn_toggles": toggles,
              "rows": [gemm_case(device, size, log) for size in sizes]}
    with open(os.path.join(out_dir, f"gemm-{COMPILER}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0
