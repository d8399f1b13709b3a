"""lora: the LoRA forward pass ``out = base(x) + (alpha / rank) * B @ (A @ x)`` on WebGPU.

The kernels are written in shaderdsl (:mod:`lora.kernels`); the execute
functions (:mod:`lora.execute`) dispatch them on a shaderdsl Device; the numpy
reference (:mod:`lora.reference`) is what every kernel is checked against.

    import numpy as np, lora
    out = lora.forward(x, a, b, base, alpha=16.0)          # numpy in, numpy out

    from shaderdsl.runtime import get_device
    dev = get_device()
    w = lora.Weight.from_numpy(dev, a, b)                    # A [rank, in], B [out, rank]
    lora.execute_lora_forward_fused(dev, w, lora.Config(8, 16).scale, x_buf, out_buf, h_buf)

``python -m lora demo`` runs the seed case; ``python -m lora --help`` for more.
"""
from . import kernels, reference
from .config import Config
from .execute import (PATHS, STRATEGIES, clear_plan_cache, execute_add_scaled, execute_lora_forward_auto,
                      execute_fused_b_add, execute_lora_forward, execute_lora_forward_fused,
                      execute_lora_forward_single, execute_project_a, execute_project_b, forward,
                      save_activation)
from .weight import Weight

__all__ = ["Config", "Weight", "kernels", "reference", "forward", "execute_project_a",
           "execute_project_b", "execute_add_scaled", "execute_fused_b_add",
           "execute_lora_forward", "execute_lora_forward_fused", "execute_lora_forward_single",
           "execute_lora_forward_auto",
           "save_activation", "clear_plan_cache", "STRATEGIES", "PATHS"]
