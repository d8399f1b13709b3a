"""The LoRA kernels on the interpreter device, race and uninitialised-read
detection on: every forward strategy and the backward strategies, small
shapes, against float64 numpy. A missing barrier in a LoRA kernel would
raise RaceError here."""
from __future__ import annotations

import numpy as np
import pytest

import lora
from lora import reference as R
from shaderdsl import interp

from test_strategies import ALIGNED_TEXTS, STRATEGY_TEXTS

pytestmark = pytest.mark.interp


@pytest.fixture(scope="module")
def cpu():
    return interp.Device(subgroup_size=8)


def problem(seed, tokens, rank=4, in_dim=12, out_dim=20):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.uniform(-1, 1, s).astype(np.float32)  # noqa: E731
    return f(tokens, in_dim), f(rank, in_dim), f(out_dim, rank), f(tokens, out_dim)


@pytest.mark.one_per_kind  # default tier: one strategy of each kind, the others slow
@pytest.mark.parametrize("strategy", STRATEGY_TEXTS + ALIGNED_TEXTS)
def test_forward_strategies(cpu, strategy):
    x, a, b, base = problem(1, 3)
    got = lora.forward(x, a, b, base, scale=1.5, device=cpu, strategy=strategy)
    np.testing.assert_allclose(got, R.forward(x, a, b, 1.5, base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["seed", "paired:64", "split:64", "split:64:0:4"])
def test_backward_strategies(cpu, strategy):
    x, a, b, g = problem(2, 3)
    gx, ga, gb = lora.backward(x, a, b, g, scale=-0.5, device=cpu, strategy=strategy)
    want = R.backward(x, a, b, g, -0.5)
    for got, key in ((gx, "grad_x"), (ga, "grad_a"), (gb, "grad_b")):
        np.testing.assert_allclose(got, want[key], rtol=1e-5, atol=1e-5, err_msg=key)
