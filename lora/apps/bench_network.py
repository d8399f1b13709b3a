"""``python -m lora bench --network``: the training step of a 3-layer MLP
(WIDTH -> WIDTH -> WIDTH -> WIDTH, ReLU between, LoRA of one rank on every
layer, mse, AdamW) as one lora.Network submit, beside torch+peft's step (a
CUDA graph; fp16 autocast for the f16 rows) in the same run. The step is also
split into its frozen base products (x W^T forward, g W backward: timed alone,
in TFLOP/s beside torch.mm) and the rest, which is set beside the sum of the
layers' single-layer LayerTrainer steps. Options (``Options``): the layer
count, lora_dropout and max_grad_norm, the same in every step timed (ours,
the single layers' and torch+peft's: peft's lora_dropout, clip_grad_norm_)."""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from shaderdsl.runtime import get_device

from ..core.tuning import median_us
from ..training.network import Linear, Network
from ..training.optim import AdamW
from ..training.trainer import LayerTrainer
from .bench_train import _captured, _cuda_us, optional_torch

FULL: dict[str, Any] = dict(width=2560, layers=3, ranks=(8, 64), tokens=(512, 4096),
                            dtypes=("f32", "f16"))
QUICK: dict[str, Any] = dict(width=64, layers=3, ranks=(8,), tokens=(32,), dtypes=("f32",))
DTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True)
class Options:
    """What every step of the run trains with: ``layers`` Linear layers (None:
    the grid's 3), peft's ``lora_dropout`` and the optimizer's global-norm
    ``max_grad_norm`` (None: no clipping)."""

    layers: int | None = None
    lora_dropout: float = 0.0
    max_grad_norm: float | None = None

    def optimizer(self) -> AdamW:
        return AdamW(lr=1e-4, max_grad_norm=self.max_grad_norm)


def gpu_us(device, record) -> float:
    """Median GPU microseconds per ``record()`` (a step: tuning.median_us, at
    most 5000 a batch, 3 batches)."""
    return median_us(device, record, 5, repeats=3, most=5000)


def _mlp(width: int, layers: int, rank: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out: list = []
    for k in range(layers):
        w = rng.normal(0, width ** -0.5, (width, width))
        a = rng.normal(0, width ** -0.5, (rank, width))
        out += [(w, rng.normal(0, 0.1, width), a, rng.normal(0, 0.1, (width, rank)))]
    return out


def ours(device, params, tokens, dtype, opts: Options) -> dict:
    """The whole step, its base products alone, and one layer's LayerTrainer step (us)."""
    layers: list = []
    for k, (w, b, a, bb) in enumerate(params):
        layers += [Linear(w, b, adapter=(a, bb), alpha=16, name=str(2 * k)), "relu"]
    net = Network(layers[:-1], loss="mse", optimizer=opts.optimizer(), batch=tokens,
                  dtype=DTYPES[dtype], device=device, lora_dropout=opts.lora_dropout)
    rng = np.random.default_rng(1)
    width = params[0][0].shape[0]
    net.step(rng.normal(0, 1, (tokens, width)), rng.normal(0, 1, (tokens, width)))
    gpu = net.build(tokens)
    base = [plan for steps in gpu.forwards + gpu.backwards for plan, _ in steps
            if plan.label.endswith(("dense", "dense grad"))]
    step_us = gpu_us(device, gpu.record_step)

    def record_base():
        for plan in base:
            plan.record()
    base_us = gpu_us(device, record_base)
    return {"step_us": step_us, "base_us": base_us, "base_products": len(base),
            "layer_us": _layer_us(device, params[0], tokens, dtype, opts)}


def _layer_us(device, param, tokens, dtype, opts: Options) -> float:
    """One LayerTrainer step of the first layer's adapter (as ``python -m lora bench``)."""
    from ..core.weight import Weight

    w, _, a, b = param
    dt = DTYPES[dtype]
    weight = Weight.from_numpy(device, a, b, dtype=dt)
    trainer = LayerTrainer(device, weight, 16 / a.shape[0], tokens, opts.optimizer(),
                           lora_dropout=opts.lora_dropout)
    x, out, target, base = (device.empty((tokens, n), dt) for n in
                            (w.shape[1], w.shape[0], w.shape[0], w.shape[0]))
    return gpu_us(device, lambda: trainer.record(x, out, target, base))


def torch_row(params, tokens, dtype, opts: Options) -> dict:
    """torch+peft's step as one CUDA graph, and torch.mm at the base products' shape."""
    torch = optional_torch()
    if torch is None or not torch.cuda.is_available():
        return {"torch": "not installed" if torch is None else "without CUDA"}
    try:
        peft = importlib.import_module("peft")
    except ImportError:
        return {"torch": torch.__version__, "peft": "not installed"}
    half, dev = dtype == "f16", torch.device("cuda")
    mods = []
    for w, b, _, _ in params:
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.tensor(w))
            lin.bias.copy_(torch.tensor(b))
        mods += [lin, torch.nn.ReLU()]
    names = [str(2 * k) for k in range(len(params))]
    model = peft.get_peft_model(torch.nn.Sequential(*mods[:-1]), peft.LoraConfig(
        r=params[0][2].shape[0], lora_alpha=16, target_modules=names,
        lora_dropout=opts.lora_dropout)).to(dev)
    width = params[0][0].shape[0]
    x, y = (torch.randn(tokens, width, device=dev) for _ in range(2))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, capturable=True)

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16, enabled=half):
            out = model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        if opts.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, opts.max_grad_norm)
        opt.step()
    graph = _captured(torch, step)
    mm_dtype = torch.float16 if half else torch.float32
    p, q = torch.randn(tokens, width, device=dev, dtype=mm_dtype), \
        torch.randn(width, width, device=dev, dtype=mm_dtype)
    return {"torch": torch.__version__, "peft": peft.__version__,
            "torch_graph_us": _cuda_us(torch, lambda: [graph.replay() for _ in range(20)], 20),
            "torch_mm_us": _cuda_us(torch, lambda: [torch.mm(p, q) for _ in range(20)], 20)}


def row(device, width, layers, rank, tokens, dtype, log, opts: Options = Options()) -> dict:
    params = _mlp(width, layers, rank)
    r: dict[str, Any] = dict(
        width=width, layers=layers, rank=rank, tokens=tokens, dtype=dtype,
        lora_dropout=opts.lora_dropout, max_grad_norm=opts.max_grad_norm,
        **ours(device, params, tokens, dtype, opts), **torch_row(params, tokens, dtype, opts))
    flops = 2 * tokens * width * width
    r["base_tflops"] = flops * r["base_products"] / r["base_us"] / 1e6
    r["rest_us"] = r["step_us"] - r["base_us"]
    r["rest_vs_layers"] = r["rest_us"] / (layers * r["layer_us"])
    text = (f"{dtype} rank {rank:3d} tokens {tokens:5d} dropout {opts.lora_dropout:g} clip "
            f"{opts.max_grad_norm or 'off'}: step {r['step_us']:9.1f} us (base "
            f"products {r['base_us']:9.1f} us, {r['base_tflops']:6.2f} TFLOP/s; the rest "
            f"{r['rest_us']:8.1f} us = {r['rest_vs_layers']:.2f}x {layers} single-layer steps)")
    if "torch_graph_us" in r:
        r["torch_mm_tflops"] = flops / r["torch_mm_us"] / 1e6
        text += (f"; torch+peft graph {r['torch_graph_us']:8.1f} us, torch.mm "
                 f"{r['torch_mm_tflops']:6.2f} TFLOP/s")
    log(text)
    return r


def network_main(out_dir: str, log, quick: bool = False, device=None,
                 opts: Options = Options()) -> int:
    grid = QUICK if quick else FULL
    layers = opts.layers or grid["layers"]
    device = get_device() if device is None else device
    log(f"{layers}-layer MLP {grid['width']} wide, ReLU, LoRA on every layer, mse, AdamW; "
        f"one lora.Network submit per step on {device.name}; lora_dropout "
        f"{opts.lora_dropout:g}, max_grad_norm {opts.max_grad_norm}")
    rows = [row(device, grid["width"], layers, rank, tokens, dtype, log, opts)
            for dtype in grid["dtypes"] for rank in grid["ranks"] for tokens in grid["tokens"]
            if dtype == "f32" or device.has_feature("shader-f16")]
    path = os.path.join(out_dir, "bench-network.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    log(f"wrote {path}")
    return 0
