"""What it costs to change a value between dispatches: bake, override, uniform.

A bitonic sort of 2**log2n floats is ``log2n * (log2n + 1) / 2`` passes of one
kernel that differ only in two numbers (k, j); each way of passing them is
timed on the same data:

* ``bake``: k and j are Python parameters, literals in the WGSL: a kernel,
  module and pipeline per pass; one submit.
* ``override``: ``m.override`` constants: one module, a pipeline per pass;
  one submit.
* ``ring``: ``m.declare_uniform``, given plain values per dispatch (the
  uniform ring): one pipeline, one submit.
* ``buffers``: the same kernel, a ``device.uniform`` Buffer per pass made
  beforehand: one pipeline, a bind group per pass, one submit.
* ``rewrite``: the same kernel with one pair of uniform Buffers rewritten by
  ``device.write`` before each pass: one pipeline, a submit per pass.

``first`` is the first sort of each way in the process (compiles included,
drivers' on-disk shader caches off); ``host`` (recording the passes), ``GPU``
(timestamp queries, batched ways) and ``wall`` (record, submit, wait) are
medians over ``--repeats`` warm sorts. Every way checks that it sorted. The
script also times the two ways the ring could bind its slots (a bind group per
offset, or dynamic offsets). Run ``python -m examples.bench_params --help``;
``--out FILE`` writes the JSON, the markdown table goes to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import shaderdsl as sd
from shaderdsl import f32

from .bitonic import WORKGROUP, bitonic, passes

WAYS = ("bake", "override", "ring", "buffers", "rewrite")
# Mesa (lavapipe, llvmpipe) and NVIDIA keep compiled shaders on disk across runs.
DISK_CACHES_OFF = {"MESA_SHADER_CACHE_DISABLE": "true", "__GL_SHADER_DISK_CACHE": "0"}


class Sorter:
    """One way of sorting: ``record(buf)`` issues every pass."""

    def __init__(self, device, way: str, n: int):
        self.device, self.way, self.n = device, way, n
        self.steps = passes(n)
        self.groups = n // WORKGROUP
        how = "uniform" if way in ("ring", "buffers", "rewrite") else way
        # A kernel name per way: no way reuses another's compiled pipeline.
        self.kernel = None if way == "bake" else sd.compile(bitonic, WORKGROUP, how=how,
                                                            name=f"bitonic_{way}")
        self.kernels: dict = {}  # bake: (k, j) -> Kernel, compiled on first use
        self.buffers: dict = {}  # buffers: (k, j) -> (uniform k, uniform j)
        if way == "rewrite":
            self.kb, self.jb = device.uniform(0), device.uniform(0)  # Python int: u32

    def record(self, buf) -> None:
        dev, way, g = self.device, self.way, self.groups
        for k, j in self.steps:
            if way == "ring":
                dev.dispatch(self.kernel, {"data": buf, "k": k, "j": j}, g)
            elif way == "override":
                dev.dispatch(self.kernel, {"data": buf}, g, overrides={"k": k, "j": j})
            elif way == "bake":
                kernel = self.kernels.get((k, j))
                if kernel is None:
                    kernel = self.kernels[k, j] = sd.compile(bitonic, WORKGROUP, how="bake",
                                                             k=k, j=j)
                dev.dispatch(kernel, {"data": buf}, g)
            elif way == "buffers":
                pair = self.buffers.get((k, j))
                if pair is None:
                    pair = self.buffers[k, j] = (dev.uniform(k), dev.uniform(j))
                dev.dispatch(self.kernel, {"data": buf, "k": pair[0], "j": pair[1]}, g)
            else:
                dev.write(self.kb, k)
                dev.write(self.jb, j)
                dev.dispatch(self.kernel, {"data": buf, "k": self.kb, "j": self.jb}, g)


def timed_sort(sorter: Sorter, buf, src) -> dict:
    """Reset ``buf`` from ``src``, then one sort: host and wall seconds, counters."""
    dev = sorter.device
    dev.copy(src, buf)
    dev.sync()
    before = dict(dev.stats)
    t0 = time.perf_counter()
    gpu_ns = None
    if sorter.way == "rewrite":  # outside a batch: each dispatch is its own submit
        sorter.record(buf)
        t1 = time.perf_counter()
    else:
        with dev.batch(timestamps=True) as batch:
            sorter.record(buf)
            t1 = time.perf_counter()
    dev.sync()
    t2 = time.perf_counter()
    if sorter.way != "rewrite":
        gpu_ns = batch.gpu_time_ns  # None without timestamp queries
    grew = {key: dev.stats[key] - before[key] for key in ("modules", "pipelines", "submits")}
    return {"host_s": t1 - t0, "wall_s": t2 - t0, "gpu_ns": gpu_ns, **grew}


def _touch(m):
    data = m.declare_output_buffer("data", f32, 64)
    data[m.global_id().x] = 1.0


def warm_up(device) -> None:
    """Pay the process's one-time costs (the driver's first pipeline, wgpu-py's
    first buffer write parsing C types) before any way is timed."""
    buf = device.buffer(np.zeros(64, np.float32))
    device.write(buf, np.ones(64, np.float32))
    device.dispatch(sd.compile(_touch, 64), {"data": buf}, 1)
    device.copy(buf, device.empty(64, np.float32))
    device.read(buf)


def measure(device, way: str, src_values: np.ndarray, repeats: int) -> dict:
    """The first sort (compiles included, result checked) and ``repeats`` warm ones."""
    n = src_values.size
    src, buf = device.buffer(src_values), device.empty(n, np.float32)
    want = np.sort(src_values)
    t0 = time.perf_counter()
    sorter = Sorter(device, way, n)
    built = time.perf_counter() - t0
    first = timed_sort(sorter, buf, src)
    ok = bool(np.array_equal(device.read(buf), want))
    warm = [timed_sort(sorter, buf, src) for _ in range(repeats)]
    ok = ok and bool(np.array_equal(device.read(buf), want))
    return {"way": way, "sorted": ok, "passes": len(sorter.steps),
            "first_wall_ms": (built + first["wall_s"]) * 1e3,
            "modules_compiled": first["modules"], "pipelines_compiled": first["pipelines"],
            "submits_per_sort": warm[-1]["submits"] if warm else first["submits"],
            "host_ms": statistics.median(w["host_s"] for w in warm) * 1e3,
            "wall_ms": statistics.median(w["wall_s"] for w in warm) * 1e3,
            "gpu_ms": None if warm[0]["gpu_ns"] is None else
            statistics.median(w["gpu_ns"] for w in warm) / 1e6,
            "recompiles_when_warm": sum(w["pipelines"] for w in warm)}


def binding_costs(device, count: int, repeats: int) -> dict:
    """Host cost of the two ways to point dispatch t at its ring slots: a bind
    group per offset (made once, then looked up; the ring's dispatches would
    share the Buffer path's layout) or one bind group and dynamic offsets
    (what the ring does). Raw wgpu calls, the layouts and pipelines of the
    runtime; ``count`` dispatches per recording, medians of ``repeats``."""
    import wgpu

    cache, stride = device._cache, device.uniform_ring.stride
    kernel = sd.compile(bitonic, WORKGROUP, how="uniform", name="bitonic_binding")
    ring = device.wgpu_device.create_buffer(size=2 * count * stride, usage=wgpu.BufferUsage.UNIFORM)
    data = device.empty(WORKGROUP, np.float32)._wgpu_buffer

    def group(layout, k_at: int, j_at: int):
        res = [(data, 0, data.size), (ring, k_at, 16), (ring, j_at, 16)]
        return device.wgpu_device.create_bind_group(layout=layout, entries=[
            {"binding": b, "resource": {"buffer": buf, "offset": off, "size": size}}
            for b, (buf, off, size) in enumerate(res)])

    t0 = time.perf_counter()
    groups = {(t, 0): group(cache.layout(kernel)[0], 2 * t * stride, (2 * t + 1) * stride)
              for t in range(count)}
    create_us = (time.perf_counter() - t0) / count * 1e6
    one = group(cache.layout(kernel, dynamic=True)[0], 0, 0)  # offsets come per dispatch
    pipes = {False: cache.pipeline(kernel, ()), True: cache.pipeline(kernel, (), dynamic=True)}

    def record(dynamic: bool) -> float:
        encoder = device.wgpu_device.create_command_encoder()
        cpass = encoder.begin_compute_pass()
        cpass.set_pipeline(pipes[dynamic])
        t0 = time.perf_counter()
        for t in range(count):
            if dynamic:
                cpass.set_bind_group(0, one, [2 * t * stride, (2 * t + 1) * stride])
            else:
                cpass.set_bind_group(0, groups[t, 0])
            cpass.dispatch_workgroups(1, 1, 1)
        elapsed = time.perf_counter() - t0
        cpass.end()
        device.queue.submit([encoder.finish()])
        return elapsed / count * 1e6

    runs = {dyn: [record(dyn) for _ in range(repeats)] for dyn in (False, True)}
    device.sync()
    return {"bind_group_create_us": create_us,
            "record_group_per_offset_us": statistics.median(runs[False]),
            "record_dynamic_offsets_us": statistics.median(runs[True])}


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def table(report: dict) -> str:
    """The results as a markdown table, under a line naming what ran them."""
    head = (f"Bitonic sort of 2^{report['log2n']} float32 ({report['passes']} passes), "
            f"{report['adapter']} ({report['backend']}, {report['wgpu_build']}), "
            f"{report['date']}; medians of {report['repeats']} warm sorts.\n\n"
            "| way | modules, pipelines compiled | first sort, compiles included (ms) | "
            "host per sort (ms) | GPU per sort (ms) | wall per sort (ms) | submits per sort "
            "| sorted |\n|---|---:|---:|---:|---:|---:|---:|---|\n")
    rows = [f"| {r['way']} | {r['modules_compiled']}, {r['pipelines_compiled']} | "
            f"{r['first_wall_ms']:.1f} | "
            f"{r['host_ms']:.2f} | {_ms(r['gpu_ms'])} | "
            f"{r['wall_ms']:.2f} | {r['submits_per_sort']} | "
            f"{'yes' if r['sorted'] else '**NO**'} |" for r in report["results"]]
    b = report.get("binding")
    tail = "" if not b else (
        f"\nBinding ring slots, per dispatch on the host: a bind group per offset costs "
        f"{b['bind_group_create_us']:.1f} µs to make (once per offset) and "
        f"{b['record_group_per_offset_us']:.2f} µs to record; one bind group with dynamic "
        f"offsets {b['record_dynamic_offsets_us']:.2f} µs to record.\n")
    return head + "\n".join(rows) + "\n" + tail


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.bench_params",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=18, help="sort 2**LOG2N floats (default 18)")
    p.add_argument("--repeats", type=int, default=5, help="warm sorts per way (default 5)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"subset of {','.join(WAYS)}")
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--driver-cache", action="store_true",
                   help="keep the drivers' on-disk shader caches (off by default, so that "
                        "'first' times real compiles)")
    args = p.parse_args(argv)
    args.ways = [w for w in args.ways.split(",") if w]
    bad = sorted(set(args.ways) - set(WAYS))
    if bad or not 8 <= args.log2n <= 26 or args.repeats < 1:
        p.error(f"--ways from {WAYS} (unknown: {bad}), --log2n in 8..26, --repeats >= 1")
    return args


def main(argv=None) -> int:
    from shaderdsl.runtime import WGPU_BUILD, get_device

    args = parse(argv)
    if not args.driver_cache:  # read when the device is made (too late if it already is)
        os.environ.update(DISK_CACHES_OFF)
    dev = get_device()
    warm_up(dev)
    values = np.random.default_rng(0).standard_normal(1 << args.log2n).astype(np.float32)
    report = {"adapter": dev.name, "backend": dev.backend, "adapter_type": dev.adapter_type,
              "wgpu_build": WGPU_BUILD, "date": datetime.date.today().isoformat(),
              "python": platform.python_version(), "log2n": args.log2n,
              "driver_disk_caches": "on" if args.driver_cache else "off",
              "passes": len(passes(values.size)), "repeats": args.repeats,
              "ring_alignment": dev.uniform_ring.stride,
              "results": [measure(dev, way, values, args.repeats) for way in args.ways],
              "binding": binding_costs(dev, len(passes(values.size)), max(args.repeats, 3))}
    print(table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["sorted"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
