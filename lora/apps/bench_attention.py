"""``python -m lora bench --attention``: each attention kernel of the causal LM
alone, at the language models' shapes, beside torch's scaled_dot_product_attention.

For each shape (SHAPES: batch 8 x 512 tokens and 1 x 2048, SmolLM2-135M's 9
heads over 3 kv heads and Qwen2.5-0.5B's 14 over 2, head_dim 64) and storage
dtype (f32; f16 where the adapter has shader-f16): the forward (SIMT, and
attention_matrix where the adapter has f16 16x16x16 subgroup matrices),
attention_delta, and the backward's grad_kv and grad_q (SIMT, and every
tiling of the matrix backward that fits the adapter's workgroup memory); the
SIMT kernels also unpadded (``pad=False``: their staged rows as before the
padding against bank conflicts). Each kernel runs once first and its output
is checked against float64 on one sequence and one kv head's group (rel_err:
the largest difference over the largest value; ``wrong`` past 1e-4 for f32
and 2e-2 for f16, whose stored results and rounded P and dS give up to a few
1e-3); then it is timed by GPU timestamps around batches of dispatches (the
median of 5, lora.core.tuning.median_us). TFLOP/s counts the useful products
of the causal half: 2 matrix products in the forward (S, P V), 4 in grad_kv
(S, dP, dV, dK), 3 in grad_q (S, dP, dQ), each 2 B H S^2 D / 2 flops.

torch (where installed with CUDA, in the same process): SDPA's forward and
forward + backward (is_causal, enable_gqa) in the same dtype, by CUDA events.
Each shape's ``layer`` rows add up ours (the fastest of each kernel that
passed) against torch's forward + backward. The JSON (``attention-<compiler>.json``)
is rewritten after each shape.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from shaderdsl.errors import DispatchError, FeatureError, WGSLCompileError
from shaderdsl.runtime import COMPILER, get_device

from ..core.tuning import median_us
from ..kernels import KERNELS
from ..kernels.attention_matrix_grad import STEP_CHOICES, SUBGROUP_CHOICES, grad_tiling
from ..kernels.matrix import FRAGMENT
from .bench_train import optional_torch

SHAPES = (  # (label, batch, seq, heads, kv_heads, head_dim)
    ("SmolLM2 8x512", 8, 512, 9, 3, 64), ("Qwen2.5 8x512", 8, 512, 14, 2, 64),
    ("SmolLM2 1x2048", 1, 2048, 9, 3, 64), ("Qwen2.5 1x2048", 1, 2048, 14, 2, 64))
QUICK_SHAPES = (("tiny", 2, 40, 4, 2, 16),)
WRONG = {"f32": 1e-4, "f16": 2e-2}
PRODUCTS = {"forward": 2, "delta": 0, "grad_kv": 4, "grad_q": 3}  # per B H S^2 D flops


# ------------------------------------------------------------------ float64 on one group

def _group(x, b, seq, heads, head0, count, d):
    """Heads head0.. of sequence b of a [tokens, heads * d] matrix: [count, seq, d] float64."""
    rows = x[b * seq:(b + 1) * seq].astype(np.float64).reshape(seq, heads, d)
    return rows[:, head0:head0 + count].transpose(1, 0, 2)


def reference(inputs: dict, shape: tuple, o_stored=None) -> dict:
    """float64 o, lse, delta (from ``o_stored``, the kernel's o, where given),
    dq, dk, dv of the last sequence's last kv head and its group of query
    heads (every key real, causal)."""
    _, batch, seq, heads, kv_heads, d = shape
    group, b, kvh = heads // kv_heads, batch - 1, kv_heads - 1
    q, do = (_group(inputs[n], b, seq, heads, kvh * group, group, d) for n in ("q", "dout"))
    k, v = (_group(inputs[n], b, seq, kv_heads, kvh, 1, d)[0] for n in ("k", "v"))
    s = q @ k.T * d ** -0.5
    s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.exp(s - top)
    p = e / e.sum(-1, keepdims=True)
    o = p @ v
    kept = o if o_stored is None else _group(o_stored, b, seq, heads, kvh * group, group, d)
    delta = (do * kept).sum(-1, keepdims=True)
    ds = p * (do @ v.T - delta)
    return {"o": o, "lse": (top + np.log(e.sum(-1, keepdims=True)))[..., 0],
            "delta": delta[..., 0], "dq": d ** -0.5 * ds @ k,
            "dk": d ** -0.5 * np.einsum("gij,gid->jd", ds, q)[None],
            "dv": np.einsum("gij,gid->jd", p, do)[None]}


def _rel(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _values(flat, shape, count, head0, heads_total):
    """lse / delta elements (b * heads + h) * seq + i of the checked group: [count, seq]."""
    _, batch, seq, _, _, _ = shape
    per = flat.reshape(batch, heads_total, seq)
    return per[batch - 1, head0:head0 + count].astype(np.float64)


# ------------------------------------------------------------------ one shape

class ShapeRun:
    """The buffers, reference and rows of one (shape, dtype)."""

    def __init__(self, device, shape, dtype, log):
        self.device, self.shape, self.dtype, self.log = device, shape, dtype, log
        _, batch, seq, heads, kv_heads, d = shape
        self.group = heads // kv_heads
        rng = np.random.default_rng(seq + heads)
        st = np.float16 if dtype == "f16" else np.float32
        t = batch * seq
        self.host = {"q": rng.standard_normal((t, heads * d)).astype(st),
                     "k": rng.standard_normal((t, kv_heads * d)).astype(st),
                     "v": rng.standard_normal((t, kv_heads * d)).astype(st),
                     "dout": rng.standard_normal((t, heads * d)).astype(st)}
        self.bufs = {n: device.buffer(x) for n, x in self.host.items()}
        self.bufs["keep"] = device.buffer(np.ones(t, np.uint32))
        self.bufs["past"] = device.buffer(np.zeros(1, np.uint32))
        for name, (shape_, dt) in {"o": ((t, heads * d), st), "lse": ((t * heads,), np.float32),
                                   "stats": ((t * heads, 2), np.float32),
                                   "dq": ((t, heads * d), st), "dk": ((t, kv_heads * d), st),
                                   "dv": ((t, kv_heads * d), st)}.items():
            self.bufs[name] = device.empty(shape_, dt)
        self.want = reference(self.host, shape)
        self.rows: list = []

    def params(self, **extra) -> dict:
        _, batch, seq, heads, kv_heads, d = self.shape
        return dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=d, **extra)

    def run(self, kind, name, params, bindings, outputs, variant=""):
        """Check KERNELS[name] (outputs: the results compared), then time it; a
        kernel the device refuses is recorded (``error``, wrong) and the run goes on."""
        spec = KERNELS[name]
        bufs = {b: self.bufs[b] for b in bindings}
        for out in outputs:
            self.device.write(self.bufs[out], np.full(self.bufs[out].shape, np.nan,
                                                      self.bufs[out].dtype))
        try:
            kernel, grid = spec.kernel(**params), spec.grid(**params)
            self.device.dispatch(kernel, bufs, grid)
            err = self._errors(outputs)
        except (DispatchError, FeatureError, WGSLCompileError) as e:
            self.log(f"  {self.dtype} {name} {variant}: refused: {e}")
            self.rows.append({"kernel": name, "kind": kind, "dtype": self.dtype,
                              "variant": variant, "us": None, "error": str(e), "wrong": True})
            return None
        us = median_us(self.device, lambda: self.device.dispatch(kernel, bufs, grid), 2)
        _, batch, seq, heads, _, d = self.shape
        flops = PRODUCTS[kind] * batch * heads * seq * seq * d
        row = {"kernel": name, "kind": kind, "dtype": self.dtype, "variant": variant, "us": us,
               "tflops": flops / us / 1e6 if flops else None, "rel_err": err,
               "wrong": any(e > WRONG[self.dtype] or e != e for e in err.values())}
        self.rows.append(row)
        rate = f", {row['tflops']:.2f} TFLOP/s" if flops else ""
        errors = ", ".join(f"{k} {e:.1e}" for k, e in err.items())
        self.log(f"  {self.dtype} {name}{' ' + variant if variant else ''}: {us:.1f} us{rate}, "
                 f"rel err {errors}{' WRONG' if row['wrong'] else ''}")
        return row

    def _errors(self, outputs) -> dict:
        _, batch, seq, heads, kv_heads, d = self.shape
        g, kvh = self.group, kv_heads - 1
        out = {}
        for name in outputs:
            got = self.device.read(self.bufs[name])
            if name == "stats":
                got = got.reshape(-1, 2)
                out["lse"] = _rel(_values(got[:, 0], self.shape, g, kvh * g, heads),
                                  self.want["lse"])
                out["delta"] = _rel(_values(got[:, 1], self.shape, g, kvh * g, heads),
                                    self.want["delta"])
            elif name == "lse":
                out[name] = _rel(_values(got, self.shape, g, kvh * g, heads), self.want["lse"])
            else:
                count, head0, total = (1, kvh, kv_heads) if name in ("dk", "dv") else \
                    (g, kvh * g, heads)
                out[name] = _rel(_group(got, batch - 1, seq, total, head0, count, d),
                                 self.want[name])
        return out


FORWARD = ("q", "k", "v", "keep", "past", "o", "lse")
BACKWARD = ("q", "k", "v", "dout", "stats", "keep")


def matrix_tilings(shape, limit) -> list[tuple[int, int]]:
    """Every (subgroups, step) of the matrix backward that both kernels tile
    within ``limit`` bytes of workgroup memory, the default (grad_tiling's) first."""
    _, _, seq, heads, kv_heads, d = shape
    out = []
    for s in SUBGROUP_CHOICES:
        for k in STEP_CHOICES:
            try:
                for kind in ("grad_kv", "grad_q"):
                    grad_tiling(kind, heads, kv_heads, d, seq, limit, s, k)
            except ValueError:
                continue
            out.append((s, k))
    default = grad_tiling("grad_kv", heads, kv_heads, d, seq, limit)
    return sorted(out, key=lambda sk: sk != (default.subgroups, default.step))


def shape_rows(device, shape, dtype, log, limit) -> ShapeRun:
    """Every kernel of ``shape`` in ``dtype``, checked and timed."""
    r, seq = ShapeRun(device, shape, dtype, log), shape[2]
    matrix = dtype == "f16" and FRAGMENT in getattr(device, "subgroup_matrix_configs", ())
    for pad in (True, False):
        r.run("forward", "attention", r.params(q_len=seq, kv_len=seq, dtype=dtype, pad=pad),
              FORWARD, ("o", "lse"), "" if pad else "unpadded")
    if matrix:
        r.run("forward", "attention_matrix", r.params(q_len=seq, kv_len=seq), FORWARD,
              ("o", "lse"), "matrix")
    r.want = reference(r.host, shape, device.read(r.bufs["o"]))  # delta of the stored o
    _, batch, _, heads, _, d = shape
    r.run("delta", "attention_delta", dict(batch=batch, heads=heads, head_dim=d, seq=seq,
                                           dtype=dtype), ("dout", "o", "lse", "stats"),
          ("stats",))
    for pad in (True, False):
        for kind, outs in (("grad_kv", ("dk", "dv")), ("grad_q", ("dq",))):
            r.run(kind, f"attention_{kind}", r.params(seq=seq, dtype=dtype, pad=pad),
                  BACKWARD + outs, outs, "" if pad else "unpadded")
    if matrix:
        for k, (subgroups, step) in enumerate(matrix_tilings(shape, limit)):
            for kind, outs in (("grad_kv", ("dk", "dv")), ("grad_q", ("dq",))):
                r.run(kind, f"attention_matrix_{kind}", r.params(
                    seq=seq, limit=limit, subgroups=subgroups, step=step), BACKWARD + outs, outs,
                    f"matrix {subgroups}x{step}{' (default)' if k == 0 else ''}")
    return r


def layer_sums(rows: list) -> dict:
    """Forward + delta + grad_kv + grad_q per dtype: the fastest kernel of each
    kind that passed its check, and what the model runs (the matrix forms with
    their default tilings for f16 where measured, else SIMT padded)."""
    out = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype and not r["wrong"]]
        kinds = {r["kind"] for r in mine}
        if kinds != set(PRODUCTS):
            continue
        fastest = sum(min(r["us"] for r in mine if r["kind"] == k) for k in PRODUCTS)

        def chosen(kind):
            pick = [r for r in mine if r["kind"] == kind and ("default" in r["variant"] or
                                                              r["variant"] == "matrix")]
            pick = pick or [r for r in mine if r["kind"] == kind and not r["variant"]]
            return pick[0]["us"]
        out[dtype] = {"fastest_us": fastest, "model_us": sum(chosen(k) for k in PRODUCTS)}
    return out


def torch_times(shape, dtype) -> dict:
    """torch SDPA forward and forward + backward microseconds, or why not."""
    torch = optional_torch()
    if torch is None:
        return {"torch": "not installed"}
    if not torch.cuda.is_available():
        return {"torch": f"{torch.__version__} without CUDA"}
    _, batch, seq, heads, kv_heads, d = shape
    dt = torch.float16 if dtype == "f16" else torch.float32
    q, k, v = (torch.randn(batch, h, seq, d, device="cuda", dtype=dt, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(batch, heads, seq, d, device="cuda", dtype=dt)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward():
        return sdpa(q, k, v, is_causal=True, enable_gqa=True)

    def both():
        forward().backward(dout)

    def timed(fn, reps=20) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(5):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000 / reps)
        return statistics.median(times)
    return {"torch": torch.__version__, "torch_forward_us": timed(forward),
            "torch_forward_backward_us": timed(both)}


def attention_main(out_dir: str, log, quick: bool = False, device=None, shapes=None) -> int:
    """Every shape of ``shapes`` (default SHAPES; --quick: QUICK_SHAPES) in f32
    and f16; the JSON rewritten after each."""
    device = device or get_device()
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    limit = device.limits.get("max-compute-workgroup-storage-size", 16384)
    fragments = FRAGMENT in getattr(device, "subgroup_matrix_configs", ())
    dtypes = ["f32"] + (["f16"] if device.has_feature("shader-f16") else [])
    log(f"adapter: {device.name}, {COMPILER}; workgroup memory {limit} bytes; "
        f"{FRAGMENT} fragments: {'yes' if fragments else 'no'}; dtypes {', '.join(dtypes)}")
    result = {"adapter": device.name, "compiler": COMPILER, "workgroup_bytes": limit,
              "fragments": fragments, "date": time.strftime("%Y-%m-%d %H:%M"), "shapes": []}
    path = os.path.join(out_dir, f"attention-{COMPILER}.json")
    for shape in shapes:
        log(f"{shape[0]}: batch {shape[1]}, seq {shape[2]}, heads {shape[3]}/{shape[4]}, "
            f"head_dim {shape[5]}")
        rows, torch = [], {}
        for dtype in dtypes:
            rows += shape_rows(device, shape, dtype, log, limit).rows
            try:
                torch[dtype] = torch_times(shape, dtype)
            except Exception as e:  # noqa: BLE001 (an SDPA backend may refuse a shape)
                torch[dtype] = {"torch": f"failed: {type(e).__name__}: {e}"}
        entry = {"shape": dict(zip(("label", "batch", "seq", "heads", "kv_heads", "head_dim"),
                                   shape)), "rows": rows, "torch": torch,
                 "layer": layer_sums(rows)}
        for dtype, sums in entry["layer"].items():
            theirs = torch[dtype].get("torch_forward_backward_us")
            versus = f"; torch SDPA {theirs:.1f} us" if theirs else f"; {torch[dtype]['torch']}"
            log(f"  {dtype} forward + backward: ours {sums['model_us']:.1f} us as the model "
                f"runs it, {sums['fastest_us']:.1f} us fastest kernels{versus}")
        result["shapes"].append(entry)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    log(f"wrote {path}")
    return 1 if any(r["wrong"] for s in result["shapes"] for r in s["rows"]) else 0
