"""The registry of LoRA kernels: each DSL function with its workgroup size and
grid, so plans, the command line and the tests name a kernel and its
parameters, and nothing else computes a grid. A binding's name is the role
of the buffer bound to it (A, x, h, output, ...); a plan step may rename the
generic ones (grad_outer's G, H and out are g, h and dB for dB)."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import shaderdsl as sd

from . import backward, dropout, lm, loss, network, optimizer
from .attention import attention, attention_delta, attention_grad_kv, attention_grad_q
from .attention import tiling as attention_tiling
from .attention_matrix import attention_matrix, matrix_tiling
from .attention_matrix_grad import attention_matrix_grad_kv, attention_matrix_grad_q, grad_tiling
from .common import ceil_div, width
from .fused import fused_forward
from .gemm import B_ADD_THREADS, gemm_tile_tokens, project_a_tiled, tiled_b_add
from .many import many_expand, many_fused, many_place, many_shrink
from .many_matrix import (
    expand_groups,
    many_matrix,
    many_matrix_expand,
    many_matrix_shrink,
    matrix_threads,
)
from .many_sort import many_sort_count, many_sort_scan, many_sort_scatter
from .matrix import (
    OUTER,
    a_tiling,
    b_add_matrix,
    b_tiling,
    dense_grad_input_matrix,
    dense_matrix,
    grad_input_matrix,
    grad_outer_matrix,
    outer_matrix_grid,
    project_a_matrix,
)
from .projections import (
    add_scaled,
    fused_b_add,
    project_a_seed,
    project_a_workgroup,
    project_b,
)
from .tiled import tiled_forward


@functools.lru_cache(maxsize=None)
def _parameters(function) -> dict:
    """A kernel function's parameters (inspect.signature, read once: a plan's
    build asks for them at every step of every plan)."""
    return dict(inspect.signature(function).parameters)


@dataclass(frozen=True)
class KernelSpec:
    """One LoRA kernel: its DSL function, its workgroup size and its grid, both
    computed from the parameters alone.

    ``kernel(**params)`` compiles it (cached by ``shaderdsl.compile``);
    ``grid(**params)`` is the workgroup count a dispatch needs. Parameters
    are the function's keyword parameters (defaults filled in), plus
    ``threads`` wherever the workgroup size is not one of them. A kernel
    built with ``tokens=None`` reads the token count at run time; its grid is
    ``grid_rule(dict(params, tokens=T))`` for T tokens (``lora.core.plan``).
    """

    name: str
    function: Callable
    workgroup: Callable[[dict], int]
    grid_rule: Callable[[dict], tuple[int, int, int]]
    doc: str

    @property
    def parameter_names(self) -> set[str]:
        return set(_parameters(self.function)) - {"m"} | {"threads"}

    def params(self, **given) -> dict:
        """``given`` over the function's defaults (and threads=256)."""
        out = {"threads": 256}
        out.update({k: p.default for k, p in _parameters(self.function).items()
                    if p.default is not inspect.Parameter.empty})
        unknown = set(given) - self.parameter_names
        if unknown:
            raise TypeError(f"kernel {self.name!r} takes no parameter(s) {sorted(unknown)}; "
                            f"it takes {sorted(self.parameter_names)}")
        out.update(given)
        return out

    def kernel(self, **given) -> sd.Kernel:
        p = self.params(**given)
        sig = _parameters(self.function)
        name = self.name if p.get("dtype", "f32") == "f32" else f"{self.name}_{p['dtype']}"
        return sd.compile(self.function, self.workgroup(p), name=name,
                          **{k: v for k, v in p.items() if k in sig})

    def grid(self, **given) -> tuple[int, int, int]:
        return self.grid_rule(self.params(**given))


KERNELS = {spec.name: spec for spec in (
    KernelSpec("project_a_seed", project_a_seed, lambda p: 64,
               lambda p: (ceil_div(p["rank"], 64), p["tokens"], 1),
               "h = A @ x, Hesper's design: one thread per element of h"),
    KernelSpec("project_a", project_a_workgroup, lambda p: p["threads"],
               lambda p: (p["tokens"], ceil_div(p["rank"], p["rank_group"])
                          if 0 < p["rank_group"] < p["rank"] else 1, 1),
               "h = A @ x: one workgroup per token (and per group of ranks)"),
    KernelSpec("project_b", project_b, lambda p: p["threads"],
               lambda p: (ceil_div(p["out_dim"], p["threads"]), p["tokens"], 1),
               "y = B @ h: one thread per element of y"),
    KernelSpec("add_scaled", add_scaled, lambda p: p["threads"],
               lambda p: (ceil_div(p["tokens"] * p["columns"] if p["num_elements"] is None
                                   else p["num_elements"], p["threads"]), 1, 1),
               "output += scale * y"),
    KernelSpec("fused_b_add", fused_b_add, lambda p: p["threads"],
               lambda p: (ceil_div(p["out_dim"], p["threads"]), p["tokens"], 1),
               "output += scale * B @ h"),
    KernelSpec("fused_forward", fused_forward, lambda p: p["threads"],
               lambda p: (ceil_div(p["out_dim"], p["threads"] * p["outputs_per_thread"]),
                          p["tokens"], 1),
               "output += scale * B @ (A @ x), one dispatch, h recomputed per workgroup"),
    KernelSpec("tiled_forward", tiled_forward, lambda p: p["threads"],
               lambda p: (ceil_div(p["tokens"], p["tile_tokens"]), 1, 1),
               "output += scale * B @ (A @ x), one dispatch, a tile of tokens per workgroup"),
    KernelSpec("project_a_tiled", project_a_tiled, lambda p: p["threads"],
               lambda p: (ceil_div(p["tokens"], gemm_tile_tokens(p["rank"], p["threads"],
                                                                  p["block"])),
                          p["splits"], 1),
               "h = A @ x as a matrix product: 4 or 8 tokens x 4 ranks per thread, in slices "
               "of in_dim"),
    KernelSpec("tiled_b_add", tiled_b_add, lambda p: B_ADD_THREADS,
               lambda p: (ceil_div(p["tokens"], p["tile_tokens"]),
                          ceil_div(p["out_dim"], 4 * B_ADD_THREADS), 1),
               "output += scale * B @ h (the slices of project_a_tiled summed), a tile of "
               "tokens and a block of columns per workgroup"),
    KernelSpec("project_a_matrix", project_a_matrix,
               lambda p: a_tiling(p["rank"], p["fragments"], p["depth"]).threads,
               lambda p: a_tiling(p["rank"], p["fragments"], p["depth"]).grid(p["tokens"],
                                                                               p["rank"])[:2]
               + (p["splits"],),
               "h = A @ x on matrix units (f16), in slices of in_dim"),
    KernelSpec("b_add_matrix", b_add_matrix,
               lambda p: _b_tiling(p).threads,
               lambda p: _b_tiling(p).grid(p["tokens"], p["out_dim"]),
               "output += scale * B @ h on matrix units (f16), the slices of h summed; "
               "direct: the output's f16 fragments as the accumulators"),
    KernelSpec("grad_input_matrix", grad_input_matrix,
               lambda p: b_tiling(p["rank"], 2, 2).threads,
               lambda p: b_tiling(p["rank"], 2, 2).grid(p["tokens"], p["in_dim"]),
               "dx (+)= dh A on matrix units (f16 A and dx, f32 dh staged as f16)"),
    KernelSpec("grad_outer_matrix", grad_outer_matrix, lambda p: OUTER.threads,
               lambda p: outer_matrix_grid(p["n"], p["rank"], p["tokens"], p["chunk"], p["layout"]),
               "grad_outer on matrix units (f16 G, f32 H staged as f16), over chunks of tokens"),
)}


def _threads(p):
    return p["threads"]


def _b_tiling(p):
    return b_tiling(p["rank"], p["rows"], p["cols"], p["group"], p["direct"])


def _columns(n_key):
    """Grid of one thread per column and one workgroup row per token."""
    return lambda p: (ceil_div(p[n_key], p["threads"]), p["tokens"], 1)


def _tiles(n_key):
    """Grid of one TILE x TILE block of the result (tokens x ``n_key``) per
    workgroup: the tiled base products (lora.kernels.network)."""
    return lambda p: (ceil_div(p[n_key], network.TILE), ceil_div(p["tokens"], network.TILE), 1)


def _elements(size, workgroup=_threads):
    """Grid of one thread per element (``workgroup`` threads per workgroup)."""
    return lambda p: (ceil_div(size(p), workgroup(p)), 1, 1)


def _outer_grid(p):
    chunk = p["chunk"] if 0 < p["chunk"] < p["tokens"] else p["tokens"]
    return (ceil_div(p["n"], p["threads"]), ceil_div(p["tokens"], chunk), 1)


TRAINING_KERNELS = (
    KernelSpec("grad_dh_seed", backward.grad_dh_seed, lambda p: 64,
               lambda p: (ceil_div(p["rank"], 64), p["tokens"], 1),
               "dh = s g B, Hesper's gradDh: one thread per element of dh"),
    KernelSpec("grad_dh", backward.grad_dh, _threads,
               lambda p: (p["tokens"], p["rank"] // p["rank_group"]
                          if 0 < p["rank_group"] < p["rank"] else 1, 1),
               "dh = s g B: one workgroup per token (and per group of ranks)"),
    KernelSpec("grad_dh_tiled", backward.grad_dh_tiled, _threads,
               lambda p: (ceil_div(p["tokens"], p["threads"] // (p["rank"] // 4)), 1, 1),
               "dh = s g B for many tokens: a vec4 of dh per thread, no reduction"),
    KernelSpec("grad_dh_b", backward.grad_dh_b, _threads, lambda p: (1, 1, 1),
               "dh = s g B and dB = s g^T h from one read of g (a few tokens)"),
    KernelSpec("grad_outer_seed", backward.grad_outer_seed, lambda p: 64,
               _elements(lambda p: p["n"] * p["rank"], lambda p: 64),
               "dB or dA, Hesper's gradB/gradA: one thread per element"),
    KernelSpec("grad_outer", backward.grad_outer, _threads, _outer_grid,
               "dB = s g^T h or dA = dh^T x over chunks of tokens"),
    KernelSpec("grad_outer_pair", backward.grad_outer_pair, _threads,
               _elements(lambda p: p["in_dim"] + p["out_dim"]),
               "dB = s g^T h and dA = dh^T x in one dispatch (a few tokens)"),
    KernelSpec("grad_outer_tiled", backward.grad_outer_tiled,
               lambda p: backward.outer_tile(p["rank"])[0],
               lambda p: (ceil_div(p["n"], backward.outer_tile(p["rank"])[1]),
                          ceil_div(p["tokens"], backward.outer_chunk(p["chunk"], p["tokens"],
                                                                     p["rank"])), 1),
               "grad_outer as a tiled matrix product: 4 columns x 4 ranks per thread"),
    KernelSpec("grad_outer_reduce", backward.grad_outer_reduce, _threads,
               _elements(lambda p: p["size"]), "the sum of grad_outer's chunks"),
    KernelSpec("grad_input_seed", backward.grad_input_seed, lambda p: 64,
               lambda p: (ceil_div(p["in_dim"], 64), p["tokens"], 1),
               "dx = dh A, Hesper's inputGrad: one thread per element"),
    KernelSpec("grad_input", backward.grad_input, _threads, _columns("in_dim"),
               "dx = dh A: one thread per element, dh in workgroup memory"),
    KernelSpec("grad_a_input", backward.grad_a_input, _threads,
               lambda p: (ceil_div(p["in_dim"], p["threads"]), 1, 1),
               "dA = dh^T x and dx = dh A from one read of x (a few tokens)"),
    KernelSpec("mse", loss.mse, _threads, _elements(lambda p: p["n"] // width(p["n"])),
               "mean squared error: gradient and per-workgroup partial sums"),
    KernelSpec("softmax_xent", loss.softmax_xent, _threads, lambda p: (p["tokens"], 1, 1),
               "softmax cross-entropy: gradient and per-token losses"),
    KernelSpec("optim_begin", optimizer.optim_begin, _threads, lambda p: (1, 1, 1),
               "the step count, learning rate, bias corrections and clip factor"),
    KernelSpec("norm_partials", optimizer.norm_partials, _threads,
               lambda p: (sum(optimizer.norm_workgroups(p["grad_sizes"],
                                                        p["chunk"])), 1, 1),
               "sums of squares for clipping's global norm: a workgroup per chunk"),
    KernelSpec("adamw_update", optimizer.adamw_update, _threads,
               _elements(lambda p: sum(p["sizes"])), "one AdamW step of up to two tensors"),
    KernelSpec("sgd_update", optimizer.sgd_update, _threads,
               _elements(lambda p: sum(p["sizes"])), "one SGD step of up to two tensors"),
    KernelSpec("dense", network.dense, _threads, _columns("out_dim"),
               "a frozen base layer: y = x W^T + b"),
    KernelSpec("dense_grad_input", network.dense_grad_input, _threads, _columns("in_dim"),
               "its input gradient: dx = g W"),
    KernelSpec("dense_tiled", network.dense_tiled, lambda p: network.TILED_THREADS,
               _tiles("out_dim"), "dense's y = x W^T + b, a 64 x 64 block of y per workgroup"),
    KernelSpec("dense_grad_input_tiled", network.dense_grad_input_tiled,
               lambda p: network.TILED_THREADS, _tiles("in_dim"),
               "dense_grad_input's dx = g W, a 64 x 64 block of dx per workgroup"),
    KernelSpec("dense_matrix", dense_matrix, lambda p: (p["tiling"] or OUTER).threads,
               lambda p: (p["tiling"] or OUTER).grid(p["tokens"], p["out_dim"]),
               "dense on matrix units: f16 x, W and y, f32 sums, the tiling's blocks"),
    KernelSpec("dense_grad_input_matrix", dense_grad_input_matrix,
               lambda p: (p["tiling"] or OUTER).threads,
               lambda p: (p["tiling"] or OUTER).grid(p["tokens"], p["in_dim"]),
               "dense_grad_input on matrix units: f16 g, W and dx, f32 sums"),
    KernelSpec("activation", network.activation, _threads, _elements(lambda p: p["n"]),
               "y = act(z): ReLU, GELU, SiLU or tanh"),
    KernelSpec("activation_grad", network.activation_grad, _threads,
               _elements(lambda p: p["n"]), "dz = dy act'(z)"),
    KernelSpec("dropout", dropout.dropout, _threads,
               _elements(lambda p: ceil_div(p["n"], width(p["n"]))),
               "LoRA dropout of x: a hash of (seed, step, index) keeps each element"),
    KernelSpec("copy", network.copy, _threads, _elements(lambda p: p["n4"]),
               "dst = src, a vec4 at a time"),
    KernelSpec("to_f16", network.to_f16, _threads, _elements(lambda p: sum(p["sizes"])),
               "h = f16(p) for one or two tensors: f16 copies of f32 parameters"),
)
KERNELS.update({spec.name: spec for spec in TRAINING_KERNELS})

MANY_KERNELS = (  # the rows of a batch naming adapters of a pool; tokens: the work items
    KernelSpec("many_fused", many_fused, _threads, lambda p: (p["tokens"], 1, 1),
               "output += scale_i B_i (A_i x) for each row's adapter i of a pool, one dispatch, "
               "a workgroup per row or tile of rows sharing an adapter"),
    KernelSpec("many_shrink", many_shrink, _threads,
               lambda p: (p["tokens"], p["max_rank"] // p["rank_block"] if p["rank_block"] else 1,
                          1),
               "h = scale_i A_i x for each row's adapter i of a pool (f32, max_rank per row)"),
    KernelSpec("many_expand", many_expand, _threads,
               lambda p: (ceil_div(p["out_dim"], p["threads"]), p["tokens"], 1),
               "output += B_i h for each row's adapter i of a pool, a thread per column"),
    KernelSpec("many_matrix", many_matrix, lambda p: matrix_threads(),
               lambda p: (p["tokens"], p["column_splits"], 1),
               "output += scale_i B_i (A_i x) on matrix units (f16), a workgroup per tile of "
               "rows sharing adapter i (and per share of the columns)"),
    KernelSpec("many_matrix_shrink", many_matrix_shrink, lambda p: matrix_threads(),
               lambda p: (p["tokens"], p["splits"], 1),
               "hp = scale_i A_i x over slices of in_dim on matrix units (f16), a workgroup per "
               "tile of rows sharing adapter i and slice"),
    KernelSpec("many_matrix_expand", many_matrix_expand, lambda p: matrix_threads(),
               lambda p: (p["tokens"], expand_groups(p["out_dim"], p["tile_tokens"],
                                                     p["max_rank"], p["column_fragments"],
                                                     p["column_splits"]), 1),
               "output += B_i (the slices of hp summed) on matrix units (f16), a workgroup per "
               "tile of rows sharing adapter i and block of columns"),
    KernelSpec("many_place", many_place, _threads,
               lambda p: (ceil_div(p["tokens"], p["threads"]), 1, 1),
               "dst[at + i] = src[src_at + i]: an adapter written into a pool, or copied out"),
    KernelSpec("many_sort_count", many_sort_count, _threads,
               lambda p: (ceil_div(p["tokens"], p["threads"]), 1, 1),
               "each row's rank among its block's rows of its adapter, and the block's counts"),
    KernelSpec("many_sort_scan", many_sort_scan, _threads, lambda p: (1, 1, 1),
               "the counts as first positions per block and adapter, and the tiles"),
    KernelSpec("many_sort_scatter", many_sort_scatter, _threads,
               lambda p: (ceil_div(p["tokens"], p["threads"]), 1, 1),
               "each row put at its place in the order sorted by adapter"),
)
KERNELS.update({spec.name: spec for spec in MANY_KERNELS})



def _per_token(items, w_key):
    """Grid of a thread per item of a row (``items(p)`` of them, a vec4 of
    ``w_key``'s width each) and a workgroup row per token."""
    return lambda p: (ceil_div(items(p) // width(p[w_key]), p["threads"]), p["tokens"], 1)


def _rows(p):
    return (p["tokens"], 1, 1)


LM_KERNELS = (  # the causal LM (lora.kernels.lm); its loss is softmax_xent(ignore=True)
    KernelSpec("embed", lm.embed, _threads, _per_token(lambda p: p["hidden"], "hidden"),
               "x[t] = E[ids[t] - first_row] for the ids in a chunk of the embedding's rows"),
    KernelSpec("rms_norm", lm.rms_norm, _threads, _rows,
               "RMSNorm y = w x rstd and rstd, a workgroup per token"),
    KernelSpec("rms_norm_grad", lm.rms_norm_grad, _threads, _rows,
               "RMSNorm's input gradient added to the residual's: dres += rstd (w dy - xhat "
               "mean(xhat w dy))"),
    KernelSpec("rope", lm.rope, _threads,
               lambda p: (ceil_div((p["heads"] + p["kv_heads"]) * (p["head_dim"] // 2)
                                   // width(p["head_dim"] // 2), p["threads"]), p["tokens"], 1),
               "rotary embeddings of q (and k) in place, or their transpose (the backward)"),
    KernelSpec("residual", lm.residual, _threads, _per_token(lambda p: p["hidden"], "hidden"),
               "out = x + y: the f32 residual stream past a block"),
    KernelSpec("swiglu", lm.swiglu, _threads, _per_token(lambda p: p["inter"], "inter"),
               "act = silu(gate) up"),
    KernelSpec("swiglu_grad", lm.swiglu_grad, _threads, _per_token(lambda p: p["inter"], "inter"),
               "d_gate = d_act up silu'(gate), d_up = d_act silu(gate)"),
    KernelSpec("argmax", lm.argmax, _threads, _rows,
               "ids[offset + r] = the first index of row r's largest logit, a workgroup per row"),
    KernelSpec("kv_write", lm.kv_write, _threads,
               lambda p: (ceil_div(p["width"] // width(p["width"]), p["threads"]),
                          p["batch"] * p["rows"], 1),
               "cache[b, past + i] = src[b, i]: a step's keys or values into a KV cache"),
    KernelSpec("last_rows", lm.last_rows, _threads,
               lambda p: (ceil_div(p["width"] // width(p["width"]), p["threads"]),
                          p["batch"], 1),
               "dst[b] = src[b, seq - 1]: each sequence's last hidden state"),
    KernelSpec("decode_advance", lm.decode_advance, lambda p: 64, lambda p: (1, 1, 1),
               "past += 1, positions += 1: the next decode step, on the GPU"),
)
KERNELS.update({spec.name: spec for spec in LM_KERNELS})
def _attention(kind):
    """The attention kernel's tiling (lora.kernels.attention) from its parameters."""
    def of(p):
        q_len, kv_len = p.get("q_len", p.get("seq")), p.get("kv_len", p.get("seq"))
        return attention_tiling(kind, p["heads"], p["kv_heads"], p["head_dim"], q_len, kv_len,
                                p["block_q"], p["block_k"], p["threads"], p["pad"])
    return of


def _attention_matrix(p):
    return matrix_tiling(p["heads"], p["kv_heads"], p["head_dim"], p["q_len"], p["kv_len"],
                         p["block_k"])


def _matrix_grad(kind):
    """The matrix backward's tiling (lora.kernels.attention_matrix_grad) from its parameters."""
    def of(p):
        return grad_tiling(kind, p["heads"], p["kv_heads"], p["head_dim"], p["seq"], p["limit"],
                           p["subgroups"], p["step"])
    return of


def _attention_grid(kind):
    def grid(p):
        q_len, kv_len = p.get("q_len", p.get("seq")), p.get("kv_len", p.get("seq"))
        return _attention(kind)(p).grid(p["batch"], p["kv_heads"], q_len, kv_len)
    return grid


ATTENTION_KERNELS = (  # the language model's causal self-attention, flash form
    KernelSpec("attention", attention, lambda p: _attention("forward")(p).threads,
               _attention_grid("forward"),
               "o = softmax(scale q k^T, causal, keep) v and lse, online over blocks of keys "
               "(past read at run time: training, prefill and decode)"),
    KernelSpec("attention_matrix", attention_matrix,
               lambda p: _attention_matrix(p).threads,
               lambda p: _attention_matrix(p).grid(p["batch"], p["kv_heads"], p["q_len"]),
               "attention (f16) with Q K^T and P V on matrix units, the softmax in f32"),
    KernelSpec("attention_delta", attention_delta, _threads,
               _elements(lambda p: p["batch"] * p["heads"] * p["seq"]),
               "delta = rowsum(do * o) per query row and head, for the backward"),
    KernelSpec("attention_grad_kv", attention_grad_kv, lambda p: _attention("grad_kv")(p).threads,
               _attention_grid("grad_kv"),
               "dk and dv: a workgroup per block of keys of a kv head, over its query heads"),
    KernelSpec("attention_grad_q", attention_grad_q, lambda p: _attention("grad_q")(p).threads,
               _attention_grid("grad_q"),
               "dq: a workgroup per block of queries of a kv head's group, over keys"),
    KernelSpec("attention_matrix_grad_kv", attention_matrix_grad_kv,
               lambda p: _matrix_grad("grad_kv")(p).threads,
               lambda p: _matrix_grad("grad_kv")(p).grid(p["batch"], p["kv_heads"], p["seq"]),
               "attention_grad_kv (f16) with S, dP, dV and dK on matrix units, P and dS in f32"),
    KernelSpec("attention_matrix_grad_q", attention_matrix_grad_q,
               lambda p: _matrix_grad("grad_q")(p).threads,
               lambda p: _matrix_grad("grad_q")(p).grid(p["batch"], p["kv_heads"], p["seq"]),
               "attention_grad_q (f16) with S, dP and dQ on matrix units, dS in f32"),
)
KERNELS.update({spec.name: spec for spec in ATTENTION_KERNELS})
