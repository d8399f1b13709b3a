"""The digits network (lora.apps.digits) trained on the GPU: frozen dense layers,
LoRA on both, softmax cross-entropy, AdamW; one submit per step.

Per step, on a batch of B images (13 dispatches):
    dense(x) -> z1; LoRA fc1 forward (saving h1); relu -> y1; dense(y1) -> logits;
    LoRA fc2 forward (saving h2); softmax_xent -> g;
    fc2 backward (dA2, dB2, and dy1 = dh2 A2); dy1 += g W2; relu_grad -> dz1;
    fc1 backward (dA1, dB1); AdamW over A1, B1, A2, B2 (clipped by their global norm).
"""
from __future__ import annotations

import numpy as np

from ..core.plan import Plan
from ..core.weight import Weight
from ..training.backward import backward_plan, train_forward_plan
from ..training.losses import mean_xent
from ..training.optim import AdamW
from . import digits as D

CLASSES = 10  # the digits


class DigitsTrainer:
    """The network's buffers, plans and steps for batches of ``batch`` images."""

    def __init__(self, device, base: D.Base, adapters: dict, scale: float, batch: int,
                 optimizer: AdamW):
        self.device, self.batch, self.scale = device, batch, scale
        f32 = np.float32
        self.weights = {name: Weight.from_numpy(device, a, b, name=name)
                        for name, (a, b) in adapters.items()}
        self.base = {k: device.buffer(np.ascontiguousarray(v, f32), name=f"base.{k}")
                     for k, v in vars(base).items()}
        shapes = {"x": (batch, 64), "labels": (batch,), "z1": (batch, D.HIDDEN),
                  "y1": (batch, D.HIDDEN), "logits": (batch, CLASSES), "g": (batch, CLASSES),
                  "dy1": (batch, D.HIDDEN), "dz1": (batch, D.HIDDEN), "losses": (batch,)}
        self.bufs = {k: device.empty(s, np.uint32 if k == "labels" else f32, name=k)
                     for k, s in shapes.items()}
        self.grads = {name: (device.empty(w.a.shape, f32), device.empty(w.b.shape, f32))
                      for name, w in self.weights.items()}
        forward = "tiled(threads=64, tile_tokens=8)"
        self.forward = {name: train_forward_plan(device, w, scale, batch, forward, given=())
                        for name, w in self.weights.items()}
        self.backward = {"fc1": backward_plan(device, self.weights["fc1"], scale, batch,
                                              with_dx=False),
                         "fc2": backward_plan(device, self.weights["fc2"], scale, batch)}
        self._base = self._base_plans()
        self.optimizer = optimizer
        optimizer.attach(device, [pair for name, w in self.weights.items()
                                  for pair in zip((w.a, w.b), self.grads[name])])

    def _base_plans(self) -> dict:
        """The frozen network's dispatches, each a plan over the trainer's buffers."""
        b, h = self.batch, D.HIDDEN
        kernels = {"dense1": ("dense", dict(in_dim=64, out_dim=h, tokens=b), {"y": "z1"}),
                   "relu": ("relu", dict(n=b * h), {"z": "z1", "y": "y1"}),
                   "dense2": ("dense", dict(in_dim=h, out_dim=CLASSES, tokens=b, threads=64),
                              {"x": "y1", "W": "w2", "bias": "b2", "y": "logits"}),
                   "xent": ("softmax_xent", dict(classes=CLASSES, tokens=b, threads=64)),
                   "dense2_grad": ("dense_grad_input", dict(in_dim=h, out_dim=CLASSES, tokens=b,
                                                            accumulate=True),
                                   {"W": "w2", "dx": "dy1"}),
                   "relu_grad": ("relu_grad", dict(n=b * h), {"z": "z1", "dy": "dy1", "dz": "dz1"})}
        kernels["dense1"][2].update({"W": "w1", "bias": "b1"})
        bound = {**self.bufs, **self.base}
        return {k: Plan(self.device, f"digits {k}", [spec], {}, bound=bound)
                for k, spec in kernels.items()}

    def load_batch(self, x: np.ndarray, labels: np.ndarray) -> None:
        self.device.write(self.bufs["x"], np.ascontiguousarray(x, np.float32))
        self.device.write(self.bufs["labels"], np.ascontiguousarray(labels, np.uint32))

    def record(self) -> None:
        """One training step on the loaded batch, recorded into one submit."""
        dev, bufs = self.device, self.bufs

        def run(name: str) -> None:
            self._base[name].record()

        with dev.batch():
            run("dense1")
            self.forward["fc1"].record(bufs["x"], bufs["z1"])
            run("relu")
            run("dense2")
            self.forward["fc2"].record(bufs["y1"], bufs["logits"])
            run("xent")
            self.backward["fc2"].record(bufs["g"], bufs["y1"], self.forward["fc2"].h,
                                        *self.grads["fc2"], bufs["dy1"])
            run("dense2_grad")
            run("relu_grad")
            self.backward["fc1"].record(bufs["dz1"], bufs["x"], self.forward["fc1"].h,
                                        *self.grads["fc1"])
            self.optimizer.record()

    def loss(self) -> float:
        """The last step's mean cross-entropy (reads back: waits for the GPU)."""
        return mean_xent(self.device.read(self.bufs["losses"]), CLASSES)

    def adapters(self) -> dict:
        """The trained adapters, read back: {"fc1": (A, B), "fc2": (A, B)}."""
        return {name: w.numpy() for name, w in self.weights.items()}
