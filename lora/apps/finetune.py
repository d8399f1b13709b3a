"""The digits network (lora.apps.digits) trained on the GPU as a lora.Network:
frozen dense layers, LoRA on both, softmax cross-entropy, AdamW; one submit per step.

Per step, on a batch of B images (13 dispatches):
    dense(x) -> z1; LoRA fc1 forward (saving h1); relu -> y1; dense(y1) -> logits;
    LoRA fc2 forward (saving h2); softmax_xent -> g;
    fc2 backward (dA2, dB2, and dy1 = dh2 A2); dy1 += g W2; relu's gradient -> dz1;
    fc1 backward (dA1, dB1); AdamW over A1, B1, A2, B2 (clipped by their global norm).
"""
from __future__ import annotations

import numpy as np

from ..training.network import Linear, Network
from ..training.optim import AdamW
from . import digits as D

CLASSES = 10  # the digits
FORWARD = "tiled(threads=64, tile_tokens=8)"  # the LoRA forward the recorded runs use


class DigitsTrainer:
    """The digits network for batches of ``batch`` images, with the buffers
    the web export names (``bufs``, ``weights``, ``base``); ``lora_dropout``
    and ``dropout_seed`` as lora.Network takes them."""

    def __init__(self, device, base: D.Base, adapters: dict, scale: float, batch: int,
                 optimizer: AdamW, lora_dropout: float = 0.0, dropout_seed: int = 0):
        self.device, self.batch, self.scale = device, batch, scale
        layers = [Linear(base.w1, base.b1, adapter=adapters["fc1"], scale=scale, name="fc1"),
                  "relu",
                  Linear(base.w2, base.b2, adapter=adapters["fc2"], scale=scale, name="fc2")]
        self.network = Network(layers, loss="xent", optimizer=optimizer, batch=batch,
                               device=device, forward=FORWARD, lora_dropout=lora_dropout,
                               dropout_seed=dropout_seed)
        gpu = self.network.build(batch)
        self.weights = gpu.weights
        self.base = {f"{k}{n}": buf for n, name in ((1, "fc1"), (2, "fc2"))
                     for k, buf in zip("wb", gpu.base[name])}
        self.bufs = {"x": gpu.values[0], "labels": gpu.target,
                     "losses": gpu.loss.scratch["losses"]}

    def load_batch(self, x: np.ndarray, labels: np.ndarray) -> None:
        self.device.write(self.bufs["x"], np.ascontiguousarray(x, np.float32))
        self.device.write(self.bufs["labels"], np.ascontiguousarray(labels, np.uint32))

    def record(self) -> None:
        """One training step on the loaded batch, recorded into one submit."""
        self.network.record()

    def loss(self) -> float:
        """The last step's mean cross-entropy (reads back: waits for the GPU)."""
        return self.network.loss()

    def adapters(self) -> dict:
        """The trained adapters, read back: {"fc1": (A, B), "fc2": (A, B)}."""
        return self.network.adapters()
