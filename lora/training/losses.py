"""Losses as plans: the gradient g = dL/d(out) and the loss's partial sums,
both owned by the plan (``plan.scratch["g"]`` feeds the backward)."""
from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from ..core.plan import Plan, Role
from ..core.weight import wgsl_dtype
from ..kernels.common import width

LOSSES = ("mse", "xent")
MSE_THREADS = 256  # the mse kernel sums a workgroup's squares into one partial


def mse_parts(n: int) -> int:
    """The mse kernel's workgroups for n values: its partial sums (and dh parts)."""
    return -(-n // (width(n) * MSE_THREADS))


def loss_plan(device, kind: str, tokens: int, columns: int, dtype: DTypeLike = np.float32,
              begin=None, dh=None, seen=False) -> Plan:
    """``kind`` "mse": given the output and a target, both ``dtype`` (f32 or
    f16) [tokens, columns]; "xent": softmax cross-entropy of the output as
    logits against u32 labels [tokens]. It owns g [tokens, columns], stored
    as ``dtype``, and the f32 partial sums ("partial": one per workgroup for
    mse; "losses": one per token for xent). Sums are f32 either way.
    ``begin``: an optimizer's (schedule, state, hyper) (``folded_begin()``):
    the loss's dispatch then also advances its step. ``dh``: (B, scale,
    the dh buffer [mse_parts(columns), rank]) at one token with mse: the
    dispatch also writes the backward's dh = scale g B in parts. ``seen``
    (xent): it also owns "seen", the sticky record of labels outside the
    classes that :func:`report_labels` reads and clears."""
    if kind not in LOSSES:
        raise ValueError(f"loss: expected one of {LOSSES}, got {kind!r}")
    dt, n = np.dtype(dtype), tokens * columns
    wgsl = wgsl_dtype(dt)
    if kind == "mse":
        params: dict[str, object] = dict(n=n, dtype=wgsl,
                                         subgroups=device.has_feature("subgroup"))
        roles = {"out": Role("output buffer", dt, (columns,)),
                 "want": Role("target buffer", dt, (columns,))}
        sums = {"partial": mse_parts(n)}
    else:
        params = dict(classes=columns, tokens=tokens, threads=64, dtype=wgsl)
        roles = {"logits": Role("output buffer", dt, (columns,)),
                 "labels": Role("labels buffer", np.dtype(np.uint32), ())}
        sums = {"losses": tokens}
        if seen:
            params["seen"] = True
            sums["seen"] = 3 * tokens
    bound = {}
    if dh is not None:
        if kind != "mse" or tokens != 1:
            raise ValueError(f"loss_plan: dh in parts needs mse at one token, got {kind} at "
                             f"{tokens}")
        bound["B"], scale, bound["dh"] = dh
        params.update(dh_rank=bound["B"].shape[1], dh_scale=float(scale))
    if begin is not None:
        schedule, bound["state"], bound["hyper"] = begin
        params["begin"] = schedule
    scratch = {"g": lambda t: (t, columns), **{k: (lambda t, v=v: (v,)) for k, v in sums.items()}}
    kernel = ("mse" if kind == "mse" else "softmax_xent", params)
    return Plan(device, f"loss {kind} tokens={tokens} columns={columns} {dt.name}", [kernel],
                roles, bound=bound, scratch=scratch, tokens=tokens,
                scratch_dtypes={"g": dt, "seen": np.uint32})


def loss_value(device, plan: Plan) -> float:
    """The last recorded loss of a loss plan (reads back: waits for the GPU).
    With a "seen" record, the mean over the tokens whose label was in range
    (call report_labels first: it raises for the others)."""
    if "partial" in plan.scratch:
        n = plan.tokens * plan.roles["out"].dims[0]
        return float(device.read(plan.scratch["partial"]).astype(np.float64).sum() / n)
    losses = device.read(plan.scratch["losses"])
    if "seen" in plan.scratch:  # out-of-range labels are reported from the record
        kept = losses[losses >= 0].astype(np.float64)
        return float(kept.mean()) if kept.size else float("nan")
    return mean_xent(losses, plan.roles["logits"].dims[0])


def report_labels(device, plan: Plan) -> None:
    """ValueError naming the first step (counted from 1) and token whose label
    was outside the classes since the last report, from the loss plan's
    sticky record (reads it back: waits for the GPU), which is then cleared;
    nothing for a plan without one."""
    buf = plan.scratch.get("seen")
    if buf is None:
        return
    tokens, classes = plan.tokens, plan.roles["logits"].dims[0]
    seen = device.read(buf).reshape(3, tokens)
    bad = np.flatnonzero(seen[1])
    if not bad.size:
        return
    first = bad[np.argmin(seen[1, bad])]  # the earliest step, its first token
    step, label = int(seen[1, first]), int(seen[2, first])
    seen[1:] = 0
    device.write(buf, seen.reshape(-1))
    raise ValueError(f"labels: label {label} at token {first} of step {step} (counting this "
                     f"trainer's steps from 1) is outside 0..{classes - 1} (the output has "
                     f"{classes} classes); that step trained without the token (its gradient "
                     f"was zero); {bad.size} token(s) had a label out of range since the last "
                     f"report")


def mean_xent(losses: np.ndarray, classes: int) -> float:
    """The mean of softmax_xent's per-token losses; ValueError where the kernel
    marked a label outside the ``classes`` (a negative loss, -1 - label)."""
    losses = losses.astype(np.float64)
    bad = np.flatnonzero(losses < 0)
    if bad.size:
        raise ValueError(f"labels: label {int(-losses[bad[0]] - 1)} at token {bad[0]} is "
                         f"outside 0..{classes - 1} (the output has {classes} classes; "
                         f"{bad.size} token(s) out of range, their gradient was zero)")
    return float(losses.mean())
