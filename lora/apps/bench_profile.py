"""``python -m lora bench --profile``: where a forward's time goes, on this GPU.

For each case (rank, token count, dtype; in = out = 2560) every strategy
listed is timed whole (GPU timestamps, as in ``lora.apps.bench``) and by parts:
each dispatch of a multi-dispatch plan alone, and the tiled kernel's two
phases alone (``tile_phase_h``: h only, written out; ``tile_phase_out``: the
output update from a made-up h; both built here from lora.kernels.tiled's
phases, with tiled_forward's parameters and grid). Then the latency of
one forward alone with its read-back, split into its host steps. WebGPU
has no profiler that reaches inside a dispatch, and wgpu does not expose the
driver's register counts, so phase ablations are the finest view there is.
Writes ``profile-<build>.json`` to ``--out``.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

import shaderdsl as sd
from shaderdsl import f32
from shaderdsl.runtime import COMPILER, WGPU_BUILD, get_device

from ..core.forward import forward_plan
from ..core.plan import Step, record_steps
from ..core.tuning import time_plan
from ..core.weight import Weight
from ..kernels import KERNELS
from ..kernels import tiled as tiled_kernels
from ..kernels.common import input_matrix, tile_origin, token_rows, widen
from .bench_train import NUMPY_DTYPES, SCALE

DIM = 2560
CASES = (  # (rank, tokens, dtype, strategies)
    (64, 4096, "f32", ("tiled(threads=512, token_block=4, unroll=False)",
                       "gemm(threads=256, splits=4)", "gemm(threads=256, splits=8)",
                       "gemm(threads=256, tile_tokens=32, splits=8)",
                       "gemm(threads=256, splits=4, block=8)",
                       "gemm(threads=256, splits=8, block=8)")),
    (64, 512, "f32", ("tiled(tile_tokens=4)", "gemm(threads=256, tile_tokens=8, splits=16)",
                      "gemm(splits=16)", "gemm(threads=256, splits=16)", "gemm(splits=8)",
                      "gemm(threads=256, splits=8)", "gemm(splits=16, block=8)")),
    (16, 4096, "f32", ("tiled(threads=512)", "gemm(threads=64, splits=8)", "gemm(splits=8)")),
    (8, 4096, "f32", ("tiled(threads=512, unroll=False)", "tiled(threads=512, quad=True)",
                      "tiled(threads=512, token_block=2, quad=True)",
                      "tiled(token_block=2, quad=True)")),
    (8, 4096, "f16", ("tiled(threads=512, unroll=False)", "tiled(threads=512, quad=True)",
                      "tiled(threads=512, token_block=2, quad=True)",
                      "tiled(token_block=2, quad=True)",
                      "tiled(threads=512, quad=True, half=True)",
                      "tiled(threads=512, token_block=2, quad=True, half=True)")),
    (8, 1, "f32", ("single", "single(threads=512, subgroups=True)")),
)


def tile_phase_h(m, rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                 unroll=True, dtype="f32", token_block=1, save_h=False, quad=False, half=False):
    """tiled_forward's phase 1 alone: h of each tile computed and written out."""
    tiled_kernels.tile_layout(rank, threads, tile_tokens, token_block)
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    x, _ = input_matrix(m, "x", tokens, in_dim, dtype)
    h = m.declare_output_buffer("h", f32, token_rows(tokens, rank))
    n, t0 = tile_origin(m, tokens, tile_tokens)
    hw = tiled_kernels.tile_memory(m, rank, tile_tokens)
    tiled_kernels.phase_h(m, hw, A, x, in_n, n, t0, rank, scale, threads, tile_tokens,
                          token_block, unroll, h, half)


def tile_phase_out(m, rank, in_dim, out_dim, scale, tokens, threads=256, tile_tokens=16,
                   unroll=True, dtype="f32", token_block=1, save_h=False, quad=False, half=False):
    """tiled_forward's phase 2 alone, from a made-up h: scale * A's first elements
    (``half`` shapes phase 1 only)."""
    w = tiled_kernels.tile_layout(rank, threads, tile_tokens, token_block)[0]
    A, in_n = input_matrix(m, "A", rank, in_dim, dtype)
    Bm, out = tiled_kernels.tile_outputs(m, rank, out_dim, tokens, dtype, quad)
    n, t0 = tile_origin(m, tokens, tile_tokens)
    hw = tiled_kernels.tile_memory(m, rank, tile_tokens)
    with m.loop(m.local_index(), tile_tokens * rank // w, threads, name="j") as j:
        hw[j] = scale * widen(A[j % (rank * in_n // w)])
    m.barrier()
    tiled_kernels.phase_out(m, Bm, out, hw, rank, out_dim, n, tile_tokens, t0, threads, quad,
                            unroll)


PHASES = {"h": tile_phase_h, "out": tile_phase_out}


def phase_step(device, phase: str, params: dict) -> Step:
    """One phase of the tiled_forward step with ``params``, compiled and
    prepared, with tiled_forward's workgroup size and grid."""
    spec = KERNELS["tiled_forward"]
    p = spec.params(**params)
    kernel = sd.compile(PHASES[phase], spec.workgroup(p), name=f"tiled_forward_{phase}", **p)
    device.prepare(kernel)
    grid = spec.grid(**params)
    return Step(kernel, tuple(b.name for b in kernel.bindings),
                grid[0] if grid[1:] == (1, 1) else grid)


class _Steps:
    """Some steps of a plan, with the ``record`` the timers call."""

    def __init__(self, device, steps, buffers):
        self.device, self.steps, self.buffers = device, steps, buffers

    def record(self, x_buf, out_buf):
        record_steps(self.device, self.steps, self.buffers)


def _problem(device, rank, tokens, dtype):
    rng = np.random.default_rng(rank * 7 + tokens)
    npdt = NUMPY_DTYPES[dtype]
    a = (rng.standard_normal((rank, DIM)) / np.sqrt(DIM)).astype(npdt)
    b = rng.standard_normal((DIM, rank)).astype(npdt)
    weight = Weight.from_numpy(device, a, b, dtype=npdt)
    x = device.buffer(rng.standard_normal((tokens, DIM)).astype(npdt))
    out = device.buffer(rng.standard_normal((tokens, DIM)).astype(npdt))
    return weight, x, out


def _parts(device, plan, x, out, tokens) -> dict:
    """Microseconds of each dispatch alone, and of the tiled kernel's phases."""
    buffers = {**plan.bound, "x": x, "output": out, **plan.scratch}
    parts = {}
    if plan.dispatches > 1:
        for i, step in enumerate(plan.steps):
            parts[f"{i}:{step.kernel.name}"] = time_plan(
                device, _Steps(device, [step], buffers), x, out, 20, repeats=3)
    if plan.strategy.name == "tiled":
        w = plan.weight
        (_, params), = plan.strategy.kernels(w.layer_shape(tokens, SCALE))
        h = device.empty((tokens, w.rank), np.float32)  # phase h writes it
        for phase in PHASES:
            steps = [phase_step(device, phase, params)]
            parts[f"phase {phase}"] = time_plan(
                device, _Steps(device, steps, dict(buffers, h=h)), x, out, 20, repeats=3)
        device.release(h)
    return parts


def profile_case(device, rank, tokens, dtype, strategies, log) -> dict:
    weight, x, out = _problem(device, rank, tokens, dtype)
    row = {"rank": rank, "tokens": tokens, "dtype": dtype, "in_dim": DIM, "out_dim": DIM,
           "strategies": {}}
    for text in strategies:
        try:
            plan = forward_plan(device, weight, SCALE, tokens, text)
        except Exception as e:  # over this device's limits: say so, go on
            row["strategies"][text] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {text}: {type(e).__name__}: {e}")
            continue
        entry = {"us": time_plan(device, plan, x, out, 20)}
        entry.update(_parts(device, plan, x, out, tokens))
        row["strategies"][text] = entry
        plan.release()
        log(f"{dtype} r={rank} T={tokens} {text}: " +
            ", ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    for buf in (x, out, weight.a, weight.b):
        device.release(buf)
    return row


def read_latency(device, log, repeats: int = 200) -> dict:
    """Wall microseconds (median) of one T = 1 forward with its read-back, and
    of the pieces: recording and submitting it, a read alone of an idle buffer,
    and waiting for the queue."""
    weight, x, out = _problem(device, 8, 1, "f32")
    plan = forward_plan(device, weight, SCALE, 1, "single")

    def median(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def alone_read(read):
        def run():
            with device.batch():
                plan.record(x, out)
                read(out)
        return run

    def submit_sync():
        plan.record(x, out)
        device.sync()

    res = {"forward + read": median(alone_read(device.read)),
           "forward + read (map_sync)": median(alone_read(lambda b: _read_map_sync(device, b))),
           "read alone": median(lambda: device.read(out)),
           "read alone (map_sync)": median(lambda: _read_map_sync(device, out)),
           "forward + sync": median(submit_sync), "sync alone": median(device.sync),
           "record + submit": median(lambda: plan.record(x, out))}
    device.sync()
    log("read-back (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    for buf in (x, out, weight.a, weight.b):
        device.release(buf)
    return res


def _read_map_sync(device, buf):
    """device.read as it was before readback.map_read: wgpu-py's map_sync."""
    import wgpu
    size = buf._wgpu_buffer.size
    staging = device._staging_for(size)
    device._recorder.copy(buf._wgpu_buffer, staging, size)
    device._recorder.flush()
    staging.map_sync(wgpu.MapMode.READ, 0, size)
    try:
        raw = staging.read_mapped(0, size)
    finally:
        staging.unmap()
    return np.frombuffer(raw, buf.dtype, count=buf.size).reshape(buf.shape)


def profile_main(out_dir: str, dispatch_floor, log=print) -> dict:
    """Every case of CASES and the read-back; ``dispatch_floor(device)`` is
    lora.apps.bench's (passed in: lora.apps.bench calls this module)."""
    device = get_device()
    result = {"adapter": device.name, "backend": device.backend, "build": WGPU_BUILD,
              "compiler": COMPILER, "floor_us": dispatch_floor(device), "cases": []}
    log(f"{device.name} ({device.backend}), {WGPU_BUILD}: dispatch floor "
        f"{result['floor_us']:.2f} us")
    path = os.path.join(out_dir, f"profile-{COMPILER}.json")
    os.makedirs(out_dir, exist_ok=True)
    result["read"] = read_latency(device, log)
    for rank, tokens, dtype, strategies in CASES:
        if dtype == "f16" and not device.has_feature("shader-f16"):
            log(f"f16 cases skipped: {device.name!r} lacks shader-f16")
            continue
        result["cases"].append(profile_case(device, rank, tokens, dtype, strategies, log))
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result
