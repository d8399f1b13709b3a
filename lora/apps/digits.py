"""The fine-tuning task of ``python -m lora train``: scikit-learn's digits, a
frozen base network, LoRA on both of its layers, and the float64 reference
of the whole training run.

Recipe (everything seeded, so a run is reproducible):

- data: ``sklearn.datasets.load_digits`` (1,797 real 8x8 images, pixel values
  0..16 scaled to 0..1), shuffled with ``seed``; the last 297 images are the
  test set, the first 1,500 the training set;
- base network: 64 -> HIDDEN (ReLU) -> 10, He-normal weights, zero biases,
  trained in numpy (float64, full batch, Adam without weight decay,
  BASE_STEPS steps at lr 1e-2) on the training images of the digits 0-4 only,
  so it knows half of the task; then frozen;
- adapters: LoRA of rank ``rank`` on both layers (``fc1``: 64 -> HIDDEN,
  ``fc2``: HIDDEN -> 10), initialised as peft does (B = 0);
- fine-tuning: all ten digits, batches of ``batch`` images in a seeded order,
  softmax cross-entropy, AdamW with global-norm clipping.

The network, per batch (s = alpha / rank):
    z1 = x W1^T + b1 + s B1 A1 x ;  y1 = relu(z1) ;  logits = y1 W2^T + b2 + s B2 A2 y1
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core import reference as R
from ..kernels.dropout import keep_mask

HIDDEN = 64
BASE_STEPS = 300
TEST = 297


@dataclass(frozen=True)
class Digits:
    train_x: np.ndarray  # (1500, 64) float64 in [0, 1]
    train_y: np.ndarray  # (1500,) int
    test_x: np.ndarray
    test_y: np.ndarray


@dataclass(frozen=True)
class Base:
    """The frozen base network: W1 [HIDDEN, 64], b1, W2 [10, HIDDEN], b2 (float64)."""
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray


def load(seed: int = 0) -> Digits:
    """The digits, scaled to [0, 1] and split (see the module docstring)."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    x, y = images[order] / 16.0, labels[order].astype(np.int64)
    return Digits(x[:-TEST], y[:-TEST], x[-TEST:], y[-TEST:])


def _base_forward(base: Base, x):
    z1 = x @ base.w1.T + base.b1
    y1 = np.maximum(z1, 0.0)
    return z1, y1, y1 @ base.w2.T + base.b2


def train_base(data: Digits, seed: int = 0, steps: int = BASE_STEPS) -> Base:
    """The base network, trained in float64 on the digits 0-4 of the training set."""
    rng = np.random.default_rng(seed + 1)
    keep = data.train_y < 5
    x, y = data.train_x[keep], data.train_y[keep]
    params = [rng.normal(0, np.sqrt(2 / 64), (HIDDEN, 64)), np.zeros(HIDDEN),
              rng.normal(0, np.sqrt(2 / HIDDEN), (10, HIDDEN)), np.zeros(10)]
    moments = [[np.zeros_like(p), np.zeros_like(p)] for p in params]
    for step in range(1, steps + 1):
        base = Base(*params)
        z1, y1, logits = _base_forward(base, x)
        _, g = R.softmax_cross_entropy(logits, y)
        dy1 = g @ base.w2
        dz1 = dy1 * (z1 > 0)
        grads = [dz1.T @ x, dz1.sum(0), g.T @ y1, g.sum(0)]
        for k, (p, gr) in enumerate(zip(params, grads)):
            params[k], moments[k][0], moments[k][1] = R.adamw_step(
                p, gr, moments[k][0], moments[k][1], step, 1e-2, weight_decay=0.0)
    return Base(*params)


def accuracy(base: Base, adapters: dict | None, scale: float, x, y) -> float:
    """Fraction of ``x`` classified right, with the adapters ({"fc1": (A, B), ...}) or without."""
    return float(np.mean(np.argmax(forward(base, adapters, scale, x)[-1], axis=1) == y))


def forward(base: Base, adapters: dict | None, scale: float, x, drop: dict | None = None):
    """(z1, y1, logits) of the adapted network, float64. ``drop``: LoRA
    dropout's multipliers (mask / (1 - p)) of each adapter's input, by layer."""
    a, drop = adapters or {}, drop or {}
    z1 = x @ base.w1.T + base.b1
    if "fc1" in a:
        a1, b1 = a["fc1"]
        z1 = z1 + R.lora_delta(x * drop.get("fc1", 1.0), a1, b1, scale)
    y1 = np.maximum(z1, 0.0)
    logits = y1 @ base.w2.T + base.b2
    if "fc2" in a:
        a2, b2 = a["fc2"]
        logits = logits + R.lora_delta(y1 * drop.get("fc2", 1.0), a2, b2, scale)
    return z1, y1, logits


def dropout_multipliers(p: float, seed: int, step: int, batch: int) -> dict:
    """The multipliers (mask / (1 - p)) lora.Network's dropout draws at ``step``
    (counted from 1) for fc1 (position 0 of the layers: seed + 0) and fc2
    (position 2: seed + 2); {} for p = 0."""
    if not p:
        return {}
    return {name: keep_mask((seed + k) % 2**32, step - 1, (batch, width), p) / (1.0 - p)
            for name, k, width in (("fc1", 0, 64), ("fc2", 2, HIDDEN))}


def batches(n: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` index arrays of ``batch`` images: seeded passes over the
    training set, each in a fresh order (the remainder of a pass is dropped)."""
    rng = np.random.default_rng(seed + 2)
    out, order = [], np.array([], np.int64)
    while len(out) < steps:
        if len(order) < batch:
            order = rng.permutation(n)
        out.append(order[:batch])
        order = order[batch:]
    return out


def init_adapters(rank: int, seed: int = 0) -> dict:
    """peft's initialisation of both layers' adapters (float32, as the GPU stores them)."""
    return {"fc1": R.init_lora(64, HIDDEN, rank, seed=seed + 3),
            "fc2": R.init_lora(HIDDEN, 10, rank, seed=seed + 4)}


def reference_step(base: Base, adapters: dict, scale: float, x, y, state: dict, step: int,
                   optimizer: dict, drop: dict | None = None) -> float:
    """One fine-tuning step in float64, updating ``adapters`` and ``state``
    (AdamW moments) in place; returns the batch's loss before the update.
    ``drop``: LoRA dropout's multipliers (:func:`dropout_multipliers`)."""
    m = {"fc1": 1.0, "fc2": 1.0, **(drop or {})}
    z1, y1, logits = forward(base, adapters, scale, x, m)
    loss, g = R.softmax_cross_entropy(logits, y)
    a2, b2 = adapters["fc2"]
    d2 = R.backward(y1 * m["fc2"], a2, b2, g, scale)
    dz1 = (g @ base.w2 + d2["grad_x"] * m["fc2"]) * (z1 > 0)
    a1, b1 = adapters["fc1"]
    d1 = R.backward(x * m["fc1"], a1, b1, dz1, scale)
    grads = {"fc1": (d1["grad_a"], d1["grad_b"]), "fc2": (d2["grad_a"], d2["grad_b"])}
    flat = [gr for pair in grads.values() for gr in pair]
    clip = R.clip_scale(flat, optimizer["max_grad_norm"]) if optimizer["max_grad_norm"] else 1.0
    lr = R.learning_rate(step, optimizer["lr"], optimizer["schedule"], optimizer["warmup"],
                         optimizer["total"])
    for name, pair in grads.items():
        new = []
        for k, gr in enumerate(pair):
            m, v = state.setdefault((name, k), (0.0, 0.0))
            p, m, v = R.adamw_step(adapters[name][k], clip * gr, m, v, step, lr,
                                   eps=optimizer["eps"], weight_decay=optimizer["weight_decay"])
            state[(name, k)] = (m, v)
            new.append(p)
        adapters[name] = tuple(new)
    return loss
