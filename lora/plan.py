"""Plans: a LoRA forward resolved once to kernels, grids and scratch buffers.

Strategy -> Plan -> dispatches is the only way the lora package runs
kernels: the execute functions are plans of fixed strategies. Building a Plan
checks everything that depends on shapes and the device (features, grid and
binding-size limits, workgroup memory) and compiles the pipelines; recording
it is nothing but ``device.dispatch`` calls with arguments fixed in advance:
no WGSL generation, no kernel lookup, no shape logic. This is the hot path
when the same layer runs again and again.

A Plan is made for one token count (``tokens=T``: T baked into the WGSL), or
for every count up to a bound (``tokens=None, max_tokens=M``): its kernels
then read T from a uniform, recording takes T from the input buffer's shape,
computes each grid from it (splitting an axis over z past
max-compute-workgroups-per-dimension) and passes ``np.uint32(T)`` as the
uniform's value, so a new T compiles nothing.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, replace

import numpy as np

from shaderdsl import checks
from shaderdsl.errors import AliasingError, BindingError, DispatchError, FeatureError
from shaderdsl.kernel import Kernel

from .kernels import KERNELS
from .strategy import STRATEGIES, Strategy  # noqa: F401  (STRATEGIES re-exported)
from .weight import check_f16, wgsl_dtype


@dataclass(frozen=True)
class Step:
    """One dispatch: a kernel, the buffer role of each binding, its grid.

    A run-time step (token count read from the uniform ``tokens``) has no
    grid of its own: ``rule(T)`` is its (x, y, z) grid for T tokens, before
    splitting (:func:`split_grid`)."""

    kernel: Kernel
    roles: tuple[str, ...]
    grid: object  # int, or (x, y, z); None for a run-time step
    rule: object = None


def _grid_at(rule, params: dict, tokens: int) -> tuple[int, int, int]:
    return rule({**params, "tokens": tokens})


def split_grid(kernel, grid: tuple, cap: int) -> tuple[int, int, int]:
    """``grid`` (x, y, 1) with x or y over ``cap`` workgroups split over z:
    ``(ceil(x / z), y, z)`` with z = ceil(x / cap) (likewise for y). The run-time
    kernels index ``workgroup_id.x + workgroup_id.z * num_workgroups.x`` (or y)
    and return past the end, so the few extra workgroups do nothing."""
    x, y, z = grid
    if x <= cap and y <= cap:
        return grid
    if z != 1 or (x > cap and y > cap) or max(x, y) > cap * cap:
        raise DispatchError(f"kernel {kernel.name!r}: grid {grid} cannot be split over z within "
                            f"max-compute-workgroups-per-dimension = {cap}")
    n = max(x, y)
    parts = -(-n // cap)
    per = -(-n // parts)
    return (per, y, parts) if x > cap else (x, per, parts)


def build_steps(device, kernels: list[tuple], sizes: dict, max_tokens: int | None = None,
                max_workgroups: int | None = None) -> list[Step]:
    """Compile and check each (kernel name, parameters[, renames]): grid limits,
    the size of each binding (``sizes``: role -> bytes; a binding's role is its
    name unless renamed), then features, workgroup size and memory, WGSL.
    ``max_tokens``: run-time steps (parameters with ``tokens=None``), their
    grids checked at that many tokens. Raises before anything is recorded."""
    cap = max_workgroups or device.limits["max-compute-workgroups-per-dimension"]
    steps = []
    for name, params, *rename in kernels:
        spec = KERNELS[name]
        kernel = spec.kernel(**params)
        if max_tokens is None:
            grid, rule = checks.workgroups(kernel, spec.grid(**params), cap), None
        else:
            rule = functools.partial(_grid_at, spec.grid_rule, spec.params(**params))
            split_grid(kernel, rule(max_tokens), cap)
        roles = tuple((rename[0] if rename else {}).get(b.name, b.name) for b in kernel.bindings)
        for b, role in zip(kernel.bindings, roles):
            if b.access != "uniform":  # the token count: a value per dispatch
                where = f"kernel {kernel.name!r} binding {b.name!r} (@binding({b.index}))"
                checks.binding_size(where, sizes[role], device)
        steps.append(Step(kernel, roles, None, rule) if rule else
                     Step(kernel, roles, grid[0] if grid[1:] == (1, 1) else grid))
    for step in steps:
        device.prepare(step.kernel, uniform_values=step.rule is not None)
    return steps


def launch(steps: list[Step], tokens: int, cap: int) -> list[Step]:
    """Run-time steps with their grids for ``tokens`` (split past ``cap``)."""
    out = []
    for step in steps:
        grid = split_grid(step.kernel, step.rule(tokens), cap)
        out.append(replace(step, grid=grid[0] if grid[1:] == (1, 1) else grid))
    return out


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

    ``tokens``: the token count, baked into the kernels; or None with
    ``max_tokens``: a run-time plan for every count from 1 to max_tokens (the
    kernels read it from a uniform; checks of grids and binding sizes are
    made for max_tokens, grids over the device's limit are split over z).
    ``max_workgroups`` replaces the device's max-compute-workgroups-per-dimension
    (smaller values make the split happen sooner: the tests use it).

    ``scratch=False`` allocates no h/y buffers: the caller passes them to
    :meth:`record` (the Hesper-mirror execute functions do). ``save_h`` leaves
    h = A @ x in ``plan.h`` for a backward, whatever the strategy. A Plan holds
    the weight's buffers, not the Weight: plans cached for a weight go with it.
    """

    def __init__(self, device, weight, scale: float, tokens: int | None, strategy: Strategy, *,
                 scratch: bool = True, save_h: bool = False, max_tokens: int | None = None,
                 max_workgroups: int | None = None):
        if strategy.subgroups and not device.has_feature("subgroup"):
            raise FeatureError(f"strategy {strategy} needs the 'subgroup' feature, which "
                               f"{device.name!r} ({device.backend}) lacks")
        check_f16(device, weight.dtype, f"Plan {strategy}")
        if (tokens is None) == (max_tokens is None):
            raise ValueError(f"Plan: give tokens (baked) or tokens=None with max_tokens "
                             f"(run time), got tokens={tokens!r}, max_tokens={max_tokens!r}")
        bound = tokens if tokens is not None else max_tokens
        if isinstance(bound, bool) or not isinstance(bound, (int, np.integer)) or bound < 1:
            raise ValueError(f"Plan: the token count must be an int >= 1, got {bound!r}")
        self.device, self.scale, self.tokens = device, float(scale), tokens
        self.max_tokens = int(bound)
        self.strategy, self.dtype = strategy, weight.dtype
        self._weight = weakref.ref(weight)
        self.a, self.b = weight.a, weight.b
        self.rank, self.in_dim, self.out_dim = weight.rank, weight.in_dim, weight.out_dim
        # the activations' shapes (a run-time plan takes any count: see check())
        self.x_shape = None if tokens is None else \
            (self.in_dim,) if tokens == 1 else (tokens, self.in_dim)
        self.out_shape = None if tokens is None else \
            (self.out_dim,) if tokens == 1 else (tokens, self.out_dim)
        self._cap = max_workgroups or device.limits["max-compute-workgroups-per-dimension"]
        self.steps = build_steps(device, strategy.kernels(
            self.rank, self.in_dim, self.out_dim, self.scale, tokens, wgsl_dtype(weight.dtype),
            save_h), self._sizes(self.max_tokens), None if tokens else self.max_tokens, self._cap)
        self.dispatches = len(self.steps)
        self._launches: dict = {}  # run time: T -> steps with their grids, and the uniform value
        self._roles = strategy.scratch(save_h) if scratch else ()
        self._rows = 0  # run time: tokens the own scratch buffers hold (grown on demand)
        self.scratch = {}
        if tokens is not None:
            self._grow(tokens)

    def _sizes(self, tokens: int) -> dict:
        """Bytes of the buffer in each role for ``tokens`` tokens."""
        item = self.dtype.itemsize
        return {"A": self.a.bound_bytes, "B": self.b.bound_bytes,
                "x": tokens * self.in_dim * item, "output": tokens * self.out_dim * item,
                "h": 4 * tokens * self.rank, "y": 4 * tokens * self.out_dim,
                "hp": 4 * tokens * self.rank * self.strategy.splits}

    def _grow(self, tokens: int) -> None:
        """Own scratch buffers for at least ``tokens`` tokens (a run-time plan
        doubles them as larger counts come, up to max_tokens)."""
        rows = tokens if self.tokens else min(self.max_tokens, 1 << (tokens - 1).bit_length())
        shapes = {"h": (rows, self.rank), "y": (rows, self.out_dim),
                  "hp": (rows * self.strategy.splits, self.rank)}
        for role in self._roles:
            old = self.scratch.get(role)
            self.scratch[role] = self.device.empty(shapes[role], np.float32, name=f"lora_{role}")
            if old is not None:
                self.device.release(old)
        self._rows = rows

    @property
    def runtime(self) -> bool:
        """Whether the token count is read at run time (``tokens=None``)."""
        return self.tokens is None

    @property
    def weight(self):
        """The Weight this plan was made for (None once it is gone; the plan
        keeps the buffers it records with)."""
        return self._weight()

    @property
    def h(self):
        """The plan's own h scratch buffer, or None (a run-time plan's holds
        at least as many rows as the largest token count recorded)."""
        return (self.scratch or {}).get("h")

    def __repr__(self) -> str:
        tokens = self.tokens if self.tokens else f"1..{self.max_tokens}"
        return (f"<Plan {self.strategy} rank={self.rank} in={self.in_dim} out={self.out_dim} "
                f"tokens={tokens} scale={self.scale} {self.dtype.name}>")

    def at(self, tokens: int) -> "PlanAt":
        """This run-time plan with its token count fixed (what the autotuner times)."""
        return PlanAt(self, tokens)

    def check(self, x_buf, out_buf, tokens: int | None = None) -> None:
        """Shapes and dtypes of the activation buffers, before anything is
        recorded. A run-time plan takes ``(T, dim)`` buffers with 1 <= T <=
        max_tokens (or ``(dim,)`` for one token); with ``tokens`` it uses the
        first ``tokens`` rows of buffers that may hold more."""
        for what, buf in (("input", x_buf), ("output", out_buf)):
            if not isinstance(buf, checks.DeviceBuffer) or buf.device is not self.device \
                    or buf.released:
                got = repr(buf) if isinstance(buf, checks.DeviceBuffer) else type(buf).__name__
                raise BindingError(f"{self!r}: {what} buffer must be a live Buffer on "
                                   f"{self.device!r}, got {got}")
        if self.tokens is None:
            self._check_rows(x_buf, out_buf, tokens)
        else:
            for what, buf, shape in (("input", x_buf, self.x_shape),
                                     ("output", out_buf, self.out_shape)):
                ok = {shape, (1, shape[0])} if self.tokens == 1 else {shape}
                if buf.dtype != self.dtype or buf.shape not in ok:
                    raise BindingError(f"{self!r}: {what} buffer must be {self.dtype.name} "
                                       f"{shape} (the weight's dtype), got {buf.dtype} "
                                       f"{buf.shape}")
        for name, buf in (("input", x_buf), ("weight A", self.a), ("weight B", self.b)):
            if out_buf is buf:
                raise AliasingError(f"{self!r}: the output buffer is also the {name} buffer")

    def _check_rows(self, x_buf, out_buf, tokens) -> None:
        """A run-time plan's activations: rows of in_dim and out_dim, as many of
        each (at least ``tokens`` where given), within max_tokens."""
        counts = []
        for what, buf, dim in (("input", x_buf, self.in_dim), ("output", out_buf, self.out_dim)):
            shape = buf.shape
            n = 1 if shape == (dim,) else shape[0] if len(shape) == 2 and shape[1] == dim else 0
            if buf.dtype != self.dtype or n < 1:
                raise BindingError(f"{self!r}: {what} buffer must be {self.dtype.name} (T, {dim}) "
                                   f"or ({dim},) (the weight's dtype), got {buf.dtype} {shape}")
            counts.append(n)
        if tokens is None and counts[0] != counts[1]:
            raise BindingError(f"{self!r}: the input buffer holds {counts[0]} token(s) and the "
                               f"output buffer {counts[1]}; they must agree")
        t = counts[0] if tokens is None else tokens
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or \
                not 1 <= t <= min(self.max_tokens, *counts):
            raise BindingError(f"{self!r}: token count {t!r} must be an int from 1 to "
                               f"{min(self.max_tokens, *counts)} (max_tokens "
                               f"{self.max_tokens}, input rows {counts[0]}, output rows "
                               f"{counts[1]})")

    def _launch(self, tokens: int) -> tuple:
        """(steps with grids, uniform value) for ``tokens``; kept per count."""
        if len(self._launches) >= 4096:
            self._launches.clear()
        hit = self._launches[tokens] = (launch(self.steps, tokens, self._cap), np.uint32(tokens))
        return hit

    def record(self, x_buf, out_buf, *, tokens: int | None = None, **scratch) -> None:
        """Dispatch the forward; several dispatches go out in one submit (or join
        the open batch). ``scratch`` (h, y) replaces the plan's own. A run-time
        plan takes the token count from ``x_buf``'s length, or ``tokens``.
        Call check() first for buffers not used before; the runtime validates
        bindings it has not seen."""
        if self.scratch is None:
            raise BindingError(f"{self!r} was released; make a new Plan")
        buffers = {"A": self.a, "B": self.b, "x": x_buf, "output": out_buf}
        if self.tokens is None:
            t = tokens or x_buf.size // self.in_dim
            steps, buffers["tokens"] = self._launches.get(t) or self._launch(t)
            if t > self._rows and self._roles:
                self._grow(t)
        else:
            steps = self.steps
        if self.scratch:
            buffers.update(self.scratch)
        if scratch:
            buffers.update(scratch)
        record_steps(self.device, steps, buffers)

    def __call__(self, x_buf, out_buf, *, tokens: int | None = None) -> None:
        self.check(x_buf, out_buf, tokens)
        self.record(x_buf, out_buf, tokens=tokens)

    def release(self) -> None:
        """Free the plan's scratch buffers now (it cannot record afterwards)."""
        for buf in (self.scratch or {}).values():
            self.device.release(buf)
        self.scratch = None


class PlanAt:
    """A run-time :class:`Plan` bound to one token count: ``record``, ``check``
    and calls use the first ``tokens`` rows of the buffers given. It has the
    attributes the autotuner reads (``tokens``, ``strategy``, ``weight``,
    ``dispatches``)."""

    def __init__(self, plan: Plan, tokens: int):
        if plan.tokens is not None:
            raise ValueError(f"{plan!r} has a fixed token count; at() is for run-time plans")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or \
                not 1 <= tokens <= plan.max_tokens:
            raise ValueError(f"{plan!r}: tokens must be an int from 1 to {plan.max_tokens}, "
                             f"got {tokens!r}")
        self.plan, self.tokens = plan, int(tokens)
        self.strategy, self.dispatches, self.device = plan.strategy, plan.dispatches, plan.device

    @property
    def weight(self):
        return self.plan.weight

    def __repr__(self) -> str:
        return f"<{self.plan!r} at {self.tokens} tokens>"

    def check(self, x_buf, out_buf) -> None:
        self.plan.check(x_buf, out_buf, self.tokens)

    def record(self, x_buf, out_buf, **scratch) -> None:
        self.plan.record(x_buf, out_buf, tokens=self.tokens, **scratch)

    def __call__(self, x_buf, out_buf) -> None:
        self.plan(x_buf, out_buf, tokens=self.tokens)
