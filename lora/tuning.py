"""Choosing the fastest strategy per (shape, adapter), measured once, cached on disk.

The cache is a JSON file (``$SHADERDSL_CACHE_DIR/lora_tuning.json``, default
``~/.cache/shaderdsl``) keyed by adapter, backend, wgpu build, shape and storage dtype.
``LORA_STRATEGY=fused:256:1`` (or the ``strategy`` argument) forces a choice.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from shaderdsl.errors import DispatchError
from shaderdsl.runtime import WGPU_BUILD

from . import kernels as K
from .plan import Plan
from .strategy import Strategy


def cache_path() -> Path:
    root = os.environ.get("SHADERDSL_CACHE_DIR") or Path.home() / ".cache" / "shaderdsl"
    return Path(root) / "lora_tuning.json"


def cache_key(device, rank: int, in_dim: int, out_dim: int, tokens: int,
              dtype=np.float32) -> str:
    key = f"{device.name}|{device.backend}|{WGPU_BUILD}|r{rank}|in{in_dim}|out{out_dim}|t{tokens}"
    return key if np.dtype(dtype) == np.float32 else f"{key}|{np.dtype(dtype).name}"


def candidates(device, rank: int, in_dim: int, out_dim: int, tokens: int) -> list[Strategy]:
    """The strategies worth timing for this shape on this device."""
    sgs = [False, True] if device.has_feature("subgroup") else [False]
    out = [Strategy("seed")]  # Hesper's design wins on some adapters (CPU ones: few, long threads)
    if rank > 8 and tokens <= 64:  # share A's rows among workgroups: project_a per rank group
        for group in (4, 8):
            out += [Strategy("split", 256, subgroups=sg, rank_group=group) for sg in sgs]
    if tokens == 1:
        for sg in sgs:
            out.append(Strategy("split", 256, subgroups=sg))
            for threads in (256, 512, 1024):
                for unroll in (True, False):
                    out.append(Strategy("fused", threads, 1, sg, unroll=unroll))
    else:
        for threads in (256, 512):
            for tile in (4, 8, 16):
                if tile <= max(4, tokens):
                    for unroll in (True, False):
                        out.append(Strategy("tiled", threads, tile_tokens=tile, unroll=unroll))
                        if tile >= 8 and tokens >= 64 and K.tiled_fits(rank, threads, tile, 4):
                            out.append(Strategy("tiled", threads, tile_tokens=tile,
                                                unroll=unroll, token_block=4))
        whole = -(-out_dim // 256)
        for sg in sgs:
            out.append(Strategy("split", 256, subgroups=sg))
            out.append(Strategy("fused", 256, whole, sg, unroll=False))
    return out


MIN_BATCH_NS = 20e6  # time a batch of at least 20 ms: Dawn rounds timestamps to 65.5 us


def time_plan(device, plan: Plan, x_buf, out_buf, forwards: int, repeats: int = 5) -> float:
    """Median time of one forward in microseconds: GPU timestamps around a batch
    of forwards where the device has them, else wall time with a wait. The
    batch grows from ``forwards`` until it lasts MIN_BATCH_NS, so quantised
    timestamps (Dawn's) and timer resolution cost under a percent."""
    def batch(n):
        t0 = time.perf_counter()
        with device.batch(timestamps=True) as b:
            for _ in range(n):
                plan.record(x_buf, out_buf)
        ns = b.gpu_time_ns
        if ns is None:
            device.sync()
            ns = (time.perf_counter() - t0) * 1e9
        return ns

    batch(min(forwards, 10))  # warm-up: pipelines, bind groups, caches
    ns = batch(forwards)
    if ns < MIN_BATCH_NS:
        forwards = min(50_000, int(forwards * MIN_BATCH_NS / max(ns, 1.0)) + 1)
    times = [batch(forwards) / forwards / 1000.0 for _ in range(repeats)]
    return statistics.median(times)


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(key: str, value: dict) -> None:
    table = _load()
    table[key] = value
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def autotune(device, weight, scale: float, tokens: int, *, use_cache: bool = True,
             forwards: int | None = None, progress=None) -> Strategy:
    """Time every candidate on scratch buffers; return the fastest. With
    ``use_cache`` the on-disk cache is read first and written after."""
    key = cache_key(device, weight.rank, weight.in_dim, weight.out_dim, tokens, weight.dtype)
    if use_cache:
        hit = _load().get(key)
        if hit:
            return Strategy.parse(hit["strategy"])
    rng = np.random.default_rng(0)
    x = device.buffer(rng.standard_normal((tokens, weight.in_dim)).astype(weight.dtype))
    out = device.buffer(rng.standard_normal((tokens, weight.out_dim)).astype(weight.dtype))
    if forwards is None:
        forwards = max(4, min(200, 2_000_000 // (tokens * (weight.in_dim + weight.out_dim))))
    timings = {}
    try:
        for s in candidates(device, weight.rank, weight.in_dim, weight.out_dim, tokens):
            try:
                plan = Plan(device, weight, scale, tokens, s)
            except DispatchError:  # e.g. over this device's workgroup memory: not a candidate
                continue
            timings[str(s)] = time_plan(device, plan, x, out, forwards, repeats=3)
            plan.release()
            if progress:
                progress(f"  {s}: {timings[str(s)]:.2f} us")
    finally:
        device.release(x)
        device.release(out)
    best = min(timings, key=timings.get)
    if use_cache:
        _store(key, {"strategy": best, "us": timings[best], "timings": timings})
    return Strategy.parse(best)


def choose(device, weight, scale: float, tokens: int, strategy=None) -> Strategy:
    """The strategy to run: an explicit one (Strategy or text), $LORA_STRATEGY,
    or the autotuned fastest for this shape and device."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy in (None, "auto"):
        strategy = os.environ.get("LORA_STRATEGY") or "auto"
    if strategy != "auto":
        return Strategy.parse(strategy)
    return autotune(device, weight, scale, tokens)
