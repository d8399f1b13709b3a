"""Adding a strategy is one registry entry: a class registered with
``forward_strategy`` parses and prints, builds a Plan that matches the
float64 reference, and is timed by the autotuner, with no other file touched."""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

import lora
from lora import reference as R
from lora.core import strategy as S
from lora.core import tuning


@pytest.fixture
def toy():
    """A strategy no release has: Hesper's seed projection, then project_b into y
    and the scaled add (``three:T:seed`` by another route), registered for one test."""
    @S.forward_strategy
    class Toy(S.Strategy):
        name: ClassVar[str] = "toy"
        numbers: ClassVar[tuple] = ("threads",)  # its positional text: toy:T
        threads: int = 64

        def kernels(self, shape, save_h=False):
            seed, = S.Seed().kernels(shape)[:1]
            return [seed] + S.Three(self.threads).kernels(shape)[1:]

        def scratch(self, shape, save_h=False):
            return {"h": (1, shape.rank), "y": (1, shape.out_dim)}

        @classmethod
        def candidates(cls, shape, subgroups, matrices=()):
            return [cls(64)]

    yield Toy
    del S.FORWARD["toy"]


def test_a_new_entry_parses_plans_and_is_tuned(device, toy, cache_dir):
    s = lora.Strategy.parse("toy(threads=128)")
    assert isinstance(s, toy) and s == toy(threads=128) and str(s) == "toy(threads=128)"
    assert lora.Strategy.parse("toy:128") == s and str(toy()) == "toy"
    with pytest.raises(ValueError, match=r"'toy' takes up to 1 number"):
        lora.Strategy.parse("toy:64:2")
    with pytest.raises(ValueError, match=r"toy has no field 'tile_tokens'; its fields "
                                         r"\(defaults\): toy\(threads=64\)"):
        lora.Strategy.parse("toy(tile_tokens=2)")
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((5, 40)), rng.standard_normal((24, 5))
    x, base = rng.standard_normal((3, 40)), rng.standard_normal((3, 24))
    w = lora.Weight.from_numpy(device, a, b)
    out = device.buffer(base.astype(np.float32))
    plan = lora.forward_plan(device, w, 0.5, 3, s)
    plan(device.buffer(x.astype(np.float32)), out)
    want = R.forward(x, a, b, 0.5, base)
    np.testing.assert_array_less(np.abs(device.read(out) - want),
                                 R.tolerance(x, a, b, 0.5, base))
    assert plan.dispatches == 3 and set(plan.scratch) == {"h", "y"}
    assert lora.Strategy.parse("toy:64") in tuning.candidates(device, 5, 40, 24, 3)
    timings = tuning._timings(device, w, 3, [lora.Strategy.parse("toy:64")],
                              lambda c: lora.forward_plan(device, w, 0.5, 3, c), 4, None)
    assert set(timings) == {"toy"} and timings["toy"] > 0
