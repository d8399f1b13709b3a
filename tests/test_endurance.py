"""Endurance: many LoRA forwards on one device, exact results, flat host memory.

``test_100k_forwards_exact_and_flat`` records 100,000 forwards of one small
adapter (rank 4, 64 -> 64, one token, scale 1) into the same output buffer, in
batches of 1,000 forwards per ``device.batch()``. A, B and x hold small
integers, so every product and partial sum is an integer far below 2**24 and
exact in float32, whatever the summation order: after k forwards the output
must equal ``base + k * delta`` exactly, with ``delta = B @ (A @ x)``.

Host memory is the resident set size from /proc/self/statm (the current RSS;
ru_maxrss only ever grows), taken after a warm-up batch and at the end.
The figures are printed.

``test_allocation_churn_is_flat`` runs lora.forward (numpy in, numpy out: a
new Weight, buffers and plan per call, all released) 2,000 times and checks
that RSS and the runtime's caches come back to where they were.
"""
from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import lora
from lora import Weight
from lora.hesper import execute_lora_forward_auto

FORWARDS = 100_000
BATCH = 1_000            # forwards per device.batch()
CHECK_EVERY = 10         # batches between read-backs
RANK, IN, OUT = 4, 64, 64
STRATEGY = "single:64:1"
RSS_LIMIT = 50 << 20     # bytes of growth allowed after warm-up
CHURN_CALLS = 2_000
CHURN_RSS_LIMIT = 20 << 20


def rss_bytes() -> int:
    """Current resident set size of this process."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("/proc/self/statm is Linux-only")
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def integer_problem(seed=0):
    """A, B, x in {-1, 0, 1}, base in [-100, 100]; delta = B @ (A @ x) in int64."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-1, 2, (RANK, IN)).astype(np.float32)
    b = rng.integers(-1, 2, (OUT, RANK)).astype(np.float32)
    x = rng.integers(-1, 2, IN).astype(np.float32)
    base = rng.integers(-100, 101, OUT).astype(np.float32)
    delta = b.astype(np.int64) @ (a.astype(np.int64) @ x.astype(np.int64))
    return a, b, x, base, delta


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@pytest.mark.slow  # 100,000 forwards
def test_100k_forwards_exact_and_flat(device, capsys):
    a, b, x, base, delta = integer_problem()
    assert np.any(b) and np.count_nonzero(delta) > OUT // 2, "the delta must be visible"
    # every partial sum stays an exact float32 integer for all FORWARDS forwards
    assert np.abs(base.astype(np.int64)).max() + FORWARDS * np.abs(delta).max() < 2**24
    w = Weight.from_numpy(device, a, b)
    x_buf, out = device.buffer(x), device.buffer(base)

    def run_batch():
        with device.batch():
            for _ in range(BATCH):
                execute_lora_forward_auto(device, w, 1.0, x_buf, out, strategy=STRATEGY)

    def check(k):
        got = device.read(out)
        want = base.astype(np.int64) + k * delta
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"after {k} forwards: {bad.size} element(s) differ, first "
                               f"[{bad[0]}]: got {got[bad[0]]}, want {want[bad[0]]}")

    start = time.perf_counter()
    run_batch()                       # warm-up: plan, pipeline, bind group, staging buffer
    check(BATCH)
    gc.collect()
    rss_before = rss_bytes()
    stats_before = dict(device.stats)
    steady = time.perf_counter()

    batches = FORWARDS // BATCH
    reads = 0
    for n in range(2, batches + 1):
        run_batch()
        if n % CHECK_EVERY == 0:
            check(n * BATCH)
            reads += 1
    assert batches % CHECK_EVERY == 0, "the last batch must be checked"
    end = time.perf_counter()
    gc.collect()
    rss_after = rss_bytes()

    grew = {k: device.stats[k] - stats_before[k] for k in stats_before}
    assert grew["dispatches"] == FORWARDS - BATCH          # one dispatch per forward
    assert grew["submits"] == (batches - 1) + reads        # one per batch, one per read
    assert grew["modules"] == grew["pipelines"] == grew["bind_groups"] == 0, grew
    growth = rss_after - rss_before
    with capsys.disabled():
        per_us = (end - steady) / (FORWARDS - BATCH) * 1e6
        print(f"\n[endurance] {FORWARDS} forwards ({STRATEGY}, rank {RANK}, {IN}->{OUT}, 1 token) "
              f"on {device!r}: {end - start:.1f} s in all, {per_us:.1f} us "
              f"per forward after warm-up; RSS {mib(rss_before)} after warm-up -> "
              f"{mib(rss_after)} at the end ({growth / 2**20:+.2f} MiB)")
    assert growth < RSS_LIMIT, f"RSS grew by {mib(growth)} over {FORWARDS} forwards"


def test_allocation_churn_is_flat(device, capsys):
    """A fresh Weight, activation buffers and plan per call (lora.forward), released
    every time: RSS, bind-group cache and plan cache come back to their sizes."""
    a, b, x, base, delta = integer_problem(1)
    want = base + delta.astype(np.float32)
    cache = device._cache

    def call():
        got = lora.forward(x, a, b, base, device=device, strategy=STRATEGY)
        assert np.array_equal(got, want)

    def sizes():
        """The bind-group cache's, its holders' and the live plans' counts."""
        plans = sum(isinstance(o, lora.Plan) for o in gc.get_objects())
        return len(cache.bind_groups), len(cache._holders), plans

    for _ in range(50):
        call()
    gc.collect()
    rss_before = rss_bytes()
    sizes_before = sizes()
    start = time.perf_counter()
    for _ in range(CHURN_CALLS):
        call()
    end = time.perf_counter()
    gc.collect()
    rss_after = rss_bytes()
    assert sizes() == sizes_before
    growth = rss_after - rss_before
    with capsys.disabled():
        print(f"\n[endurance] {CHURN_CALLS} lora.forward calls (allocate, run, read, release) on "
              f"{device!r}: {end - start:.1f} s; RSS {mib(rss_before)} -> {mib(rss_after)} "
              f"({growth / 2**20:+.2f} MiB)")
    assert growth < CHURN_RSS_LIMIT, f"RSS grew by {mib(growth)} over {CHURN_CALLS} calls"
