"""The LoRA kernels on the interpreter device, race and uninitialised-read
detection on: every forward strategy and the backward strategies, small
shapes, against float64 numpy. A missing barrier in a LoRA kernel would
raise RaceError here."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, problem
from test_strategies import (
    ALIGNED_TEXTS,
    STRATEGY_TEXTS,
    STREAM_CASES,
    streaming_plan_result,
)

import lora
from lora import reference as R


@pytest.mark.one_per_kind  # default tier: one strategy of each kind, the others slow
@pytest.mark.parametrize("strategy", STRATEGY_TEXTS + ALIGNED_TEXTS)
def test_forward_strategies(interp_device, strategy):
    a, b, x, base = problem(np.random.default_rng(1), 4, 12, 20, 3, rows=True)
    got = lora.forward(x, a, b, base, scale=1.5, device=interp_device, strategy=strategy)
    np.testing.assert_allclose(got, R.forward(x, a, b, 1.5, base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy, dtype", STREAM_CASES)
def test_streaming_forward(interp_device, strategy, dtype):
    """tiled's paired and half forms with races checked: 37 tokens baked in
    and 5 read at run time, both ragged."""
    for tokens, runtime in ((37, False), (5, True)):
        got, want, tol = streaming_plan_result(interp_device, strategy, dtype, 8, tokens, runtime)
        assert_close(got, want, tol, f"{strategy} T={tokens}")


@pytest.mark.parametrize("strategy", ["seed", "paired:64", "split:64", "split:64:0:4"])
def test_backward_strategies(interp_device, strategy):
    a, b, x, g = problem(np.random.default_rng(2), 4, 12, 20, 3, rows=True)
    gx, ga, gb = lora.backward(x, a, b, g, scale=-0.5, device=interp_device,
                               strategy=strategy)
    want = R.backward(x, a, b, g, -0.5)
    for got, key in ((gx, "grad_x"), (ga, "grad_a"), (gb, "grad_b")):
        np.testing.assert_allclose(got, want[key], rtol=1e-5, atol=1e-5, err_msg=key)
