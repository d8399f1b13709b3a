"""Choosing the fastest strategy per (shape, adapter), measured once, cached on disk.

The cache is a JSON file (``$SHADERDSL_CACHE_DIR/lora_tuning.json``, default
``~/.cache/shaderdsl``) keyed by adapter, backend, wgpu build, shape and storage dtype,
and by the token count (``autotune``: plans with the count baked in) or a
bucket of counts (``autotune_bucket``: run-time plans, ``BUCKETS``).
``LORA_STRATEGY=single`` or ``LORA_STRATEGY="split(rank_group=4)"`` (or the
``strategy`` argument) forces a choice; the tuned choice is stored as that
keyed text (the older positional texts of earlier entries still parse).
Nothing is timed unless asked (``strategy="auto"``, ``LORA_STRATEGY=auto``):
without a tuned entry, :func:`model` gives the strategy, from what ran
fastest on the H200.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from shaderdsl.checks import MAX_INVOCATIONS, MAX_WG_SIZE
from shaderdsl.errors import BindingError, DispatchError, ShaderDSLError

from ..kernels import KERNELS
from . import tilings
from .forward import forward_plan
from .shape import LayerShape
from .strategy import FORWARD, Gemm, Matrix, Seed, Single, Split, Strategy, Tiled
from .weight import wgsl_dtype

# 2: strategies renamed (fused -> single), older entries not read. Entries store
# the keyed text (tiled(threads=512, tile_tokens=4)) since; those of version 2
# written before hold the positional one (tiled:512:4), which parse() still reads.
CACHE_VERSION = 2


def cache_path() -> Path:
    root = os.environ.get("SHADERDSL_CACHE_DIR") or Path.home() / ".cache" / "shaderdsl"
    return Path(root) / "lora_tuning.json"


def cache_key(device, rank: int, in_dim: int, out_dim: int, tokens,
              dtype: DTypeLike = np.float32) -> str:
    """``tokens``: a count (plans with it baked in) or "lo-hi" (a bucket)."""
    from shaderdsl.runtime import WGPU_BUILD  # (the kernels and plans print without wgpu)

    key = (f"v{CACHE_VERSION}|{device.name}|{device.backend}|{WGPU_BUILD}|r{rank}|in{in_dim}"
           f"|out{out_dim}|t{tokens}")
    return key if np.dtype(dtype) == np.float32 else f"{key}|{np.dtype(dtype).name}"


def candidates(device, rank: int, in_dim: int, out_dim: int, tokens: int,
               dtype: DTypeLike = np.float32) -> list[Strategy]:
    """The strategies worth timing for this shape, storage dtype and device:
    what each registry entry (lora.core.strategy.FORWARD) offers, less those
    whose kernels need more than the device's limits (:func:`needs`): on a
    device of WebGPU's default limits (256 invocations per workgroup) the
    512- and 1024-thread forms would only fail to build."""
    shape = LayerShape(rank, in_dim, out_dim, tokens, wgsl_dtype(np.dtype(dtype)))
    sub = device.has_feature("subgroup")
    offered = [s for entry in FORWARD.values()
               for s in entry.candidates(shape, sub, _matrices(device, shape.dtype))]
    return [s for s in offered if not over_limits(device, needs(s, shape))]


WORKGROUP_STORAGE = "max-compute-workgroup-storage-size"
STORAGE_BUFFERS = "max-storage-buffers-per-shader-stage"


def needs(strategy: Strategy, shape: LayerShape) -> dict[str, int]:
    """What ``strategy``'s kernels need of a device's limits for ``shape``, by
    limit name: invocations per workgroup, workgroup size per axis, workgroup
    storage bytes and storage buffers, the most of any of its kernels. Read
    from the kernels themselves (their WGSL is generated, and cached by
    shaderdsl.compile; no pipeline is built), so no size is written twice."""
    most: dict[str, int] = {}
    for name, params, *_ in strategy.kernels(shape):
        kernel = KERNELS[name].kernel(**params)
        storage = sum(b.access != "uniform" for b in kernel.bindings)
        for limit, n in ((MAX_INVOCATIONS, kernel.threads_per_workgroup),
                         *zip(MAX_WG_SIZE, kernel.workgroup_size),
                         (WORKGROUP_STORAGE, kernel.workgroup_bytes), (STORAGE_BUFFERS, storage)):
            most[limit] = max(most.get(limit, 0), n)
    return most


def over_limits(device, need: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The limits of ``device`` that ``need`` (:func:`needs`) exceeds:
    name -> (needed, the device's); empty where it fits. A limit the device
    does not report is not checked."""
    limits = device.limits
    return {k: (n, limits[k]) for k, n in need.items() if k in limits and n > limits[k]}


def _matrices(device, dtype: str) -> tuple:
    """The adapter's subgroup-matrix shapes for a storage dtype ("f32" or "f16")."""
    return tuple(c for c in getattr(device, "subgroup_matrix_configs", ())
                 if c.component == dtype)


MIN_BATCH_NS = 20e6  # time a batch of at least 20 ms: Dawn rounds timestamps to 65.5 us
# the most items in one timed batch: a quantised timestamp reads 0 ns for a short
# batch, which asked for 20 million dispatches in one submit (Dawn never returned)
MAX_BATCH = 50_000


class Recordable(Protocol):
    """What time_plan times: a Plan, a PlanAt, or other steps that record a forward."""

    def record(self, x_buf, out_buf, /) -> None: ...


def median_us(device, record: Callable[[], None], n: int, repeats: int = 5,
              most: int = MAX_BATCH) -> float:
    """Median microseconds of one ``record()`` (a forward, a dispatch, a step):
    GPU timestamps around a batch of them where the device has them, else wall
    time with a wait. The batch grows from ``n`` (at most to ``most``) until it
    lasts MIN_BATCH_NS, so quantised timestamps (Dawn's) and timer resolution
    cost under a percent."""
    def batch(count):
        t0 = time.perf_counter()
        with device.batch(timestamps=True) as b:
            for _ in range(count):
                record()
        ns = b.gpu_time_ns
        if ns is None:
            device.sync()
            ns = (time.perf_counter() - t0) * 1e9
        return ns
    return median_of_batches(batch, n, repeats, most)


# Inside quick_timing(): one batch of the count asked for, after the warm-up
_QUICK = contextvars.ContextVar("quick_timing", default=False)


@contextlib.contextmanager
def quick_timing() -> Iterator[None]:
    """Time every median_of_batches inside from one batch of the count its caller
    asks for, not grown to MIN_BATCH_NS nor repeated, and store no tuned choice:
    ``bench --quick`` (CI's smoke run, whose figures on a CPU driver mean nothing;
    52 -> 40 s cold on lavapipe, optimisation note 58)."""
    token = _QUICK.set(True)
    try:
        yield
    finally:
        _QUICK.reset(token)


def median_of_batches(batch: Callable[[int], float], n: int, repeats: int = 5,
                      most: int = MAX_BATCH) -> float:
    """Median microseconds of one item over ``repeats`` batches that ``batch(count)``
    runs and times (in ns), after a warm-up; the batch grows from ``n`` (at most to
    ``most``) until it lasts MIN_BATCH_NS (one batch of ``n`` in quick_timing())."""
    batch(min(n, 10))  # warm-up: pipelines, bind groups, caches
    if _QUICK.get():
        return batch(n) / n / 1000.0
    ns = batch(n)
    if ns < MIN_BATCH_NS:
        n = min(most, int(n * MIN_BATCH_NS / max(ns, 1.0)) + 1)
    return statistics.median(batch(n) / n / 1000.0 for _ in range(repeats))


def time_plan(device, plan: Recordable, x_buf, out_buf, forwards: int,
              repeats: int = 5) -> float:
    """Median time of one forward in microseconds (median_us)."""
    return median_us(device, lambda: plan.record(x_buf, out_buf), forwards, repeats)


_FILE_LOCK = threading.Lock()  # one thread at a time reads, changes and writes the file


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(key: str, value: dict) -> None:
    """Write a tuned choice, unless timed in quick_timing() (its figures are one batch)."""
    if _QUICK.get():
        return
    with _FILE_LOCK:
        _store_locked(key, value)


def _store_locked(key: str, value: dict) -> None:
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


def _timings(device, weight, tokens: int, cands, make_plan, forwards, progress) -> dict:
    """Microseconds per forward of each candidate that builds (``make_plan(s)``:
    a Plan, or a run-time Plan bound to ``tokens``), on scratch buffers of
    ``tokens`` tokens. A candidate over this device's limits (binding sizes;
    :func:`candidates` leaves out those over its workgroup limits) is left
    out: it is never returned. Timed holding
    the device's lock, so no other thread's work lands in the times."""
    with device.lock:
        return _timings_locked(device, weight, tokens, cands, make_plan, forwards, progress)


def _timings_locked(device, weight, tokens: int, cands, make_plan, forwards, progress) -> dict:
    rng = np.random.default_rng(0)
    x = device.buffer(rng.standard_normal((tokens, weight.in_dim)).astype(weight.dtype))
    out = device.buffer(rng.standard_normal((tokens, weight.out_dim)).astype(weight.dtype))
    if forwards is None:
        forwards = max(4, min(200, 2_000_000 // (tokens * (weight.in_dim + weight.out_dim))))
    timings = {}
    try:
        for s in cands:
            try:
                plan = make_plan(s)
            except (DispatchError, BindingError):  # over this device's limits: not a candidate
                continue
            timings[str(s)] = time_plan(device, plan, x, out, forwards, repeats=3)
            getattr(plan, "plan", plan).release()
            if progress:
                progress(f"  {s}: {timings[str(s)]:.2f} us")
    finally:
        device.release(x)
        device.release(out)
    if not timings:
        raise DispatchError(f"no candidate strategy runs {tokens} token(s) of {weight!r} on "
                            f"{device.name!r}")
    return timings


def _said_after_a_second(weight, tokens) -> Callable[[str], None]:
    """Progress for a tuning that is not silent: each candidate's time on
    stderr once a second has passed (a first call that tunes says why it waits)."""
    t0 = time.perf_counter()
    what = f"lora: tuning rank {weight.rank} {weight.in_dim}->{weight.out_dim}, {tokens} token(s):"

    def say(line: str) -> None:
        if time.perf_counter() - t0 > 1.0:
            print(f"{what}{line}", file=sys.stderr, flush=True)
    return say


def _best(key: str, timings: dict, use_cache: bool) -> Strategy:
    best = min(timings, key=timings.__getitem__)
    if use_cache:
        _store(key, {"strategy": best, "us": timings[best], "timings": timings})
    return Strategy.parse(best)


def _cached(key: str, use_cache: bool) -> Strategy | None:
    hit = _load().get(key) if use_cache else None
    try:
        return Strategy.parse(hit["strategy"]) if hit else None
    except (ValueError, TypeError, KeyError):  # an entry no strategy reads now: measure again
        return None


def autotune(device, weight, scale: float, tokens: int, *, use_cache: bool = True,
             forwards: int | None = None, progress=None) -> Strategy:
    """Time every candidate on scratch buffers; return the fastest. With
    ``use_cache`` the on-disk cache is read first and written after."""
    key = cache_key(device, weight.rank, weight.in_dim, weight.out_dim, tokens, weight.dtype)
    hit = _cached(key, use_cache)
    if hit:
        return hit
    cands = candidates(device, weight.rank, weight.in_dim, weight.out_dim, tokens, weight.dtype)
    timings = _timings(device, weight, tokens, cands,
                       lambda s: forward_plan(device, weight, scale, tokens, s), forwards,
                       progress or _said_after_a_second(weight, tokens))
    return _best(key, timings, use_cache)


def choose(device, weight, scale: float, tokens: int, strategy=None, *,
           save_h: bool = False) -> Strategy:
    """The strategy to run: an explicit one (Strategy or text); else
    $LORA_STRATEGY's; "auto": the autotuned fastest (timed now unless
    cached); None: the cached tuned choice where there is one, else
    :func:`default_strategy` (nothing timed)."""
    return _choice(strategy, lambda: autotune(device, weight, scale, tokens),
                   cache_key(device, weight.rank, weight.in_dim, weight.out_dim, tokens,
                             weight.dtype),
                   lambda: default_strategy(device, weight, scale, tokens,
                                            lambda s: forward_plan(device, weight, scale, tokens,
                                                                   s, save_h=save_h)))


def _choice(strategy, tune, key: str, model) -> Strategy:
    """``strategy`` (or $LORA_STRATEGY's) if it names one; "auto": ``tune()``;
    None: the tuning cache's entry under ``key``, else ``model()``."""
    strategy = _asked(strategy)
    if isinstance(strategy, Strategy):
        return strategy
    if strategy == "auto":
        return tune()
    return _cached(key, True) or model()


def _asked(strategy):
    """A Strategy, "auto" (tune) or None (tuned if cached, else the model's):
    ``strategy`` as given, else $LORA_STRATEGY's."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy is None:
        strategy = os.environ.get("LORA_STRATEGY") or None
    return strategy if strategy in (None, "auto") else Strategy.parse(strategy)


# ---------------------------------------------------------------- the engine's tilings

def product_key(device, name: str, params: dict) -> str:
    """The tuning cache's key of a frozen base product (lora.core.tilings.base_problem)."""
    from shaderdsl.runtime import WGPU_BUILD

    M, N, K, _, _, read8 = tilings.base_problem(name, **params)
    return (f"v{CACHE_VERSION}|{device.name}|{device.backend}|{WGPU_BUILD}|{name}"
            f"|{M}x{N}x{K}|read{8 if read8 else 4}")


def product_tiling(device, name: str, params: dict, use_cache: bool = True):
    """The engine's tiling of a frozen base product ("dense" or
    "dense_grad_input", the kernels' parameters): the tuned one where the
    cache holds it (:func:`autotune_product`), else lora.core.tilings' rule
    for the device's limits. Nothing is timed."""
    hit = _load().get(product_key(device, name, params)) if use_cache else None
    try:
        return tilings.from_fields(hit["tiling"]) if hit else \
            tilings.base_tiling(name, device.limits, **params)
    except (ValueError, TypeError, KeyError):  # an entry no tiling reads now: the rule's
        return tilings.base_tiling(name, device.limits, **params)


def autotune_product(device, name: str, params: dict, *, use_cache: bool = True,
                     cands=None, progress=None):
    """Time the rule's candidates (``cands``: these tilings instead) for a
    frozen base product on scratch buffers of its shape, f16 (the matrix
    form's); cache and return the fastest (what :func:`product_tiling` then
    gives)."""
    key = product_key(device, name, params)
    if use_cache and key in _load():
        return product_tiling(device, name, params)
    spec = KERNELS[f"{name}_matrix"]
    rng = np.random.default_rng(0)
    timings = {}
    with device.lock:
        for t in cands or tilings.base_candidates(name, device.limits, **params):
            kernel = spec.kernel(**params, tiling=t)
            bufs = {b.name: device.buffer(rng.standard_normal(
                b.min_bytes // 2).astype(np.float16)) for b in kernel.bindings}
            us = median_us(device, lambda k=kernel, b=bufs, t=t: device.dispatch(
                k, b, spec.grid(**params, tiling=t)), 2, repeats=3)
            timings[json.dumps(tilings.as_fields(t))] = us
            for buf in bufs.values():
                device.release(buf)
            if progress:
                progress(f"  {t}: {us:.2f} us")
    best = min(timings, key=timings.__getitem__)
    if use_cache:
        _store(key, {"tiling": json.loads(best), "us": timings[best], "timings": timings})
    return tilings.from_fields(json.loads(best))


# ---------------------------------------------------------------- without timing

def model(device, weight, tokens: int) -> list[Strategy]:
    """What ran fastest on the H200 for this kind of shape (docs/benchmarks.md),
    best first, then plainer forms and Hesper's seed, which runs anything. One
    token: single (rank 8) or split by rank groups; up to 64 tokens: split;
    beyond, from rank 32: matrix (f16 with the adapter's f16 16x16x16 -> f32;
    the H200's fastest form for the token count) then gemm (8 tokens per thread
    from 512), where the shape allows; else tiled."""
    shape = weight.layer_shape(tokens)
    if tokens > 64:
        return _model_many(device, shape) + [Seed()]
    if shape.rank > 8:
        return [Split(rank_group=4), Split(), Seed()]
    return [Single() if tokens == 1 else Split(), Seed()]


def _model_many(device, shape: LayerShape) -> list[Strategy]:
    """:func:`model` past 64 tokens."""
    tokens = shape.token_count
    wide = (device.limits.get(MAX_INVOCATIONS) or 256) >= 512
    out = []
    if shape.rank >= 32:
        out += _model_matrix(device, shape)
        if Gemm.candidates(shape, False):
            many = tokens >= 2048  # rank 64, 2560: 153 / 141 us (naga / Tint) at 4096
            splits = 8 if many else 16  # tokens, 31.5 / 27.9 at 512 (optimisation note 33)
            while splits > 1 and splits * 32 > shape.in_dim:
                splits //= 2
            out.append(Gemm(256 if many else 128, 16, splits, 8 if tokens >= 512 else 4))
    threads = 512 if wide else 256  # past 1024 tokens the H200 chose looped output columns
    return out + [Tiled(threads, 4) if tokens <= 1024 else Tiled(threads, 16, unroll=False),
                  Tiled(256, 8)]


def _model_matrix(device, shape: LayerShape) -> list[Strategy]:
    """The matrix form that ran fastest on the H200 (f16 rank 64, 2560 -> 2560,
    Dawn, robust or not alike; optimisation note 37) where the shape offers
    it, else the first candidate; none where the adapter lacks the fragments."""
    offered = Matrix.candidates(shape, False, _matrices(device, shape.dtype))
    if shape.token_count > 1024:  # T = 4096: 80.8 us (splits=8: 105.3); 1025-2047 unmeasured
        best = Matrix(splits=2, fragments=1, rows=2, cols=2)
    else:  # T = 512: 17.55 us (depth 32: 18.03; splits=2: 22.8)
        best = Matrix(splits=8, fragments=1, rows=2, cols=2, depth=64)
    return [best if best in offered else offered[0]] if offered else []


def default_strategy(device, weight, scale: float, tokens: int, make_plan) -> Strategy:
    """The first of :func:`model`'s strategies whose plan ``make_plan(s)``
    builds on this device (within its limits); its kernels stay compiled."""
    for s in model(device, weight, tokens):
        try:
            make_plan(s).release()
            return s
        except (ShaderDSLError, ValueError):  # over a limit, or not for this shape
            continue
    raise DispatchError(f"no strategy runs {tokens} token(s) of {weight!r} on {device.name!r}")


# ---------------------------------------------------------------- run-time token counts

# The token counts one run-time plan (and one tuning entry) serves: a new
# count in a bucket seen before compiles nothing. One token keeps its plan
# with the count baked in (its kernels are the fastest there, and there is
# only one such count). The last bucket's top is lowered per weight to what
# the device's binding sizes allow (runtime_bucket); grids past
# max-compute-workgroups-per-dimension are split over z.
BUCKETS = ((1, 1), (2, 16), (17, 256), (257, 4096), (4097, 1 << 24))
RUNTIME_TOKENS = BUCKETS[-1][1]
TIMED_TOKENS = 8192  # a bucket is timed at the geometric mean of its bounds, at most this


def bucket_of(tokens: int) -> tuple[int, int] | None:
    """The bucket (lo, hi) holding ``tokens``, or None past the last."""
    for lo, hi in BUCKETS:
        if lo <= tokens <= hi:
            return lo, hi
    return None


def fitting_tokens(device, weight) -> int:
    """The most tokens whose x, output, h and y buffers each fit the device's
    max-storage-buffer-binding-size."""
    cap = device.limits.get("max-storage-buffer-binding-size") or 1 << 62
    row = max(weight.dtype.itemsize * max(weight.in_dim, weight.out_dim),
              4 * max(weight.rank, weight.out_dim))
    return cap // row


def runtime_bucket(device, weight, tokens) -> tuple[int, int] | None:
    """The bucket of a run-time plan for ``tokens`` tokens of ``weight``, its top
    lowered to what the device's binding sizes allow; None where a baked plan
    runs instead: one token, more than RUNTIME_TOKENS, over the binding limit."""
    bucket = bucket_of(tokens) if isinstance(tokens, int) and tokens > 1 else None
    if bucket is None:
        return None
    hi = min(bucket[1], fitting_tokens(device, weight))
    return (bucket[0], hi) if tokens <= hi else None


def timed_tokens(bucket: tuple[int, int]) -> int:
    """The token count a bucket's candidates are timed at."""
    lo, hi = bucket
    return max(lo, min(hi, TIMED_TOKENS, round((lo * hi) ** 0.5)))


def bucket_key(device, rank: int, in_dim: int, out_dim: int, bucket: tuple[int, int],
               dtype=np.float32) -> str:
    """The tuning cache's key for a bucket of run-time plans."""
    return cache_key(device, rank, in_dim, out_dim, f"{bucket[0]}-{bucket[1]}", dtype)


def autotune_bucket(device, weight, scale: float, bucket: tuple[int, int], *,
                    use_cache: bool = True, forwards: int | None = None,
                    progress=None) -> Strategy:
    """The fastest strategy for run-time plans of ``bucket`` (lo, hi): every
    candidate for ``timed_tokens(bucket)`` tokens is built as a run-time Plan
    for up to hi tokens (so it is checked at hi: one that cannot run there is
    left out) and timed at that count. Cached like :func:`autotune`, under
    :func:`bucket_key`."""
    key = bucket_key(device, weight.rank, weight.in_dim, weight.out_dim, bucket, weight.dtype)
    hit = _cached(key, use_cache)
    if hit:
        return hit
    tokens = timed_tokens(bucket)
    cands = candidates(device, weight.rank, weight.in_dim, weight.out_dim, tokens, weight.dtype)
    timings = _timings(device, weight, tokens, cands,
                       lambda s: forward_plan(device, weight, scale, None, s,
                                              max_tokens=bucket[1]).at(tokens), forwards,
                       progress or _said_after_a_second(weight, tokens))
    return _best(key, timings, use_cache)


def choose_bucket(device, weight, scale: float, bucket: tuple[int, int],
                  strategy=None) -> Strategy:
    """:func:`choose` for a bucket of run-time plans (the model's strategy
    for the bucket's timed count)."""
    return _choice(strategy, lambda: autotune_bucket(device, weight, scale, bucket),
                   bucket_key(device, weight.rank, weight.in_dim, weight.out_dim, bucket,
                              weight.dtype),
                   lambda: default_strategy(device, weight, scale, timed_tokens(bucket),
                                            lambda s: forward_plan(device, weight, scale, None,
                                                                   s, max_tokens=bucket[1])))
