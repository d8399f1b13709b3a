"""The LoRA kernels, written in shaderdsl: one module per family.

``common`` (buffers, f16 handling, reductions, loops), ``matrix`` (the f16
forward on matrix units), ``forward`` (h = A @ x,
y = B @ h, the scaled add, fused forms); ``registry`` holds :data:`KERNELS`,
each kernel with the role of its bindings, its workgroup size and its grid:
``KERNELS[name].kernel(...)`` compiles (and caches) it. Nothing here needs wgpu.
"""
from .common import DTYPES, SHARED_FLOATS, UNROLL_BUDGET
from .forward import (
                      MAX_BLOCK_ACCS,
                      add_scaled,
                      fused_b_add,
                      fused_forward,
                      project_a_seed,
                      project_a_workgroup,
                      project_b,
                      tiled_fits,
                      tiled_forward,
)
from .registry import KERNELS, KernelSpec

__all__ = ["KERNELS", "KernelSpec", "DTYPES", "SHARED_FLOATS", "UNROLL_BUDGET", "MAX_BLOCK_ACCS",
           "tiled_fits", "project_a_seed", "project_a_workgroup", "project_b", "add_scaled",
           "fused_b_add", "fused_forward", "tiled_forward"]
