"""``python -m lora check``: every kernel and execute function once, on a small
odd shape, against numpy float64; exit status 1 on any failure. Also the
forward runner ``python -m lora demo`` times (lora.apps.demo_cli)."""
from __future__ import annotations

import numpy as np

from shaderdsl.runtime import get_device

from .. import hesper
from ..core import auto
from ..core import reference as R
from ..core.weight import Weight


def normal(rng, shape):
    """Standard normal float32 values: every input of check and demo."""
    return rng.standard_normal(shape).astype(np.float32)


def forward_runner(dev, name, weight, scale, x_buf, out_buf, h_buf, y_buf, **kw):
    """A zero-argument function running one forward of strategy ``name`` the way
    its execute function does (``auto``: the chosen or a given ``strategy``)."""
    F = hesper
    if name == "three":
        return lambda: F.execute_lora_forward(dev, weight, scale, x_buf, out_buf, h_buf, y_buf,
                                              **kw)
    if name == "split":
        return lambda: F.execute_lora_forward_fused(dev, weight, scale, x_buf, out_buf, h_buf,
                                                    **kw)
    if name == "auto":
        return lambda: F.execute_lora_forward_auto(dev, weight, scale, x_buf, out_buf,
                                                   strategy=kw.get("strategy"))
    kw.pop("projection", None)
    return lambda: F.execute_lora_forward_single(dev, weight, scale, x_buf, out_buf, **kw)


class _SelfCheck:
    """Every kernel and execute function once, on a small odd shape, against numpy."""

    SHAPE = dict(rank=5, in_dim=37, out_dim=300, tokens=2, scale=-0.75)

    def __init__(self, dev):
        self.dev, self.F = dev, hesper
        rank, in_dim, out_dim, T = (self.SHAPE[k] for k in ("rank", "in_dim", "out_dim", "tokens"))
        rng = np.random.default_rng(1234)
        self.a, self.b = normal(rng, (rank, in_dim)), normal(rng, (out_dim, rank))
        self.x, self.base = normal(rng, (T, in_dim)), normal(rng, (T, out_dim))
        self.h, self.y = normal(rng, (T, rank)), normal(rng, (T, out_dim))
        self.w = Weight.from_numpy(dev, self.a, self.b)
        self.scale = self.SHAPE["scale"]

    @staticmethod
    def result(got, want, tol):
        err = np.abs(np.asarray(got, np.float64) - want)
        return R.within(got, want, tol), float(np.nanmax(err)) if err.size else 0.0

    def nans(self, shape):
        return self.dev.buffer(np.full(shape, np.nan, np.float32))

    def project_a(self, **kw):
        xb, hb = self.dev.buffer(self.x), self.nans(self.h.shape)
        self.F.execute_project_a(self.dev, self.w, xb, hb, **kw)
        return self.result(self.dev.read(hb), R.project_a(self.a, self.x),
                           R.h_tolerance(self.x, self.a))

    def project_b(self):
        yb = self.nans(self.y.shape)
        self.F.execute_project_b(self.dev, self.w, self.dev.buffer(self.h), yb)
        tol = R.RTOL_Y * R.project_b(np.abs(self.b), np.abs(self.h)) + R.ATOL
        return self.result(self.dev.read(yb), R.project_b(self.b, self.h), tol)

    def add_scaled(self):
        ob, s = self.dev.buffer(self.base), self.scale
        self.F.execute_add_scaled(self.dev, self.dev.buffer(self.y), ob, self.base.size, s)
        tol = R.RTOL_ADD * (abs(s) * np.abs(self.y) + np.abs(self.base))
        return self.result(self.dev.read(ob), R.add_scaled(self.y, self.base, s), tol)

    def fused_b_add(self):
        ob, s = self.dev.buffer(self.base), self.scale
        self.F.execute_fused_b_add(self.dev, self.w, s, self.dev.buffer(self.h), ob)
        mag = abs(s) * R.project_b(np.abs(self.b), np.abs(self.h)) + np.abs(self.base)
        return self.result(self.dev.read(ob), R.fused_b_add(self.b, self.h, self.base, s),
                           R.RTOL_Y * mag + R.ATOL)

    def forward(self, name, one_token=False, **kw):
        xs, bs = (self.x[0], self.base[0]) if one_token else (self.x, self.base)
        xb, ob = self.dev.buffer(xs), self.dev.buffer(bs)
        hb, yb = self.nans(xs.shape[:-1] + (self.SHAPE["rank"],)), self.nans(bs.shape)
        forward_runner(self.dev, name, self.w, self.scale, xb, ob, hb, yb, **kw)()
        return self.result(self.dev.read(ob), R.forward(xs, self.a, self.b, self.scale, bs),
                           R.tolerance(xs, self.a, self.b, self.scale, bs))

    def save_activation(self):
        src, dst = self.dev.buffer(self.x), self.nans(self.x.shape)
        self.F.save_activation(self.dev, src, dst, self.x.size)
        got = self.dev.read(dst)
        return bool(np.array_equal(got, self.x)), float(np.abs(got - self.x).max())

    def numpy_forward(self):
        got = auto.forward(self.x, self.a, self.b, self.base, scale=self.scale, device=self.dev)
        want = R.forward(self.x, self.a, self.b, self.scale, self.base)
        return self.result(got, want, R.tolerance(self.x, self.a, self.b, self.scale, self.base))

    def items(self) -> list:
        """(name, function returning (ok, max error), or None when the adapter lacks subgroups)."""
        sub = self.dev.has_feature("subgroup")

        def run(f, *a, **kw):
            return lambda: f(*a, **kw)

        def maybe(f, *a, **kw):  # needs subgroups
            return run(f, *a, **kw) if sub else None

        return [
            ("kernel project_a (workgroup)", run(self.project_a)),
            ("kernel project_a (seed)", run(self.project_a, projection="seed")),
            ("kernel project_a (workgroup, subgroups)", maybe(self.project_a, subgroups=True)),
            ("kernel project_b", self.project_b),
            ("kernel add_scaled", self.add_scaled),
            ("kernel fused_b_add", self.fused_b_add),
            ("single: execute_lora_forward_single", run(self.forward, "single")),
            ("single(outputs_per_thread=2, subgroups=True): execute_lora_forward_single",
             maybe(self.forward, "single", subgroups=True, outputs_per_thread=2)),
            ("three: execute_lora_forward", run(self.forward, "three")),
            ('three(projection="seed"): execute_lora_forward',
             run(self.forward, "three", projection="seed")),
            ("split: execute_lora_forward_fused", run(self.forward, "split")),
            ("split, one token", run(self.forward, "split", one_token=True)),
            ("save_activation", self.save_activation),
            ("lora.forward (numpy in and out)", self.numpy_forward),
        ]


def cmd_check(args) -> int:
    dev = get_device()
    items = _SelfCheck(dev).items()
    print(f"lora self-check on {dev.name} ({dev.backend}): "
          + ", ".join(f"{k} {v}" for k, v in _SelfCheck.SHAPE.items()) + "; against numpy float64")
    failures = 0
    for name, fn in items:
        if fn is None:
            print(f"SKIP  {name}: adapter lacks 'subgroup'")
            continue
        try:
            ok, err = fn()
        except Exception as e:  # report and carry on: the point is a full list
            ok, err = False, None
            detail = f"{type(e).__name__}: {e}"
        else:
            detail = f"max abs err {err:.2e}"
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print(f"{len(items) - failures} of {len(items)} passed" if failures else "all passed")
    return 1 if failures else 0
