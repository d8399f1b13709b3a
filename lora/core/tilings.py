"""The engine's tiling for a product of (M x K)(K x N), chosen by a rule, nothing timed.

``product_tiling(M, N, K, ...)`` gives the :class:`shaderdsl.matmul.MatrixTiling`
a frozen base product (lora.training.network.base_kernel: a network's layers,
a language model's projections and head, their input gradients) runs with,
so a transformer's shapes get a good tiling on the user's machine without
tuning there. The rule, from the H200's measurements (docs/benchmarks.md,
round 4; optimisation note 40) and what they leave open (notes 42-46, the
bench that settles them: ``python -m lora bench --gemm``):

1. **Candidates, best per block first** (``CANDIDATES``): 256 x 128 and
   128 x 256 blocks of 4 x 4 fragments a subgroup (16 accumulators: the
   multiply ceiling's 644 TFLOP/s needs them; 219.0 and 216.9 TFLOP/s at
   4096^3), then 128 x 128 (4 x 2 subgroups of 2 x 4 fragments, k_step 32;
   175.3 with 16-byte reads, 198.4 exact), 128 x 64, 64 x 64. 16-byte reads
   wherever the factors allow them (``read8``; +10 % at 4096^3), else the
   same blocks read four f16 at a time.
2. **Enough blocks for the GPU**: the first candidate whose grid has at
   least ``MIN_BLOCKS`` workgroups (one per SM of an H200: 132) wins; a
   block per SM is the most a 16-accumulator block gets (about 180
   registers a thread), so fewer blocks leave SMs idle (4096 x 576 x 576:
   80 blocks of 256 x 128 on 132 SMs), unless its grid pads the output
   more than ``PADDING`` (1.25) times the least any of them does (a decode's
   few tokens in 256-row blocks); between the two 16-accumulator blocks,
   the one that pads less. Where none has enough, the candidate with the most
   blocks (of equals, the smallest).
3. **Within the device's limits**: a candidate over ``limits`` (workgroup
   memory, invocations; WebGPU's defaults: 16 KiB and 256) is skipped; the
   64 x 64 block (16 KiB, 128 threads) fits the defaults.
4. **Exact** (no edge tests) wherever M, N and K are whole blocks and steps.

Where a user's GPU differs, ``lora.core.tuning.autotune_product`` times the
candidates that fit (``base_candidates``) on it and caches the fastest, which
``lora.core.tuning.product_tiling`` (what ``base_kernel`` asks) then gives in
place of the rule's.

The transformer shapes of issue 43 (tokens x out x in) get: 4096 x 576 x 576
and 4096 x 896 x 4864: 128 x 128 (160 and 224 blocks; exact for the second);
4096 x 1536 x 576 and 4096 x 49152 x 576: 256 x 128, exact (192 and 6144
blocks); 4096^3: 256 x 128, exact.
"""
from __future__ import annotations

from typing import Any

from shaderdsl.checks import MAX_INVOCATIONS
from shaderdsl.matmul import MatrixTiling

from ..kernels.matrix import FRAGMENT

MIN_BLOCKS = 132     # workgroups that give each SM of an H200 one block
PADDING = 1.25       # a bigger block may pad the output this much more than the least
WORKGROUP_STORAGE = "max-compute-workgroup-storage-size"


def _tiling(subgroups, fragments, k_step, read_width) -> MatrixTiling:
    return MatrixTiling(FRAGMENT, subgroups, fragments, k_step, read_width=read_width)


# (subgroups, fragments, k_step) best per block first; each with 16-byte reads or four f16
BLOCKS = (((4, 2), (4, 4), 16), ((2, 4), (4, 4), 16), ((4, 2), (2, 4), 32),
          ((4, 2), (2, 2), 32), ((2, 2), (2, 2), 16))


def candidates(read8: bool = True) -> list[MatrixTiling]:
    """The rule's candidates, best per block first (16-byte reads where ``read8``)."""
    return [_tiling(s, f, k, 8 if read8 else 4) for s, f, k in BLOCKS]


def fits(tiling: MatrixTiling, limits: dict | None, a_major: str = "row",
         b_major: str = "row") -> bool:
    """Whether ``tiling`` is within ``limits`` (a device's, by WebGPU name; None:
    no limit): its workgroup memory and invocations."""
    limits = limits or {}
    memory = limits.get(WORKGROUP_STORAGE)
    threads = limits.get(MAX_INVOCATIONS)
    return (memory is None or tiling.shared_bytes(a_major, b_major) <= memory) and \
        (threads is None or tiling.threads <= threads)


def product_tiling(M: int, N: int, K: int, a_major: str = "row", b_major: str = "row",
                   limits: dict | None = None, read8: bool = True) -> MatrixTiling:
    """The tiling of an (M x K)(K x N) product by the module's rule: the
    first candidate within ``limits`` with at least MIN_BLOCKS workgroups
    (the 16-accumulator pair by the less padding), else the one with the most;
    exact where the product is whole blocks and steps. ``read8``: every
    factor's contiguous extent, row stride and offset are multiples of 8
    (16-byte reads), else four f16 a read. ValueError where no candidate fits."""
    if not all(isinstance(d, int) and d > 0 for d in (M, N, K)):
        raise ValueError(f"product_tiling takes positive int M, N, K, got {(M, N, K)}")
    fitting = [t for t in candidates(read8) if fits(t, limits, a_major, b_major)]
    if not fitting:
        raise ValueError(f"no engine tiling fits the limits {limits} (the smallest needs "
                         f"{candidates(read8)[-1].shared_bytes(a_major, b_major)} bytes of "
                         f"workgroup memory and 128 invocations)")
    enough = [t for t in fitting if _blocks(t, M, N) >= MIN_BLOCKS]
    if enough:  # of those, the ones that pad the output at most PADDING x the least
        least = min(_padded(t, M, N) for t in enough)
        enough = [t for t in enough if _padded(t, M, N) <= PADDING * least]
        first = enough[0]
        pair = [t for t in enough if t.fragments == first.fragments == (4, 4)]
        chosen = min(pair, key=lambda t: _padded(t, M, N)) if pair else first
    else:  # the most blocks; of those, the smallest (the last)
        chosen = max(reversed(fitting), key=lambda t: _blocks(t, M, N))
    return _exact(chosen, M, N, K)


def _blocks(t: MatrixTiling, M: int, N: int) -> int:
    x, y, _ = t.grid(M, N)
    return x * y


def _padded(t: MatrixTiling, M: int, N: int) -> int:
    """Output elements the grid covers (M x N and the edge blocks' padding)."""
    return _blocks(t, M, N) * t.rows * t.cols


def _exact(t: MatrixTiling, M: int, N: int, K: int) -> MatrixTiling:
    if not t.whole(M, N, K):
        return t
    return MatrixTiling(t.config, t.subgroups, t.fragments, t.k_step, t.pad, t.group,
                        t.read_width, t.stages, exact=True)


def base_problem(name: str, in_dim: int, out_dim: int, tokens: int, g_stride: int = 0,
                 g_column: int = 0, **_) -> tuple:
    """(M, N, K, a_major, b_major, read8) of a frozen base product: ``name``
    "dense" (y = x W^T: tokens x out_dim x in_dim, W read down its rows: a
    column-major right factor) or "dense_grad_input" (dx = g W: tokens x
    in_dim x out_dim, g perhaps a block of wider rows); the other parameters
    as the kernels take them (lora.kernels.matrix)."""
    if name == "dense":
        return tokens, out_dim, in_dim, "row", "col", in_dim % 8 == 0
    aligned = all(v % 8 == 0 for v in (in_dim, out_dim, g_stride, g_column))
    return tokens, in_dim, out_dim, "row", "row", aligned


def base_tiling(name: str, limits: dict | None, **params) -> MatrixTiling:
    """The rule's tiling of a frozen base product (base_problem's)."""
    M, N, K, a_major, b_major, read8 = base_problem(name, **params)
    return product_tiling(M, N, K, a_major, b_major, limits, read8)


def base_candidates(name: str, limits: dict | None, **params) -> list[MatrixTiling]:
    """Every candidate of the rule that fits ``limits`` for this base
    product, exact where whole: what ``lora.core.tuning.autotune_product`` times."""
    M, N, K, a_major, b_major, read8 = base_problem(name, **params)
    return [_exact(t, M, N, K) for t in candidates(read8) if fits(t, limits, a_major, b_major)]


FIELDS = ("subgroups", "fragments", "k_step", "pad", "group", "read_width", "stages", "exact",
          "prefetch")


def as_fields(t: MatrixTiling) -> dict:
    """A tiling of FRAGMENT as JSON-ready fields (the tuning cache's form)."""
    return {f: list(v) if isinstance(v := getattr(t, f), tuple) else v for f in FIELDS}


def from_fields(fields: dict) -> MatrixTiling:
    """``as_fields``' inverse; ValueError (or TypeError) on fields no tiling takes."""
    given: dict[str, Any] = {f: tuple(v) if isinstance(v, list) else v
                             for f, v in fields.items()}
    return MatrixTiling(FRAGMENT, **given)
