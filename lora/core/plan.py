"""Plans: kernels resolved once to steps, scratch buffers and checked roles.

A Plan is the one way the lora package runs kernels: the forward, the
backward, the losses, the optimizers and the digits network are builders of
it (``lora.core.forward.forward_plan``, ``lora.training.backward.backward_plan``,
...), and the Hesper-named execute functions (``lora.hesper``) are plans of
fixed strategies. Building a Plan checks everything that depends on shapes
and the device (features, grid and binding-size limits, workgroup memory)
and compiles the pipelines; recording it is nothing but ``device.dispatch``
calls with arguments fixed in advance: no WGSL generation, no kernel lookup,
no shape logic. This is the hot path when the same layer runs again and again.

A Plan holds three kinds of buffer: ``bound`` ones fixed when it is built
(a weight's A and B, an optimizer's state), ``scratch`` ones it owns (h
between two dispatches), and the roles it is given each time it records
(x and the output), each with the dtype and shape :meth:`Plan.check` wants.

A Plan is made for one token count (``tokens=T``: T baked into the WGSL), or
for every count up to a bound (``tokens=None, max_tokens=M``): its kernels
then read T from a uniform, recording takes T from the first given buffer's
shape, computes each grid from it (splitting an axis over z past
max-compute-workgroups-per-dimension) and passes ``np.uint32(T)`` as the
uniform's value, so a new T compiles nothing.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from shaderdsl import checks
from shaderdsl.devicebuffer import DeviceBuffer
from shaderdsl.errors import BindingError, DeviceLostError, DispatchError
from shaderdsl.kernel import Kernel

from ..kernels import KERNELS
from .checks import count


@dataclass(frozen=True)
class Step:
    """One dispatch: a kernel, the buffer role of each binding, its grid.

    A run-time step (token count read from the uniform ``tokens``) has no
    grid of its own: ``rule(T)`` is its (x, y, z) grid for T tokens, before
    splitting (:func:`split_grid`)."""

    kernel: Kernel
    roles: tuple[str, ...]
    grid: object  # int, or (x, y, z); None for a run-time step
    rule: Callable[[int], tuple] | None = None


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
        if step.rule is None:
            raise ValueError(f"kernel {step.kernel.name!r}: its grid is baked in; only run-time "
                             f"steps launch per token count")
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



@dataclass(frozen=True)
class Role:
    """A buffer a plan is given when it records: the argument's name in
    messages, its dtype, and its shape: ``(tokens, *dims)`` when ``per_token``
    (or ``dims`` alone for one token), else ``dims``."""

    what: str
    dtype: np.dtype
    dims: tuple
    per_token: bool = True
    writes: bool = False
    why: str = ""  # said after the expected dtype and shape

    def shape(self, tokens: int) -> tuple:
        return ((tokens,) + self.dims) if self.per_token else self.dims

    def rows(self, shape: tuple) -> int:
        """Tokens a buffer of ``shape`` holds for this role (0: none fit)."""
        if shape == self.dims and self.per_token:
            return 1
        return shape[0] if self.per_token and shape[1:] == self.dims and shape else 0

    def nbytes(self, tokens: int) -> int:
        return int(np.prod(self.shape(tokens), dtype=np.int64)) * np.dtype(self.dtype).itemsize


BOUND_NAMES = {"A": "weight A", "B": "weight B"}  # how messages name bound buffers


class Plan:
    """Steps, buffers and roles of one piece of work for fixed shapes (see the
    module docstring). ``kernels``: (name in lora.kernels.KERNELS, parameters
    [, binding renames]) of each dispatch; ``roles``: role -> :class:`Role`,
    in the order positional buffers are given; ``bound``: role -> buffer;
    ``scratch``: role -> its f32 shape for a token count (owned, grown on
    demand by a run-time plan); ``scratch_dtypes``: role -> another dtype
    for some of them. ``label`` names the plan in messages;
    ``strategy`` and ``weight`` are kept for readers (the weight weakly: a
    plan cached on a weight goes with it). ``max_workgroups`` replaces the
    device's max-compute-workgroups-per-dimension (the tests split sooner)."""

    def __init__(self, device, label: str, kernels: list, roles: dict, *, bound=None,
                 scratch=None, tokens: int | None = 1, max_tokens: int | None = None,
                 max_workgroups: int | None = None, strategy=None, weight=None,
                 scratch_dtypes=None):
        if (tokens is None) == (max_tokens is None):
            raise ValueError(f"Plan: give tokens (baked) or tokens=None with max_tokens "
                             f"(run time), got tokens={tokens!r}, max_tokens={max_tokens!r}")
        self.max_tokens = count(tokens if tokens is not None else max_tokens,
                                 "Plan: the token count")
        self.device, self.label, self.tokens = device, label, tokens
        self.roles, self.args = dict(roles), tuple(roles)
        self.bound, self._shapes = dict(bound or {}), dict(scratch or {})
        self._dtypes = {r: np.dtype((scratch_dtypes or {}).get(r, np.float32))
                        for r in self._shapes}
        self.strategy = strategy
        self._weight = weakref.ref(weight) if weight is not None else lambda: None
        self._cap = max_workgroups or device.limits["max-compute-workgroups-per-dimension"]
        self.steps = build_steps(device, kernels, self._sizes(self.max_tokens),
                                 None if tokens else self.max_tokens, self._cap)
        self.dispatches = len(self.steps)
        self._launches: dict = {}  # run time: T -> steps with their grids, and the uniform value
        self._rows = 0  # tokens the own scratch buffers hold (a run-time plan grows them)
        self.scratch: dict = {}
        self.released = False
        if tokens is not None:
            self._grow(tokens)

    def _sizes(self, tokens: int) -> dict:
        """Bytes of the buffer in each role for ``tokens`` tokens."""
        return {**{r: spec.nbytes(tokens) for r, spec in self.roles.items()},
                **{r: b.bound_bytes for r, b in self.bound.items()},
                **{r: self._dtypes[r].itemsize * int(np.prod(shape(tokens), dtype=np.int64))
                   for r, shape in self._shapes.items()}}

    def _grow(self, tokens: int) -> None:
        """Own scratch buffers for at least ``tokens`` tokens (a run-time plan
        doubles them as larger counts come, up to max_tokens)."""
        rows = tokens if self.tokens else min(self.max_tokens, 1 << (tokens - 1).bit_length())
        for role, shape in self._shapes.items():
            old = self.scratch.get(role)
            self.scratch[role] = self.device.empty(shape(rows), self._dtypes[role],
                                                   name=f"lora_{role}")
            if old is not None:
                self.device.release(old)
        self._rows = rows

    @property
    def runtime(self) -> bool:
        """Whether the token count is read at run time (``tokens=None``)."""
        return self.tokens is None

    @property
    def weight(self):
        """The Weight this plan was made for (None once it is gone, or for none)."""
        return self._weight()

    @property
    def h(self):
        """The plan's own h scratch buffer, or None."""
        return self.scratch.get("h")

    def __repr__(self) -> str:
        tokens = self.tokens if self.tokens else f"1..{self.max_tokens}"
        return f"<Plan {self.label} tokens={tokens}>"

    def at(self, tokens: int) -> "PlanAt":
        """This run-time plan with its token count fixed (what the autotuner times)."""
        return PlanAt(self, tokens)

    def _given(self, args: tuple, named: dict) -> dict:
        if len(args) > len(self.args):
            raise TypeError(f"{self!r} takes {len(self.args)} buffers {self.args}, "
                            f"got {len(args)}")
        given = dict(zip(self.args, args), **named)
        unknown = set(given) - set(self.roles)
        if unknown:
            raise TypeError(f"{self!r} has no buffer role(s) {sorted(unknown)}; it takes "
                            f"{list(self.args)}")
        return given

    def check(self, *args, tokens: int | None = None, **named) -> int:
        """Every given buffer: live, on this device, its dtype and shape, none
        aliasing another where one is written; returns the token count. A
        run-time plan takes ``(T, *dims)`` buffers with 1 <= T <= max_tokens
        (or ``dims`` for one token); with ``tokens`` it uses their first rows."""
        given = self._given(args, named)
        for role, spec in self.roles.items():
            buf = given.get(role)
            if not isinstance(buf, DeviceBuffer) or buf.device is not self.device \
                    or buf.released:
                got = repr(buf) if isinstance(buf, DeviceBuffer) else type(buf).__name__
                hint = "" if isinstance(buf, DeviceBuffer) or buf is None else \
                    " (device.buffer(values) puts values on the device)"
                raise BindingError(f"{self!r}: {spec.what} must be a live Buffer on "
                                   f"{self.device!r}, got {got}{hint}")
        t = self._check_shapes(given, tokens) if self.tokens is None else \
            self._check_baked(given, self.tokens)
        checks.distinct(*((spec.what, given[r], spec.writes) for r, spec in self.roles.items()),
                        *((BOUND_NAMES.get(r, r), b, False) for r, b in self.bound.items()))
        return t

    def _check_baked(self, given: dict, tokens: int) -> int:
        """A baked plan's buffers: exactly its ``tokens`` rows of their dims."""
        for role, spec in self.roles.items():
            buf, want = given[role], spec.shape(tokens)
            ok = buf.shape == want or (tokens == 1 and spec.rows(buf.shape) == 1)
            if buf.dtype != spec.dtype or not ok:
                show = spec.dims if tokens == 1 and spec.per_token else want
                raise BindingError(f"{self!r}: {spec.what} must be {np.dtype(spec.dtype).name} "
                                   f"{show}{spec.why}, got {buf.dtype} {buf.shape}")
        return tokens

    def _check_shapes(self, given: dict, tokens) -> int:
        """A run-time plan's buffers: rows of their dims, as many of each (at
        least ``tokens`` where given), within max_tokens."""
        counts = {}
        for role, spec in self.roles.items():
            buf = given[role]
            n = spec.rows(buf.shape) if spec.per_token else int(buf.shape == spec.dims)
            if buf.dtype != spec.dtype or n < 1:
                want = f"(T, {', '.join(map(str, spec.dims))}) or {spec.dims}" \
                    if spec.per_token else str(spec.dims)
                raise BindingError(f"{self!r}: {spec.what} must be {np.dtype(spec.dtype).name} "
                                   f"{want}{spec.why}, got {buf.dtype} {buf.shape}")
            if spec.per_token:
                counts[spec.what] = n
        if tokens is None and len(set(counts.values())) > 1:
            raise BindingError(f"{self!r}: the buffers hold different token counts "
                               f"{counts}; they must agree")
        most = min(self.max_tokens, *counts.values())
        t = next(iter(counts.values())) if tokens is None else tokens
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 1 <= t <= most:
            raise BindingError(f"{self!r}: token count {t!r} must be an int from 1 to {most} "
                               f"(max_tokens {self.max_tokens}, rows {counts})")
        return int(t)

    def _launch(self, tokens: int) -> tuple:
        """(steps with grids, uniform value) for ``tokens``; kept per count."""
        if len(self._launches) >= 4096:
            self._launches.clear()
        hit = self._launches[tokens] = (launch(self.steps, tokens, self._cap), np.uint32(tokens))
        return hit

    def record(self, *args, tokens: int | None = None, **named) -> None:
        """Dispatch the steps; several go out in one submit (or join the open
        batch). A run-time plan takes the token count from the first given
        buffer's length, or ``tokens``. Call check() first for buffers not
        used before; the runtime validates bindings it has not seen. Holds the
        device's lock: threads sharing the plan share its scratch buffers."""
        with self.device.lock:
            try:
                self._record(args, tokens, named)
            except DeviceLostError as err:
                raise DeviceLostError(f"{self!r} was made on a device that is lost: {err}") \
                    from None

    def _record(self, args: tuple, tokens: int | None, named: dict) -> None:
        if self.released:
            raise BindingError(f"{self!r} was released; make a new plan")
        buffers = dict(self.bound)
        buffers.update(zip(self.args, args))
        buffers.update(named)
        if self.tokens is None:
            first = self.roles[self.args[0]]
            t = tokens or buffers[self.args[0]].size // max(1, int(np.prod(first.dims)))
            steps, buffers["tokens"] = self._launches.get(t) or self._launch(t)
            if t > self._rows and self._shapes:
                self._grow(t)
        else:
            steps = self.steps
        buffers.update(self.scratch)
        record_steps(self.device, steps, buffers)

    def __call__(self, *args, tokens: int | None = None, **named) -> None:
        self.check(*args, tokens=tokens, **named)
        self.record(*args, tokens=tokens, **named)

    def release(self) -> None:
        """Free the plan's scratch buffers now (it cannot record afterwards)."""
        for buf in self.scratch.values():
            self.device.release(buf)
        self.scratch, self.released = {}, True


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

    def check(self, *args, **named) -> int:
        return self.plan.check(*args, tokens=self.tokens, **named)

    def record(self, *args, **named) -> None:
        self.plan.record(*args, tokens=self.tokens, **named)

    def __call__(self, *args, **named) -> None:
        self.plan(*args, tokens=self.tokens, **named)

    def release(self) -> None:
        self.plan.release()
