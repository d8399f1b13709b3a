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

``python -m lora demo`` runs the seed case; ``python -m lora --help`` for more.
"""
from . import kernels, reference
from .config import Config
from .plan import Plan
from .strategy import STRATEGIES, Strategy
from .weight import Weight

# The execute functions need the GPU runtime (wgpu): imported on first use,
# so that `import lora.kernels` works on a machine without wgpu.
_EXECUTE = ("PATHS", "clear_plan_cache", "execute_add_scaled", "execute_lora_forward_auto",
            "execute_fused_b_add", "execute_lora_forward", "execute_lora_forward_fused",
            "execute_lora_forward_single", "execute_project_a", "execute_project_b", "forward",
            "save_activation")


def __getattr__(name):
    if name in _EXECUTE:
        from . import execute
        return getattr(execute, name)
    raise AttributeError(f"module 'lora' has no attribute {name!r}")


__all__ = ["Config", "Weight", "Plan", "Strategy", "STRATEGIES", "kernels", "reference",
           *_EXECUTE]
