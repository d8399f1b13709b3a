"""Optimizers on the GPU: AdamW and SGD with momentum, global-norm clipping and
learning-rate schedules, with the step count kept on the GPU.

Two ways to use one:

- buffer level, for a training loop that stays on the GPU: ``attach`` the
  (parameter, gradient) buffers once, then ``record()`` the step inside the
  batch that also runs the forward and backward (see lora.training.trainer);
- numpy in, numpy out: ``new_params = opt.step(params, grads)``, which keeps
  the moments on the GPU between calls.

The update is exactly torch.optim.AdamW's (see lora.reference.adamw_step for
the formula in the order it is computed); SGD is torch.optim.SGD's with
dampening 0. Changing ``lr`` (or any setting) rewrites a small buffer: no
kernel is rebuilt. A schedule (constant, linear warm-up, cosine) is evaluated
on the GPU from the step count, so it costs nothing per step.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from shaderdsl.errors import BindingError

from ..core.plan import Plan
from ..kernels.optimizer import (
    HYPER,
    HYPER_SIZE,
    MAX_PARTIAL_TENSORS,
    MAX_UPDATE_TENSORS,
    SCHEDULES,
    STATE,
    STATE_SIZE,
    norm_workgroups,
)

# (low, high, high excluded) of the settings not in [0, inf): AdamW's betas below
# 1 as torch requires (beta2 = 1 made the first step NaN)
LIMITS = {"beta1": (0.0, 1.0, True), "beta2": (0.0, 1.0, True), "momentum": (0.0, 1.0, False),
          "min_ratio": (0.0, 1.0, False)}


def _setting(key: str, value, what: str | None = None) -> float:
    """Setting ``key``'s value checked against LIMITS (``what``: its name in the message)."""
    low, high, below = LIMITS.get(key, (0.0, math.inf, False))
    return _real(value, what or key, low, high, below)


def _real(value, what: str, low: float = 0.0, high: float = math.inf,
          below_high: bool = False) -> float:
    """A finite number in [low, high] (or [low, high) with ``below_high``)."""
    top = ")" if below_high else "]"
    real = not isinstance(value, bool) and isinstance(value, numbers.Real)
    v = float(value) if real else math.nan
    if not (math.isfinite(v) and low <= v <= high) or (below_high and v == high):
        raise ValueError(f"{what}: expected a finite number in [{low}, {high}{top}, got "
                         f"{value!r}")
    return v


def check_free(optimizer, who: str) -> None:
    """A TypeError unless ``optimizer`` is a lora.AdamW or lora.SGD, a
    RuntimeError where it is attached already: a second trainer re-attaching it
    would leave the first one's steps updating the second one's parameters."""
    if not isinstance(optimizer, _Optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        module = getattr(optimizer, "__module__", "") or ""
        ours = f"lora.{name}(lr=...)" if name in ("AdamW", "SGD") else "lora.AdamW(lr=...)"
        hint = (f" (torch.optim.{name} is torch's: give {ours}, torch's update on the GPU)"
                if module.startswith("torch") else "")
        raise TypeError(f"{who}: optimizer: expected a lora.AdamW or lora.SGD, got "
                        f"{name}{hint}")
    if optimizer.groups is not None:
        raise RuntimeError(f"{who}: this {type(optimizer).__name__} already updates "
                           f"{len(optimizer.groups)} parameter(s) (of another trainer or "
                           f"network, or of its own step()); it holds one set of moments and "
                           f"one step count, so give each trainer its own: "
                           f"lora.{type(optimizer).__name__}(lr=...)")


class _Optimizer:
    """What AdamW and SGD share: settings, buffers, the recorded step."""

    update_kernel = ""
    extra_role = ""  # the role of the per-tensor state buffer (moments, momentum)

    @staticmethod
    def _extra_size(n: int) -> int:
        """f32 values of per-tensor state for ``n`` parameters."""
        raise NotImplementedError

    def __init__(self, lr, *, max_grad_norm=None, schedule="constant", warmup=0, total=0,
                 min_ratio=0.0, device=None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if schedule == "cosine" and total <= warmup:
            raise ValueError(f"schedule 'cosine' needs total > warmup, got total={total}, "
                             f"warmup={warmup}")
        self.settings = {"lr": _real(lr, "lr"), "max_norm": 0.0 if max_grad_norm is None else
                         _real(max_grad_norm, "max_grad_norm"),
                         "warmup": _real(warmup, "warmup"), "total": _real(total, "total"),
                         "min_ratio": _setting("min_ratio", min_ratio)}
        self.grad_scale = 1.0  # the factor on every gradient, undoing a loss scale
        self.schedule, self.device = schedule, device
        self.groups = None  # [(param, grad), ...] once attached

    # ------------------------------------------------------------ buffer level

    def attach(self, device, params: list) -> None:
        """Use ``params``: a list of (parameter buffer, gradient buffer), f32, on
        ``device``. Allocates the moments, the state and the settings buffers.
        Once only: an optimizer holds one set of moments and one step count."""
        check_free(self, f"{type(self).__name__}.attach")
        pairs = list(params)
        for k, (p, g) in enumerate(pairs):
            for what, buf in ((f"params[{k}]", p), (f"grads[{k}]", g)):
                if getattr(buf, "device", None) is not device or buf.dtype != np.float32:
                    raise BindingError(f"{type(self).__name__}.attach: {what} must be a float32 "
                                       f"Buffer on {device!r}, got {buf!r}")
            if p.size != g.size:
                raise BindingError(f"{type(self).__name__}.attach: params[{k}] has {p.size} "
                                   f"values, its gradient {g.size}")
        self.device, self.groups = device, pairs
        self.hyper = device.buffer(self._hyper(), name="optim.hyper")
        self.state = device.empty(STATE_SIZE, np.float32, name="optim.state")
        self.extra = [device.empty(self._extra_size(sum(p.size for p, _ in chunk)), np.float32,
                                   name="optim.moments") for chunk in self._chunks()]
        self._begin, self._updates = self._build()

    def _attached(self, what: str) -> tuple:
        """(device, [(param, grad), ...]) once attached, else a RuntimeError."""
        if self.groups is None or self.device is None:
            raise RuntimeError(f"{type(self).__name__}.{what}: attach(device, params) first")
        return self.device, self.groups

    def _chunks(self) -> list:
        _, pairs = self._attached("attach")
        return [pairs[i:i + MAX_UPDATE_TENSORS] for i in range(0, len(pairs), MAX_UPDATE_TENSORS)]

    def _build(self) -> tuple[list, list]:
        """The plans of one step: with clipping the gradients' norm_partials
        first, then the begin, then one update per chunk of tensors."""
        device, groups = self._attached("attach")
        name = type(self).__name__
        begin, bound = [], {"state": self.state, "hyper": self.hyper}
        if self.settings["max_norm"]:
            begin = self._norm_plans([g for _, g in groups])
            bound["partials"] = self.partials
        begin.append(Plan(device, f"{name} begin", [("optim_begin", dict(
            partials=self.partials.size if begin else 0, schedule=self.schedule))], {},
            bound=bound))
        updates = []
        for chunk, extra in zip(self._chunks(), self.extra):
            bound = {"state": self.state, "hyper": self.hyper, self.extra_role: extra}
            for k, (p, g) in enumerate(chunk):
                bound[f"p{k}"], bound[f"g{k}"] = p, g
            updates.append(Plan(device, f"{name} update", [(self.update_kernel, dict(
                sizes=tuple(p.size for p, _ in chunk)))], {}, bound=bound))
        return begin, updates

    def _norm_plans(self, grads: list) -> list:
        """norm_partials over ``grads`` in groups of MAX_PARTIAL_TENSORS, each
        gradient's chunks' sums of squares into their slots of ``self.partials``."""
        device, _ = self._attached("attach")
        counts = norm_workgroups([g.size for g in grads])
        self.partials = device.empty(sum(counts), np.float32, name="optim.norm_partials")
        plans = []
        for first in range(0, len(grads), MAX_PARTIAL_TENSORS):
            group = grads[first:first + MAX_PARTIAL_TENSORS]
            plans.append(Plan(device, f"{type(self).__name__} norm", [("norm_partials", dict(
                grad_sizes=tuple(g.size for g in group), first=sum(counts[:first]),
                slots=sum(counts)))], {},
                bound={**{f"g{k}": g for k, g in enumerate(group)},
                       "partials": self.partials}))
        return plans

    def record(self, begin: bool = True) -> None:
        """Record one optimizer step (joins the open batch, or one submit).
        ``begin=False``: without the step's begin, which an earlier dispatch
        of the same step ran (``folded_begin``)."""
        device, _ = self._attached("record")
        with device.batch():
            for plan in self.plans(begin):
                plan.record()

    def plans(self, begin: bool = True) -> list:
        """The plans of one step, in order (``begin=False``: as :meth:`record`)."""
        self._attached("plans")
        return (self._begin if begin else []) + self._updates

    def folded_begin(self):
        """(schedule, state, hyper) for another kernel of the step to run the
        begin in (lora.kernels.optimizer.advance), or None where the begin
        needs the gradients (clipping) or nothing is attached."""
        if self.groups is None or self.settings["max_norm"]:
            return None
        return self.schedule, self.state, self.hyper

    def set(self, **settings) -> None:
        """Change settings (lr=..., weight_decay=..., ...) from the next step on."""
        for key, value in settings.items():
            if key not in self.settings:
                raise ValueError(f"{type(self).__name__}.set: unknown setting {key!r}; it has "
                                 f"{sorted(self.settings)}")
            if key == "max_norm" and self.groups is not None and \
                    bool(value) != bool(self.settings["max_norm"]):
                raise ValueError(f"{type(self).__name__}.set: max_norm: clipping was "
                                 f"{'on' if self.settings['max_norm'] else 'off'} when the "
                                 f"optimizer was attached, and its kernels were built so; "
                                 f"make a new optimizer with max_grad_norm=... to turn it "
                                 f"{'off' if self.settings['max_norm'] else 'on'}")
            self.settings[key] = _setting(key, value, f"{type(self).__name__}.set: {key}")
        if self.groups is not None:
            device, _ = self._attached("set")
            device.write(self.hyper, self._hyper())

    def scale_gradients(self, factor: float) -> None:
        """Every gradient times ``factor`` before clipping and the update, from
        the next step on: what undoes a loss scale (the loss gradient made
        ``1 / factor`` times larger so f16 keeps it)."""
        self.grad_scale = _real(factor, "scale_gradients: factor", 0.0, math.inf)
        if self.groups is not None:
            device, _ = self._attached("scale_gradients")
            device.write(self.hyper, self._hyper())

    def _hyper(self) -> np.ndarray:
        out = np.zeros(HYPER_SIZE, np.float32)
        for key, value in self.settings.items():
            if key in HYPER:
                out[HYPER[key]] = value
        out[HYPER["grad_scale"]] = self.grad_scale
        return out

    @property
    def step_count(self) -> int:
        """Steps taken (read back from the GPU)."""
        if self.groups is None:
            return 0
        device, _ = self._attached("step_count")
        return int(device.read(self.state)[STATE["step"]])

    def last_norm(self) -> float | None:
        """The gradients' global norm at the last step (with clipping), read back."""
        if self.groups is None or not self.settings["max_norm"]:
            return None
        device, _ = self._attached("last_norm")
        return float(device.read(self.state)[STATE["norm"]])

    # ------------------------------------------------------------ numpy in, numpy out

    def step(self, params, grads):
        """One step on numpy arrays (a list or a dict of float arrays, grads alike);
        returns the new parameters in the same structure. The moments stay on
        the GPU between calls; the shapes must stay the same."""
        from shaderdsl.runtime import get_device

        keys = list(params) if isinstance(params, dict) else None
        ps = [params[k] for k in keys] if keys else list(params)
        gs = [grads[k] for k in keys] if keys else list(grads)
        if len(ps) != len(gs):
            raise ValueError(f"step: {len(ps)} parameters but {len(gs)} gradients")
        arrays = [(np.ascontiguousarray(p, np.float32), np.ascontiguousarray(g, np.float32))
                  for p, g in zip(ps, gs)]
        for k, (p, g) in enumerate(arrays):
            if p.shape != g.shape:
                raise ValueError(f"step: parameter {k} has shape {p.shape}, its gradient {g.shape}")
        if self.groups is None:
            device = self.device or get_device()
            self.attach(device, [(device.buffer(p), device.buffer(g)) for p, g in arrays])
        device, groups = self._attached("step")
        if [p.shape for p, _ in arrays] != [b.shape for b, _ in groups]:
            raise ValueError(f"step: shapes {[p.shape for p, _ in arrays]} differ from the "
                             f"first call's {[b.shape for b, _ in groups]}")
        for (pb, gb), (p, g) in zip(groups, arrays):
            device.write(pb, p)
            device.write(gb, g)
        self.record()
        new = [device.read(pb) for pb, _ in groups]
        return dict(zip(keys, new)) if keys else new


class AdamW(_Optimizer):
    """torch.optim.AdamW on the GPU: ``AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01, max_grad_norm=None, schedule="constant", warmup=0,
    total=0, min_ratio=0.0)``."""

    update_kernel, extra_role = "adamw_update", "moments"

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw):
        super().__init__(lr, **kw)
        b1, b2 = betas
        self.settings.update(beta1=_setting("beta1", b1, "betas[0]"),
                             beta2=_setting("beta2", b2, "betas[1]"),
                             eps=_real(eps, "eps"),
                             weight_decay=_real(weight_decay, "weight_decay"))

    @staticmethod
    def _extra_size(n: int) -> int:
        return 2 * n  # m and v


class SGD(_Optimizer):
    """torch.optim.SGD on the GPU (dampening 0, no Nesterov): ``SGD(lr, momentum=0.0,
    weight_decay=0.0, max_grad_norm=None, schedule=..., warmup=..., total=...)``."""

    update_kernel, extra_role = "sgd_update", "momentum_buf"

    def __init__(self, lr=1e-2, momentum=0.0, weight_decay=0.0, **kw):
        super().__init__(lr, **kw)
        self.settings.update(momentum=_setting("momentum", momentum),
                             weight_decay=_real(weight_decay, "weight_decay"))

    @staticmethod
    def _extra_size(n: int) -> int:
        return n  # the momentum buffer
