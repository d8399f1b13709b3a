"""The LoRA kernels, written in shaderdsl: one module per family.

``common`` (buffers, f16 handling, reductions, loops, tiles staged in
workgroup memory); the forward's families: ``projections`` (h = A @ x,
y = B @ h, the scaled add, B @ h fused with the add: one job per dispatch),
``fused`` (the whole forward in one dispatch, a token per workgroup row),
``tiled`` (one dispatch, a tile of tokens per workgroup), ``gemm`` (two
dispatches shaped like matrix products) and ``matrix`` (the kernels on
matrix units: the f16 forward's two dispatches and the backward's
grad_outer_matrix); the training's ``backward``, ``loss``, ``optimizer`` and
``network``; the causal language model's ``lm`` (embedding, RMSNorm, rotary
embeddings, SwiGLU, argmax; its loss is ``loss.softmax_xent(ignore=True)``),
``attention`` (causal self-attention in the flash form, forward and backward)
and ``attention_matrix`` (its f16 forward on matrix units). ``registry`` holds
:data:`KERNELS`, each kernel with the role of its bindings, its workgroup size
and its grid: ``KERNELS[name].kernel(...)``
compiles (and caches) it. Nothing here needs wgpu.
"""
from .common import DTYPES, SHARED_FLOATS, UNROLL_BUDGET
from .fused import fused_forward
from .projections import add_scaled, fused_b_add, project_a_seed, project_a_workgroup, project_b
from .registry import KERNELS, KernelSpec
from .tiled import MAX_BLOCK_ACCS, tiled_fits, tiled_forward

__all__ = ["KERNELS", "KernelSpec", "DTYPES", "SHARED_FLOATS", "UNROLL_BUDGET", "MAX_BLOCK_ACCS",
           "tiled_fits", "project_a_seed", "project_a_workgroup", "project_b", "add_scaled",
           "fused_b_add", "fused_forward", "tiled_forward"]
