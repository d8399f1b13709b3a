"""The plan builder of the forward ``output += scale * B @ (A @ x)``.

x and the output are stored like the weight (float32 or float16); the
scratch buffers (h, y) are float32; sums are f32 in every case."""
from __future__ import annotations

import numpy as np

from shaderdsl.errors import FeatureError

from .checks import check_f16
from .plan import Plan, Role
from .strategy import Strategy
from .weight import wgsl_dtype

LIKE_WEIGHT = " (the weight's dtype)"
FROM_BASE_KERNELS = ("fused_forward",)  # the kernels that can add to a base buffer


def forward_plan(device, weight, scale: float, tokens: int | None, strategy, *, given=(),
                 save_h: bool = False, max_tokens: int | None = None,
                 max_workgroups: int | None = None, from_base: bool = False) -> Plan:
    """The Plan of one forward of ``weight`` (a Strategy or its text). Its
    roles are ``x`` and ``output`` (positional in that order), then, with
    ``from_base``, ``base`` (output = base + the delta, for a strategy whose
    one dispatch is a FROM_BASE_KERNELS kernel; ValueError for others), then
    the scratch roles named in ``given`` (h, y: the caller passes them; the
    plan owns the others). ``save_h`` leaves h = A @ x in the "h" buffer for
    a backward, whatever the strategy. ``tokens`` None with ``max_tokens``: a
    run-time plan (see lora.core.plan)."""
    strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
    if strategy.subgroups and not device.has_feature("subgroup"):
        raise FeatureError(f"strategy {strategy} needs the 'subgroup' feature, which "
                           f"{device.name!r} ({device.backend}) lacks")
    check_f16(device, weight.dtype, f"Plan {strategy}")
    dt, r, i, o = weight.dtype, weight.rank, weight.in_dim, weight.out_dim
    roles = {"x": Role("input buffer", dt, (i,), why=LIKE_WEIGHT),
             "output": Role("output buffer", dt, (o,), writes=True, why=LIKE_WEIGHT)}
    kernels = strategy.kernels(r, i, o, scale, tokens, wgsl_dtype(dt), save_h)
    if from_base:
        if len(kernels) != 1 or kernels[0][0] not in FROM_BASE_KERNELS:
            raise ValueError(f"forward_plan: {strategy} adds to the output in place; from_base "
                             f"needs a one-dispatch strategy of {FROM_BASE_KERNELS}")
        kernels = [(kernels[0][0], dict(kernels[0][1], from_base=True), *kernels[0][2:])]
        roles["base"] = Role("base buffer", dt, (o,), why=LIKE_WEIGHT)
    columns = {"h": r, "y": o, "hp": r}
    rows = strategy.scratch(save_h)
    for role in given:
        if role not in rows or rows[role] != 1:
            raise ValueError(f"forward_plan: {strategy} has no scratch buffer {role!r} to give "
                             f"(it has {sorted(rows)})")
        roles[role] = Role(f"{role}_buf", np.float32, (columns[role],), writes=True)
    scratch = {role: (lambda t, k=k, c=columns[role]: (k * t, c))
               for role, k in rows.items() if role not in given}
    label = (f"{strategy} rank={r} in={i} out={o} scale={float(scale)} {dt.name}")
    return Plan(device, label, kernels, roles, bound={"A": weight.a, "B": weight.b},
                scratch=scratch, tokens=tokens, max_tokens=max_tokens,
                max_workgroups=max_workgroups, strategy=strategy, weight=weight)
