"""The training step of a LoRA layer for web pages: ``python -m lora export --train``.

The step is recorded, not rewritten: a :class:`LayerTrainer` is built on an
interpreter device that records its dispatches and copies instead of running
them (no subgroups, WebGPU's default limits, so every browser takes the
kernels), and one ``record`` gives the exact list of one step: the base
output copied in, the forward saving h, the loss and its gradient, the
backward, the optimizer's begin and update. The ES module holds those
kernels, every buffer the step touches (with its first contents: A and B as
peft initialises them, the optimizer's settings, zeroed moments and state)
and ``loraTrainer(device, options)`` (web_assets/train.mjs), whose
``step({x, target, base})`` records the whole step into one submit, as the
Python trainer does.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import numpy as np

from shaderdsl.export import js_object, kernel_info

from ..core import reference as R
from ..core.shape import LayerShape
from ..core.weight import Weight
from ..kernels.optimizer import HYPER
from ..training.optim import LIMITS, SGD, AdamW
from ..training.trainer import LayerTrainer
from .web_export import Recorder, asset, module_code, module_steps, module_types


@dataclass(frozen=True)
class TrainSetup:
    """One exported training step: the layer (its tokens are the batch, its
    scale alpha / rank; the step stores f32 whatever its dtype), its loss and
    its optimizer (``settings``: the optimizer's other keyword arguments,
    e.g. weight_decay, betas, eps, momentum, schedule, warmup, total)."""

    layer: LayerShape
    loss: str = "mse"
    optimizer: str = "adamw"
    lr: float = 1e-3
    max_grad_norm: float | None = None
    seed: int = 0
    lora_dropout: float = 0.0  # LayerTrainer's: its dispatch is recorded with the step
    settings: dict = field(default_factory=dict)

    @property
    def alpha(self) -> float:
        return self.layer.scale * self.layer.rank


@dataclass
class Recording:
    """One recorded training step: the device's ops, the buffers' names
    (id -> (name, buffer); the named ones first, buf<k> for the rest) and
    the module's config (its ``given`` inputs, ``loss`` and ``adapters``)."""

    device: Recorder
    named: dict
    config: dict

    def names(self) -> dict:
        names = {id(buf): (name, buf) for name, buf in self.named.items()}
        for op in self.device.ops:
            for buf in (op[2] if op[0] == "dispatch" else op[1:3]):
                if id(buf) not in names:
                    names[id(buf)] = (f"buf{len(names)}", buf)
        return names


def _layer(name: str, weight, alpha: float, scale: float) -> dict:
    return {"a": f"{name}.a", "b": f"{name}.b", "rank": weight.rank, "inDim": weight.in_dim,
            "outDim": weight.out_dim, "alpha": alpha, "scale": scale}


# The optimizer's settings by their names in the page (the rest are spelt alike).
JS_NAMES = {"max_norm": "maxGradNorm", "weight_decay": "weightDecay", "min_ratio": "minRatio"}


def optimizer_config(opt) -> dict:
    """What the page needs to read and change an optimizer's settings: their values
    (JS names; maxGradNorm null without clipping), the schedule (built into the
    kernels), where each lives in the settings buffer, and each one's limits."""
    values = {JS_NAMES.get(k, k): v for k, v in opt.settings.items()}
    values["maxGradNorm"] = values["maxGradNorm"] or None
    return {"kind": type(opt).__name__.lower(), "schedule": opt.schedule, "values": values,
            "buffer": "optim.hyper",
            "index": {JS_NAMES.get(k, k): HYPER[k] for k in opt.settings},
            "limits": {JS_NAMES.get(k, k): list(LIMITS.get(k, (0.0, None, False)))
                       for k in opt.settings}}


def record_layer(setup: TrainSetup) -> Recording:
    """One LayerTrainer step (base copied into the output, forward, loss,
    backward, optimizer) on a Recorder; A and B as peft initialises them."""
    shape, dev = setup.layer, Recorder(features=[])  # no subgroups: every browser takes it
    if shape.tokens is None:
        raise ValueError("the training export needs a token count (the batch size)")
    a, b = R.init_lora(shape.in_dim, shape.out_dim, shape.rank, seed=setup.seed)
    weight = Weight.from_numpy(dev, a, b)
    make = AdamW if setup.optimizer == "adamw" else SGD
    opt = make(lr=setup.lr, max_grad_norm=setup.max_grad_norm, **setup.settings)
    trainer = LayerTrainer(dev, weight, shape.scale, shape.tokens, opt, loss=setup.loss,
                           lora_dropout=setup.lora_dropout, dropout_seed=setup.seed)
    f32, t, mse = np.float32, shape.tokens, setup.loss == "mse"
    given = {"x": dev.empty((t, shape.in_dim), f32), "base": dev.empty((t, shape.out_dim), f32),
             "target": dev.empty((t, shape.out_dim), f32) if mse else dev.empty(t, np.uint32)}
    out = dev.empty((t, shape.out_dim), f32)
    trainer.record(given["x"], out, given["target"], given["base"])
    scratch = trainer.loss_plan.scratch or {}  # (never released)
    # xent's sticky record of out-of-range labels (losses.report_labels), which the page
    # reads and clears as LayerTrainer does
    seen = {} if mse else {"loss_seen": scratch["seen"]}
    config = {"tokens": t, "alpha": setup.alpha, "scale": shape.scale,
              "optimizer": optimizer_config(opt), "seed": setup.seed, "given": list(given),
              "lora_dropout": setup.lora_dropout,
              "loss": {"kind": setup.loss, "buffer": "loss_sums",
                       "count": t * shape.out_dim if mse else t, "classes": shape.out_dim,
                       "seen": None if mse else "loss_seen"},
              "adapters": {"layer": _layer("layer", weight, setup.alpha, shape.scale)}}
    return Recording(dev, {**given, "output": out, "layer.a": weight.a, "layer.b": weight.b,
                           "loss_sums": scratch["partial" if mse else "losses"], **seen,
                           "optim.hyper": opt.hyper}, config)


def _module_parts(rec: Recording) -> tuple[list, list, dict]:
    """(kernels, steps, buffers) for the module (web_export.module_steps); every
    buffer's size, dtype and first contents (none for the step's inputs and
    for zeros)."""
    names = rec.names()
    kernels, steps = module_steps(rec.device.ops, lambda buf: names[id(buf)][0])
    buffers = {}
    for name, buf in names.values():
        first = rec.device.read(buf)
        buffers[name] = {"bytes": int(first.nbytes), "dtype": first.dtype.name,
                         "init": None if name in rec.config["given"] or not first.any()
                         else base64.b64encode(first.tobytes()).decode("ascii")}
    return kernels, steps, buffers


def module_js(rec: Recording, command: str = "") -> str:
    """The ES module: config, buffers, steps, kernels, the runtime, loraTrainer."""
    kernels, steps, buffers = _module_parts(rec)
    config = dict(rec.config, features=sorted({f for k in kernels
                                               for f in kernel_info(k)["features"]}))
    body = ",\n".join("  " + js_object(kernel_info(k), "  ") for k in kernels)
    made = f"`{command}`" if command else "lora.apps.web_train"
    return (f"// lora_train.js: generated by {made}.\n"
            f"// One LoRA training step (forward, loss, backward, optimizer) per submit on "
            f"GPUBuffers; standard WebGPU only. See docs/browser.md.\n\n"
            f"export const config = {json.dumps(config)};\n"
            f"export const buffers = {json.dumps(buffers)};\n"
            f"export const steps = [\n" + "".join(f"  {json.dumps(s)},\n" for s in steps) + "];\n"
            f"export const kernels = [\n{body},\n];\n\n{module_code('optim.mjs', 'train.mjs')}")


def module_dts(command: str = "") -> str:
    made = f"`{command}`" if command else "lora.apps.web_train"
    return f"// lora_train.d.ts: generated by {made}.\n{module_types('train.d.ts')}"


# ---------------------------------------------------------------- the digits page

@dataclass(frozen=True)
class DigitsRun:
    """The fine-tuning the page runs: python -m lora train's task and defaults."""

    steps: int = 200
    batch: int = 64
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-2
    warmup: int = 10
    max_grad_norm: float = 1.0
    seed: int = 0


def record_digits(run: DigitsRun) -> tuple[Recording, dict]:
    """One step of python -m lora train's DigitsTrainer (both layers' LoRA,
    the frozen network, cross-entropy, AdamW with clipping and a cosine
    schedule), recorded; and the page's data: the images, labels, the batch
    order and the base network (float32, as the GPU holds it)."""
    from . import digits as D
    from .finetune import DigitsTrainer
    from .train_cli import optimizer_settings

    data = D.load(run.seed)
    base = D.train_base(data, run.seed)
    dev = Recorder(features=[])
    settings = optimizer_settings(run.lr, run.max_grad_norm, "cosine", run.warmup, run.steps)
    opt = AdamW(**settings)
    trainer = DigitsTrainer(dev, base, D.init_adapters(run.rank, run.seed), run.alpha / run.rank,
                            run.batch, opt)
    trainer.record()
    named = {"x": trainer.bufs["x"], "labels": trainer.bufs["labels"],
             "losses": trainer.bufs["losses"],
             **{f"{m}.{p}": getattr(w, p) for m, w in trainer.weights.items() for p in "ab"},
             **{f"base.{k}": buf for k, buf in trainer.base.items()}, "optim.hyper": opt.hyper}
    scale = run.alpha / run.rank
    config = {"tokens": run.batch, "alpha": run.alpha, "scale": scale,
              "optimizer": optimizer_config(opt), "seed": run.seed, "given": ["x", "labels"],
              "loss": {"kind": "xent", "buffer": "losses", "count": run.batch, "classes": 10},
              "adapters": {m: _layer(m, w, run.alpha, scale) for m, w in trainer.weights.items()}}
    order = np.stack(D.batches(len(data.train_y), run.batch, run.steps, run.seed))
    page = {"steps": run.steps, "batch": run.batch, "hidden": D.HIDDEN, "seed": run.seed,
            "train": _b64(np.rint(data.train_x * 16).astype(np.uint8)),
            "trainLabels": _b64(data.train_y.astype(np.uint8)),
            "test": _b64(np.rint(data.test_x * 16).astype(np.uint8)),
            "testLabels": _b64(data.test_y.astype(np.uint8)),
            "order": _b64(order.astype(np.uint16))}
    return Recording(dev, named, config), page


def _b64(array) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def digits_page(run: DigitsRun, command: str = "") -> str:
    """The self-contained page (web_assets/digits.html and digits.mjs): the
    training module and lora_adapter.js inlined, the digits embedded; it
    trains, plots, measures and offers the adapter."""
    rec, page = record_digits(run)
    script = asset("digits.mjs").replace("/*PAGE*/null", json.dumps(page))
    return (asset("digits.html").replace("/*TRAIN*/", module_js(rec, command))
            .replace("/*ADAPTER*/", asset("adapter.mjs")).replace("/*SCRIPT*/", script))
