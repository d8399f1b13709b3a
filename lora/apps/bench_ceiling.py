"""``python -m lora bench --ceiling``: what the hardware gives a WGSL kernel,
measured before any kernel is tuned against it.

- **copy**: dst = src over 256 MiB, vec4<f32> accesses, at several workgroup
  sizes and vec4s per thread (all of a thread's loads issued before its
  stores); beside ``torch``'s ``copy_`` in a CUDA graph where torch has CUDA.
  The fastest is the bandwidth yardstick of the memory-bound forwards.
- **fragments** (f16 16x16x16 subgroup matrices, where the adapter has them):
  a copy through fragments (storage -> fragment -> storage), fragment loads
  from storage alone and from workgroup memory alone (each load feeds one
  multiply so it is not dropped), a multiply-only loop on fragments held in
  registers (the matrix units' ceiling), and a GEMM whose subgroups load
  their fragments straight from storage beside the staged ``tiled_product``.

Each kernel's output is checked (a copy equals its source, the sums equal
their float64 value) before its time counts. Robustness is a Dawn instance
toggle, so one process measures one setting; the JSON names the toggles, and
the H200 sweep runs the command once per setting (docs/benchmarks.md,
"Ceilings")."""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from shaderdsl import builtins as B
from shaderdsl import compile as compile_kernel
from shaderdsl import f16, f32, vec4f
from shaderdsl.matmul import MatrixTiling, gemm
from shaderdsl.runtime import COMPILER, get_device
from shaderdsl.types import MatrixConfig

from ..core.tuning import median_us
from .bench_train import optional_torch

CONFIG = MatrixConfig("f16", "f32", 16, 16, 16)
COPY_SHAPES = ((256, 1), (256, 2), (256, 4), (512, 2), (1024, 1), (128, 8))  # threads, vec4s
FRAGMENT_BYTES = CONFIG.m * CONFIG.k * 2  # one f16 16x16 fragment
SUBGROUPS = 4  # per workgroup in the fragment kernels
# copy MiB; the f16 matrix the fragment kernels move; multiply-adds per loop; workgroups of the
# loops (the H200's 132 SMs x 16); the GEMMs' size
CEILING_SIZES = {"mib": 256, "rows": 4096, "cols": 8192, "loops": 256, "groups": 132 * 16,
                 "gemm": 4096}


def batch_us(device, kernel, bufs, grid) -> float:
    """Median microseconds per dispatch of ``kernel`` (tuning.median_us)."""
    return median_us(device, lambda: device.dispatch(kernel, bufs, grid), 2)


def grid_of(groups: int) -> tuple[int, int, int]:
    """A 2-D grid of ``groups`` workgroups (x at most 65535)."""
    gx = min(groups, 32768)
    return (gx, -(-groups // gx), 1)


def group_index(m):
    """The linear workgroup index of a grid_of grid."""
    wg = m.workgroup_id()
    return m.let(wg.x + wg.y * m.num_workgroups().x, "group")


# ------------------------------------------------------------------ kernels

def copy_kernel(m, n4, threads, per):
    """dst = src, ``per`` vec4s a thread, ``threads`` apart (each load
    coalesced over the workgroup); all loads, then all stores. n4 is a
    multiple of threads * per."""
    src = m.declare_input_buffer("src", vec4f, n4)
    dst = m.declare_output_buffer("dst", vec4f, n4)
    base = m.let(group_index(m) * (threads * per) + m.local_index(), "base")
    values = [m.let(src[base + q * threads], f"v{q}") for q in range(per)]
    for q, v in enumerate(values):
        dst[base + q * threads] = v


def fragment_copy(m, rows, cols, per, sized=True):
    """dst = src (f16, rows x cols) through left fragments: each subgroup moves
    ``per`` fragments side by side. ``sized``: the arrays declared with their
    length (Tint clamps every access), else runtime-sized (Dawn on Vulkan leaves
    those to the driver's robust buffer access)."""
    left_t = CONFIG.types()[0]
    n = rows * cols if sized else None
    src = m.declare_input_buffer("src", f16, n)
    dst = m.declare_output_buffer("dst", f16, n)
    origin = _fragment_origin(m, cols, per)
    values = [m.let(B.subgroup_matrix_load(left_t, src, origin + q * CONFIG.k, cols), f"f{q}")
              for q in range(per)]
    for q, v in enumerate(values):
        B.subgroup_matrix_store(dst, origin + q * CONFIG.k, v, cols)


def _fragment_origin(m, cols, per):
    """This subgroup's first element: subgroups tile the matrix in row-major
    order of (16 x 16 * per) blocks."""
    sg = m.let(group_index(m) * SUBGROUPS + m.local_index() / CONFIG.subgroup_sizes[0], "sg")
    per_row = cols // (CONFIG.k * per)
    return m.let(sg / per_row * (CONFIG.m * cols) + sg % per_row * (CONFIG.k * per), "origin")


def fragment_loads(m, rows, cols, per, sized=True):
    """Every f16 fragment of src (rows x cols) loaded once from storage, each
    multiplied by a fragment of ones into one sum per subgroup, stored at the
    end (the loads are the cost); ``sized`` as in fragment_copy."""
    left_t, right_t, result_t = CONFIG.types()
    src = m.declare_input_buffer("src", f16, rows * cols if sized else None)
    ones = m.declare_input_buffer("ones", f16, CONFIG.k * CONFIG.n)
    sums = m.declare_output_buffer("sums", f32, rows * cols // (CONFIG.k * per) * CONFIG.n)
    origin = _fragment_origin(m, cols, per)
    right = m.let(B.subgroup_matrix_load(right_t, ones, 0, CONFIG.n), "right")
    acc = m.var(result_t, name="acc")
    for q in range(per):
        left = m.let(B.subgroup_matrix_load(left_t, src, origin + q * CONFIG.k, cols), f"f{q}")
        m.assign(acc, B.subgroup_matrix_multiply_accumulate(left, right, acc))
    sg = m.let(group_index(m) * SUBGROUPS + m.local_index() / CONFIG.subgroup_sizes[0], "at")
    B.subgroup_matrix_store(sums, sg * (CONFIG.m * CONFIG.n), acc, CONFIG.n)


def shared_loads(m, loops, tiles):
    """Each subgroup loads ``tiles`` fragments from workgroup memory ``loops``
    times, each into one multiply-add: the workgroup-memory fragment rate."""
    left_t, right_t, result_t = CONFIG.types()
    ones = m.declare_input_buffer("ones", f16, CONFIG.k * CONFIG.n)
    sums = m.declare_output_buffer("sums", f32)
    stride = CONFIG.k * tiles + 8
    stage = m.shared(f16, CONFIG.m * stride, "stage")
    with m.loop(m.local_index(), CONFIG.m * stride, SUBGROUPS * CONFIG.subgroup_sizes[0],
                name="i") as i:
        stage[i] = f16(1.0)
    m.barrier()
    right = m.let(B.subgroup_matrix_load(right_t, ones, 0, CONFIG.n), "right")
    acc = m.var(result_t, name="acc")
    with m.loop(loops, name="it"):
        for q in range(tiles):
            left = B.subgroup_matrix_load(left_t, stage, q * CONFIG.k, stride)
            m.assign(acc, B.subgroup_matrix_multiply_accumulate(left, right, acc))
    sg = m.let(group_index(m) * SUBGROUPS + m.local_index() / CONFIG.subgroup_sizes[0], "at")
    B.subgroup_matrix_store(sums, sg * (CONFIG.m * CONFIG.n), acc, CONFIG.n)


def multiply_only(m, loops, frags):
    """``frags`` x ``frags`` accumulators per subgroup, multiplied ``loops``
    times by fragments held in registers: the matrix units alone."""
    left_t, right_t, result_t = CONFIG.types()
    ones = m.declare_input_buffer("ones", f16, CONFIG.k * CONFIG.n)
    sums = m.declare_output_buffer("sums", f32)
    left = m.let(B.subgroup_matrix_load(left_t, ones, 0, CONFIG.k), "left")
    right = m.let(B.subgroup_matrix_load(right_t, ones, 0, CONFIG.n), "right")
    accs = [m.var(result_t, name=f"acc{i}") for i in range(frags * frags)]
    with m.loop(loops, name="it"):
        for acc in accs:
            m.assign(acc, B.subgroup_matrix_multiply_accumulate(left, right, acc))
    sg = m.let(group_index(m) * SUBGROUPS + m.local_index() / CONFIG.subgroup_sizes[0], "at")
    for i, acc in enumerate(accs):
        B.subgroup_matrix_store(sums, (sg * len(accs) + i) * (CONFIG.m * CONFIG.n), acc,
                                CONFIG.n)


def direct_gemm(m, size, frags, sized=True):
    """C = A @ B (f16 size x size, f32 C), every fragment loaded straight from
    storage: each subgroup owns frags x frags result fragments, the workgroup
    a 2 x 2 block of subgroups; ``sized`` as in fragment_copy."""
    left_t, right_t, result_t = CONFIG.types()
    n = size * size if sized else None
    A = m.declare_input_buffer("A", f16, n)
    Bm = m.declare_input_buffer("B", f16, n)
    C = m.declare_output_buffer("C", f32, n)
    sg = m.let(m.local_index() / CONFIG.subgroup_sizes[0], "sg")
    span = frags * CONFIG.m
    row0 = m.let((m.workgroup_id().y * 2 + sg / 2) * span, "row0")
    col0 = m.let((m.workgroup_id().x * 2 + sg % 2) * span, "col0")
    accs = [[m.var(result_t, name=f"acc{i}_{j}") for j in range(frags)] for i in range(frags)]
    with m.loop(0, size, CONFIG.k, name="k") as k:
        lefts = [m.let(B.subgroup_matrix_load(left_t, A, (row0 + i * CONFIG.m) * size + k, size),
                       f"l{i}") for i in range(frags)]
        rights = [m.let(B.subgroup_matrix_load(right_t, Bm, k * size + col0 + j * CONFIG.n, size),
                        f"r{j}") for j in range(frags)]
        for i in range(frags):
            for j in range(frags):
                m.assign(accs[i][j], B.subgroup_matrix_multiply_accumulate(
                    lefts[i], rights[j], accs[i][j]))
    for i in range(frags):
        for j in range(frags):
            B.subgroup_matrix_store(C, (row0 + i * CONFIG.m) * size + col0 + j * CONFIG.n,
                                    accs[i][j], size)


# ------------------------------------------------------------------ measurements

def copy_rows(device, mib: float, log) -> list[dict]:
    """Each COPY_SHAPES copy of ``mib`` MiB: GB/s (read + write), checked."""
    n4 = int(mib * (1 << 20)) // 16
    src = device.buffer(np.arange(n4 * 4, dtype=np.float32))
    dst = device.empty(n4 * 4, np.float32)
    rows = []
    cap = device.limits.get("max-compute-invocations-per-workgroup", 256)
    for threads, per in COPY_SHAPES:
        if threads > cap:
            log(f"  copy, {threads} threads: over this device's {cap} invocations a workgroup")
            continue
        kernel = compile_kernel(copy_kernel, threads, n4=n4, threads=threads, per=per)
        device.write(dst, np.zeros(n4 * 4, np.float32))
        us = batch_us(device, kernel, {"src": src, "dst": dst}, grid_of(n4 // (threads * per)))
        ok = bool(np.array_equal(device.read(dst), np.arange(n4 * 4, dtype=np.float32)))
        rows.append({"kernel": f"copy threads={threads} vec4s={per}", "us": us,
                     "gbps": 2 * src.nbytes / us / 1e3, "checked": ok})
        log(f"  copy {mib} MiB, {threads} threads x {per} vec4: {rows[-1]['gbps']:.0f} GB/s"
            f"{'' if ok else '  WRONG'}")
    device.release(src)
    device.release(dst)
    return rows


def copy_bandwidth(device, mib: int, warm_up_s: float = 0.0) -> float:
    """GB/s (read + write) of a vec4 copy over ``mib`` MiB (copy_kernel: a
    grid of exactly the work, no bounds test; the earlier kernel's 65535 x 3
    grid left a third of its workgroups idle and measured 12 % less on the
    H200, docs/benchmarks.md "Ceilings"), after ``warm_up_s`` seconds of
    copies (an idle GPU's clocks take a while to rise: optimisation notes 16
    and 27)."""
    n4 = mib * (1 << 20) // 16
    k = compile_kernel(copy_kernel, 256, n4=n4, threads=256, per=1)
    src = device.buffer(np.ones(n4 * 4, np.float32))
    dst = device.empty(n4 * 4, np.float32)
    grid = grid_of(n4 // 256)
    until = time.perf_counter() + warm_up_s
    while time.perf_counter() < until:
        batch_us(device, k, [src, dst], grid)
    gbps = 2 * src.nbytes / batch_us(device, k, [src, dst], grid) / 1e3
    device.release(src)
    device.release(dst)
    return gbps


def torch_copy_gbps(mib: float) -> float | None:
    """torch's copy_ of ``mib`` MiB in a CUDA graph (None without CUDA)."""
    torch = optional_torch()
    if torch is None or not torch.cuda.is_available():
        return None
    src = torch.ones(int(mib * (1 << 18)), device="cuda")  # float32s
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            dst.copy_(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            dst.copy_(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return 2 * src.nbytes / statistics.median(times) / 1e3


def fragment_rows(device, sizes: dict, log) -> list[dict]:
    """The fragment kernels at ``sizes`` (CEILING_SIZES' keys), each checked;
    GB/s or TFLOP/s."""
    rows, cols, loops, groups = sizes["rows"], sizes["cols"], sizes["loops"], sizes["groups"]
    rng = np.random.default_rng(0)
    data = rng.standard_normal((rows, cols)).astype(np.float16)
    ones = device.buffer(np.ones(CONFIG.k * CONFIG.n, np.float16))
    src = device.buffer(data)
    out = []
    for per in (1, 4):
        for sized in (True, False):
            out.append(_fragment_copy_row(device, src, data, per, sized, log))
            out.append(_fragment_load_row(device, src, ones, data, per, sized, log))
    for tiles in (1, 4):
        out.append(_shared_row(device, ones, loops, groups, tiles, log))
    for frags in (1, 2, 4):
        out.append(_multiply_row(device, ones, loops, groups, frags, log))
    out += _gemm_rows(device, sizes["gemm"], log)
    for buf in (ones, src):
        device.release(buf)
    return out


def _arrays(sized: bool) -> str:
    return "sized arrays" if sized else "runtime-sized arrays"


def _fragment_copy_row(device, src, data, per, sized, log) -> dict:
    rows, cols = data.shape
    kernel = compile_kernel(fragment_copy, SUBGROUPS * CONFIG.subgroup_sizes[0], rows=rows,
                            cols=cols, per=per, sized=sized)
    dst = device.empty(data.size, np.float16)
    us = batch_us(device, kernel, {"src": src, "dst": dst},
                  grid_of(data.size // (FRAGMENT_BYTES // 2 * per * SUBGROUPS)))
    ok = bool(np.array_equal(device.read(dst).reshape(data.shape), data))
    device.release(dst)
    return _row(log, f"fragment copy, storage, {per} per subgroup, {_arrays(sized)}", us,
                gbps=2 * data.nbytes, checked=ok)


def _fragment_load_row(device, src, ones, data, per, sized, log) -> dict:
    rows, cols = data.shape
    kernel = compile_kernel(fragment_loads, SUBGROUPS * CONFIG.subgroup_sizes[0], rows=rows,
                            cols=cols, per=per, sized=sized)
    blocks = data.size // (CONFIG.m * CONFIG.k * per)
    sums = device.empty(blocks * CONFIG.m * CONFIG.n, np.float32)
    us = batch_us(device, kernel, {"src": src, "ones": ones, "sums": sums},
                  grid_of(blocks // SUBGROUPS))
    got = device.read(sums).reshape(blocks, CONFIG.m, CONFIG.n)[:, :, 0]
    want = data.astype(np.float64).reshape(rows // CONFIG.m, CONFIG.m, cols // (CONFIG.k * per),
                                           CONFIG.k * per).sum(axis=3)
    want = want.transpose(0, 2, 1).reshape(blocks, CONFIG.m)
    ok = bool(np.allclose(got, want, rtol=1e-3, atol=1e-3 * per))
    device.release(sums)
    return _row(log, f"fragment loads, storage, {per} per subgroup, {_arrays(sized)}", us,
                gbps=data.nbytes, checked=ok)


def _shared_row(device, ones, loops, groups, tiles, log) -> dict:
    kernel = compile_kernel(shared_loads, SUBGROUPS * CONFIG.subgroup_sizes[0], loops=loops,
                            tiles=tiles)
    sums = device.empty(groups * SUBGROUPS * CONFIG.m * CONFIG.n, np.float32)
    us = batch_us(device, kernel, {"ones": ones, "sums": sums}, grid_of(groups))
    ok = bool(np.all(device.read(sums) == CONFIG.k * loops * tiles))
    device.release(sums)
    loads = groups * SUBGROUPS * loops * tiles
    return _row(log, f"fragment loads, workgroup memory, {tiles} tiles", us,
                gbps=loads * FRAGMENT_BYTES, tflops=loads * 2 * CONFIG.m * CONFIG.n * CONFIG.k,
                checked=ok)


def _multiply_row(device, ones, loops, groups, frags, log) -> dict:
    kernel = compile_kernel(multiply_only, SUBGROUPS * CONFIG.subgroup_sizes[0], loops=loops,
                            frags=frags)
    cells = groups * SUBGROUPS * frags * frags * CONFIG.m * CONFIG.n
    sums = device.empty(cells, np.float32)
    us = batch_us(device, kernel, {"ones": ones, "sums": sums}, grid_of(groups))
    ok = bool(np.all(device.read(sums) == CONFIG.k * loops))
    device.release(sums)
    flops = cells * 2 * CONFIG.k * loops
    return _row(log, f"multiply only, {frags}x{frags} accumulators", us, tflops=flops, checked=ok)


def _gemm_rows(device, size, log) -> list[dict]:
    """The direct GEMM beside the staged tiled_product one, size^3, checked on
    64 rows against float64."""
    rng = np.random.default_rng(size)
    a, b = (rng.standard_normal((size, size)).astype(np.float16) for _ in range(2))
    bufs = {"A": device.buffer(a), "B": device.buffer(b),
            "C": device.empty(size * size, np.float32)}
    want = a[:64].astype(np.float64) @ b.astype(np.float64)
    cases = [(f"GEMM direct from storage, 2x2 subgroups x {f}x{f} fragments, {_arrays(sized)}",
              compile_kernel(direct_gemm, 4 * CONFIG.subgroup_sizes[0], size=size, frags=f,
                             sized=sized),
              (size // (2 * f * CONFIG.n), size // (2 * f * CONFIG.m), 1))
             for f in (2, 4) for sized in (True, False) if size % (2 * f * CONFIG.m) == 0]
    tiling = MatrixTiling(CONFIG, (2, 2), (2, 4), 32)
    cases.append((f"GEMM staged ({tiling})",
                  compile_kernel(gemm, tiling.threads, M=size, N=size, K=size, tiling=tiling),
                  tiling.grid(size, size)))
    out = []
    for name, kernel, grid in cases:
        us = batch_us(device, kernel, bufs, grid)
        got = device.read(bufs["C"]).reshape(size, size)[:64]
        err = float(np.abs(got - want).max() / np.abs(want).max())
        out.append(_row(log, f"{name}, {size}^3", us, tflops=2 * size**3, checked=err < 1e-2))
    for buf in bufs.values():
        device.release(buf)
    return out


def _row(log, kernel: str, us: float, gbps: float = 0, tflops: float = 0,
         checked: bool = True) -> dict:
    """A result row from bytes moved and flops done in ``us``."""
    row = {"kernel": kernel, "us": us, "checked": checked}
    if gbps:
        row["gbps"] = gbps / us / 1e3
    if tflops:
        row["tflops"] = tflops / us / 1e6
    rates = ([f"{row['gbps']:.0f} GB/s"] if gbps else []) + \
        ([f"{row['tflops']:.1f} TFLOP/s"] if tflops else [])
    log(f"  {kernel}: {us:.1f} us, {', '.join(rates)}{'' if checked else '  WRONG'}")
    return row


def robustness_label() -> str:
    """Which robustness the Dawn toggles of this process give (naga: its own)."""
    if COMPILER != "tint":
        return "naga"
    from shaderdsl.runtime.wgpu_build import DAWN_TOGGLES
    if "disable_robustness" in DAWN_TOGGLES:
        return "off"
    return "range" if "enable_integer_range_analysis_in_robustness" in DAWN_TOGGLES else "on"


def ceiling_main(out_dir: str, log, sizes: dict = CEILING_SIZES, device=None) -> int:
    """Every ceiling on ``device`` (default: the runtime's) at ``sizes``; writes
    ceiling-<compiler>-<robustness>.json; 1 where a kernel's output was wrong."""
    device = device or get_device()
    mib = sizes["mib"]
    label = robustness_label()
    log(f"ceilings on {device.name} ({COMPILER}, robustness {label})")
    result = {"adapter": device.name, "compiler": COMPILER, "robustness": label,
              "copy": copy_rows(device, mib, log), "torch_copy_gbps": torch_copy_gbps(mib)}
    if result["torch_copy_gbps"]:
        log(f"  torch copy_ {mib} MiB (CUDA graph): {result['torch_copy_gbps']:.0f} GB/s")
    if CONFIG in device.subgroup_matrix_configs:
        result["fragments"] = fragment_rows(device, sizes, log)
    else:
        log(f"  no {CONFIG} subgroup matrices here: fragment rows left out")
    with open(os.path.join(out_dir, f"ceiling-{COMPILER}-{label}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r["checked"] for r in result["copy"] + result.get("fragments", [])) else 1
