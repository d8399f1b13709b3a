"""Plans: a LoRA forward resolved once to kernels, grids and scratch buffers.

Strategy -> Plan -> dispatches is the only way the lora package runs
kernels: the execute functions are plans of fixed strategies. Building a Plan
checks everything that depends on shapes and the device (features, grid and
binding-size limits, workgroup memory) and compiles the pipelines; recording
it is nothing but ``device.dispatch`` calls with arguments fixed in advance:
no WGSL generation, no kernel lookup, no shape logic. This is the hot path
when the same layer runs again and again.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from shaderdsl import checks
from shaderdsl.errors import AliasingError, BindingError, FeatureError
from shaderdsl.kernel import Kernel

from .kernels import KERNELS
from .strategy import STRATEGIES, Strategy  # noqa: F401  (STRATEGIES re-exported)
from .weight import check_f16, wgsl_dtype


@dataclass(frozen=True)
class Step:
    """One dispatch: a kernel, the buffer role of each binding, its grid."""

    kernel: Kernel
    roles: tuple[str, ...]
    grid: object  # int, or (x, y, z)


def build_steps(device, kernels: list[tuple], sizes: dict) -> list[Step]:
    """Compile and check each (kernel name, parameters[, renames]): grid limits,
    the size of each binding (``sizes``: role -> bytes; a binding's role is its
    name unless renamed), then features, workgroup size and memory, WGSL.
    Raises before anything is recorded."""
    steps = []
    for name, params, *rename in kernels:
        spec = KERNELS[name]
        kernel = spec.kernel(**params)
        grid = checks.workgroups(kernel, spec.grid(**params),
                                 device.limits["max-compute-workgroups-per-dimension"])
        roles = tuple((rename[0] if rename else {}).get(b.name, b.name) for b in kernel.bindings)
        for b, role in zip(kernel.bindings, roles):
            where = f"kernel {kernel.name!r} binding {b.name!r} (@binding({b.index}))"
            checks.binding_size(where, sizes[role], device)
        steps.append(Step(kernel, roles, grid[0] if grid[1:] == (1, 1) else grid))
    for step in steps:
        device.prepare(step.kernel)
    return steps


def record_steps(device, steps: list[Step], buffers: dict) -> None:
    """Dispatch every step; several go out in one submit (or join the open batch)."""
    dispatch = device.dispatch
    if len(steps) == 1 or device.in_batch:
        for step in steps:
            dispatch(step.kernel, [buffers[r] for r in step.roles], step.grid)
        return
    with device.batch():
        for step in steps:
            dispatch(step.kernel, [buffers[r] for r in step.roles], step.grid)


class Plan:
    """One forward ``output += scale * B @ (A @ x)`` for fixed shapes, ready to
    record. x and output are stored like the weight (float32 or float16).

    ``scratch=False`` allocates no h/y buffers: the caller passes them to
    :meth:`record` (the Hesper-mirror execute functions do). ``save_h`` leaves
    h = A @ x in ``plan.h`` for a backward, whatever the strategy. A Plan holds
    the weight's buffers, not the Weight: plans cached for a weight go with it.
    """

    def __init__(self, device, weight, scale: float, tokens: int, strategy: Strategy, *,
                 scratch: bool = True, save_h: bool = False):
        if strategy.subgroups and not device.has_feature("subgroup"):
            raise FeatureError(f"strategy {strategy} needs the 'subgroup' feature, which "
                               f"{device.name!r} ({device.backend}) lacks")
        check_f16(device, weight.dtype, f"Plan {strategy}")
        self.device, self.scale, self.tokens = device, float(scale), tokens
        self.strategy, self.dtype = strategy, weight.dtype
        self._weight = weakref.ref(weight)
        self.a, self.b = weight.a, weight.b
        self.rank, self.in_dim, self.out_dim = weight.rank, weight.in_dim, weight.out_dim
        self.x_shape = (self.in_dim,) if tokens == 1 else (tokens, self.in_dim)
        self.out_shape = (self.out_dim,) if tokens == 1 else (tokens, self.out_dim)
        self._scratch_shapes = {"h": (tokens, self.rank), "y": (tokens, self.out_dim)}
        self.steps = build_steps(device, strategy.kernels(
            self.rank, self.in_dim, self.out_dim, self.scale, tokens, wgsl_dtype(weight.dtype),
            save_h), self._sizes())
        self.dispatches = len(self.steps)
        self.scratch = {role: device.empty(self._scratch_shapes[role], np.float32,
                                           name=f"lora_{role}")
                        for role in strategy.scratch(save_h)} if scratch else {}

    def _sizes(self) -> dict:
        """Bytes of the buffer in each role."""
        item = self.dtype.itemsize
        return {"A": self.a.bound_bytes, "B": self.b.bound_bytes,
                "x": self.tokens * self.in_dim * item, "output": self.tokens * self.out_dim * item,
                **{role: 4 * int(np.prod(shape)) for role, shape in self._scratch_shapes.items()}}

    @property
    def weight(self):
        """The Weight this plan was made for (None once it is gone; the plan
        keeps the buffers it records with)."""
        return self._weight()

    @property
    def h(self):
        """The plan's own h scratch buffer, or None."""
        return (self.scratch or {}).get("h")

    def __repr__(self) -> str:
        return (f"<Plan {self.strategy} rank={self.rank} in={self.in_dim} out={self.out_dim} "
                f"tokens={self.tokens} scale={self.scale} {self.dtype.name}>")

    def check(self, x_buf, out_buf) -> None:
        """Shapes and dtypes of the activation buffers, before anything is recorded."""
        for what, buf, shape in (("input", x_buf, self.x_shape), ("output", out_buf, self.out_shape)):
            if not isinstance(buf, checks.DeviceBuffer) or buf.device is not self.device \
                    or buf.released:
                got = repr(buf) if isinstance(buf, checks.DeviceBuffer) else type(buf).__name__
                raise BindingError(f"{self!r}: {what} buffer must be a live Buffer on "
                                   f"{self.device!r}, got {got}")
            ok = {shape, (1, shape[0])} if self.tokens == 1 else {shape}
            if buf.dtype != self.dtype or buf.shape not in ok:
                raise BindingError(f"{self!r}: {what} buffer must be {self.dtype.name} {shape} "
                                   f"(the weight's dtype), got {buf.dtype} {buf.shape}")
        for name, buf in (("input", x_buf), ("weight A", self.a), ("weight B", self.b)):
            if out_buf is buf:
                raise AliasingError(f"{self!r}: the output buffer is also the {name} buffer")

    def record(self, x_buf, out_buf, **scratch) -> None:
        """Dispatch the forward; several dispatches go out in one submit (or join
        the open batch). ``scratch`` (h, y) replaces the plan's own. Call
        check() first for buffers not used before; the runtime validates
        bindings it has not seen."""
        if self.scratch is None:
            raise BindingError(f"{self!r} was released; make a new Plan")
        buffers = {"A": self.a, "B": self.b, "x": x_buf, "output": out_buf}
        if self.scratch:
            buffers.update(self.scratch)
        if scratch:
            buffers.update(scratch)
        record_steps(self.device, self.steps, buffers)

    def __call__(self, x_buf, out_buf) -> None:
        self.check(x_buf, out_buf)
        self.record(x_buf, out_buf)

    def release(self) -> None:
        """Free the plan's scratch buffers now (it cannot record afterwards)."""
        for buf in (self.scratch or {}).values():
            self.device.release(buf)
        self.scratch = None
