"""``python -m lora bench --many``: many adapters in one batch (an
``AdapterPool`` and its plan) beside the CUDA baselines
(lora.apps.bench_many_torch) and the bytes' floor.

Cases: 1, 4, 32 and 100 adapters of ranks cycling 4, 8, 16, 32, 64 (one
adapter: rank 64), scale alpha / rank with alpha = 2 rank; decode: 64 rows of
scattered ids; prefill: 4096 rows (4000 at 100 adapters) in equal segments of
one adapter each. Then the no-padding cases: 31 adapters of rank 4 and one of
rank 64, against the same adapters zero-padded to rank 64 (as vLLM's stacked
layout pads them). Every form of ``lora.core.many_plan.CANDIDATES`` (with
``--quick``: the four that won a case on the H200) is built first (a form
this device or dtype cannot build is skipped, the log saying why: the
matrix forms take f16 pools and subgroup matrices), then
timed (GPU timestamps, median; compiles between timings would let the GPU's
clocks fall); the fastest is checked against float64 and reported.
The floor: x, the output read and written, and the A and B of the adapters the
batch uses, at the copy bandwidth measured in the same run. With one adapter,
``lora.forward``'s own plan on the same rows is timed too, beside the path
ManyPlan takes where every row names that adapter (its copy of it under
``lora.forward``'s plan: the form named ONE_ADAPTER). Writes
``many-<compiler>.json`` to ``--out`` after every case.
"""
from __future__ import annotations

import json
import os

import numpy as np

from shaderdsl.errors import DispatchError, FeatureError
from shaderdsl.runtime import COMPILER, get_device

from ..core import reference as R
from ..core.auto import auto_plan
from ..core.many import matrix_runs
from ..core.many_plan import CANDIDATES, chosen_form
from ..core.pool import AdapterPool
from ..core.tuning import time_plan
from ..core.weight import Weight
from ..training.adapter_io import LoraLayer
from .bench_ceiling import copy_bandwidth
from .bench_many_torch import torch_many_us

DIM, RANKS = 2560, (4, 8, 16, 32, 64)
QUICK_DIM = 64
# --quick times only the forms that won some case on the H200 (docs/benchmarks.md)
QUICK_FORMS = ("fused segments t16", "split rows rb16", "split rows rr4 l64 rb16",
               "split segments t8 rb16")
ONE_ADAPTER = "one adapter: lora.forward's plan"  # ManyPlan's path where all ids name one


def make_case(dtype: str, kind: str, ranks: list[int], dim: int, seed: int = 0) -> dict:
    """Adapters of ``ranks``, x, base and ids for a decode or prefill batch."""
    rng = np.random.default_rng(seed)
    dt = np.float16 if dtype == "f16" else np.float32
    n = len(ranks)
    adapters = [((rng.standard_normal((r, dim)) / np.sqrt(dim)).astype(dt),
                 (rng.standard_normal((dim, r)) / np.sqrt(r)).astype(dt), 2.0) for r in ranks]
    if kind == "decode":
        ids = rng.integers(0, n, 64 if dim == DIM else 8)
    else:
        per = (4096 if dim == DIM else 64) // n
        ids = np.repeat(np.arange(n), per)
    rows = len(ids)
    x, base = (rng.standard_normal((rows, dim)).astype(dt) for _ in range(2))
    used = sorted(set(ids.tolist()))
    floor_bytes = dt().itemsize * (rows * dim * 3 + sum(2 * ranks[i] * dim for i in used))
    return {"dtype": dtype, "kind": kind, "ranks": ranks, "adapters": adapters, "ids": ids,
            "x": x, "base": base, "used": len(used), "floor_bytes": floor_bytes}


def cases(dim: int, quick: bool, counts=None) -> list[tuple[str, dict]]:
    """(label, case) of the sweep: adapter counts, then the no-padding pair
    (``quick``: f32, 1 and 4 adapters, small shapes; ``counts`` given: those
    adapter counts alone, f32 and f16)."""
    out = []
    given = counts is not None
    counts = counts or ((1, 4) if quick else (1, 4, 32, 100))
    for dtype in ("f32",) if quick else ("f32", "f16"):
        for kind in ("decode", "prefill"):
            for n in counts:
                ranks = [64] if n == 1 else [RANKS[k % len(RANKS)] for k in range(n)]
                out.append((f"{n} adapters", make_case(dtype, kind, ranks, dim)))
    if not quick and not given:
        for kind in ("decode", "prefill"):
            mixed = make_case("f16", kind, [4] * 31 + [64], dim)
            out.append(("31 x rank 4 + 1 x rank 64", mixed))
            out.append(("the same padded to rank 64", _padded(mixed)))
    return out


def _padded(case: dict) -> dict:
    """``case`` with every adapter zero-padded to the largest rank."""
    top = max(case["ranks"])
    pad = [(np.pad(a, ((0, top - a.shape[0]), (0, 0))), np.pad(b, ((0, 0), (0, top - b.shape[1]))),
            s) for a, b, s in case["adapters"]]
    item = case["x"].dtype.itemsize
    extra = sum(2 * (top - r) * case["x"].shape[1] for r in case["ranks"][:case["used"]])
    return dict(case, adapters=pad, ranks=[top] * len(pad),
                floor_bytes=case["floor_bytes"] + item * extra)


def ours(device, case: dict, log, forms=tuple(CANDIDATES)) -> dict:
    """Each of ``forms`` (CANDIDATES' names) built, then timed; the fastest checked."""
    dim, rows = case["x"].shape[1], len(case["ids"])
    pool = AdapterPool(device, dim, dim, dtype=case["x"].dtype, slots=len(case["ranks"]),
                       rows=sum(case["ranks"]), max_rank=max(64, max(case["ranks"])))
    for a, b, s in case["adapters"]:
        pool.add(LoraLayer(a, b, alpha=s * a.shape[0]))
    x, out = device.buffer(case["x"]), device.buffer(case["base"])
    plans = built(pool, rows, case["ids"], forms, log)
    if case["used"] == 1 and min(case["ids"]) >= 0:  # what ManyPlan records for such ids
        plans[ONE_ADAPTER] = pool.forward_plan(rows).with_ids(case["ids"])
    times = {name: time_plan(device, p, x, out, 20) for name, p in plans.items()}
    best = min(times, key=times.__getitem__)
    device.write(out, case["base"])
    plans[best].record(x, out)
    got = device.read(out).astype(np.float64)
    want = R.forward_many(case["x"], case["adapters"], case["ids"], case["base"])
    tol = R.many_tolerance(case["x"], case["adapters"], case["ids"], case["base"],
                           f16=case["dtype"] == "f16")
    for p in plans.values():
        p.plan.release()
    for buf in (x, out):
        device.release(buf)
    pool.release()
    return {"best": best, "us": times[best], "forms": times,
            "correct": bool(np.all(np.abs(got - want) <= tol))}


def built(pool, rows: int, ids, forms, log) -> dict:
    """The plans of ``forms`` with ``ids`` fixed; a form this device or dtype
    cannot build (tiles over its workgroup memory; the matrix forms on an f32
    pool or a device without subgroup matrices) left out, logged once per reason."""
    plans, why = {}, {}
    for name in forms:
        try:
            plans[name] = pool.forward_plan(rows, one_adapter=False,
                                            **CANDIDATES[name]).with_ids(ids)
        except (DispatchError, FeatureError, ValueError) as e:
            why.setdefault(str(e), []).append(name)
    for reason, names in why.items():
        log(f"    not built ({', '.join(names)}): {reason}")
    return plans


def one_adapter_us(device, case: dict) -> float:
    """lora.forward's own plan (the model's strategy) on the case's rows."""
    a, b, s = case["adapters"][0]
    w = Weight.from_numpy(device, a, b, dtype=case["x"].dtype)
    x, out = device.buffer(case["x"]), device.buffer(case["base"])
    plan = auto_plan(device, w, s, len(case["ids"]))
    us = time_plan(device, plan, x, out, 20)
    for buf in (x, out, w.a, w.b):
        device.release(buf)
    return us


def many_main(out_dir: str, log, quick: bool = False, counts=None) -> int:
    device = get_device()
    dim = QUICK_DIM if quick else DIM
    copy = copy_bandwidth(device, 16 if quick else 256, 0.0 if quick else 3.0)
    log(f"adapter: {device.name}, {COMPILER}; copy bandwidth {copy:.0f} GB/s")
    result = {"adapter": device.name, "compiler": COMPILER, "copy_gbps": copy, "rows": []}
    for label, case in cases(dim, quick, counts):
        if case["dtype"] == "f16" and not device.has_feature("shader-f16"):
            continue
        row = _row(device, label, case, copy, log, QUICK_FORMS if quick else tuple(CANDIDATES))
        result["rows"].append(row)
        with open(os.path.join(out_dir, f"many-{COMPILER}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["correct"] for r in result["rows"]) else 1


def _row(device, label: str, case: dict, copy: float, log, forms) -> dict:
    mine = ours(device, case, log, forms)
    floor_us = case["floor_bytes"] / copy / 1e3
    row = {"label": label, "dtype": case["dtype"], "kind": case["kind"],
           "rows": len(case["ids"]), "adapters": len(case["ranks"]), "used": case["used"],
           "floor_us": floor_us, **mine, **torch_many_us(case)}
    named = case["ids"][case["ids"] >= 0]  # forward_many's choice (where not one adapter)
    matrix = matrix_runs(device, np.float16 if case["dtype"] == "f16" else np.float32,
                         case["x"].shape[1], case["x"].shape[1], max(case["ranks"]))
    row["chosen"] = chosen_form(named.size, case["used"],
                                float(np.mean(np.asarray(case["ranks"])[named])), matrix)
    if len(case["ranks"]) == 1:
        row["one_adapter_us"] = one_adapter_us(device, case)
    extra = [f"lora.forward {row['one_adapter_us']:.1f}"] if "one_adapter_us" in row else []
    extra += [f"torch loop {row['loop_us']:.1f}, padded {row['padded_us']:.1f}"] \
        if "loop_us" in row else [f"torch: {row['why']}"]
    log(f"{case['dtype']} {case['kind']:7s} {row['rows']:4d} rows, {label} ({row['used']} used): "
        f"{mine['us']:.1f} us ({mine['us'] / floor_us:.2f}x the floor {floor_us:.1f}) "
        f"{mine['best']}{'' if mine['correct'] else ' WRONG'}, the rule's {row['chosen']}; "
        + "; ".join(extra))
    return row
