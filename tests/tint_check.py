"""Compile every kernel the project generates with one WGSL compiler; print a JSON report.

    python tests/tint_check.py            # Tint: Dawn's Null backend, no GPU needed
    python tests/tint_check.py --list     # the kernels, without compiling them
    python tests/tint_check.py --part sample   # the default tier's sample (--part rest: the others)

By default the script runs under Dawn (SHADERDSL_WGPU=dawn, package
``wgpudawn``) on its Null backend (WGPU_BACKEND_TYPE=Null), where Tint still
parses, validates and builds every module and pipeline. Dawn and wgpu-native
cannot both be ``wgpu`` in one process, so tests/test_tint.py runs this file
in a subprocess; it imports the module too, for ``grid()``, and compiles the
same kernels with naga in-process. ``SHADERDSL_WGPU=native`` gives naga's
report from this script instead.

The report, one JSON object on the last line of stdout (and in ``--json PATH``):
``compiler``, ``device``, ``checked`` (kernels the compiler accepted),
``expected`` (kernels in the grid), ``control_rejected`` (a kernel with a
type error was refused: the check is not vacuous), ``digest`` (of their WGSL, so the two sides
can tell they saw the same kernels), ``module_only`` (kernels over this
device's limits, e.g. more than 16 KiB of workgroup memory on the Null device:
their WGSL was compiled as a module, no pipeline made), ``unsupported`` (the
device lacks a feature: not compiled), ``failures`` (rejected: name, params,
error) and ``seconds``.

The grid: the LoRA kernels over ranks, shapes, scales, token counts and
strategy variants (pruned from the full product, every value of each axis
kept: see ``lora_entries``), the kernels the LoRA autotuner also tries, every
example kernel, the kernels tests/test_codegen.py hands to its naga fixture,
and a few kernels here that use the DSL constructs those leave out.
Kernels with the same WGSL are counted once.
"""
# pyright: reportInvalidTypeForm=false
# (@sd.function annotates parameters and results with WGSL types, f32 and the like: DSL
# values, which pyright checks as Python type expressions and refuses)
from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not installed; the repository root has it
    sys.path.insert(0, str(ROOT))

# Nothing here may import shaderdsl.runtime at module level: importing it picks
# the wgpu build (native or Dawn), and the test process has already picked naga.
import shaderdsl as sd  # noqa: E402
from shaderdsl import array, atomic, bool_, f16, f32, i32, u32, vec4f, vec4h, vec4i, vec4u  # noqa: E402
from shaderdsl import builtins as B  # noqa: E402


@dataclass(frozen=True)
class Entry:
    """One kernel of the grid: where it comes from, how it is built; the Kernel is
    built when first asked for (a part of the grid builds only its own)."""

    group: str
    name: str
    params: dict = field(hash=False)
    build: Callable[[], sd.Kernel] = field(hash=False, repr=False, compare=False)

    @functools.cached_property
    def kernel(self) -> sd.Kernel:
        return self.build()

    def describe(self) -> dict:
        return {"group": self.group, "name": self.name, "params": self.params}


# ---------------------------------------------------------------- LoRA kernels

RANKS = (1, 3, 8, 16, 64)
DIMS = ((1, 1), (7, 33), (256, 320), (2560, 2560))  # (in_dim, out_dim)
SCALES = (0.0, -1.5, 2.0)
TOKENS = (1, 5)


def _spread(n: int) -> dict:
    """The axes that only change literals or loop bounds, chosen from the
    running count n of a full product: n % 4 (shape), n % 3 (scale) and
    (n // 4) % 2 (tokens) have coprime periods, so over consecutive n every
    pair of their values occurs, and a block of 4 or more consecutive kernels
    sees every shape."""
    in_dim, out_dim = DIMS[n % 4]
    return {"in_dim": in_dim, "out_dim": out_dim, "scale": SCALES[n % 3],
            "tokens": TOKENS[(n // 4) % 2]}


def lora_entries() -> list[Entry]:
    """The LoRA kernels: the full product of the axes that change the code's
    shape (strategy, threads, subgroups, outputs per thread, unroll, rank and,
    for the two-dispatch kernels, the dimension), the others spread over it."""
    from lora import kernels as K

    out: list[Entry] = []

    def add(name, **params):
        out.append(Entry("lora", name, params, functools.partial(K.KERNELS[name].kernel,
                                                                 **params)))

    a_variants = [("project_a_seed", {})] + [
        ("project_a", dict(threads=t, subgroups=sg))
        for t, sg in itertools.product((64, 256), (False, True))]
    for n, ((name, variant), rank, (in_dim, _)) in enumerate(
            itertools.product(a_variants, RANKS, DIMS)):
        add(name, rank=rank, in_dim=in_dim, tokens=_spread(n)["tokens"], **variant)

    for n, (rank, (_, out_dim)) in enumerate(itertools.product(RANKS, DIMS)):
        s = _spread(n)
        add("project_b", out_dim=out_dim, rank=rank, tokens=s["tokens"])
        add("fused_b_add", out_dim=out_dim, rank=rank, scale=s["scale"], tokens=s["tokens"])

    for n, ((_, out_dim), scale) in enumerate(itertools.product(DIMS, SCALES)):
        add("add_scaled", num_elements=out_dim * TOKENS[n % 2], scale=scale)

    fused = itertools.product((128, 256), (1, 2), (False, True), (False, True), RANKS)
    for n, (threads, per_thread, sg, unroll, rank) in enumerate(fused):
        add("fused_forward", rank=rank, **_spread(n), threads=threads,
            outputs_per_thread=per_thread, subgroups=sg, unroll=unroll)

    tiled = itertools.product((128, 256), (4, 16), (False, True), RANKS)
    for n, (threads, tile, unroll, rank) in enumerate(tiled):
        add("tiled_forward", rank=rank, **_spread(n), threads=threads, tile_tokens=tile,
            unroll=unroll)

    # tiled with blocks of tokens per thread (ranks split over thread groups at rank 64)
    for n, (block, unroll, rank) in enumerate(itertools.product((2, 4), (False, True), RANKS)):
        add("tiled_forward", rank=rank, **_spread(n), threads=128, tile_tokens=8,
            unroll=unroll, token_block=block)
    # project_a over groups of ranks (split:T:G), and every kernel with f16 storage
    for n, (group, sg, rank) in enumerate(itertools.product((3, 4), (False, True), RANKS)):
        add("project_a", rank=rank, in_dim=_spread(n)["in_dim"], tokens=_spread(n)["tokens"],
            threads=64, subgroups=sg, rank_group=group)
    for n, rank in enumerate(RANKS):
        s = _spread(n)
        add("project_a_seed", rank=rank, in_dim=s["in_dim"], tokens=s["tokens"], dtype="f16")
        add("project_a", rank=rank, in_dim=s["in_dim"], tokens=s["tokens"], threads=64,
            subgroups=bool(n % 2), dtype="f16")
        add("project_b", out_dim=s["out_dim"], rank=rank, tokens=s["tokens"], dtype="f16")
        add("fused_b_add", out_dim=s["out_dim"], rank=rank, scale=s["scale"],
            tokens=s["tokens"], dtype="f16")
        add("add_scaled", num_elements=s["out_dim"], scale=s["scale"], dtype="f16")
        add("fused_forward", rank=rank, **s, threads=128, outputs_per_thread=1 + n % 2,
            subgroups=bool(n % 2), unroll=bool(n // 2 % 2), dtype="f16")
        add("tiled_forward", rank=rank, **s, threads=128, tile_tokens=4,
            unroll=bool(n % 2), dtype="f16", token_block=1 + n % 2)
    # token counts read at run time (tokens=None: a uniform, grids split over z)
    for n, rank in enumerate(RANKS):
        s = dict(_spread(n), tokens=None)
        dt = "f16" if n % 3 == 2 else "f32"
        add("project_a_seed", rank=rank, in_dim=s["in_dim"], tokens=None, dtype=dt)
        add("project_a", rank=rank, in_dim=s["in_dim"], tokens=None, threads=64,
            subgroups=bool(n % 2), rank_group=3 if n % 2 and rank > 3 else 0, dtype=dt)
        add("project_b", out_dim=s["out_dim"], rank=rank, tokens=None, dtype=dt)
        add("fused_b_add", out_dim=s["out_dim"], rank=rank, scale=s["scale"], tokens=None,
            dtype=dt)
        add("add_scaled", num_elements=None, columns=s["out_dim"], scale=s["scale"], dtype=dt)
        add("fused_forward", rank=rank, **s, threads=128, outputs_per_thread=1 + n % 2,
            subgroups=bool(n % 2), unroll=bool(n // 2 % 2), dtype=dt, save_h=bool(n % 2))
        add("tiled_forward", rank=rank, **s, threads=128, tile_tokens=4 << n % 2,
            unroll=bool(n % 2), dtype=dt, token_block=1 + n % 2, save_h=not n % 2)
    # the GEMM-shaped pair (gemm:T:TT:S) and vec4 output columns (tiled:…:q), where the
    # shapes are multiples of 4: slices of in_dim, baked and run-time counts, f16, save_h
    aligned = [(r, d) for r, d in itertools.product(RANKS, DIMS)
               if r % 4 == 0 and d[0] % 4 == 0 and d[1] % 4 == 0]
    for n, (rank, (in_dim, out_dim)) in enumerate(aligned):
        s = dict(_spread(n), in_dim=in_dim, out_dim=out_dim, tokens=(None, 3)[n % 2])
        dt = ("f32", "f16")[n // 2 % 2]
        add("project_a_tiled", rank=rank, in_dim=in_dim, tokens=s["tokens"],
            threads=(64, 256)[n % 2], splits=1 + n % 3, dtype=dt, block=(4, 8)[n // 2 % 2])
        add("project_a_tiled", rank=rank, in_dim=out_dim, tokens=3, threads=(256, 64)[n % 2],
            splits=1 + n % 2, dtype=dt, a_columns=True, scale=s["scale"])  # gemm's dh
        add("tiled_b_add", out_dim=out_dim, rank=rank, scale=s["scale"], tokens=s["tokens"],
            tile_tokens=(4, 16)[n % 2], splits=1 + n % 3, dtype=dt, save_h=bool(n % 2))
        if rank <= 16:
            add("tiled_forward", rank=rank, **s, threads=128, tile_tokens=4, quad=True,
                unroll=bool(n % 2), dtype=dt)
    _training_entries(add)
    _many_entries(add)
    _lm_entries(add)
    _attention_entries(add)
    return out


def _lm_entries(add) -> None:
    """The causal LM's kernels (lora.kernels.lm) and the loss and residual add
    it uses: scalar and vec4 rows, f32 and f16, baked and run-time token
    counts, subgroups or trees, their options spread over that product."""
    for n, (width, dt, tokens) in enumerate(itertools.product((37, 40), ("f32", "f16"),
                                                                (3, None))):
        sg, threads = bool(n % 2), (64, 256)[n // 2 % 2]
        add("embed", hidden=width, rows=1000, tokens=tokens, dtype=dt, first_row=n * 100,
            id_offset=bool(n // 4 % 2))
        add("rms_norm", hidden=width, tokens=tokens, eps=1e-6, dtype=dt,
            x_dtype=("f32", dt)[n // 4 % 2], threads=threads, subgroups=sg)
        add("rms_norm_grad", hidden=width, tokens=tokens, dtype=dt, threads=threads,
            subgroups=sg)
        add("rope", heads=3, head_dim=width // 2 * 2 - 2 * (n % 2), tokens=tokens, dtype=dt,
            inverse=bool(n // 2 % 2), kv_heads=n % 3)
        add("swiglu", inter=width, tokens=tokens, dtype=dt)
        add("residual", hidden=width, tokens=tokens, dtype=dt)
        add("kv_write", batch=2, rows=1 + n % 3, kv_len=9, width=width, dtype=dt)
        add("last_rows", batch=2, seq=1 + n % 3, width=width)
        add("decode_advance", batch=1 + n % 8)
        add("swiglu_grad", inter=width, tokens=tokens, dtype=dt, in_place=bool(n % 2))
        add("argmax", vocab=width * 25, tokens=tokens, dtype=dt, threads=threads, subgroups=sg)
        add("softmax_xent", classes=width * 25, tokens=tokens, dtype=dt, threads=threads,
            ignore=True, in_place=bool(n // 2 % 2), subgroups=sg)
        add("add_scaled", num_elements=None if tokens is None else 3 * width, columns=width,
            scale=1.0, y_dtype=dt)


def _attention_entries(add) -> None:
    """The language model's attention kernels (lora.kernels.attention): head_dims
    read as vec4s and as scalars, grouped heads, decode, explicit tilings with
    partial lanes, f32 and f16, each at the largest workgroup memory it takes."""
    shapes = [(4, 2, 16, 17, 17, {}), (9, 3, 64, 1, 2048, {}), (14, 2, 64, 128, 128, {}),
              (32, 8, 128, 64, 64, {}), (2, 2, 10, 9, 9, dict(block_q=3, block_k=5)),
              (4, 1, 8, 7, 7, dict(block_q=1, block_k=3, threads=12))]
    for n, (heads, kv_heads, d, q_len, kv_len, tiles) in enumerate(shapes):
        dt = ("f32", "f16")[n % 2]
        common = dict(batch=2, heads=heads, kv_heads=kv_heads, head_dim=d, dtype=dt)
        add("attention", q_len=q_len, kv_len=kv_len, **common, **tiles)
        if q_len == kv_len:
            add("attention_grad_kv", seq=q_len, **common, **tiles)
            add("attention_grad_q", seq=q_len, **common, **tiles)
        add("attention_delta", batch=2, heads=heads, head_dim=d, seq=q_len,
            dtype=("f16", "f32")[n % 2])


def _many_entries(add) -> None:
    """The kernels of many adapters in one batch (lora.kernels.many): rows and
    segments, fused and split, ids checked on the device, f32 and f16."""
    for n, ((in_dim, out_dim), seg, dt) in enumerate(
            itertools.product(DIMS, (False, True), ("f32", "f16"))):
        tile = 4 if seg else 1
        common = dict(max_rank=64, threads=(64, 256)[n % 2], tile_tokens=tile, segments=seg,
                      dtype=dt)
        add("many_fused", in_dim=in_dim, out_dim=out_dim, lanes=16, check_ids=not seg,
            unroll=bool(n % 2), **dict(common, threads=256 if seg else common["threads"]))
        add("many_shrink", in_dim=in_dim, lanes=8, check_ids=not seg and n % 2 == 0,
            rank_block=(0, 32)[n % 2], **common)
        add("many_fused", in_dim=in_dim, out_dim=out_dim, lanes=32, rank_rows=4,
            check_ids=False, unroll=bool(n % 2), **common)
        add("many_expand", out_dim=out_dim, **common)
    add("many_place", dtype="f32")
    add("many_place", dtype="f16", threads=64)
    for threads in (64, 256):
        add("many_sort_count", threads=threads)
        add("many_sort_scan", threads=threads, tile_tokens=(3, 8)[threads == 256], block=threads)
        add("many_sort_scatter", threads=threads)


def _training_entries(add) -> None:
    """The training kernels (lora.kernels.backward, loss, optimizer, network) and
    the forwards that save h, over ranks, token counts, dtypes and options."""
    for n, rank in enumerate(RANKS):
        s, dt = _spread(n), ("f32", "f16")[n % 2]
        t, i, o = s["tokens"], s["in_dim"], s["out_dim"]
        add("fused_forward", rank=rank, **s, threads=128, save_h=True, dtype=dt,
            from_base=bool(n % 2))
        add("tiled_forward", rank=rank, **s, threads=128, tile_tokens=4, save_h=True,
            token_block=1 + n % 2, dtype=dt)
        add("grad_dh_seed", out_dim=o, rank=rank, scale=s["scale"], tokens=t, dtype=dt)
        add("grad_dh", out_dim=o, rank=rank, scale=s["scale"], tokens=t, threads=64,
            subgroups=bool(n % 2), dtype=dt, rank_group=8 if rank in (16, 64) else 0)
        if rank % 4 == 0 and o % 4 == 0:
            add("grad_dh_tiled", out_dim=o, rank=rank, scale=s["scale"], tokens=t, threads=64,
                dtype=dt)
        add("grad_dh_b", out_dim=o, rank=rank, scale=s["scale"], tokens=min(t, 2), threads=64,
            accumulate=bool(n % 2), dtype=dt)
        for layout, dim in (("jr", o), ("rj", i)):
            add("grad_outer_seed", n=dim, rank=rank, scale=s["scale"], tokens=t, layout=layout,
                accumulate=bool(n % 2), dtype=dt)
            add("grad_outer", n=dim, rank=rank, scale=s["scale"], tokens=t, threads=64,
                chunk=2 * (n % 2), layout=layout, accumulate=bool(n % 2), dtype=dt)
            if dim % 4 == 0 and rank % 4 == 0:  # outer_tiled_fits
                add("grad_outer_tiled", n=dim, rank=rank, scale=s["scale"], tokens=t,
                    chunk=2 * (n % 2), layout=layout, accumulate=bool(n % 2), dtype=dt)
        add("grad_outer_reduce", size=i * rank, chunks=3, accumulate=bool(n % 2))
        add("grad_outer_pair", in_dim=i, out_dim=o, rank=rank, scale=s["scale"], tokens=t,
            accumulate=bool(n % 2), dtype=dt, threads=64)
        add("grad_outer_pair", in_dim=i, out_dim=o, rank=rank, scale=s["scale"], tokens=1,
            dtype=dt, dh_parts=1 + n % 3)  # dh in the mse kernel's parts
        add("grad_input_seed", in_dim=i, rank=rank, tokens=t, accumulate=bool(n % 2), dtype=dt)
        add("grad_input", in_dim=i, rank=rank, tokens=t, threads=64, dtype=dt)
        add("grad_a_input", in_dim=i, rank=rank, tokens=min(t, 2), threads=64,
            with_dx=bool(n % 2), dtype=dt)
    for schedule, partials in itertools.product(("constant", "linear", "cosine"), (0, 12)):
        add("optim_begin", partials=partials, schedule=schedule, threads=64)
    add("norm_partials", grad_sizes=(40, 7, 5, 6, 7, 8, 9), chunk=16, slots=12, threads=64)
    add("norm_partials", grad_sizes=(40, 7), first=7, slots=12)
    for sizes in ((40,), (24, 320)):
        add("adamw_update", sizes=sizes)
        add("sgd_update", sizes=sizes)
        add("to_f16", sizes=sizes)
    for n, (classes, dt) in enumerate(itertools.product((10, 1000), ("f32", "f16"))):
        add("mse", n=classes * 3, threads=64, dtype=dt)
        add("mse", n=classes + n % 2, threads=64, dtype=dt, begin=("constant", "cosine")[n % 2],
            dh_rank=(4, 3)[n % 2], dh_scale=0.5, subgroups=bool(n % 2))  # folded dispatches
        add("softmax_xent", classes=classes, tokens=3, threads=64, dtype=dt)
        add("softmax_xent", classes=classes, tokens=3, threads=64, dtype=dt, begin="linear")
        add("softmax_xent", classes=classes, tokens=3, threads=64, dtype=dt, seen=True)
        add("dropout", n=classes * 3 + n % 2, keep_from=1 << 30, scale=4 / 3, seed=n, dtype=dt)
        add("dense", in_dim=64, out_dim=classes, tokens=5, dtype=dt)
        add("dense_grad_input", in_dim=64, out_dim=classes, tokens=5, accumulate=bool(n % 2),
            dtype=dt)
        add("dense", in_dim=64, out_dim=classes, tokens=5, dtype=dt, bias=False)
        add("dense_tiled", in_dim=40, out_dim=classes, tokens=70, dtype=dt, bias=bool(n % 2))
        add("dense_grad_input_tiled", in_dim=40, out_dim=classes, tokens=70, dtype=dt,
            accumulate=bool(n % 2))
        add("copy", n4=classes, dtype=dt)
        for kind in ("relu", "gelu", "silu", "tanh"):
            add("activation", n=classes, kind=kind, dtype=dt)
            add("activation_grad", n=classes, kind=kind, dtype=dt)


def matrix_entries() -> list[Entry]:
    """The GEMM engine (shaderdsl.matmul.gemm: ``bench --gemm``'s variants at a
    square and a transformer shape, and every prologue and epilogue option on
    partial blocks) and the LoRA kernels on it (lora.kernels.matrix). Only Tint
    compiles them: wgpu-native has no subgroup matrices."""
    from lora.apps.bench_gemm import variants
    from lora.core.tilings import product_tiling
    from lora.kernels import KERNELS
    from shaderdsl.matmul import MatrixTiling, gemm
    from shaderdsl.types import MatrixConfig

    out: list[Entry] = []

    def engine(M, N, K, tiling, **opts):
        out.append(Entry("engine", "gemm", dict(M=M, N=N, K=K, tiling=str(tiling), **opts),
                         functools.partial(sd.compile, gemm, tiling.threads, M=M, N=N, K=K,
                                           tiling=tiling, **opts)))

    for M, N, K, layout in ((4096, 4096, 4096, "plain"), (4096, 576, 576, "linear")):
        for _, tiling, opts in variants(M, N, K, layout):
            engine(M, N, K, tiling, **opts)
    f32, f16 = (MatrixConfig("f16", r, 16, 16, 16) for r in ("f32", "f16"))
    small = MatrixTiling(f32, (2, 2), (1, 2), 32)
    for n, opts in enumerate([
            dict(a_major="col", b_major="col"), dict(out="f16", bias=True, activation="relu",
                                                     scale=0.5),
            dict(activation="silu", accumulate=True, c_stride=44, c_offset=4),
            dict(out="f16", accumulate=True, c_stride=43, c_offset=1, activation="tanh"),
            dict(in_place=True, accumulate=True, batches=3), dict(batches=2, b_major="col")]):
        engine(72, 40, 56, small if n % 2 else MatrixTiling(f32, (2, 2), (1, 2), 32,
                                                             read_width=8, prefetch=2), **opts)
    engine(72, 136, 48, MatrixTiling(f16, (2, 2), (1, 2), 32), out="f16", in_place=True,
           accumulate=True)
    engine(64, 128, 64, MatrixTiling(f32, (2, 2), (1, 2), 16, stages=1, prefetch=2, exact=True),
           in_place=True)

    def add(name, **params):
        out.append(Entry("lora", name, params, functools.partial(KERNELS[name].kernel,
                                                                 **params)))

    for tokens in (70, None):
        add("project_a_matrix", rank=64, in_dim=256, tokens=tokens, splits=2)
        add("project_a_matrix", rank=24, in_dim=64, tokens=tokens, fragments=1, depth=64,
            a_columns=True, scale=0.5, group=2)
        for direct, group in ((False, 0), (False, 3), (True, 0), (True, 2)):
            add("b_add_matrix", out_dim=136, rank=32, scale=-1.5, tokens=tokens, splits=2,
                rows=1, cols=2, save_h=tokens is None, group=group, direct=direct)
    for rank, accumulate in ((64, False), (16, True)):
        add("grad_input_matrix", in_dim=136, rank=rank, tokens=70, accumulate=accumulate)
    for layout, chunk, accumulate in (("jr", 128, False), ("rj", 64, True), ("jr", 300, True)):
        add("grad_outer_matrix", n=136, rank=64, scale=0.5, tokens=300, chunk=chunk,
            layout=layout, accumulate=accumulate)
    for limits in (None, {"max-compute-workgroup-storage-size": 16384}):
        tiling = product_tiling(512, 576, 1536, "row", "col", limits)
        add("dense_matrix", in_dim=1536, out_dim=576, tokens=512, tiling=tiling)
        add("dense_matrix", in_dim=40, out_dim=28, tokens=70, y_stride=44, y_column=16,
            bias=False)
        add("dense_grad_input_matrix", in_dim=576, out_dim=1536, tokens=512, accumulate=True,
            tiling=product_tiling(512, 576, 1536, limits=limits))
        add("dense_grad_input_matrix", in_dim=40, out_dim=28, tokens=70, g_stride=44,
            g_column=12)
    return out


def planner_entries() -> list[Entry]:
    """Kernels outside that grid which lora.core.tuning.candidates() also tries:
    512 and 1024 threads, and single (fused_forward) with one workgroup for all outputs."""
    from lora import kernels as K

    out: list[Entry] = []

    def add(name, **params):
        out.append(Entry("lora-autotuner", name, params,
                         functools.partial(K.KERNELS[name].kernel, **params)))

    for threads, sg, unroll in itertools.product((512, 1024), (False, True), (False, True)):
        add("fused_forward", rank=8, in_dim=2560, out_dim=2560, scale=2.0, tokens=1,
            threads=threads, outputs_per_thread=1, subgroups=sg, unroll=unroll)
    for sg in (False, True):
        add("fused_forward", rank=16, in_dim=2560, out_dim=2560, scale=-1.5, tokens=5,
            threads=256, outputs_per_thread=10, subgroups=sg, unroll=False)
    for tile, unroll in itertools.product((4, 8, 16), (False, True)):
        add("tiled_forward", rank=8, in_dim=256, out_dim=320, scale=2.0, tokens=5,
            threads=512, tile_tokens=tile, unroll=unroll)
    return out


# ---------------------------------------------------------------- examples

def example_entries() -> list[Entry]:
    """Every kernel function of examples/, with the parameters its run()
    helpers and tests use, edges included (1-wide workgroups, 1x1 matrices)."""
    from examples import (
        bitonic,
        half,
        histogram,
        int8_matmul,
        matmul,
        reduction,
        rows,
        saxpy,
        scan,
        stencil,
    )

    table = [
        *[(saxpy.saxpy, 64, dict(n=n, a_from=a)) for n in (None, 1, 1000)
          for a in ("override", "uniform")],
        (saxpy.saxpy, 256, dict(n=100)),
        *[(reduction.reduce_sum, ws, {}) for ws in (1, 64, 256)],
        *[(reduction.reduce_sum_subgroup, ws, {}) for ws in (1, 4, 64, 256)],
        (matmul.matmul, (4, 4), dict(M=3, K=5, N=7)),
        (matmul.matmul, (8, 8), dict(M=100, K=50, N=70)),
        (matmul.matmul, (16, 16), dict(M=100, K=50, N=70)),
        (matmul.matmul, (16, 16), dict(M=1, K=1, N=1)),
        (histogram.histogram, 128, dict(nbins=100)),
        (histogram.histogram, 32, dict(nbins=1)),
        (histogram.histogram, 128, dict(nbins=37, private=True)),
        (histogram.histogram, 128, dict(nbins=4096, private=True)),
        (histogram.histogram, 64, dict(nbins=3, private=True)),
        *[(half.gemv_f16, 64, dict(rows=rows, cols=cols)) for rows, cols in
          ((300, 256), (300, 250), (1, 1), (4, 4))],
        *[(int8_matmul.int8_matmul, (8, 8), dict(M=37, K=k, N=n, signed=s))
          for k, n, s in ((301, 45, True), (8, 8, False), (1, 1, True))],
        *[(fn, ws, dict(rows=r, cols=c)) for fn in (rows.softmax, rows.layer_norm)
          for ws, r, c in ((64, 3, 100), (64, 1, 1), (32, 2, 17))],
        *[(scan.scan_blocks, ws, dict(subgroups=sg)) for ws in (256, 7) for sg in (False, True)],
        (scan.add_offsets, 256, {}),
        (bitonic.bitonic, 256, dict(how="uniform")),
        (bitonic.bitonic, 256, dict(how="override")),
        (bitonic.bitonic, 256, dict(how="bake", k=8, j=2)),
        *[(stencil.conv2d, ws, dict(height=h, width=w, radius=r))
          for ws, h, w, r in (((8, 8), 37, 50, 1), ((4, 4), 1, 1, 0), ((16, 16), 5, 70, 2))],
    ]
    out = []
    for fn, ws, params in table:
        name = f"{fn.__module__}.{fn.__name__}"
        out.append(Entry("examples", name, {"workgroup_size": ws, **params},
                         functools.partial(sd.compile, fn, ws, **params)))
    return out


# ---------------------------------------------------------------- tests/test_codegen.py

def codegen_entries() -> list[Entry]:
    """The kernels tests/test_codegen.py compiles with its ``naga`` fixture:
    each of its tests whose only argument is ``naga`` is called with a
    recorder in the fixture's place (its text assertions run as well)."""
    path = ROOT / "tests" / "test_codegen.py"
    spec = importlib.util.spec_from_file_location("_tint_check_test_codegen", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = []
    for name, fn in sorted(vars(module).items()):
        if not (name.startswith("test_") and inspect.isfunction(fn)):
            continue
        if list(inspect.signature(fn).parameters) != ["naga"]:
            continue
        seen: list = []
        fn(lambda kernel: seen.append(kernel) or kernel)
        out.extend(Entry("codegen", f"test_codegen.{name}[{i}]", {}, functools.partial(_same, k))
                   for i, k in enumerate(seen))
    return out


def _same(kernel):
    return kernel


# ------------------------------------------------------------ constructs test_codegen leaves out

def c_subgroup_ops(m, elem):
    """Every subgroup builtin on one element type."""
    src = m.declare_input_buffer("src", elem)
    dst = m.declare_output_buffer("dst", elem)
    flags = m.declare_output_buffer("flags", vec4u)
    gid = m.let(m.global_id().x, "gid")
    lane = m.let(m.subgroup_invocation_id(), "lane")
    v = m.let(src[gid], "v")
    terms = [B.subgroup_add(v), B.subgroup_mul(v), B.subgroup_max(v), B.subgroup_min(v),
             B.subgroup_inclusive_add(v), B.subgroup_exclusive_add(v),
             B.subgroup_broadcast_first(v), B.subgroup_broadcast(v, 1),
             B.subgroup_shuffle(v, m.subgroup_size() - 1 - lane), B.subgroup_shuffle_xor(v, 1),
             B.subgroup_shuffle_up(v, 1), B.subgroup_shuffle_down(v, 1)]
    if elem in (u32, i32):
        terms += [B.subgroup_and(v), B.subgroup_or(v), B.subgroup_xor(v)]
    lets = [m.let(t) for t in terms]
    total = lets[0]
    for t in lets[1:]:
        total = total + t
    dst[gid] = total
    big = m.let(B.subgroup_all(lane < 64), "all_small")
    some = m.let(B.subgroup_any(lane == 0), "any_first")
    ballot = m.let(B.subgroup_ballot(big & some), "ballot")
    flags[gid] = ballot


def c_atomics(m, elem, workgroup):
    """Every atomic builtin on atomic<u32|i32>, in storage or workgroup memory."""
    n = 16
    counts = m.declare_output_buffer("counts", atomic(elem), n)
    out = m.declare_output_buffer("out", elem)
    cells = m.shared(atomic(elem), n, "cells") if workgroup else counts
    i = m.let(m.local_index() % n, "i")
    one = elem(1)
    olds = [B.atomic_add(cells[i], one), B.atomic_sub(cells[i], one), B.atomic_max(cells[i], one),
            B.atomic_min(cells[i], one), B.atomic_and(cells[i], one), B.atomic_or(cells[i], one),
            B.atomic_xor(cells[i], one), B.atomic_exchange(cells[i], one), B.atomic_load(cells[i])]
    B.atomic_store(cells[(i + 1) % n], one)
    if workgroup:
        m.barrier()
        B.atomic_add(counts[i], B.atomic_load(cells[i]))
    total = olds[0]
    for o in olds[1:]:
        total = total + o
    out[m.global_id().x] = total


def c_f16_math(m):
    """f16 scalars and vectors: arithmetic, builtins, conversions both ways."""
    h = m.declare_input_buffer("h", vec4h)
    o = m.declare_output_buffer("o", f16)
    w = m.declare_output_buffer("w", vec4h)
    f = m.declare_output_buffer("f", f32)
    i = m.let(m.global_id().x, "i")
    v = m.let(h[i], "v")
    s = m.let(v.x * 0.5 + v.y, "s")
    o[i] = (B.sqrt(B.abs(s)) + B.exp(s) + B.fma(s, s, 1.0) + B.clamp(s, -1.0, 1.0)
            + B.min(s, v.z) + B.max(s, v.w) + B.dot(v, v) + B.length(v) + B.select(s, -s, s > 0.0))
    w[i] = B.normalize(v) * vec4h(s) + B.mix(v, vec4h(1.0), 0.25)
    f[i] = f32(s) + B.dot(vec4f(v), vec4f(1.0))
    o[i + 1] = f16(f[0]) * 2.0


def c_overrides(m):
    """Overrides of every scalar type, without defaults (set at pipeline creation)."""
    o = m.declare_output_buffer("o", f32)
    q = m.declare_output_buffer("q", i32)
    count = m.override("count", u32)
    offset = m.override("offset", i32)
    gain = m.override("gain", f32)
    flag = m.override("flag", bool_)
    bias = m.override("bias", f32, -0.5)
    acc = m.var(f32, 0.0, "acc")
    with m.loop(count, name="k") as k:
        acc += gain * f32(k) + bias
    with m.if_(flag):
        o[0] = acc
    q[0] = offset * 2 - 1


def c_control_flow(m):
    """Nested, descending and i32 loops, while with break, early return, local arrays."""
    o = m.declare_output_buffer("o", f32)
    q = m.declare_output_buffer("q", i32)
    lid = m.let(m.local_index(), "lid")
    acc = m.var(f32, 0.0, "acc")
    table = m.var(array(f32, 8), name="table")
    for r in m.static_loop(range(8)):
        table[r] = f32(r) * 0.5
    with m.loop(4, name="a") as a:
        with m.loop(a, 8, 2, name="b") as b:
            with m.if_(b == 6):
                m.break_()
            with m.elif_(b == 2):
                m.continue_()
            acc += table[b] * f32(a)
    with m.loop(i32(10), i32(-10), -3, name="c") as c:
        q[lid] = c
    left = m.var(u32, 100, "left")
    with m.while_(left > 0):
        left >>= 1
        with m.if_((left & 1) == 1):
            m.break_()
    m.storage_barrier()
    with m.if_(lid >= 64):
        m.return_()
    v = m.var(vec4f, vec4f(acc), "v")
    v.y = f32(left)
    o[lid] = v.x + v.y + table[lid % 8]


def c_workgroup_3d(m):
    """A 3-D workgroup, 3-D indexing of shared memory, scalar and vector uniforms."""
    sx, sy, sz = m.workgroup_size
    params = m.declare_uniform("params", vec4f)
    stride = m.declare_uniform("stride", u32)
    o = m.declare_output_buffer("o", vec4f)
    cube = m.shared(vec4f, sx * sy * sz, "cube")
    lid = m.local_id()
    flat = m.let(lid.z * (sx * sy) + lid.y * sx + lid.x, "flat")
    cube[flat] = params * f32(m.global_id().z) + vec4f(f32(m.num_workgroups().y))
    m.barrier()
    o[m.workgroup_id().x * stride + flat] = cube[(flat + 1) % (sx * sy * sz)]


def c_int_math(m):
    """i32 and u32 arithmetic, vectors, bit builtins, bitcasts, vector select."""
    a = m.declare_output_buffer("a", vec4i)
    b = m.declare_output_buffer("b", vec4u)
    x = m.let(a[0], "x")
    y = m.let(b[0], "y")
    n = m.let(x.x, "n")
    a[1] = B.abs(x) + B.sign(x) + B.clamp(x, vec4i(-3), vec4i(3)) + x % vec4i(7) + x / vec4i(2)
    a[2] = vec4i(n << 2, n >> 1, -n, ~n) + B.bitcast(vec4i, y)
    b[1] = B.count_ones(y) + B.reverse_bits(y) + B.first_leading_bit(y) + B.max(y, vec4u(1))
    b[2] = B.select(y, vec4u(0), x < vec4i(0))
    b[3] = vec4u(B.bitcast(u32, f32(n) * 0.5), u32(n), u32(B.bitcast(f32, y.x) > 0.0), 0)


def c_int_constants(m):
    """Constant integer operations at the edge of what WGSL accepts at shader
    creation (unsigned wrap-around, shifts into the top bit; the DSL refuses
    the ones just past it)."""
    b = m.declare_output_buffer("b", vec4u)
    a = m.declare_output_buffer("a", vec4i)
    y = m.let(b[0], "y")
    b[1] = y + vec4u(u32(2) - u32(3), u32(65536) * u32(65536), u32(1) << u32(31), ~u32(0))
    a[1] = a[0] + vec4i(i32(-1) << u32(31), i32(-2**31) / i32(-2), i32(-7) % i32(3), -i32(5))


def c_shaped(m):
    """Shaped buffers (sizes from an int, an override, a uniform) and a shaped tile."""
    depth = m.override("depth", u32, 3)
    cols = m.declare_uniform("cols", u32)
    x = m.declare_input_buffer("x", f32, (depth, 4, cols))
    y = m.declare_output_buffer("y", f32, (8, 8))
    tile = m.shared(f32, (8, 9))
    lid = m.local_id()
    tile[lid.y, lid.x] = x[lid.x % depth, i32(lid.y) % 4, 2]
    m.barrier()
    y[lid.x, lid.y] = tile[lid.y, lid.x]


@sd.function
def _c_scaled_total(m, v: f32, scale: f32) -> f32:
    """A WGSL function holding a barrier (a reduction) and using a builtin value."""
    return sd.collectives.reduce(m, v * scale) + f32(m.local_index())


def c_functions(m):
    out = m.declare_output_buffer("out", f32, 64)
    i = m.local_index()
    out[i] = _c_scaled_total(m, f32(i), 0.5) + _c_scaled_total(m, 1.0, 2.0)


def c_packing(m):
    """The packed 8-bit dot products and every pack/unpack builtin."""
    x = m.declare_input_buffer("x", u32)
    vf = m.declare_input_buffer("vf", vec4f)
    vi = m.declare_input_buffer("vi", vec4i)
    o = m.declare_output_buffer("o", u32)
    fo = m.declare_output_buffer("fo", vec4f)
    i = m.let(m.global_id().x, "i")
    w, v = m.let(x[i], "w"), m.let(vf[i], "v")
    o[i] = (u32(B.dot4_i8_packed(w, 7)) + B.dot4_u8_packed(w, w) + B.pack4x_i8(vi[i])
            + B.pack4x_u8(vec4u(vi[i])) + B.pack4x_i8_clamp(vi[i]) + B.pack4x_u8_clamp(vec4u(w))
            + B.pack4x8snorm(v) + B.pack4x8unorm(v) + B.pack2x16snorm(v.xy)
            + B.pack2x16unorm(v.zw) + B.pack2x16float(v.xy))
    fo[i] = (vec4f(B.unpack4x_i8(w)) + vec4f(B.unpack4x_u8(w)) + B.unpack4x8snorm(w)
             + B.unpack4x8unorm(w) + vec4f(B.unpack2x16snorm(w), B.unpack2x16unorm(w))
             + vec4f(B.unpack2x16float(w), 0.0, 1.0))


def construct_entries() -> list[Entry]:
    table = [
        *[(c_subgroup_ops, 64, dict(elem=e)) for e in (f32, i32, u32, f16)],
        *[(c_atomics, 64, dict(elem=e, workgroup=w)) for e in (u32, i32) for w in (False, True)],
        (c_f16_math, 64, {}),
        (c_overrides, 1, {}),
        (c_control_flow, 64, {}),
        (c_workgroup_3d, (4, 4, 4), {}),
        (c_int_math, 1, {}),
        (c_int_constants, 1, {}),
        (c_packing, 64, {}),
        (c_shaped, (8, 8, 1), {}),
        (c_functions, 64, {}),
    ]
    out = []
    for fn, ws, params in table:
        shown = {k: str(v) for k, v in params.items()}
        out.append(Entry("constructs", fn.__name__, {"workgroup_size": ws, **shown},
                         functools.partial(sd.compile, fn, ws, **params)))
    return out


# ---------------------------------------------------------------- the grid and the check

GROUPS = (lora_entries, matrix_entries, planner_entries, example_entries, codegen_entries,
          construct_entries)


# The grid's parts: the default tier's sample (every kernel function with its first
# entry) and the rest (--full: the other entries); together, all.
PARTS = ("all", "sample", "rest")


def entries() -> list[Entry]:
    """Every entry of the grid, in a fixed order, nothing built yet."""
    return [entry for group in GROUPS for entry in group()]


def grid(part: str = "all") -> list[Entry]:
    """The kernels of ``part`` (PARTS) to validate, in a fixed order, each WGSL text once."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    seen, out, counts = set(), [], collections.Counter()
    for entry in entries():
        k = counts[entry.group, entry.name]
        counts[entry.group, entry.name] += 1
        if part != "all" and (k == 0) != (part == "sample"):
            continue
        key = entry.kernel.cache_key
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out


def digest(entries) -> str:
    """Identifies the grid's WGSL texts, in order."""
    h = hashlib.sha256()
    for e in entries:
        h.update(e.kernel.cache_key.encode())
    return h.hexdigest()[:16]


class Unsupported(Exception):
    """The device lacks a feature the kernel needs."""


def compile_one(device, kernel) -> str:
    """Compile ``kernel`` on ``device``: "pipeline" (module and pipeline made),
    or "module: <why>" when the kernel is over this device's limits, so only its
    WGSL could be compiled. Raises WGSLCompileError on rejection, Unsupported
    when the device lacks a feature."""
    from shaderdsl import checks
    from shaderdsl.runtime import COMPILER
    from shaderdsl.runtime.pipelines import compile_error

    missing = sorted(set(kernel.features) - set(device.features))
    if missing:
        raise Unsupported(f"device lacks {', '.join(missing)}")
    try:
        checks.check_kernel(kernel, device)
    except sd.DispatchError as over:  # workgroup size or memory over this device's limits
        import wgpu

        try:
            device.wgpu_device.create_shader_module(label=kernel.name,
                                                    code=kernel.wgsl_for(COMPILER))
        except wgpu.GPUError as err:
            raise compile_error(kernel, err) from None
        return f"module: {over}"
    overrides = {o.name: 1 for o in kernel.overrides if o.default is None}
    device.prepare(kernel, overrides=overrides or None)
    return "pipeline"


# A kernel both compilers must reject (a float literal for a u32): shows that the
# check really compiles, so an empty list of failures means something.
CONTROL = sd.Kernel(name="control", workgroup_size=(1, 1, 1), bindings=(),
                    wgsl="@compute @workgroup_size(1, 1, 1)\nfn main() {\n"
                         "    let x: u32 = 1.5f;\n}\n")


def control_rejected(device) -> bool:
    try:
        compile_one(device, CONTROL)
    except sd.WGSLCompileError:
        return True
    return False


def check(device, entries) -> dict:
    """Compile every entry; the report described in the module docstring."""
    from shaderdsl.runtime import COMPILER

    t0 = time.perf_counter()
    failures, module_only, unsupported = [], [], []
    checked = 0
    for e in entries:
        try:
            how = compile_one(device, e.kernel)
        except Unsupported as why:
            unsupported.append({**e.describe(), "error": str(why)})
            continue
        except Exception as err:  # WGSLCompileError, or anything else the compile raised
            failures.append({**e.describe(), "error": f"{type(err).__name__}: {err}"})
            continue
        checked += 1
        if how != "pipeline":
            module_only.append({**e.describe(), "reason": how.split(": ", 1)[1]})
    return {"compiler": COMPILER, "device": f"{device.name} ({device.backend})",
            "checked": checked, "expected": len(entries), "digest": digest(entries),
            "control_rejected": control_rejected(device), "module_only": module_only,
            "unsupported": unsupported, "failures": failures,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the kernels, compile nothing")
    parser.add_argument("--json", metavar="PATH", help="also write the report to PATH")
    parser.add_argument("--part", choices=PARTS, default="all",
                        help="the default tier's sample of the grid, the rest, or all of it")
    args = parser.parse_args(argv)
    # Before anything imports wgpu (importing lora imports shaderdsl.runtime):
    # Dawn, on its Null backend, unless told otherwise.
    os.environ.setdefault("SHADERDSL_WGPU", "dawn")
    os.environ.setdefault("WGPU_BACKEND_TYPE", "Null")

    t0 = time.perf_counter()
    chosen = grid(args.part)
    built = time.perf_counter() - t0
    if args.list:
        for e in chosen:
            print(json.dumps(e.describe(), default=str))
        print(f"{len(chosen)} kernels, digest {digest(chosen)}", file=sys.stderr)
        return 0

    from shaderdsl.runtime import get_device

    report = check(get_device(), chosen)
    report["build_seconds"] = round(built, 2)
    text = json.dumps(report, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    ok = report["control_rejected"] and report["checked"] == report["expected"]
    return 0 if ok and not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
