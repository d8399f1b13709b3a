"""The plan builder of the forward ``output += scale * B @ (A @ x)``.

x and the output are stored like the weight (float32 or float16); the
scratch buffers (h, y) are float32; sums are f32 in every case."""
from __future__ import annotations

import functools

import numpy as np

from shaderdsl.errors import FeatureError

from .checks import check_f16
from .plan import Plan, Role
from .strategy import Strategy

LIKE_WEIGHT = " (the weight's dtype)"
FROM_BASE_KERNELS = ("fused_forward",)  # the kernels that can add to a base buffer


def _rows_of(rows: int, columns: int, tokens: int) -> tuple[int, int]:
    """A scratch buffer's shape for ``tokens`` tokens."""
    return (rows * tokens, columns)


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
    dt = weight.dtype
    shape = weight.layer_shape(tokens, scale)
    roles = {"x": Role("input buffer", dt, (shape.in_dim,), why=LIKE_WEIGHT),
             "output": Role("output buffer", dt, (shape.out_dim,), writes=True, why=LIKE_WEIGHT)}
    kernels = strategy.kernels(shape, save_h)
    if from_base:
        if len(kernels) != 1 or kernels[0][0] not in FROM_BASE_KERNELS:
            raise ValueError(f"forward_plan: {strategy} adds to the output in place; from_base "
                             f"needs a one-dispatch strategy of {FROM_BASE_KERNELS}")
        kernels = [(kernels[0][0], dict(kernels[0][1], from_base=True), *kernels[0][2:])]
        roles["base"] = Role("base buffer", dt, (shape.out_dim,), why=LIKE_WEIGHT)
    sizes = strategy.scratch(shape, save_h)  # role -> (rows per token, columns)
    for role in given:
        if role not in sizes or sizes[role][0] != 1:
            raise ValueError(f"forward_plan: {strategy} has no scratch buffer {role!r} to give "
                             f"(it has {sorted(sizes)})")
        roles[role] = Role(f"{role}_buf", np.dtype(np.float32), (sizes[role][1],), writes=True)
    scratch = {role: functools.partial(_rows_of, rows, columns)
               for role, (rows, columns) in sizes.items() if role not in given}
    label = (f"{strategy} rank={shape.rank} in={shape.in_dim} out={shape.out_dim} "
             f"scale={shape.scale} {dt.name}")
    return Plan(device, label, kernels, roles, bound={"A": weight.a, "B": weight.b},
                scratch=scratch, tokens=tokens, max_tokens=max_tokens,
                max_workgroups=max_workgroups, strategy=strategy, weight=weight)
