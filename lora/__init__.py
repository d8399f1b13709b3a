"""lora: the LoRA forward pass ``out = base(x) + (alpha / rank) * B @ (A @ x)`` on WebGPU.

The kernels are written in shaderdsl (:mod:`lora.kernels`, importable and
printable without wgpu); a :class:`Strategy` names the kernels of a forward,
a :class:`Plan` resolves it for one shape on one device, and the execute
functions (:mod:`lora.execute`) are plans of fixed strategies; the numpy
reference (:mod:`lora.reference`) is what every kernel is checked against.

    import numpy as np, lora
    out = lora.forward(x, a, b, base, alpha=16.0)          # numpy in, numpy out

    from shaderdsl.runtime import get_device
    dev = get_device()
    w = lora.Weight.from_numpy(dev, a, b)                    # A [rank, in], B [out, rank]
    lora.execute_lora_forward_fused(dev, w, lora.Config(8, 16).scale, x_buf, out_buf, h_buf)

    grad_x, grad_a, grad_b = lora.backward(x, a, b, grad_out, alpha=16.0)   # training
    new = lora.AdamW(lr=1e-3).step([a, b], [grad_a, grad_b])

Training (:mod:`lora.training`, :mod:`lora.optim`), adapter files in peft's and
Hesper's formats (:mod:`lora.adapter_io`). ``python -m lora demo`` runs the
seed case, ``python -m lora train`` fine-tunes on real data; ``--help`` for more.
"""
from . import kernels, reference
from .adapter_io import (AdapterFileError, LoraLayer, load_adapter, load_hesper, save_adapter,
                         save_hesper)
from .config import Config
from .optim import SGD, AdamW
from .plan import Plan
from .strategy import STRATEGIES, Backward, Strategy
from .weight import Weight

# The execute functions need the GPU runtime (wgpu): imported on first use,
# so that `import lora.kernels` works on a machine without wgpu.
_EXECUTE = ("PATHS", "clear_plan_cache", "execute_add_scaled", "execute_lora_forward_auto",
            "execute_fused_b_add", "execute_lora_forward", "execute_lora_forward_fused",
            "execute_lora_forward_single", "execute_project_a", "execute_project_b", "forward",
            "save_activation")
_TRAINING = ("BackwardPlan", "LayerTrainer", "backward", "execute_lora_backward",
             "execute_lora_forward_train", "execute_grad_a", "execute_grad_b", "execute_grad_dh",
             "execute_grad_input")


def __getattr__(name):
    if name in _EXECUTE:
        from . import execute
        return getattr(execute, name)
    if name in _TRAINING:
        from . import training
        return getattr(training, name)
    raise AttributeError(f"module 'lora' has no attribute {name!r}")


__all__ = ["Config", "Weight", "Plan", "Strategy", "Backward", "STRATEGIES", "AdamW", "SGD",
           "kernels", "reference", "save_adapter", "load_adapter", "save_hesper", "load_hesper",
           "LoraLayer", "AdapterFileError", *_EXECUTE, *_TRAINING]
