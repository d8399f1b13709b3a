"""lora: LoRA ``out = base(x) + (alpha / rank) * B @ (A @ x)`` on WebGPU, forward and training.

Layers, each importing only those before it: the kernels, written in
shaderdsl (:mod:`lora.kernels`, importable and printable without wgpu); the
core (:mod:`lora.core`: the Weight, the strategy registry, Plans and their
cache, the autotuner, ``forward``, the float64 reference every kernel is
checked against); training (:mod:`lora.training`: backward strategies and
plans, losses, AdamW and SGD, the one-submit training step, adapter files
in peft's and Hesper's formats); Hesper's execute functions as plans of
fixed strategies (:mod:`lora.hesper`); and the apps (:mod:`lora.apps`: the
command line, benchmarks, the web export, the digits example).

    import numpy as np, lora
    out = lora.forward(x, a, b, base, alpha=16.0)          # numpy in, numpy out
    out = lora.forward_many(x, [layer0, layer1], ids, base) # each row its adapter (-1: none)

    from shaderdsl.runtime import get_device
    dev = get_device()
    w = lora.Weight.from_numpy(dev, a, b)                    # A [rank, in], B [out, rank]
    plan = lora.forward_plan(dev, w, lora.Config(8, 16).scale, 4, "tiled(tile_tokens=8)")
    plan(x_buf, out_buf)                                     # checks, then dispatches

    grad_x, grad_a, grad_b = lora.backward(x, a, b, grad_out, alpha=16.0)   # training
    new = lora.AdamW(lr=1e-3).step([a, b], [grad_a, grad_b])
    net = lora.Network([lora.Linear(w1, b1, rank=8), "gelu", lora.Linear(w2, b2, rank=8)],
                       loss="xent", optimizer=lora.AdamW(lr=1e-3))   # layers trained together
    net.step(x, labels); net.loss(); net.save_adapter("adapter")

``python -m lora demo`` runs the seed case, ``python -m lora train``
fine-tunes on real data; ``--help`` for more.
"""
import importlib
from typing import TYPE_CHECKING

from . import kernels
from .core import reference
from .core.auto import auto_plan, forward
from .core.cache import clear_plan_cache
from .core.config import Config
from .core.forward import forward_plan
from .core.many import forward_many
from .core.many_plan import ManyPlan, Route
from .core.plan import Plan, PlanAt, Role
from .core.pool import AdapterPool
from .core.shape import LayerShape
from .core.strategy import FORWARD, Strategy
from .core.weight import Weight
from .models.causal_lm import CausalLM
from .training.adapter_io import (
    AdapterExtrasWarning,
    AdapterFileError,
    LoraLayer,
    adapter_extras,
    load_adapter,
    load_hesper,
    save_adapter,
    save_hesper,
)
from .training.backward import backward, backward_plan, train_forward_plan
from .training.losses import LOSSES, loss_plan
from .training.network import Linear, Network
from .training.optim import SGD, AdamW
from .training.strategy import BACKWARD, Backward
from .training.trainer import LayerTrainer

if TYPE_CHECKING:  # for editors and the checker; at run time __getattr__ imports them
    from .hesper import (
        execute_add_scaled,
        execute_fused_b_add,
        execute_grad_a,
        execute_grad_b,
        execute_grad_dh,
        execute_grad_input,
        execute_lora_backward,
        execute_lora_forward,
        execute_lora_forward_auto,
        execute_lora_forward_fused,
        execute_lora_forward_single,
        execute_lora_forward_train,
        execute_project_a,
        execute_project_b,
        save_activation,
    )

__all__ = ["Config", "Weight", "LayerShape", "Plan", "PlanAt", "Role", "Strategy", "Backward",
           "FORWARD", "BACKWARD", "forward", "forward_plan", "auto_plan",
           "forward_many", "AdapterPool", "ManyPlan", "Route",
           "backward", "backward_plan", "train_forward_plan", "loss_plan", "LOSSES",
           "LayerTrainer", "AdamW", "SGD", "clear_plan_cache", "kernels", "reference",
           "save_adapter", "load_adapter", "save_hesper", "load_hesper", "LoraLayer",
           "AdapterFileError", "AdapterExtrasWarning", "adapter_extras",
           "Network", "Linear",  # lora.training.network: layers trained together
           "CausalLM",  # lora.models: a transformers causal LM with LoRA
           # Hesper's execute functions (lora.hesper), imported on first use
           "execute_add_scaled", "execute_fused_b_add", "execute_lora_forward",
           "execute_lora_forward_auto", "execute_lora_forward_fused",
           "execute_lora_forward_single", "execute_project_a", "execute_project_b",
           "save_activation", "execute_lora_forward_train", "execute_lora_backward",
           "execute_grad_a", "execute_grad_b", "execute_grad_dh", "execute_grad_input"]


def __getattr__(name):
    """The public names not imported above (Hesper's execute functions), and
    ``lora.hesper``, from lora.hesper on first use."""
    if name in __all__ or name == "hesper":
        hesper = importlib.import_module("lora.hesper")
        return hesper if name == "hesper" else getattr(hesper, name)
    raise AttributeError(f"module 'lora' has no attribute {name!r}")
